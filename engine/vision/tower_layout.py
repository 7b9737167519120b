"""Where a batch of images' patches sit in a Qwen tower's forward (engine/vision/qwen2_vl.py,
qwen2_5_vl.py, qwen3_vl.py): the patches' axial rotary table, the runs attention stays within (frames;
Qwen2.5-VL's windows) and Qwen2.5-VL's window-major order of the merged units with its inverse.

Made from per-grid pieces kept on the device (``grid_piece``: one per (t, h, w) grid, tower setting,
device and CUDA stream; LRU of ``PIECES_KEPT`` pieces and ``PIECE_BYTES_KEPT`` bytes); a batch is
assembled from its grids' pieces by device ops with Python-int offsets only. Why: a forward of 32
images at 448 x 448 made all of this afresh with ~1,000 small host ops (a slice per window, a meshgrid
per image: 7-10 ms of host time on the project's CPU box, the GIL held against the executor's
thread), and its window order went to the device by a blocking copy (torch's pageable host->device
copy synchronizes the stream), so the encode queue's worker (engine/vision/encode_queue.py) waited for
the forward before it every time instead of queueing the next one behind it. Now a piece's one blocking copy happens once per new grid size on a stream;
a batch of grids seen before makes no copy and ~10-20 launches of small device ops.

Pieces are kept per CUDA stream: a tensor the caching allocator gave on one stream and freed (an
evicted piece) is reused on that stream without waiting for another stream's kernels that read it.

Shapes, per piece of a (t, h, w) grid, P = t * h * w patches, U = P / merge**2 merged units:
- ``table`` (P, head_dim) float32: [cos | sin] of the patch's head_dim / 2 axial frequencies (its row's
  then its column's, transformers' VisionRotaryEmbedding), in the forward's order (window-major when
  windowed), as kernels/rotary.py's apply_rotary takes it;
- ``order`` / ``inverse`` (U,) int64: the processor's unit index at each window-major place, and back
  (None without windows);
- ``window_starts`` {window length in patches: (windows of it,) int64 patch offsets in the piece}.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels.rotary import apply_rotary

# Per-grid pieces kept (all devices and streams), the least recently used dropped first past either bound: a
# 32 x 32-patch grid's piece is ~0.33 MB at head_dim 80, a 74 x 74 one's ~1.8 MB, the largest image's ~5 MB
PIECES_KEPT = 64
PIECE_BYTES_KEPT = 64 << 20


class Segments:
    """Consecutive runs of patches that attend within themselves (an image's frames, or its windows),
    grouped by length: each group's rows as one (runs, length) gather index, so one attention call
    serves every run of a length (a batch of 448 x 448 images has 16 windows each, all of one length)
    instead of one call per run. ``groups``: [(length, rows (runs, length) int64 on the device, or None
    when there is one length: the runs tile every patch in order)]."""

    def __init__(self, lengths: list[int], device=None, groups: list | None = None, windows: bool = False):
        self.lengths = list(lengths)
        self.windows = windows  # Qwen2.5-VL's windows (their attention backend may be set apart)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._runs = None
        if groups is None:
            starts = torch.tensor([0, *self.lengths[:-1]]).cumsum(0).tolist()
            by_length: dict[int, list[int]] = {}
            for start, n in zip(starts, self.lengths):
                by_length.setdefault(n, []).append(start)
            groups = [(n, None if len(by_length) == 1 else (torch.tensor(s)[:, None] + torch.arange(n)).to(device))
                      for n, s in by_length.items()]
        self.groups = groups

    def runs(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(starts, lengths (runs,) int64 on the device, the longest run's length): kernels/window_attention.py's
        runs, from the groups by device ops (no host->device copy), made once and shared by the blocks."""
        if self._runs is None:
            starts, lengths = [], []
            for n, rows in self.groups:
                first = torch.arange(len(self.lengths), device=self.device) * n if rows is None else rows[:, 0]
                starts.append(first)
                lengths.append(torch.full_like(first, n))
            self._runs = (torch.cat(starts), torch.cat(lengths), max(self.lengths))
        return self._runs


class PatchRotary:
    """The patches' axial rotary as kernels/rotary.py's apply_rotary takes it: a (patches, head_dim) float32
    table of [cos | sin] of the head_dim / 2 frequencies (axial_cos_sin's halves repeat, so one half each
    holds them) and positions 0..patches-1 into it; one Triton launch rotates q and k in place on CUDA,
    the same fp32 math as transformers' apply_rotary_pos_emb_vision (the torch reference elsewhere)."""

    def __init__(self, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, table: torch.Tensor | None = None):
        if table is None:
            half = cos.shape[-1] // 2
            table = torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
        self.table = table.float().contiguous()
        self.positions = torch.arange(self.table.shape[0], device=self.table.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, self.positions, self.table)


def grid_positions(t: int, h: int, w: int, merge: int, device=None) -> torch.Tensor:
    """(t * h * w, 2) int64: each patch's (row, column) in its image's grid, in the processor's block-major
    order (merge x merge blocks row-major, the patches of a block row-major), repeated over t frames."""
    rows, columns = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    columns = columns.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, columns], dim=-1).repeat(t, 1)


def axial_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """positions (patches, 2) -> (patches, head_dim / 2) float32 angles: the row's head_dim / 4 frequencies,
    then the column's (transformers' Qwen2-VL VisionRotaryEmbedding, indexed by row and column)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=positions.device)
                                / (head_dim // 2)))
    angles = positions.float()[..., None] * inv_freq  # (patches, 2, head_dim // 4)
    return torch.cat([angles[:, 0], angles[:, 1]], dim=-1)


def window_order(grids: list[list[int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(order (merged units,): the processor's unit index at each place of the window-major order,
    each window's length in merged units, in that order). ``window``: merged units per window side;
    windows at the right and bottom edges are cut short, windows row-major within a frame."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, columns = h // merge, w // merge
        units = torch.arange(t * rows * columns).view(t, rows, columns) + base
        for frame in units:
            for top in range(0, rows, window):
                for left in range(0, columns, window):
                    block = frame[top:top + window, left:left + window].flatten()
                    order.append(block)
                    lengths.append(block.numel())
        base += t * rows * columns
    return torch.cat(order), lengths


@dataclass
class GridPiece:
    patches: int
    table: torch.Tensor
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    window_lengths: list[int]  # in patches, window-major order (empty without windows)
    window_starts: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        tensors = [self.table, self.order, self.inverse, *self.window_starts.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


_pieces: OrderedDict = OrderedDict()
_lock = threading.Lock()
_reading = threading.local()  # .pieces: the list pieces_read() fills on this thread (None outside it)


@contextlib.contextmanager
def pieces_read():
    """A list of every piece ``grid_piece`` hands the calling thread inside the block. For a CUDA graph of a
    forward (engine/vision/tower_graphs.py): its kernels read the kept pieces by address, so the graph must hold
    them for its life; the LRU above drops only its own references, and a piece it evicted would otherwise be
    freed and its memory given to other tensors that the graph's replays then read as rotary tables."""
    outer = getattr(_reading, "pieces", None)
    _reading.pieces = read = []
    try:
        yield read
    finally:
        _reading.pieces = outer


def _stream_key(device: torch.device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def grid_piece(grid: tuple[int, int, int], merge: int, head_dim: int, theta: float, window: int | None,
               device: torch.device, keep: bool = True) -> GridPiece:
    """The kept piece of one grid (made once per grid, setting, device and stream: its blocking copies
    then); ``keep`` False: made afresh and not kept."""
    piece = _piece(tuple(grid), merge, head_dim, theta, window, device, keep)
    read = getattr(_reading, "pieces", None)
    if read is not None:
        read.append(piece)
    return piece


def _piece(grid: tuple[int, int, int], merge: int, head_dim: int, theta: float, window: int | None,
           device: torch.device, keep: bool) -> GridPiece:
    key = (grid, merge, head_dim, theta, window, str(device), _stream_key(device))
    with _lock:
        piece = _pieces.get(key) if keep else None
        if piece is not None:
            _pieces.move_to_end(key)
            return piece
    t, h, w = grid
    unit = merge * merge
    positions = grid_positions(t, h, w, merge)  # on the host: small, made once
    order = inverse = None
    lengths, starts = [], {}
    if window is not None:
        order, units = window_order([[t, h, w]], merge, window)
        positions = positions.view(-1, unit, 2)[order].view(-1, 2)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        lengths = [n * unit for n in units]
        offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
        by_length: dict[int, list[int]] = {}
        for offset, n in zip(offsets, lengths):
            by_length.setdefault(n, []).append(offset)
        starts = {n: torch.tensor(s).to(device) for n, s in by_length.items()}
        order, inverse = order.to(device), inverse.to(device)
    angles = axial_angles(positions.to(device), head_dim, theta)
    piece = GridPiece(t * h * w, torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous(), order, inverse,
                      lengths, starts)
    if not keep:
        return piece
    with _lock:
        _pieces[key] = piece
        while len(_pieces) > PIECES_KEPT or (len(_pieces) > 1 and sum(p.nbytes for p in _pieces.values())
                                                                   > PIECE_BYTES_KEPT):
            _pieces.popitem(last=False)
    return piece


def _runs(grids: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], int]]:
    """Consecutive equal grids as (grid, count)."""
    runs: list = []
    for grid in grids:
        if runs and runs[-1][0] == grid:
            runs[-1][1] += 1
        else:
            runs.append([grid, 1])
    return [(g, n) for g, n in runs]


def _tiled(piece_values: torch.Tensor, count: int, base: int, stride: int) -> torch.Tensor:
    """``count`` copies of a piece's int64 index values, the i-th offset by base + i * stride, flattened."""
    if count == 1:
        return piece_values + base if base else piece_values
    offsets = torch.arange(count, device=piece_values.device) * stride + base
    return (piece_values[None] + offsets.view(-1, *([1] * piece_values.dim()))).flatten()


@dataclass
class TowerLayout:
    rotary: PatchRotary
    frames: Segments
    windows: Segments | None  # Qwen2.5-VL's window blocks' runs; None without windows
    order: torch.Tensor | None  # (units,) int64 window-major -> processor unit; None without windows
    inverse: torch.Tensor | None


def tower_layout(grids: list[list[int]], merge: int, head_dim: int, theta: float, device,
                 window: int | None = None, keep: bool = True) -> TowerLayout:
    """The layout of a batch of images of these (t, h, w) grids (``window``: merged units per window side,
    Qwen2.5-VL; None: no windows, the processor's order; ``keep`` False: pieces made afresh, not kept)."""
    device = torch.device(device)
    unit = merge * merge
    runs = _runs([tuple(int(v) for v in g) for g in grids])
    pieces = [(grid_piece(g, merge, head_dim, theta, window, device, keep), g, n) for g, n in runs]
    table = torch.cat([p.table if n == 1 else p.table.repeat(n, 1) for p, _, n in pieces])
    frame_lengths = [h * w for (t, h, w), n in runs for _ in range(n * t)]
    frames = Segments(frame_lengths, device, _frame_groups(runs, frame_lengths, device))
    order = inverse = windows = None
    if window is not None:
        orders, inverses, starts, lengths, base = [], [], {}, [], 0
        for piece, grid, n in pieces:
            units = piece.patches // unit
            orders.append(_tiled(piece.order, n, base // unit, units))
            inverses.append(_tiled(piece.inverse, n, base // unit, units))
            for length, s in piece.window_starts.items():
                starts.setdefault(length, []).append(_tiled(s, n, base, piece.patches))
            lengths += piece.window_lengths * n
            base += n * piece.patches
        order, inverse = torch.cat(orders), torch.cat(inverses)
        groups = [(length, None if len(starts) == 1 else
                   torch.cat(parts)[:, None] + torch.arange(length, device=device)) for length, parts in starts.items()]
        windows = Segments(lengths, device, groups, windows=True)
    return TowerLayout(PatchRotary(table=table), frames, windows, order, inverse)


def _frame_groups(runs, frame_lengths: list[int], device) -> list:
    """Segments.groups of the frames: one length -> no rows; else per length the frames' rows, each frame's
    start from Python ints through arange (no host->device copy)."""
    if len(set(frame_lengths)) == 1:
        return [(frame_lengths[0], None)]
    by_length: dict[int, list[torch.Tensor]] = {}
    base = 0
    for (t, h, w), n in runs:
        frames = n * t
        by_length.setdefault(h * w, []).append(torch.arange(frames, device=device) * (h * w) + base)
        base += frames * h * w
    return [(length, torch.cat(parts)[:, None] + torch.arange(length, device=device))
            for length, parts in by_length.items()]
