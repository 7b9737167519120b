"""Batched multi-adapter LoRA: many adapters applied to one packed batch (segmented gather-matmuls,
the SGMV idea of punica).

For every token t that uses pool slot p, for each output slice j of a fused projection
(columns slice_starts[j]:slice_starts[j+1]) with rank r = ranks[p, j] > 0:

    out[t, s_j:s_{j+1}] += (x[t] @ lora_a[p, j, :r].T) @ lora_b[p, s_j:s_{j+1}, :r].T

Shapes (T tokens, I in_features, O out_features, S pool slots, J slices, R max rank):
    x (T, I); out (T, O), x's dtype, contiguous rows; lora_a (S, J, R, I); lora_b (S, O, R), the
    scale folded in; ranks (S, J) int32; slice_starts: J + 1 host ints, 0 .. O.
I and every slice width must be multiples of 16 (tensor-core tiles; tensor-parallel shards are).

Tokens are grouped into segments, one per slot in use (``LoraBatch``). Worked example: sequences
with row_slots [2, -1, 0, 2] and seq_lens [3, 1, 5, 1] (packed rows 0-2, 3, 4-8, 9):

    token_order:    0 1 2 9 | 4 5 6 7 8       (row 3 has no adapter: in no segment)
    segment_starts: 0         4          9
    segment_slots:  2         0

The Triton path is two kernels, both gridded over (segment, M-block of that segment's tokens):
1. shrink: part[split, i, :, :] = x[token_order[i]] @ lora_a[slot].T over the split's share of I,
   in float32; lora_a[slot] is read as one (J * R, I) matrix, so one program covers every slice.
   Few tokens per segment (decode) split the reduction over I across programs (split-K), so a
   batch-1 shrink is not one program streaming a (R, I) matrix alone.
2. expand: out[token_order[i], n] += (sum over splits of part[., i, j, :r]) @ lora_b[slot, n, :r],
   for a chunk of output columns n inside one slice j (chunks never straddle a slice boundary).
   Each output element belongs to one program: no atomics, and the split-K sum has a fixed order.
Programs of an unused segment (slot -1), of an M-block past the segment's end, or of a slice of
rank 0 exit at once; weights past a slot's rank are never loaded. Grid sizes come from host ints
only (num_segments, max_segment_tokens, shapes), so a step is capturable in a CUDA graph:
``LoraBatchBuffers`` keeps the metadata in static buffers for that.

Decode tiles. A grid of segments x M-blocks is sized for the worst case: a captured graph of 64
rows over 64 slots has 64 x 4 row blocks, of which a step uses at most 64, often 4. Decode
batches also carry ``tiles``: each segment cut into DECODE_BLOCK_M-row pieces, (slot, start, end)
into token_order, listed from the front (lora_batch when every segment holds at most
DECODE_MAX_TOKENS tokens; LoraBatchBuffers views of at most that many rows, or of any size when
the buffers serve decode steps). The kernels then grid over tiles,
not segments x M-blocks; the worked example's tiles (DECODE_BLOCK_M = 4 for the picture):

    tiles: (2, 0, 4) (0, 4, 8) (0, 8, 9)

Rows of T tokens in at most S segments make at most min(T, (T + S * (DECODE_BLOCK_M - 1)) //
DECODE_BLOCK_M) tiles (``max_tiles``), the grid of a captured graph: 64 for 64 rows over 64
slots. Both kernels launch with programmatic dependent launch (kernels/_triton.py) where the
engine enables it and the grid has at most PDL_MAX_ROW_BLOCKS row blocks (``LoraLaunch.pdl``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels._triton import (jit, num_sms, pdl_options, pdl_prologue, power_of_2_floor, require_dense, tl, triton,
                             use_triton)

MAX_SLICES = 4  # the expand kernel takes the slice boundaries as scalars (S1..S3)
DECODE_MAX_TOKENS = 64  # a batch whose segments all hold at most this many tokens splits the shrink's K
DECODE_BLOCK_M = 16  # rows of a decode tile (LoraBatch.tiles)
# Grids of at most this many row blocks launch with PDL (where the engine enables it). On an H100
# (bf16, rank 16, benchmarks/features/lora_kernel_bench.py --graphs, LoRA calls back to back) PDL saved
# ~0.7 us a call at batch 1, changed nothing at 64 decode rows over 1-4 adapters and cost 1-5 us
# a call over 16-64 adapters (and at 256 rows).
PDL_MAX_ROW_BLOCKS = 16


@dataclass
class LoraBatch:
    """Which pool slot each token of a packed batch (num_tokens rows) uses, grouped by slot."""

    token_order: torch.Tensor  # (capacity_tokens,) int32: rows that use an adapter, segment after segment
    segment_starts: torch.Tensor  # (capacity_segments + 1,) int32: segment s is token_order[starts[s]:starts[s+1]]
    segment_slots: torch.Tensor  # (capacity_segments,) int32: pool slot of segment s; -1: unused (skipped)
    max_segment_tokens: int  # host: upper bound of any segment's token count (sizes the grid)
    # Host copy for the torch reference, so it never syncs: [(slot, start, end)] into token_order.
    host_segments: list[tuple[int, int, int]] | None = None
    # (num_tiles, 3) int32 rows (slot, start, end) into token_order, DECODE_BLOCK_M rows at most,
    # unused rows slot -1; when set, the kernels grid over these tiles (decode tilings).
    tiles: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        return self.segment_slots.shape[0]


def max_tiles(num_tokens: int, num_segments: int) -> int:
    """Most decode tiles num_tokens rows in at most num_segments segments can make."""
    return min(num_tokens, (num_tokens + num_segments * (DECODE_BLOCK_M - 1)) // DECODE_BLOCK_M)


def cut_tiles(starts: list[int], slots: list[int]) -> list[int]:
    """Segments -> their decode tiles, flattened (slot, start, end, slot, start, end, ...)."""
    flat = []
    for slot, start, end in zip(slots, starts, starts[1:]):
        for lo in range(start, end, DECODE_BLOCK_M):
            flat += [slot, lo, min(lo + DECODE_BLOCK_M, end)]
    return flat


def group_rows(row_slots: list[int], seq_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Packed sequences -> (token_order, segment_starts, segment_slots) as host lists, segments in
    order of each slot's first appearance; sequences with slot -1 are left out."""
    rows_of: dict[int, list[int]] = {}
    row = 0
    for slot, n in zip(row_slots, seq_lens, strict=True):
        if slot >= 0:
            rows_of.setdefault(slot, []).extend(range(row, row + n))
        row += n
    order, starts = [], [0]
    for rows in rows_of.values():
        order.extend(rows)
        starts.append(len(order))
    return order, starts, list(rows_of)


def lora_batch(row_slots: list[int], seq_lens: list[int], device, tiles: bool | None = None) -> LoraBatch | None:
    """Sequence i has seq_lens[i] consecutive token rows (packed, in order) and uses pool slot
    row_slots[i] (-1: no adapter). None when no sequence uses an adapter. Exact sizes: capacity is
    what is used and max_segment_tokens is the largest segment. ``tiles``: give the batch decode
    tiles (None: when max_segment_tokens <= DECODE_MAX_TOKENS)."""
    order, starts, slots = group_rows(row_slots, seq_lens)
    if not slots:
        return None
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    flat_tiles = cut_tiles(starts, slots) if (longest <= DECODE_MAX_TOKENS if tiles is None else tiles) else []
    # One host-to-device copy, then views.
    packed = torch.tensor(order + starts + slots + flat_tiles, dtype=torch.int32).to(device)
    t, s = len(order), len(slots)
    return LoraBatch(
        token_order=packed[:t], segment_starts=packed[t:t + s + 1], segment_slots=packed[t + s + 1:t + 2 * s + 1],
        max_segment_tokens=longest,
        host_segments=[(slot, starts[i], starts[i + 1]) for i, slot in enumerate(slots)],
        tiles=packed[t + 2 * s + 1:].view(-1, 3) if flat_tiles else None,
    )


class LoraBatchBuffers:
    """Static device buffers for CUDA-graph replay: capacity_tokens rows, capacity_segments segments.

    ``fill`` writes a step's metadata into pinned host staging and copies it without blocking into
    the device buffers (unused segments and tiles: slot -1 and an empty range). ``batch`` returns a
    LoraBatch over the static buffers with max_segment_tokens = capacity_tokens, since the grid is
    fixed at capture; its host_segments is None (a captured graph outlives any one step's
    metadata). ``batch(n)`` is the view a graph of n rows captures: n tokens, min(n, Cs) segments,
    max_tiles(n, that) tiles (a step fills all three from the front).
    ``fill`` also cuts the segments into decode tiles. A view of n tokens carries them (the
    kernels' decode path) when n <= DECODE_MAX_TOKENS or the buffers were made with
    ``decode=True``: the graphs of decode steps, where a segment holds one token per sequence
    whatever n is. (Prefill-sized segments run faster on the segment grid's 64-row tiles.)
    Layout of the one int32 buffer: [token_order (Ct) | segment_starts (Cs + 1) | segment_slots (Cs)
    | tiles (3 * max_tiles(Ct, Cs))]. On a CPU device (tests) the staging is plain memory and the
    copy synchronous.
    """

    def __init__(self, capacity_tokens: int, capacity_segments: int, device, decode: bool = False):
        self.capacity_tokens = capacity_tokens
        self.capacity_segments = capacity_segments
        self.capacity_tiles = max_tiles(capacity_tokens, capacity_segments)
        self.decode = decode
        self.device = torch.device(device)
        size = capacity_tokens + 2 * capacity_segments + 1 + 3 * self.capacity_tiles
        is_cuda = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=is_cuda)
        self._dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._np = self._host.numpy()
        # Recorded after each copy: fill waits on it before overwriting the pinned staging.
        self._copied = torch.cuda.Event() if is_cuda else None
        self.fill([], [])

    def fill(self, row_slots: list[int], seq_lens: list[int]) -> None:
        order, starts, slots = group_rows(row_slots, seq_lens)
        if len(order) > self.capacity_tokens or len(slots) > self.capacity_segments:
            raise ValueError(f"{len(order)} adapter tokens in {len(slots)} segments exceed the buffers' "
                             f"capacity ({self.capacity_tokens} tokens, {self.capacity_segments} segments)")
        flat_tiles = cut_tiles(starts, slots)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned staging
        ct, cs = self.capacity_tokens, self.capacity_segments
        tiles_at = ct + 2 * cs + 1
        self._np[:len(order)] = order
        self._np[ct + len(starts):ct + cs + 1] = len(order)  # unused segments: empty ranges ...
        self._np[ct:ct + len(starts)] = starts
        self._np[ct + cs + 1:tiles_at] = -1  # ... and no slot
        self._np[ct + cs + 1:ct + cs + 1 + len(slots)] = slots
        self._np[tiles_at:] = 0  # unused tiles: (-1, 0, 0)
        self._np[tiles_at::3] = -1
        self._np[tiles_at:tiles_at + len(flat_tiles)] = flat_tiles
        self._dev.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()

    def batch(self, num_tokens: int | None = None) -> LoraBatch:
        ct, cs = self.capacity_tokens, self.capacity_segments
        n = ct if num_tokens is None else num_tokens
        if not 0 < n <= ct:
            raise ValueError(f"a view of {n} tokens of buffers of {ct}")
        segments = min(n, cs)
        tiles_at = ct + 2 * cs + 1
        with_tiles = self.decode or n <= DECODE_MAX_TOKENS
        tiles = self._dev[tiles_at:].view(-1, 3)[:max_tiles(n, segments)] if with_tiles else None
        return LoraBatch(token_order=self._dev[:n], segment_starts=self._dev[ct:ct + segments + 1],
                         segment_slots=self._dev[ct + cs + 1:ct + cs + 1 + segments], max_segment_tokens=n,
                         tiles=tiles)


# ---- torch reference ----------------------------------------------------------------------------

def add_lora_ref(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
                 slice_starts: tuple[int, ...], batch: LoraBatch) -> None:
    """``add_lora`` in plain torch, one segment at a time, in float32. Weights past a slot's rank
    are masked with ``where`` (not multiplied by 0), so whatever they hold never reaches out."""
    segments = batch.host_segments
    if segments is None:  # static buffers: read the metadata back (syncs)
        starts, slots = batch.segment_starts.tolist(), batch.segment_slots.tolist()
        segments = [(p, starts[s], starts[s + 1]) for s, p in enumerate(slots) if p >= 0]
    max_rank = lora_a.shape[2]
    for slot, start, end in segments:
        if end <= start:
            continue
        rows = batch.token_order[start:end].to(device=x.device, dtype=torch.long)
        rank_ok = torch.arange(max_rank, device=x.device) < ranks[slot].to(x.device)[:, None]  # (J, R)
        a = torch.where(rank_ok[:, :, None], lora_a[slot].float(), 0.0)  # (J, R, I)
        t = torch.einsum("mi,jri->mjr", x[rows].float(), a)  # (m, J, R)
        delta = torch.empty(rows.shape[0], out.shape[1], dtype=torch.float32, device=x.device)
        for j, (lo, hi) in enumerate(zip(slice_starts, slice_starts[1:])):
            b = torch.where(rank_ok[j], lora_b[slot, lo:hi].float(), 0.0)  # (hi - lo, R)
            delta[:, lo:hi] = t[:, j] @ b.T
        out[rows] = (out[rows].float() + delta).to(out.dtype)


# ---- Triton kernels -----------------------------------------------------------------------------

@jit
def _program_rows(tiles_ptr, starts_ptr, slots_ptr, m_blocks, BLOCK_M: tl.constexpr, TILED: tl.constexpr):
    """-> (slot, start, end) of this program's rows in token_order: decode tile program_id(0), or
    M-block program_id(0) % m_blocks of segment program_id(0) // m_blocks."""
    if TILED:
        tile = tiles_ptr + tl.program_id(0) * 3
        slot = tl.load(tile)
        start = tl.load(tile + 1)
        end = tl.load(tile + 2)
    else:
        seg = tl.program_id(0) // m_blocks
        slot = tl.load(slots_ptr + seg)
        start = tl.load(starts_ptr + seg) + (tl.program_id(0) % m_blocks) * BLOCK_M
        end = tl.load(starts_ptr + seg + 1)
    return slot, start, end


@jit(do_not_specialize=["m_blocks", "capacity"])
def _shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, order_ptr, starts_ptr, slots_ptr, tiles_ptr, part_ptr,
    K, K_PER_SPLIT, m_blocks, capacity, stride_xm,
    N_SLICES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row block, column block, split): the row block's tokens (``_program_rows``, at
    most BLOCK_M) times BLOCK_R columns of lora_a[slot] viewed as (N_SLICES * R, K) (column c =
    slice c // R, rank c % R), over K range [split * K_PER_SPLIT, + K_PER_SPLIT).
    part (SPLIT_K, capacity, N_SLICES * R) float32: row i is token_order position i."""
    pdl_prologue(PDL)  # before the early returns too: every program must wait (kernels/_triton.py)
    slot, start, end = _program_rows(tiles_ptr, starts_ptr, slots_ptr, m_blocks, BLOCK_M, TILED)
    if slot < 0:
        return
    if start >= end:
        return
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank = tl.load(ranks_ptr + slot * N_SLICES + cols // R, mask=cols < N_SLICES * R, other=0)
    col_ok = cols % R < rank
    if tl.max(col_ok.to(tl.int32), axis=0) == 0:  # every slice here has rank 0 (or is past the last)
        return
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    tokens = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    x_rows = x_ptr + tokens[:, None] * stride_xm
    a_rows = a_ptr + slot.to(tl.int64) * (N_SLICES * R) * K + cols[:, None] * K
    k_lo = tl.program_id(2) * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        at = tl.load(a_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
    # Columns past a rank hold 0 (their lora_a rows loaded as 0); storing them keeps the store a
    # whole-row vector store.
    part = part_ptr + (tl.program_id(2) * capacity + pos[:, None]).to(tl.int64) * (N_SLICES * R) + cols[None, :]
    tl.store(part, acc, mask=row_ok[:, None] & (cols < N_SLICES * R)[None, :])


@jit(do_not_specialize=["m_blocks", "capacity"])
def _expand_kernel(
    part_ptr, b_ptr, ranks_ptr, order_ptr, starts_ptr, slots_ptr, tiles_ptr, out_ptr,
    N, S1, S2, S3, m_blocks, capacity, stride_om,
    N_SLICES: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, SPLIT_K: tl.constexpr, SPLIT_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
    VEC_B: tl.constexpr, PRECISION: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row block, N-chunk): out[tokens, chunk] += t @ lora_b[slot, chunk, :r].T,
    BLOCK_N columns at a time, with t (BLOCK_M, R_PAD) the sum of the SPLIT_K partials of the
    chunk's slice j, loaded once. S1..S3: the slice boundaries after slices 0..2 (N where there are
    fewer slices); CHUNK_N divides them, so the whole chunk is in slice j.
    Rank masks are rounded up to 16-byte vectors (VEC_B lora_b elements, 4 float32 partials) so the
    loads vectorize; what that reads past the rank (same sectors, never past the row's R) is
    replaced by 0 with ``where``."""
    pdl_prologue(PDL)
    slot, start, end = _program_rows(tiles_ptr, starts_ptr, slots_ptr, m_blocks, BLOCK_M, TILED)
    if slot < 0:
        return
    if start >= end:
        return
    n_lo = tl.program_id(1) * CHUNK_N
    j = (n_lo >= S1).to(tl.int32) + (n_lo >= S2).to(tl.int32) + (n_lo >= S3).to(tl.int32)
    rank = tl.load(ranks_ptr + slot * N_SLICES + j)
    if rank == 0:
        return
    pos = start + tl.arange(0, BLOCK_M)
    row_ok = pos < end
    ranks_i = tl.arange(0, R_PAD)
    rank_ok = ranks_i < rank
    # The partials of SPLIT_CHUNK splits in one (SPLIT_CHUNK, BLOCK_M, R_PAD) load: issued together,
    # not one L2 round trip per split.
    t = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    t_mask = row_ok[:, None] & ((ranks_i // 4 * 4 < rank) & (ranks_i < R))[None, :]
    for s0 in tl.static_range(0, SPLIT_PAD, SPLIT_CHUNK):
        s = s0 + tl.arange(0, SPLIT_CHUNK)
        rows = (s[:, None, None] * capacity + pos[None, :, None]).to(tl.int64) * (N_SLICES * R)
        mask = (s < SPLIT_K)[:, None, None] & t_mask[None, :, :]
        t += tl.sum(tl.load(part_ptr + rows + j * R + ranks_i[None, None, :], mask=mask, other=0.0), axis=0)
    t = tl.where(rank_ok[None, :], t, 0.0)
    tokens = tl.load(order_ptr + pos, mask=row_ok, other=0).to(tl.int64)
    b_rows = b_ptr + slot.to(tl.int64) * N * R + ranks_i[None, :]
    b_mask = ((ranks_i // VEC_B * VEC_B < rank) & (ranks_i < R))[None, :]
    for n0 in range(n_lo, n_lo + CHUNK_N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        b = tl.load(b_rows + n[:, None] * R, mask=b_mask, other=0.0)  # (BLOCK_N, R_PAD)
        b = tl.where(rank_ok[None, :], b, 0.0)
        acc = tl.dot(t, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
        o_ptrs = out_ptr + tokens[:, None] * stride_om + n[None, :]
        o = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
        tl.store(o_ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=row_ok[:, None])


@dataclass(frozen=True)
class LoraLaunch:
    """Tile shapes of one add_lora call, chosen from host ints only (graph-safe)."""

    block_m: int
    block_r: int  # shrink columns (of the J * R flattened slice-rank columns) per program
    block_k: int
    split_k: int
    k_per_split: int
    block_n: int  # expand output columns per tile
    chunk_n: int  # expand output columns per program: a multiple of block_n dividing every slice boundary
    num_warps: int
    pdl: bool = True  # launch with PDL when kernels/_triton.py enables it


def choose_launch(max_segment_tokens: int, num_segments: int, in_features: int, n_slices: int, max_rank: int,
                  slice_starts: tuple[int, ...], sms: int = 132, max_tiles_per_program: int = 4,
                  num_tiles: int | None = None) -> LoraLaunch:
    """Decode-sized segments (<= DECODE_MAX_TOKENS tokens) stream weights: 16-row tiles and the
    shrink's K split into ~512-column shares, so a (J * R, I) lora_a read is spread over many SMs
    (on an H100, bf16 rank 16, batch 1: 8 splits of I = 4096 and 28 of 14336 timed best,
    benchmarks/features/lora_kernel_bench.py --sweep). Prefill-sized segments are tensor-core GEMMs: 64-row
    tiles, no split, all slice-rank columns of a token block in one or two programs so x is read
    about once. The expand gives a program up to ``max_tiles_per_program`` column tiles (loading
    its t once) when there are more than ~4 tiles per SM. ``num_tiles``: the batch's decode tiles
    (LoraBatch.tiles), which take the decode tilings whatever max_segment_tokens is."""
    boundary_gcd = math.gcd(*slice_starts)
    pow2_gcd = boundary_gcd & -boundary_gcd  # the largest power of 2 dividing every slice boundary
    block_n = min(128, pow2_gcd)
    if num_tiles is not None or max_segment_tokens <= DECODE_MAX_TOKENS:
        # 16-row tiles even for a 64-token segment: in a captured graph max_segment_tokens is the
        # capacity, and most segments hold a token or two.
        block_m, block_r, block_k = DECODE_BLOCK_M, min(64, max(16, triton.next_power_of_2(max_rank))), 128
        split_k = min(32, triton.cdiv(in_features, 512))
        num_warps = 4
    else:
        block_m, block_k, split_k, num_warps = 64, 64, 1, 8
        block_r = min(128, max(16, triton.next_power_of_2(n_slices * max_rank)))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)  # no empty splits
    row_blocks = num_segments * triton.cdiv(max_segment_tokens, block_m) if num_tiles is None else num_tiles
    tiles = row_blocks * (slice_starts[-1] // block_n)
    tiles_per_program = min(max_tiles_per_program, pow2_gcd // block_n, max(1, tiles // (4 * sms)))
    chunk_n = block_n * power_of_2_floor(tiles_per_program)  # a power of 2 times block_n
    return LoraLaunch(block_m, block_r, block_k, split_k, k_per_split, block_n, chunk_n, num_warps,
                      pdl=row_blocks <= PDL_MAX_ROW_BLOCKS)


# The kernels' K and N tiles: in_features and every slice boundary must be multiples of it.
KERNEL_ALIGNMENT = 16


def kernels_take(in_features: int, slice_starts: tuple[int, ...]) -> bool:
    """Whether the Triton kernels can run a projection of these widths (KERNEL_ALIGNMENT)."""
    return in_features % KERNEL_ALIGNMENT == 0 and all(s % KERNEL_ALIGNMENT == 0 for s in slice_starts)


def check_shapes(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 ranks: torch.Tensor, slice_starts: tuple[int, ...]) -> None:
    num_slots, n_slices, max_rank, in_features = lora_a.shape
    if not 1 <= n_slices <= MAX_SLICES:
        raise ValueError(f"{n_slices} slices: the kernels take 1..{MAX_SLICES}")
    if len(slice_starts) != n_slices + 1 or slice_starts[0] != 0 or slice_starts[-1] != out.shape[1]:
        raise ValueError(f"slice_starts {slice_starts} do not cut {out.shape[1]} columns into {n_slices} slices")
    if not kernels_take(in_features, slice_starts):
        raise ValueError(f"in_features {in_features} and slice_starts {slice_starts} must be multiples of "
                         f"{KERNEL_ALIGNMENT}")
    if max_rank > 128:
        raise ValueError(f"max rank {max_rank} > 128")
    assert x.shape == (out.shape[0], in_features) and x.dtype == out.dtype == lora_a.dtype == lora_b.dtype
    assert lora_b.shape == (num_slots, out.shape[1], max_rank) and ranks.shape == (num_slots, n_slices)
    assert ranks.dtype == torch.int32 and x.stride(1) == 1 and out.stride(1) == 1
    assert lora_a.is_contiguous() and lora_b.is_contiguous() and ranks.is_contiguous()


def launch_options(t: torch.Tensor, launch: LoraLaunch) -> dict:
    return pdl_options(t) if launch.pdl else {"PDL": False, "launch_pdl": False}


def row_grid(batch: LoraBatch, launch: LoraLaunch) -> tuple[int, int, torch.Tensor]:
    """-> (m_blocks, grid rows, tiles argument): one grid row per decode tile when the batch has
    them (each at most DECODE_BLOCK_M <= block_m rows), else per segment M-block."""
    # read at ptr + i; a graph's are its static buffers (LoraBatchBuffers: slices of one buffer), so not copied
    require_dense(token_order=batch.token_order, segment_starts=batch.segment_starts,
                  segment_slots=batch.segment_slots, tiles=batch.tiles)
    if batch.tiles is not None:
        assert launch.block_m >= DECODE_BLOCK_M
        return 1, batch.tiles.shape[0], batch.tiles
    m_blocks = triton.cdiv(batch.max_segment_tokens, launch.block_m)
    return m_blocks, batch.num_segments * m_blocks, batch.segment_slots


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, batch: LoraBatch,
                launch: LoraLaunch) -> torch.Tensor:
    """-> part (split_k, capacity_tokens, n_slices * R) float32; entries the expand does not read
    (columns past a rank, positions in no segment) are left uninitialised."""
    _, n_slices, max_rank, in_features = lora_a.shape
    capacity = batch.token_order.shape[0]
    part = torch.empty(launch.split_k, capacity, n_slices * max_rank, dtype=torch.float32, device=x.device)
    m_blocks, row_blocks, tiles = row_grid(batch, launch)
    grid = (row_blocks, triton.cdiv(n_slices * max_rank, launch.block_r), launch.split_k)
    _shrink_kernel[grid](
        x, lora_a, ranks, batch.token_order, batch.segment_starts, batch.segment_slots, tiles, part,
        in_features, launch.k_per_split, m_blocks, capacity, x.stride(0),
        N_SLICES=n_slices, R=max_rank, BLOCK_M=launch.block_m, BLOCK_R=launch.block_r, BLOCK_K=launch.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", TILED=batch.tiles is not None,
        num_warps=launch.num_warps, num_stages=3, **launch_options(x, launch),
    )
    return part


def lora_expand(part: torch.Tensor, out: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
                slice_starts: tuple[int, ...], batch: LoraBatch, launch: LoraLaunch) -> None:
    n_slices, max_rank = ranks.shape[1], lora_b.shape[2]
    out_features = out.shape[1]
    bounds = list(slice_starts[1:-1]) + [out_features] * (MAX_SLICES - n_slices)
    m_blocks, row_blocks, tiles = row_grid(batch, launch)
    grid = (row_blocks, out_features // launch.chunk_n)
    r_pad = max(16, triton.next_power_of_2(max_rank))
    split_pad = triton.next_power_of_2(launch.split_k)
    # Splits summed per load: at most 4096 float32 (32 registers a thread at 4 warps).
    split_chunk = min(split_pad, max(1, 4096 // (launch.block_m * r_pad)))
    _expand_kernel[grid](
        part, lora_b, ranks, batch.token_order, batch.segment_starts, batch.segment_slots, tiles, out,
        out_features, *bounds, m_blocks, part.shape[1], out.stride(0),
        N_SLICES=n_slices, R=max_rank, R_PAD=r_pad, SPLIT_K=launch.split_k, SPLIT_PAD=split_pad,
        SPLIT_CHUNK=split_chunk, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, CHUNK_N=launch.chunk_n,
        VEC_B=16 // lora_b.element_size(),
        # fp32 engines get fp32 dots; otherwise t (float32) meets lora_b in a tf32 dot (10-bit
        # mantissa, finer than bf16's 7 and equal to fp16's, so lora_b is exact).
        PRECISION="ieee" if out.dtype == torch.float32 else "tf32", TILED=batch.tiles is not None,
        num_warps=4, num_stages=2, **launch_options(out, launch),
    )


def add_lora_triton(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    ranks: torch.Tensor, slice_starts: tuple[int, ...], batch: LoraBatch,
                    launch: LoraLaunch | None = None) -> None:
    check_shapes(x, out, lora_a, lora_b, ranks, slice_starts)
    if batch.max_segment_tokens == 0 or batch.num_segments == 0 or x.shape[0] == 0:
        return
    if batch.tiles is not None and batch.tiles.shape[0] == 0:
        return
    if launch is None:
        launch = choose_launch(batch.max_segment_tokens, batch.num_segments, x.shape[1], ranks.shape[1],
                               lora_a.shape[2], slice_starts, num_sms(x.device),
                               num_tiles=None if batch.tiles is None else batch.tiles.shape[0])
    part = lora_shrink(x, lora_a, ranks, batch, launch)
    lora_expand(part, out, lora_b, ranks, slice_starts, batch, launch)


def add_lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
             slice_starts: tuple[int, ...], batch: LoraBatch) -> None:
    """In place: out[t] += each adapted slice's (x[t] @ A.T) @ B.T for every token t of a segment
    (module docstring). x, out (num_tokens, ·) in the model dtype (fp32/fp16/bf16), out with
    contiguous rows; lora_a (S, J, R, I), lora_b (S, O, R) in the model dtype; ranks (S, J) int32 on
    x's device (0: slice not adapted); slice_starts J + 1 host ints. Rows of tokens without an
    adapter are untouched. The products accumulate in float32 and are added to out once."""
    if use_triton(x):
        add_lora_triton(x, out, lora_a, lora_b, ranks, slice_starts, batch)
    else:
        add_lora_ref(x, out, lora_a, lora_b, ranks, slice_starts, batch)
