"""One parse of a GGUF file per load through transformers (``parsed_once``).

Why: transformers' GGUF loader (5.x) opens the file with ``gguf.GGUFReader`` three times for one
model (its config, its weights, its tokenizer), and each reader parses every metadata field, the
tokenizer's ~50k-entry token and merge arrays element by element through numpy memmaps; it also
builds gguf's tensor-name map (``get_tensor_name_map``, a table of every architecture's names)
anew for each submodule it walks, 397 times for SmolLM2. Measured on the 2-core CPU machine,
SmolLM2-135M Q4_1 (engine.build.load_gguf): 18.3 -> 7.8 CPU-s, the same weights and tokenizer.

Inside ``parsed_once()`` gguf hands out one reader per (file, mode) and one name map per
(architecture, layers). Both are only read by transformers (the reader's arrays are memmaps of the
file, opened read-only by default). Outside it, gguf is as it was. The patch is of gguf's module
attributes, which transformers imports at call time; with another gguf the names may be missing,
and then nothing is patched.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

_lock = threading.Lock()
_active = 0  # loads inside parsed_once (load_gguf calls load_gguf_tokenizer inside its own)
_originals: tuple | None = None  # gguf's (GGUFReader, get_tensor_name_map) while patched


@contextlib.contextmanager
def parsed_once():
    global _active, _originals
    import gguf

    with _lock:
        if _active == 0 and hasattr(gguf, "GGUFReader") and hasattr(gguf, "get_tensor_name_map"):
            _originals = real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
            readers: dict[tuple[str, str], object] = {}

            def reader(path, mode="r"):
                key = (os.path.abspath(os.fspath(path)), mode)
                if key not in readers:
                    readers[key] = real_reader(path, mode)
                return readers[key]

            gguf.GGUFReader = reader
            gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _originals is not None:
                gguf.GGUFReader, gguf.get_tensor_name_map = _originals
                _originals = None
