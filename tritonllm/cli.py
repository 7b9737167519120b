"""``tritonllm serve [CHECKPOINT] [options]``: ``make serve MODEL=CHECKPOINT`` as a command.

With a checkpoint (a Hugging Face directory or a .gguf file) its engine is built once into the
engine cache and served with tritonserver and the OpenAI frontend; with none, the embedded
SmolLM2. The options are scripts/serve_default.py's (``tritonllm serve --help``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _serve_default():
    path = REPO_ROOT / "scripts" / "serve_default.py"
    if not path.exists():
        sys.exit(f"tritonllm: {path} is missing; run tritonllm from a source checkout (pip install -e .)")
    spec = importlib.util.spec_from_file_location("serve_default", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_default"] = module
    spec.loader.exec_module(module)
    return module


USAGE = "usage: tritonllm serve [CHECKPOINT] [options]   (tritonllm serve --help: the options)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return
    if argv[0] != "serve":
        sys.exit(f"tritonllm: unknown command {argv[0]!r}; commands: serve\n{USAGE}")
    rest = argv[1:]
    if rest and not rest[0].startswith("-"):  # the checkpoint, positional as in `vllm serve MODEL`
        rest = ["--model", rest[0], *rest[1:]]
    _serve_default().main(rest)


if __name__ == "__main__":
    main()
