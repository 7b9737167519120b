#!/usr/bin/env python3
"""Fill `${name}` placeholders of a model-repository config.pbtxt: the path NVIDIA's docs run, kept
in the checkout; the code is tritonllm/fill_template.py, installed as ``tritonllm fill-template``.

    python3 tools/fill_template.py [-i] <file_path> key1:value1,key2:value2,...
"""
import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])
if CHECKOUT not in sys.path:  # this checkout's code, whether or not it is installed
    sys.path.insert(0, CHECKOUT)
from tritonllm import fill_template as _implementation  # noqa: E402

# Its names, private ones included, for callers that load this file as a module.
globals().update({name: value for name, value in vars(_implementation).items() if not name.startswith("__")})

if __name__ == "__main__":
    _implementation.main()
