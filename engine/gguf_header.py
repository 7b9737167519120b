"""Scalar metadata of a GGUF file's header, read without the tensors.

Why not ``gguf.GGUFReader``: it parses every tensor's description and turns each metadata array
(SmolLM2's 49,152 tokens and 48,900 merges) into Python objects, 2.6 s for the 93 MB embedded model
on 2 cores, where the few scalars the build needs (the special token ids) take milliseconds.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata count
u64, then each metadata pair: key (u64 length + UTF-8 bytes), value type u32, value. Arrays are an
element type u32, a count u64 and the elements; strings a u64 length and the bytes.
"""
from __future__ import annotations

import mmap
import struct

# value type -> struct format of a fixed-size scalar (8: string and 9: array are variable)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this reader understands."""


def read_gguf_scalars(path: str, keys: set[str]) -> dict[str, int | float | bool | str]:
    """The values of those ``keys`` the header holds as scalars or strings (arrays are skipped)."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise GGUFHeaderError(f"{path} is not a GGUF file (magic {bytes(data[:4])!r})")
        version, _, count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise GGUFHeaderError(f"{path}: GGUF version {version} is not supported (2, 3)")
        offset, found = 24, {}
        for _ in range(count):
            key, offset = _string(data, offset)
            (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
            value, offset = _value(data, offset, kind)
            if key in keys and value is not None:
                found[key] = value
        return found


def _string(data, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return bytes(data[start:start + length]).decode("utf-8", errors="replace"), start + length


def _value(data, offset: int, kind: int):
    """(value, the offset after it); arrays are skipped and read as None."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, offset)
    if kind == _ARRAY:
        element, length = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if element in _SCALARS:
            return None, offset + length * struct.calcsize(_SCALARS[element])
        for _ in range(length):
            _, offset = _value(data, offset, element)
        return None, offset
    raise GGUFHeaderError(f"unknown GGUF value type {kind} at byte {offset}")
