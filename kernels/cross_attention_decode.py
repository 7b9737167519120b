"""Decode cross-attention over a cached, paged encoder K/V: every row one query token, its keys its
request's encoder output (no mask, no bias), the cross pool bf16/fp16/fp32 or FP8 E4M3 (scale 1).

The launch is kernels/one_query_attention.py's (shared with T5's decode self-attention, which adds
its position bias): one program per (row, group of heads, key split), float32 multiply-and-sum dot
products of the row's one query (no 16-row tensor-core tile per (row, head), as the general paged
kernel spends on MHA), key splits merged by kernels/triton_attention.py's merge kernel where the
rows alone do not fill the GPU (Whisper at batch 1: 20 programs). The grid depends on the row count
(a CUDA graph's bucket: padding rows attend to one key of block 0) and ``max_len`` (the launch's
longest encoder input: a graph captures it at the engine's longest), never on device values.

Shapes: q (rows, heads, head_dim) with unit last stride; k_cache / v_cache (blocks, tokens_per_block,
heads, head_dim) views (any block, token and head strides; the runner's pools are head-major);
block_tables (rows, width) int32; lengths (rows,) int32 -> out (rows, heads, head_dim) in q's dtype.
``cross_attention_decode`` runs the kernel on CUDA and ``cross_attention_decode_ref`` elsewhere.
The engine (engine/encoder_decoder/model.py) runs decode steps' cross-attention
here unless $TRITONLLM_ENCDEC_CROSS_KERNEL=0 (the general paged kernel, as before).
"""
from __future__ import annotations

import torch

from kernels._triton import use_triton
from kernels.attention import KV_FP8_DTYPE
from kernels.one_query_attention import one_query_attention_triton

# (HEADS a program, BLOCK_N keys a step, warps, stages) by the pool's bytes an element: one warp a head. H200
# sweeps (benchmarks/kernels/cross_attention_bench.py, 2026-11-30, commits 9a46289 and 6528c29;
# benchmarks/results/kernels.md): a bf16 pool 16 keys a step, fastest of 5 tilings at every shape (256 x 32
# heads x 512 keys 247.8 us against 268.9 for 32 keys: 4.3 TB/s of K/V; 64 x 20 x 1,500 120.5, 64 x 32 x 512
# 69.9, batch 1 8.1 against 10.2). An FP8 pool 64 keys a step from FP8_WIDE_PROGRAMS (row, head) pairs (256 x 32
# x 512 130.2 us against 135.6 for 32 keys; 64 x 32 x 512 38.7 against 42.4, both unsplit), 32 below (64 x 20 x
# 1,500: 67.5 against 80.7 for 64 keys, 2 splits; batch 1 5.6 us in 16 splits).
CROSS_TILINGS = {1: (1, 32, 1, 1), 2: (1, 16, 1, 1), 4: (1, 32, 1, 1)}  # (float32 pools: not timed)
FP8_WIDE_TILING = (1, 64, 1, 1)
FP8_WIDE_PROGRAMS = 2048


def cross_tiling(pool_dtype: torch.dtype, rows: int, heads: int) -> tuple[int, int, int, int]:
    """The default tiling of ``rows`` one-query rows of ``heads`` heads over a pool of ``pool_dtype``."""
    if pool_dtype.itemsize == 1 and rows * heads >= FP8_WIDE_PROGRAMS:
        return FP8_WIDE_TILING
    return CROSS_TILINGS[pool_dtype.itemsize]


def cross_attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                                  max_len: int, *, tiling: tuple[int, int, int, int] | None = None,
                                  splits: int | None = None) -> torch.Tensor:
    """``tiling`` / ``splits`` instead of ``cross_tiling`` / one_query_attention.py's ``decode_splits`` (sweeps)."""
    return one_query_attention_triton(q, k_cache, v_cache, block_tables, lengths, scale,
                                      tiling=tiling or cross_tiling(k_cache.dtype, *q.shape[:2]),
                                      max_context_len=max_len,
                                      splits=splits)


def gather_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """cache[blocks, offsets], also for an FP8 pool on the CPU (no float8 gather there: moved as bytes)."""
    if cache.dtype == KV_FP8_DTYPE:
        return cache.view(torch.uint8)[blocks, offsets].view(KV_FP8_DTYPE)
    return cache[blocks, offsets]


def cross_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's softmax(q k^T * scale) v over its first lengths[row] keys (float32 math)."""
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for row, length in enumerate(lengths.tolist()):
        positions = torch.arange(length, device=q.device)
        blocks = block_tables[row, positions // page].long()
        k = gather_rows(k_cache, blocks, positions % page).float()  # (length, heads, dim)
        v = gather_rows(v_cache, blocks, positions % page).float()
        scores = torch.einsum("hd,khd->hk", q[row].float(), k) * scale
        out[row] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def cross_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                           max_len: int) -> torch.Tensor:
    """The kernel on CUDA (``max_len``: the longest row's keys the launch must cover), else the reference."""
    if use_triton(q):
        return cross_attention_decode_triton(q, k_cache, v_cache, block_tables, lengths, scale, max_len)
    return cross_attention_decode_ref(q, k_cache, v_cache, block_tables, lengths, scale)
