"""Decode cross-attention over a cached, paged encoder K/V: one launch, its K/V read before the PDL wait.

A decode row of an encoder-decoder (Whisper's 1,500 encoder outputs) attends to K/V that no kernel
of the step writes (they were written once, at encode time), so each program loads its keys and
values, and the block-table entries and length that locate them, before ``pdl_prologue``: while
the kernel before it (the cross q product) still runs. After the wait it reads its query, and the
key splits of a (row, head) are merged by whichever of its programs arrives last (arrival counters
of kernels/linear.py; the splits added in split order, so the result does not depend on which one
finished last): no second merge launch, as the general paged-attention kernel's split path has.

Grid (rows, heads, splits): split s covers keys [s * BLOCK, (s + 1) * BLOCK), fixed by
``max_len`` (a CUDA graph captures it at the engine's longest encoder input; rows with fewer keys
mask the rest, and a split past a row's length contributes nothing). Scores, softmax and the
weighted sum are float32 (one query row: plain multiply-and-sum, no tensor-core padding).

Shapes: q (rows, heads, head_dim) with unit last stride; k_cache / v_cache (blocks, tokens_per_block,
heads, head_dim) views (any block, token and head strides; the runner's pools are head-major);
block_tables (rows, width) int32; lengths (rows,) int32 -> out (rows, heads, head_dim) in q's dtype.
``cross_attention_decode`` runs the kernel on CUDA and ``cross_attention_decode_ref`` elsewhere.

Measured (H200, 2026-11-29, Whisper large-v3's 1,500 keys of 20 heads): slower than the general
paged kernel, ~193 us a layer at 64 rows against ~145, and no faster at one row (its 12 x 20
programs, each 32 KB of K/V in registers, keep too few bytes in flight), so engine/encoder_decoder/
fused_decode.py uses it only on request ($TRITONLLM_ENCDEC_CROSS_KERNEL=1).
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.linear import _arrival_counters

BLOCK_KEYS = 128  # keys a program covers: Whisper's 1,500 in 12 splits (240 programs a row of 20 heads)
_LOG2E = 1.4426950408889634


@jit(do_not_specialize=["rows"])
def _cross_attention_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, part_ptr, stats_ptr, arrivals_ptr, rows, heads,
    stride_qr, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
    stride_or, stride_oh, qk_scale,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    keys = split * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    length = tl.load(lengths_ptr + row)
    key_ok = keys < length
    blocks = tl.load(tables_ptr + row.to(tl.int64) * stride_tr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
    ok = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + (blocks * stride_kb + (keys % PAGE) * stride_kt + head * stride_kh)[:, None] + dims[None, :],
                mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (blocks * stride_vb + (keys % PAGE) * stride_vt + head * stride_vh)[:, None] + dims[None, :],
                mask=ok, other=0.0).to(tl.float32)
    pdl_prologue(PDL)  # q is the previous kernel's output
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    scores = tl.where(key_ok, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))  # log2 units
    best = tl.max(scores, axis=0)  # -inf for a split past the row's keys (its weight in the merge: 0)
    p = tl.exp2(scores - tl.where(best == float("-inf"), 0.0, best))
    total = tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * v, axis=0)
    out = out_ptr + row * stride_or + head * stride_oh + dims
    if SPLITS == 1:
        tl.store(out, (acc / total).to(out_ptr.dtype.element_ty), mask=dim_ok)
    else:
        pair = row * heads + head
        tl.store(part_ptr + (pair * SPLITS + split) * DIM_PAD + dims, acc)
        tl.store(stats_ptr + (pair * SPLITS + split) * 2, best)
        tl.store(stats_ptr + (pair * SPLITS + split) * 2 + 1, total)
        tl.debug_barrier()  # every thread's partials stored before the count goes up (see linear.py)
        arrived = tl.atomic_add(arrivals_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            splits = tl.arange(0, SPLITS_PAD)
            split_ok = splits < SPLITS
            base = stats_ptr + (pair * SPLITS + splits) * 2
            bests = tl.load(base, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
            totals = tl.load(base + 1, mask=split_ok, other=0.0, cache_modifier=".cg")
            top = tl.max(bests, axis=0)
            weights = tl.where(split_ok, tl.exp2(bests - top), 0.0)
            parts = tl.load(part_ptr + (pair * SPLITS + splits)[:, None] * DIM_PAD + dims[None, :],
                            mask=split_ok[:, None], other=0.0, cache_modifier=".cg")
            merged = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights * totals, axis=0)
            tl.store(out, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)
            tl.store(arrivals_ptr + pair, 0)


def cross_attention_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, lengths: torch.Tensor, scale: float,
                                  max_len: int) -> torch.Tensor:
    rows, heads, head_dim = q.shape
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_tables, lengths = dense(block_tables, lengths)  # read at ptr + row * row stride + j, ptr + row
    splits = triton.cdiv(max(max_len, 1), BLOCK_KEYS)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    part = torch.empty(rows * heads * splits, dim_pad, dtype=torch.float32, device=q.device) if splits > 1 else out
    stats = torch.empty(rows * heads * splits, 2, dtype=torch.float32, device=q.device) if splits > 1 else out
    arrivals = _arrival_counters(q.device, rows * heads) if splits > 1 else out
    _cross_attention_decode_kernel[(rows, heads, splits)](
        q, k_cache, v_cache, block_tables, lengths, out, part, stats, arrivals, rows, heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * _LOG2E,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, PAGE=k_cache.shape[1], BLOCK=BLOCK_KEYS, SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        num_warps=4, num_stages=1, **pdl_options(q))
    return out


def cross_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's softmax(q k^T * scale) v over its first lengths[row] keys (float32 math)."""
    page = k_cache.shape[1]
    out = torch.empty_like(q)
    for row, length in enumerate(lengths.tolist()):
        positions = torch.arange(length, device=q.device)
        blocks = block_tables[row, positions // page].long()
        k = k_cache[blocks, positions % page].float()  # (length, heads, dim)
        v = v_cache[blocks, positions % page].float()
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
