#!/usr/bin/env python3
"""Launch tritonserver on a model repository (tensorrtllm_backend-compatible flags): the path
NVIDIA's docs and clients run, kept in the checkout; the code is tritonllm/launcher.py, installed
as ``tritonllm launch``.

    python3 scripts/launch_triton_server.py --model_repo=/path/to/repo [--world_size=1] ...
"""
import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:  # this checkout's code, whether or not it is installed
    sys.path.insert(0, CHECKOUT)
from tritonllm import launcher as _implementation  # noqa: E402

# Its names, private ones included, for callers that load this file as a module.
globals().update({name: value for name, value in vars(_implementation).items() if not name.startswith("__")})

if __name__ == "__main__":
    _implementation.main()
