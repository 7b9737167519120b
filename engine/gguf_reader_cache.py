"""One parse of a GGUF file per load through transformers (``parsed_once``).

Why: transformers' GGUF loader (5.x) opens the file with ``gguf.GGUFReader`` three times for one
model (its config, its weights, its tokenizer), and each reader parses every metadata field, the
tokenizer's ~50k-entry token and merge arrays element by element through numpy memmaps; it also
builds gguf's tensor-name map (``get_tensor_name_map``, a table of every architecture's names)
anew for each submodule it walks, 397 times for SmolLM2. Measured on the 2-core CPU machine,
SmolLM2-135M Q4_1 (engine.build.load_gguf): 18.3 -> 7.8 CPU-s, the same weights and tokenizer.

The parse itself indexes the file's array ~3.7 million times (every element of those arrays), and
``np.memmap`` runs Python code on each index (``memmap.__getitem__``, ``__array_finalize__``): a
read-only reader (mode "r", the default) here parses a plain ndarray over a read-only mmap of the
file instead, the same bytes without that per-index Python. SmolLM2 Q4_1 load_gguf 12.4 -> 6.4 CPU-s
(2026-11-30, the same weights and tokenizer).

Inside ``parsed_once()`` gguf hands out one reader per (file, mode) and one name map per
(architecture, layers). Both are only read by transformers (the reader's arrays are views of the
file, read-only in mode "r"). Outside it, gguf is as it was. The patch is of gguf's module
attributes, which transformers imports at call time; with another gguf the names may be missing,
and then nothing is patched.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading

import numpy as np

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
                    readers[key] = _read_only_reader(real_reader, path) if mode == "r" else real_reader(path, mode)
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


class _NumpyWithPlainMaps:
    """numpy, but ``memmap(path, mode="r")`` gives a plain read-only uint8 ndarray over an mmap of the
    file (what GGUFReader makes its ``data`` with): indexing it runs no Python."""

    def __getattr__(self, name):  # (kept: the parse looks names up ~450,000 times)
        value = self.__dict__[name] = getattr(np, name)
        return value

    @staticmethod
    def memmap(path, mode="r"):
        if mode != "r":  # another thread's writable reader, made while the stand-in is gguf's np: numpy's own
            return np.memmap(path, mode=mode)
        with open(path, "rb") as file:  # the map stays valid after the file is closed
            return np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def _read_only_reader(real_reader, path):
    """``real_reader(path, "r")`` parsed over a plain ndarray (_NumpyWithPlainMaps); falls back to the
    reader as it is where gguf's reader module does not make its data with its module's ``np``."""
    import gguf.gguf_reader as reader_module

    if getattr(reader_module, "np", None) is not np or real_reader is not getattr(reader_module, "GGUFReader", None):
        return real_reader(path, "r")
    # Another thread reading the module's np meanwhile gets numpy's names all the same (and, for a writable
    # reader, numpy's memmap); one restoring it before this construction's memmap call only makes this reader
    # a memmap one.
    reader_module.np = _NumpyWithPlainMaps()
    try:
        return real_reader(path, "r")
    finally:
        reader_module.np = np
