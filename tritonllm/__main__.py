"""``python -m tritonllm ...``: the ``tritonllm`` command (cli.py)."""
from tritonllm.cli import main

main()
