"""Batched multi-adapter LoRA kernels (kernels/lora.py): device microseconds of the shrink, the
expand, and both (one add_lora call), per Llama-8B projection, replayed from CUDA graphs
(kernels.linear.graph_time_ms: no launch overhead).

    python benchmarks/features/lora_kernel_bench.py                      # bf16, rank 16
    python benchmarks/features/lora_kernel_bench.py --rank 64 --sweep    # also time a few decode tilings

Decode-sized batches: 1, 8, 64 tokens (one per sequence) spread round-robin over 1, 4, 16, 64
adapters of a 64-slot pool; then one 8192-token prefill segment of one adapter. Every slice of
every slot has the same rank. Two rows per projection put batch 1 and batch 64 (64 adapters) in
LoraBatchBuffers of capacity 64 tokens / 64 segments, the grid a captured decode graph has.
"base" is the projection itself (F.linear through cuBLAS) at the same token count, for scale.

    python benchmarks/features/lora_kernel_bench.py --graphs             # decode-graph buckets only

--graphs times one add_lora call the way a captured decode graph of bucket b runs it: b rows (one
per sequence, round-robin over the adapters) in LoraBatchBuffers(b, min(b, 64), decode=True),
seen as the segment grid (a LoraBatch without tiles: segments x 16-row blocks, or 64-row blocks
past 64 rows, PDL off: the kernels before decode tiles) and as batch(b) (decode tiles) with
programmatic dependent launch off, on, and as choose_launch picks (LoraLaunch.pdl). --sweep then
times the shrink's split-K ways at bucket 1 and the expand's column tiles per program x PDL at 64.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import int_list  # noqa: E402
from kernels._triton import num_sms  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402
from kernels.lora import (  # noqa: E402
    LoraBatch,
    LoraBatchBuffers,
    add_lora_triton,
    choose_launch,
    lora_batch,
    lora_expand,
    lora_shrink,
)

# name: (in_features, slice_starts)
PROJECTIONS = {
    "qkv": (4096, (0, 4096, 5120, 6144)),
    "gate_up": (4096, (0, 14336, 28672)),
    "o": (4096, (0, 4096)),
    "down": (14336, (0, 4096)),
}
POOL_SLOTS = 64


def make_pool(in_features, slice_starts, rank, dtype):
    n_slices = len(slice_starts) - 1
    lora_a = torch.randn(POOL_SLOTS, n_slices, rank, in_features, device="cuda", dtype=dtype) * in_features**-0.5
    lora_b = torch.randn(POOL_SLOTS, slice_starts[-1], rank, device="cuda", dtype=dtype) * rank**-0.5
    ranks = torch.full((POOL_SLOTS, n_slices), rank, dtype=torch.int32, device="cuda")
    return lora_a, lora_b, ranks


def time_case(proj, num_tokens, num_adapters, pool, dtype, launch=None, graph_capacity=None) -> dict:
    """graph_capacity (tokens, segments): the batch lives in LoraBatchBuffers of that capacity, as
    in a captured decode graph (the grid covers the capacity, the unused programs exit)."""
    in_features, slice_starts = PROJECTIONS[proj]
    lora_a, lora_b, ranks = pool
    x = torch.randn(num_tokens, in_features, device="cuda", dtype=dtype)
    out = torch.randn(num_tokens, slice_starts[-1], device="cuda", dtype=dtype)
    if num_adapters == 1 and num_tokens > 64:
        batch = lora_batch([0], [num_tokens], "cuda")
    else:
        batch = lora_batch([i % num_adapters for i in range(num_tokens)], [1] * num_tokens, "cuda")
    if graph_capacity:
        buffers = LoraBatchBuffers(*graph_capacity, device="cuda")
        buffers.fill([i % num_adapters for i in range(num_tokens)], [1] * num_tokens)
        batch = buffers.batch()
    launch = launch or choose_launch(batch.max_segment_tokens, batch.num_segments, in_features,
                                     len(slice_starts) - 1, lora_a.shape[2], slice_starts, num_sms(x.device),
                                     num_tiles=None if batch.tiles is None else batch.tiles.shape[0])
    part = lora_shrink(x, lora_a, ranks, batch, launch)
    weight = torch.randn(slice_starts[-1], in_features, device="cuda", dtype=dtype)
    return {
        "shrink": graph_time_ms(lambda: lora_shrink(x, lora_a, ranks, batch, launch)) * 1e3,
        "expand": graph_time_ms(lambda: lora_expand(part, out, lora_b, ranks, slice_starts, batch, launch)) * 1e3,
        "total": graph_time_ms(
            lambda: add_lora_triton(x, out, lora_a, lora_b, ranks, slice_starts, batch, launch)) * 1e3,
        "base": graph_time_ms(lambda: F.linear(x, weight)) * 1e3,
    }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sweep_variants(in_features: int, slice_starts: tuple[int, ...], rank: int):
    """(case, launch) pairs around the chosen tilings: the shrink's split-K ways at batch 1, and
    the expand's column tiles per program at 64 tokens over 64 adapters."""
    n_slices = len(slice_starts) - 1
    base = choose_launch(1, 1, in_features, n_slices, rank, slice_starts)
    for split_k in (4, 8, 16, 32):
        k_per_split = cdiv(cdiv(in_features, split_k), base.block_k) * base.block_k
        yield (1, 1), dataclasses.replace(base, split_k=cdiv(in_features, k_per_split), k_per_split=k_per_split)
    for tiles in (1, 2, 4, 8, 16):
        launch = choose_launch(1, 64, in_features, n_slices, rank, slice_starts, max_tiles_per_program=tiles)
        if launch.chunk_n == launch.block_n * tiles:
            yield (64, 64), launch


def decode_graph_batch(bucket: int, num_adapters: int, tiles: bool) -> LoraBatch:
    """The LoraBatch a decode graph of ``bucket`` rows captures, filled with one step of bucket rows."""
    buffers = LoraBatchBuffers(bucket, min(bucket, POOL_SLOTS), device="cuda", decode=True)
    buffers.fill([i % num_adapters for i in range(bucket)], [1] * bucket)
    batch = buffers.batch(bucket)
    if not tiles:  # what DecodeGraphs._lora_batch builds without tiles
        batch = dataclasses.replace(batch, tiles=None)
    batch.keep = buffers  # the views' storage
    return batch


def time_decode_graph(proj, bucket, num_adapters, pool, dtype, tiles: bool, pdl: bool | None = None,
                      launch=None, **choose) -> float:
    """pdl None: as choose_launch picks (LoraLaunch.pdl), else forced; choose: choose_launch keywords."""
    in_features, slice_starts = PROJECTIONS[proj]
    lora_a, lora_b, ranks = pool
    x = torch.randn(bucket, in_features, device="cuda", dtype=dtype)
    out = torch.randn(bucket, slice_starts[-1], device="cuda", dtype=dtype)
    batch = decode_graph_batch(bucket, num_adapters, tiles)
    launch = launch or choose_launch(batch.max_segment_tokens, batch.num_segments, in_features,
                                     len(slice_starts) - 1, lora_a.shape[2], slice_starts, num_sms(x.device),
                                     num_tiles=None if batch.tiles is None else batch.tiles.shape[0], **choose)
    if pdl is not None:
        launch = dataclasses.replace(launch, pdl=pdl)
    return graph_time_ms(lambda: add_lora_triton(x, out, lora_a, lora_b, ranks, slice_starts, batch, launch)) * 1e3


def graphs_main(rank: int, dtype_name: str, sweep: bool) -> None:
    dtype = getattr(torch, dtype_name)
    print(f"# {torch.cuda.get_device_name()}, {dtype_name}, rank {rank}, pool {POOL_SLOTS} slots; microseconds "
          f"of one add_lora in a decode graph of the bucket's size")
    print(f"{'proj':8} {'bucket':>6} {'adapters':>8} {'seg':>8} {'tiles':>8} {'tile+pdl':>8} {'chosen':>8} "
          f"{'base':>8}")
    cases = [(1, 1), (64, 1), (64, 4), (64, 16), (64, 64), (256, 1), (256, 64)]
    for proj, (in_features, slice_starts) in PROJECTIONS.items():
        pool = make_pool(in_features, slice_starts, rank, dtype)
        weight = torch.randn(slice_starts[-1], in_features, device="cuda", dtype=dtype)
        for bucket, num_adapters in cases:
            times = [time_decode_graph(proj, bucket, num_adapters, pool, dtype, tiles, pdl)
                     for tiles, pdl in ((False, False), (True, False), (True, True), (True, None))]
            x = torch.randn(bucket, in_features, device="cuda", dtype=dtype)
            base = graph_time_ms(lambda: F.linear(x, weight)) * 1e3
            print(f"{proj:8} {bucket:6d} {num_adapters:8d} " + " ".join(f"{t:8.2f}" for t in times)
                  + f" {base:8.2f}", flush=True)
        if sweep:
            n_slices = len(slice_starts) - 1
            base_launch = choose_launch(1, 1, in_features, n_slices, rank, slice_starts, num_tiles=1)
            for split_k in (4, 8, 16, 32):
                k_per_split = cdiv(cdiv(in_features, split_k), base_launch.block_k) * base_launch.block_k
                launch = dataclasses.replace(base_launch, split_k=cdiv(in_features, k_per_split),
                                             k_per_split=k_per_split)
                t = time_decode_graph(proj, 1, 1, pool, dtype, True, launch=launch)
                print(f"  sweep {proj} bucket 1, split_k={launch.split_k}: {t:.2f}", flush=True)
            for num_adapters in (1, 16, 64):
                t = [time_decode_graph(proj, 64, num_adapters, pool, dtype, True, pdl, max_tiles_per_program=tpp)
                     for tpp in (1, 2, 4) for pdl in (False, True)]
                print(f"  sweep {proj} bucket 64, {num_adapters} adapters, expand tiles per program 1/2/4 x "
                      f"PDL off/on: " + " ".join(f"{v:.2f}" for v in t), flush=True)
        del pool, weight
        torch.cuda.empty_cache()


def main(tokens: list[int], adapters: list[int], rank: int, dtype_name: str, prefill_tokens: int, sweep: bool) -> None:
    dtype = getattr(torch, dtype_name)
    print(f"# {torch.cuda.get_device_name()}, {dtype_name}, rank {rank}, pool {POOL_SLOTS} slots; microseconds")
    print(f"{'proj':8} {'tokens':>6} {'adapters':>8} {'shrink':>8} {'expand':>8} {'total':>8} {'base':>8}")
    for proj, (in_features, slice_starts) in PROJECTIONS.items():
        pool = make_pool(in_features, slice_starts, rank, dtype)
        cases = [(t, a) for t in tokens for a in adapters if a <= t] + [(prefill_tokens, 1)]
        for num_tokens, num_adapters in cases:
            r = time_case(proj, num_tokens, num_adapters, pool, dtype)
            print(f"{proj:8} {num_tokens:6d} {num_adapters:8d} {r['shrink']:8.2f} {r['expand']:8.2f} "
                  f"{r['total']:8.2f} {r['base']:8.2f}", flush=True)
        for num_tokens, num_adapters in [(1, 1), (64, 64)]:
            r = time_case(proj, num_tokens, num_adapters, pool, dtype, graph_capacity=(64, 64))
            print(f"{proj:8} {num_tokens:6d} {num_adapters:8d} {r['shrink']:8.2f} {r['expand']:8.2f} "
                  f"{r['total']:8.2f} {r['base']:8.2f}  (LoraBatchBuffers of 64 tokens, 64 segments)", flush=True)
        if sweep:
            for (num_tokens, num_adapters), launch in sweep_variants(in_features, slice_starts, rank):
                r = time_case(proj, num_tokens, num_adapters, pool, dtype, launch)
                print(f"  sweep {proj} {num_tokens} tokens / {num_adapters} adapters, split_k={launch.split_k} "
                      f"k_per_split={launch.k_per_split} chunk_n={launch.chunk_n}: shrink {r['shrink']:.2f} "
                      f"expand {r['expand']:.2f} total {r['total']:.2f}", flush=True)
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int_list, default=[1, 8, 64])
    parser.add_argument("--adapters", type=int_list, default=[1, 4, 16, 64])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--graphs", action="store_true", help="decode-graph buckets only")
    args = parser.parse_args()
    if args.graphs:
        graphs_main(args.rank, args.dtype, args.sweep)
    else:
        main(args.tokens, args.adapters, args.rank, args.dtype, args.prefill_tokens, args.sweep)
