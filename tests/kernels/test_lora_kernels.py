"""Batched multi-adapter LoRA: the torch reference against a per-token loop and the segment
metadata (CPU); the Triton kernels against the reference (GPU, or Triton's CPU interpreter with
TRITON_INTERPRET=1), eagerly, on the segment grid and on decode tiles, and replayed from a CUDA
graph over LoraBatchBuffers (the full buffers and a decode bucket view).

Weights past a slot's rank hold NaN here (the pool promises zeros there): a kernel or reference
that reads them, even to multiply by zero, fails.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

from kernels.lora import (
    DECODE_BLOCK_M,
    LoraBatch,
    LoraBatchBuffers,
    add_lora,
    add_lora_ref,
    add_lora_triton,
    choose_launch,
    lora_batch,
    max_tiles,
)

QKV_SMALL = (0, 64, 96, 128)  # 3 slices, in 80: widths 64/32/32 (not multiples of a 128 block)
QKV_8B = (0, 4096, 5120, 6144)
GATE_UP_8B = (0, 14336, 28672)


def make_pool(num_slots, in_features, slice_starts, max_rank, ranks, *, seed, dtype=torch.float32, device="cpu"):
    """lora_a (S, J, R, I), lora_b (S, O, R) in ``dtype``, NaN past each slot's rank; ranks (S, J) int32.
    Scales keep each product O(1): a ~ I^-1/2, b ~ R^-1/2."""
    gen = torch.Generator().manual_seed(seed)
    n_slices = len(slice_starts) - 1
    a = torch.randn(num_slots, n_slices, max_rank, in_features, generator=gen) * in_features**-0.5
    b = torch.randn(num_slots, slice_starts[-1], max_rank, generator=gen) * max_rank**-0.5
    ranks = torch.tensor(ranks, dtype=torch.int32).reshape(num_slots, n_slices)
    for p in range(num_slots):
        for j, (lo, hi) in enumerate(zip(slice_starts, slice_starts[1:])):
            r = int(ranks[p, j])
            a[p, j, r:] = float("nan")
            b[p, lo:hi, r:] = float("nan")
    return a.to(device, dtype), b.to(device, dtype), ranks.to(device)


def make_rows(num_tokens, in_features, out_features, *, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    out = torch.randn(num_tokens, out_features, generator=gen)
    return x.to(device, dtype), out.to(device, dtype)


def per_token_loop(x, out, lora_a, lora_b, ranks, slice_starts, row_slots, seq_lens):
    """The definition, one token and slice at a time, in float64 (only weights below the rank)."""
    expected = out.double().cpu().clone()
    token_slots = [slot for slot, n in zip(row_slots, seq_lens) for _ in range(n)]
    for t, p in enumerate(token_slots):
        if p < 0:
            continue
        for j, (lo, hi) in enumerate(zip(slice_starts, slice_starts[1:])):
            r = int(ranks[p, j])
            if r:
                a, b = lora_a[p, j, :r].double().cpu(), lora_b[p, lo:hi, :r].double().cpu()
                expected[t, lo:hi] += (x[t].double().cpu() @ a.T) @ b.T
    return expected


# ---- metadata (CPU) -----------------------------------------------------------------------------

def test_lora_batch_groups_interleaved_sequences():
    batch = lora_batch([2, -1, 0, 2], [3, 1, 5, 1], "cpu")
    assert batch.token_order.tolist() == [0, 1, 2, 9, 4, 5, 6, 7, 8]
    assert batch.segment_starts.tolist() == [0, 4, 9]
    assert batch.segment_slots.tolist() == [2, 0]
    assert batch.max_segment_tokens == 5 and batch.num_segments == 2
    assert batch.host_segments == [(2, 0, 4), (0, 4, 9)]
    assert batch.token_order.dtype == batch.segment_starts.dtype == batch.segment_slots.dtype == torch.int32


def test_lora_batch_decode_tiles():
    """Decode-sized segments are cut into DECODE_BLOCK_M-row tiles (slot, start, end) into token_order."""
    batch = lora_batch([2, -1, 0, 2], [3, 1, 5, 1], "cpu")
    assert batch.tiles.tolist() == [[2, 0, 4], [0, 4, 9]]
    batch = lora_batch([1, 0, 1], [DECODE_BLOCK_M + 3, 2, 1], "cpu")
    m = DECODE_BLOCK_M
    assert batch.tiles.tolist() == [[1, 0, m], [1, m, m + 4], [0, m + 4, m + 6]]
    assert lora_batch([0], [65], "cpu").tiles is None  # a prefill segment: the segment grid
    assert lora_batch([0], [65], "cpu", tiles=True).tiles.shape == (5, 3)
    assert lora_batch([0], [3], "cpu", tiles=False).tiles is None


@pytest.mark.parametrize("seed", range(20))
def test_max_tiles_bounds_any_split(seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(torch.randint(1, 300, (1,), generator=gen))
    num_segments = int(torch.randint(1, min(num_tokens, 70) + 1, (1,), generator=gen))
    cuts = sorted(torch.randperm(num_tokens - 1, generator=gen)[:num_segments - 1].add(1).tolist())
    seq_lens = [b - a for a, b in zip([0] + cuts, cuts + [num_tokens])]
    batch = lora_batch(list(range(num_segments)), seq_lens, "cpu", tiles=True)
    assert batch.tiles.shape[0] <= max_tiles(num_tokens, num_segments)


def test_lora_batch_none_without_adapters():
    assert lora_batch([-1, -1], [4, 1], "cpu") is None
    assert lora_batch([], [], "cpu") is None


@pytest.mark.parametrize("seed", range(5))
def test_segments_cover_exactly_the_adapter_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = 12
    row_slots = (torch.randint(-1, 4, (num_seqs,), generator=gen)).tolist()
    seq_lens = torch.randint(1, 9, (num_seqs,), generator=gen).tolist()
    token_slots = [slot for slot, n in zip(row_slots, seq_lens) for _ in range(n)]
    batch = lora_batch(row_slots, seq_lens, "cpu")
    if batch is None:
        assert all(s < 0 for s in row_slots)
        return
    order = batch.token_order.tolist()
    assert sorted(order) == [t for t, p in enumerate(token_slots) if p >= 0]
    sizes = []
    for slot, start, end in batch.host_segments:
        assert {token_slots[t] for t in order[start:end]} == {slot}
        sizes.append(end - start)
    assert len({s for s, _, _ in batch.host_segments}) == batch.num_segments  # one segment per slot
    assert batch.max_segment_tokens == max(sizes)


def test_buffers_fill_pads_unused_segments():
    buffers = LoraBatchBuffers(capacity_tokens=12, capacity_segments=4, device="cpu")
    buffers.fill([2, -1, 0, 2], [3, 1, 5, 1])
    batch = buffers.batch()
    assert batch.max_segment_tokens == 12 and batch.num_segments == 4 and batch.host_segments is None
    assert batch.token_order[:9].tolist() == [0, 1, 2, 9, 4, 5, 6, 7, 8]
    assert batch.segment_starts.tolist() == [0, 4, 9, 9, 9]
    assert batch.segment_slots.tolist() == [2, 0, -1, -1]
    buffers.fill([1], [2])  # a later step: the earlier step's segments must be gone
    assert batch.segment_starts.tolist() == [0, 2, 2, 2, 2]
    assert batch.segment_slots.tolist() == [1, -1, -1, -1]
    with pytest.raises(ValueError, match="capacity"):
        buffers.fill([0, 1, 2, 3, 4], [1] * 5)
    with pytest.raises(ValueError, match="capacity"):
        buffers.fill([0], [13])


def test_buffers_decode_views():
    """batch(n): the view a graph of n rows captures; tiles from the front, unused ones slot -1."""
    buffers = LoraBatchBuffers(capacity_tokens=256, capacity_segments=64, device="cpu", decode=True)
    assert buffers.capacity_tiles == max_tiles(256, 64) == 76
    buffers.fill([5, 5, -1, 3] + [5] * 20, [1] * 24)
    view = buffers.batch(4)
    assert view.token_order.shape == (4,) and view.num_segments == 4 and view.max_segment_tokens == 4
    assert view.tiles.shape == (max_tiles(4, 4), 3) == (4, 3)
    m = DECODE_BLOCK_M
    assert view.tiles.tolist() == [[5, 0, m], [5, m, 22], [3, 22, 23], [-1, 0, 0]]
    assert buffers.batch(1).tiles.shape == (1, 3) and buffers.batch(256).tiles.shape == (76, 3)
    prefill = LoraBatchBuffers(capacity_tokens=256, capacity_segments=8, device="cpu")
    assert prefill.batch().tiles is None and prefill.batch(64).tiles is not None
    with pytest.raises(ValueError):
        buffers.batch(257)


# ---- reference (CPU) ----------------------------------------------------------------------------

# Ranks per (slot, slice): they differ per slot and per slice, with rank-0 slices and an unused slot 3.
RANKS_4x3 = [[8, 4, 0], [2, 8, 8], [0, 0, 5], [8, 8, 8]]
SCENARIOS = {
    "interleaved": ([2, -1, 0, 2], [3, 1, 5, 1]),
    "decode": ([1, 0, -1, 1, 2, 0], [1] * 6),
    "one_prefill": ([1], [37]),
    "rank0_only": ([2], [4]),  # slot 2 adapts only slice 2
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_ref_matches_per_token_loop(scenario, dtype):
    row_slots, seq_lens = SCENARIOS[scenario]
    x, out = make_rows(sum(seq_lens), 80, QKV_SMALL[-1], seed=1, dtype=dtype)
    lora_a, lora_b, ranks = make_pool(4, 80, QKV_SMALL, 8, RANKS_4x3, seed=2, dtype=dtype)
    expected = per_token_loop(x, out, lora_a, lora_b, ranks, QKV_SMALL, row_slots, seq_lens)
    untouched = [t for t, p in enumerate(p for p, n in zip(row_slots, seq_lens) for _ in range(n)) if p < 0]
    before = out.clone()
    add_lora_ref(x, out, lora_a, lora_b, ranks, QKV_SMALL, lora_batch(row_slots, seq_lens, "cpu"))
    assert torch.equal(out[untouched], before[untouched])
    # fp32: only the summation order differs; bf16: out is rounded once (2^-9 relative).
    assert relative_error(out, expected) < {torch.float32: 1e-6, torch.bfloat16: 5e-3}[dtype]


def test_ref_reads_device_metadata_without_host_segments():
    row_slots, seq_lens = SCENARIOS["interleaved"]
    x, out = make_rows(10, 80, 128, seed=3)
    lora_a, lora_b, ranks = make_pool(4, 80, QKV_SMALL, 8, RANKS_4x3, seed=4)
    expected = out.clone()
    add_lora_ref(x, expected, lora_a, lora_b, ranks, QKV_SMALL, lora_batch(row_slots, seq_lens, "cpu"))
    buffers = LoraBatchBuffers(capacity_tokens=16, capacity_segments=3, device="cpu")
    buffers.fill(row_slots, seq_lens)
    add_lora(x, out, lora_a, lora_b, ranks, QKV_SMALL, buffers.batch())  # CPU tensors: the reference
    assert torch.equal(out, expected)


# ---- Triton kernels (GPU, or the interpreter) ---------------------------------------------------

def run_both(x, out, lora_a, lora_b, ranks, slice_starts, batch):
    """-> (kernel result, reference result), the reference run first on a copy (both write in place)."""
    expected = out.clone()
    add_lora_ref(x, expected, lora_a, lora_b, ranks, slice_starts, batch)
    add_lora_triton(x, out, lora_a, lora_b, ranks, slice_starts, batch)
    return out, expected


def check(out, expected, dtype, touched_rows):
    """Kernel vs reference: equal where no adapter applies; elsewhere the same float32 sums in a
    different order (and, below fp32, the expand's tf32 dot: 2^-11 relative on the intermediate),
    each rounded once to the output dtype, so within the kernel tests' usual bounds."""
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    untouched[touched_rows] = False
    assert torch.equal(out[untouched], expected[untouched])
    assert relative_error(out, expected) < TOLERANCE[dtype]


def dtypes(device):
    return [torch.float32] + low_precision_dtypes(device)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_triton_small_shapes(device, scenario):
    row_slots, seq_lens = SCENARIOS[scenario]
    for dtype in dtypes(device):
        x, out = make_rows(sum(seq_lens), 80, 128, seed=5, dtype=dtype, device=device)
        lora_a, lora_b, ranks = make_pool(4, 80, QKV_SMALL, 8, RANKS_4x3, seed=6, dtype=dtype, device=device)
        batch = lora_batch(row_slots, seq_lens, device)
        check(*run_both(x, out, lora_a, lora_b, ranks, QKV_SMALL, batch), dtype, batch.token_order.long())


def mixed_sequences(num_tokens, num_adapters):
    """About num_tokens rows: two sequences per adapter where there is room (so a segment gathers
    rows that are not adjacent), and a one-token sequence without adapter after every third."""
    num_seqs = min(num_tokens, 2 * num_adapters)
    row_slots, seq_lens = [], []
    for i in range(num_seqs):
        row_slots.append(i % num_adapters)
        seq_lens.append(num_tokens // num_seqs)
        if i % 3 == 2:
            row_slots.append(-1)
            seq_lens.append(1)
    return row_slots, seq_lens


def random_ranks(num_slots, n_slices, choices, *, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor(choices)[torch.randint(len(choices), (num_slots, n_slices), generator=gen)].tolist()


@pytest.mark.parametrize("num_tokens,num_adapters", [(1, 1), (8, 4), (64, 1), (64, 4), (64, 16), (64, 64),
                                                     (300, 3)])
@pytest.mark.parametrize("max_rank", [4, 16, 64])
def test_triton_mixed_ranks(device, num_tokens, num_adapters, max_rank):
    """Decode-sized (one token per sequence) and prefill-sized batches over many adapters; ranks
    per slot and slice drawn from {0, 4, 8, 16, 64} up to max_rank."""
    if device != "cuda" and num_tokens > 64:
        pytest.skip("interpreter: too slow")
    slice_starts = (0, 256, 320, 384)
    choices = [r for r in (0, 4, 8, 16, 64) if r <= max_rank]
    row_slots, seq_lens = mixed_sequences(num_tokens, num_adapters)
    for dtype in dtypes(device):
        x, out = make_rows(sum(seq_lens), 256, 384, seed=7, dtype=dtype, device=device)
        pool = make_pool(num_adapters, 256, slice_starts, max_rank,
                         random_ranks(num_adapters, 3, choices, seed=8), seed=9, dtype=dtype, device=device)
        batch = lora_batch(row_slots, seq_lens, device)
        check(*run_both(x, out, *pool, slice_starts, batch), dtype, batch.token_order.long())


@pytest.mark.parametrize("num_tokens,num_adapters", [(1, 1), (8, 4), (64, 4), (64, 64), (300, 3)])
def test_triton_tiles_forced_other_way(device, num_tokens, num_adapters):
    """The path lora_batch does not pick by default: segments for decode batches, decode tiles
    (16-row pieces of 100-token segments) for a prefill batch."""
    if device != "cuda" and num_tokens > 64:
        pytest.skip("interpreter: too slow")
    slice_starts = (0, 256, 320, 384)
    row_slots, seq_lens = mixed_sequences(num_tokens, num_adapters)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, out = make_rows(sum(seq_lens), 256, 384, seed=21, dtype=dtype, device=device)
    pool = make_pool(num_adapters, 256, slice_starts, 16, random_ranks(num_adapters, 3, [0, 4, 16], seed=22),
                     seed=23, dtype=dtype, device=device)
    batch = lora_batch(row_slots, seq_lens, device, tiles=num_tokens > 64)
    assert (batch.tiles is not None) == (num_tokens > 64)
    check(*run_both(x, out, *pool, slice_starts, batch), dtype, batch.token_order.long())


@pytest.mark.parametrize("variant", [
    {"split_k": 1, "k_per_split": 256},  # no split
    {"split_k": 3, "k_per_split": 128, "block_k": 64},  # splits not a power of 2, two K steps each
    {"block_n": 32, "chunk_n": 128},  # four column tiles per expand program
    {"block_m": 64, "block_r": 128, "block_k": 64, "split_k": 1, "k_per_split": 256, "num_warps": 8},  # prefill tiles
])
def test_triton_launch_variants(device, variant):
    """Tilings choose_launch picks for other shapes, forced on a small one (mixed ranks, NaN past them)."""
    slice_starts = (0, 256, 384, 512)
    row_slots, seq_lens = mixed_sequences(40, 5)
    x, out = make_rows(sum(seq_lens), 256, 512, seed=18, device=device)
    pool = make_pool(5, 256, slice_starts, 16, random_ranks(5, 3, [0, 4, 16], seed=19), seed=20, device=device)
    batch = lora_batch(row_slots, seq_lens, device)
    launch = dataclasses.replace(choose_launch(batch.max_segment_tokens, batch.num_segments, 256, 3, 16,
                                               slice_starts), **variant)
    expected = out.clone()
    add_lora_ref(x, expected, *pool, slice_starts, batch)
    add_lora_triton(x, out, *pool, slice_starts, batch, launch)
    check(out, expected, torch.float32, batch.token_order.long())


LLAMA_8B = {"qkv": (4096, QKV_8B), "gate_up": (4096, GATE_UP_8B), "o": (4096, (0, 4096)), "down": (14336, (0, 4096))}


@pytest.mark.parametrize("proj", sorted(LLAMA_8B))
@pytest.mark.parametrize("num_tokens,num_adapters", [(1, 1), (64, 64), (64, 4), (1000, 2)])
def test_triton_llama_8b_shapes(device, proj, num_tokens, num_adapters):
    if device != "cuda":
        pytest.skip("8B shapes: GPU only")
    in_features, slice_starts = LLAMA_8B[proj]
    n_slices = len(slice_starts) - 1
    row_slots = [i % num_adapters for i in range(min(num_tokens, 64))]
    seq_lens = [num_tokens // len(row_slots)] * len(row_slots)
    seq_lens[-1] += num_tokens - sum(seq_lens)
    ranks = random_ranks(num_adapters, n_slices, [8, 16], seed=10)
    for dtype in dtypes(device):
        x, out = make_rows(num_tokens, in_features, slice_starts[-1], seed=11, dtype=dtype, device=device)
        pool = make_pool(num_adapters, in_features, slice_starts, 16, ranks, seed=12, dtype=dtype, device=device)
        batch = lora_batch(row_slots, seq_lens, device)
        check(*run_both(x, out, *pool, slice_starts, batch), dtype, batch.token_order.long())


def test_triton_8192_token_prefill_segment(device):
    if device != "cuda":
        pytest.skip("GPU only")
    x, out = make_rows(8192, 4096, 6144, seed=13, dtype=torch.bfloat16, device=device)
    pool = make_pool(2, 4096, QKV_8B, 64, [[64, 16, 16], [8, 8, 8]], seed=14, dtype=torch.bfloat16, device=device)
    batch = lora_batch([1], [8192], device)
    check(*run_both(x, out, *pool, QKV_8B, batch), torch.bfloat16, batch.token_order.long())


def graph_batch(buffers: LoraBatchBuffers, view: str, num_tokens: int) -> LoraBatch:
    if view == "segments":  # what a caller that knows no tiles builds: the segment grid
        full = buffers.batch()
        return LoraBatch(token_order=full.token_order[:num_tokens], segment_starts=full.segment_starts,
                         segment_slots=full.segment_slots, max_segment_tokens=num_tokens)
    return buffers.batch() if view == "tiles" else buffers.batch(num_tokens)


@pytest.mark.parametrize("view,capacity_tokens", [("tiles", 64), ("segments", 64), ("bucket", 256)])
def test_buffers_in_a_cuda_graph(device, view, capacity_tokens):
    """Capture add_lora once over LoraBatchBuffers, then fill different steps' metadata and replay:
    each replay must equal the reference over that step's own lora_batch. Views: the full buffers
    (decode tiles), the segment grid, and a 64-row bucket of decode buffers of 256."""
    if device != "cuda":
        pytest.skip("CUDA graphs: GPU only")
    dtype, num_tokens = torch.bfloat16, 64
    x, out = make_rows(num_tokens, 4096, 6144, seed=15, dtype=dtype, device=device)
    out0 = out.clone()
    pool = make_pool(8, 4096, QKV_8B, 16, random_ranks(8, 3, [0, 8, 16], seed=16), seed=17, dtype=dtype, device=device)
    buffers = LoraBatchBuffers(capacity_tokens=capacity_tokens, capacity_segments=8, device=device,
                               decode=view == "bucket")
    buffers.fill([0], [num_tokens])
    batch = graph_batch(buffers, view, num_tokens)
    assert (batch.tiles is None) == (view == "segments")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        add_lora(x, out, *pool, QKV_8B, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(x, out, *pool, QKV_8B, batch)
    steps = [([3, -1, 0, 3, 7], [10, 4, 20, 5, 25]), ([5] * 64, [1] * 64), (list(range(8)) * 8, [1] * 64),
             ([-1, 2], [63, 1]), ([-1], [64]), ([1, 1, -1, 6] * 16, [1] * 64)]
    for row_slots, seq_lens in steps:
        buffers.fill(row_slots, seq_lens)
        out.copy_(out0)
        graph.replay()
        expected = out0.clone()
        batch = lora_batch(row_slots, seq_lens, device)
        if batch is None:
            assert torch.equal(out, out0)
            continue
        add_lora_ref(x, expected, *pool, QKV_8B, batch)
        check(out, expected, dtype, batch.token_order.long())
