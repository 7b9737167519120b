"""Safetensors files read and written one tensor at a time, so that building an engine from a checkpoint larger
than host memory holds about one tensor of it at once (engine/build.py's write_engine).

The format (the safetensors spec): 8 bytes, N, the header's length as an unsigned little-endian 64-bit integer;
N bytes of UTF-8 JSON that begin with ``{`` and may be padded at the end with spaces (0x20); then the data
buffer. The header maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}``, offsets
relative to the buffer's start, the tensors tiling the buffer without holes, plus an optional ``__metadata__``
object of strings.

Why not ``safetensors.torch.save_file``: it takes a dict of every tensor of the file, so an engine rank was
whole in memory before its file was written. Why not ``safe_open`` for reading: it maps the whole file, and
the pages a ``get_tensor`` touched stay mapped (counted in the process's RSS) until the file is closed, so
reading a checkpoint through one handle shows the whole checkpoint resident. SafetensorsReader reads each
tensor with ``pread`` into a fresh tensor instead; the page cache keeps what it keeps, outside the process.
"""
from __future__ import annotations

import json
import os
import struct

import torch

# The spec's dtype names of the torch dtypes engines and checkpoints hold.
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

# The reference implementation refuses longer headers.
MAX_HEADER_BYTES = 100 << 20

# Header bytes reserved per tensor beyond its quoted name: the entry's keys, a dtype name (at most 11
# characters) and two offsets of at most 20 digits take about 90; the rest is room for a shape of up to
# eight dimensions of 16 digits, whatever shape the tensor comes with.
_ENTRY_ROOM = 256


class SafetensorsFormatError(ValueError):
    """A file that is not a well-formed safetensors file; the message names it and what is wrong."""


class SafetensorsReader:
    """Name -> tensor of one safetensors file, each read on request into memory of its own (never mapped)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsFormatError(f"{path}: {size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsFormatError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise SafetensorsFormatError(f"{path}: header is not JSON: {err}") from None
        if not isinstance(header, dict):
            raise SafetensorsFormatError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = TORCH_DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsFormatError(f"{path}: entry {name!r} is not {{dtype, shape, data_offsets}} of a "
                                             f"known dtype ({', '.join(TORCH_DTYPES)}): {entry}") from None
            expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected or begin < 0 or self._data_start + end > size:
                raise SafetensorsFormatError(f"{path}: {name} spans bytes [{begin}, {end}) of the data, not "
                                             f"{expected} bytes within the file's {size - self._data_start}")
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[name]
        data = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self._data_start + begin)
                view, done = memoryview(data.numpy()), 0
                while done < len(view):  # readinto may return fewer bytes than asked
                    count = f.readinto(view[done:])
                    if not count:
                        raise SafetensorsFormatError(f"{self.path}: truncated inside {name}")
                    done += count
        return data.view(dtype).reshape(shape)


class StreamingSafetensorsWriter:
    """A safetensors file written one tensor at a time: ``add(name, tensor)`` appends its bytes and drops
    it, ``close()`` writes the header at the file's start. The header's room is reserved up front from the
    names the file will hold (``names``), so no tensor is held or copied twice; the real header is padded
    to that room with spaces, as the spec allows. ``close`` refuses a file whose names differ from ``names``
    (a converter bug: the engine model declares them). Tensors are stored in the order added."""

    def __init__(self, path: str, names, metadata: dict[str, str] | None = None):
        self.path, self._names, self._metadata = path, list(names), dict(metadata or {})
        room = len(json.dumps({"__metadata__": self._metadata})) + 2
        room += sum(len(json.dumps(name)) + _ENTRY_ROOM for name in self._names)
        self._room = (room + 7) // 8 * 8  # the data buffer starts 8-byte aligned
        self._entries: dict[str, dict] = {}
        self._offset = 0
        self._file = open(path, "wb")
        self._file.seek(8 + self._room)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"{self.path}: {name} added twice")
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{self.path}: {name} has dtype {tensor.dtype}; storable: "
                             f"{', '.join(str(d) for d in DTYPE_NAMES)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        end = self._offset + data.nbytes
        self._entries[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [self._offset, end]}
        self._offset = end

    def close(self) -> None:
        """Write the header; the file is complete only after this returns."""
        missing, unexpected = set(self._names) - set(self._entries), set(self._entries) - set(self._names)
        if missing or unexpected:
            self._file.close()
            raise AssertionError(f"{self.path}: tensors missing {sorted(missing)[:5]}, not declared "
                                 f"{sorted(unexpected)[:5]}")  # a converter bug, never a user error
        header = {"__metadata__": self._metadata} if self._metadata else {}
        header.update(self._entries)
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self._room:
            self._file.close()
            raise AssertionError(f"{self.path}: header of {len(text)} bytes exceeds the {self._room} reserved")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self._room) + text + b" " * (self._room - len(text)))
        self._file.close()

    def abort(self) -> None:
        """Close and remove an unfinished file (a failed build leaves no file that looks complete)."""
        self._file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
