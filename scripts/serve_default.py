#!/usr/bin/env python3
"""`make serve`: build the engine if missing, fill a model repository and serve it with tritonserver
and the OpenAI-compatible frontend (``python scripts/serve_default.py [--model CHECKPOINT] ...``).
The code is tritonllm/serve.py, installed as ``tritonllm serve``; this path is kept for `make serve`
and for the callers that load it.
"""
import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:  # this checkout's code, whether or not it is installed
    sys.path.insert(0, CHECKOUT)
from tritonllm import serve as _implementation  # noqa: E402

# Its names, private ones included, for callers that load this file as a module.
globals().update({name: value for name, value in vars(_implementation).items() if not name.startswith("__")})

if __name__ == "__main__":
    _implementation.main()
