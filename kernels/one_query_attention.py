"""Decode attention of one query row per (sequence, head) over a paged pool, heads == KV heads (MHA):
plain float32 multiply-and-sum dot products, no tensor-core tile.

Two users: T5's decoder self-attention on decode steps (kernels/t5_bias_attention.py, with its
relative position bias) and the encoder-decoder cross-attention of decode steps
(kernels/cross_attention_decode.py: T5, BART, Whisper; no bias, no mask, keys = the request's encoder
output). The general paged kernel (kernels/triton_attention.py) pads each one-row query to a 16-row
tensor-core tile per (sequence, head) when KV heads == heads: 15 rows wasted, and its programs
leave HBM idle between key tiles (~2.4 TB/s for Flan-T5-XL's cross K/V at 256 rows, 2026-11-30).

Program (sequence, group of HEADS heads, key split): the sequence's one new token (row
``cu_seqlens_q[seq]``, or row ``seq`` with ONE_TOKEN_ROWS) in each of its heads attends to keys
``[split * split_keys, +split_keys)`` of its first ``context_lens[seq]``, BLOCK_N keys a step on
(HEADS, BLOCK_N, DIM_PAD) K and V tiles (both loads in flight together). Scores, online softmax and
the weighted sum in float32 (base 2, the query pre-multiplied by scale * log2(e)); an FP8 E4M3 pool
(scale 1, kernels/attention.py) widens to float32 on load. HAS_BIAS adds T5's causal
``distance_bias`` of ``k - (context - 1)`` (kernels/t5_bias_attention.py).

With ``splits`` > 1 each program stores its normalized partial output and its base-2 log-sum-exp
(``-1e30`` for a split with no keys: finite, so a row of no keys at all merges to zeros) and
kernels/triton_attention.py's ``_merge_splits_kernel`` combines them. The grid depends only on the
row count, the heads and the splits (``decode_splits``: from the rows and the launch's longest
context, host values), never on device values: CUDA-graph safe. A sequence with no new token
returns at once; one of no keys stores zeros.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton
from kernels.triton_attention import _merge_splits_kernel, merge_splits_pad

_LOG2E = 1.4426950408889634
# decode_splits: split a launch's keys until its programs' key tiles (K and V of one step each) put
# IN_FLIGHT_BYTES_PER_SM of loads in flight an SM, each split at least MIN_SPLIT_STEPS key tiles, at most
# MAX_SPLITS splits. H200 (2026-11-30, benchmarks/results/kernels.md): 64 x 32 heads x 512 keys over an FP8
# pool in 64-key tiles (8 KB a step, 2,048 programs: 124 KB an SM) took 38.7 us unsplit against 41.6-43.4 split
# 2-8 ways; 64 x 20 x 1,500 over bf16 in 32-key tiles (8 KB, 1,280 programs: 78 KB an SM) 139.3 unsplit, 120.9
# in 2 splits; batch 1 of 20 heads (all its 8 KB steps: ~1 KB an SM) as many splits as its keys allow.
IN_FLIGHT_BYTES_PER_SM = 96 << 10
MIN_SPLIT_STEPS = 2
MAX_SPLITS = 64


@jit
def _kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_heads, v_heads, head_valid, dim_valid, k_pos, end,
             stride_kb, stride_ks, stride_vb, stride_vs, PAGE_SIZE: tl.constexpr):
    """(HEADS, BLOCK_N, DIM_PAD) K and V of keys ``k_pos`` (those < ``end``) in the pool's dtype; both loads
    issued together."""
    k_valid = k_pos < end
    block = tl.load(block_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
    in_page = k_pos % PAGE_SIZE
    kv_mask = head_valid[:, None, None] & k_valid[None, :, None] & dim_valid[None, None, :]
    k = tl.load(k_cache_ptr + (block * stride_kb + in_page * stride_ks)[None, :, None] + k_heads, mask=kv_mask,
                other=0.0)
    v = tl.load(v_cache_ptr + (block * stride_vb + in_page * stride_vs)[None, :, None] + v_heads, mask=kv_mask,
                other=0.0)
    return k, v


@jit(do_not_specialize=["stride_bt", "split_keys", "splits"])
def _one_query_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, bias_ptr, block_tables_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, scale_log2, num_heads, split_keys, splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt, stride_bias, stride_ps, stride_pt,
    HAS_BIAS: tl.constexpr, REACH: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_TOKEN_ROWS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    split = tl.program_id(2)
    head_valid = heads < num_heads
    pdl_prologue(PDL)  # q (and a self-attention's new K/V) come from the kernels before
    if ONE_TOKEN_ROWS:
        token = seq
    else:
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) == token:
            return
    context = tl.load(context_lens_ptr + seq)
    first = split * split_keys
    end = tl.minimum(context, first + split_keys)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    hd_mask = head_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=hd_mask, other=0.0).to(tl.float32) * scale_log2
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_heads = (heads * stride_kh)[:, None, None] + dims[None, None, :]
    v_heads = (heads * stride_vh)[:, None, None] + dims[None, None, :]
    m_i = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    if PREFETCH:
        k_next, v_next = _kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_heads, v_heads, head_valid, dim_valid,
                                  first + cols, end, stride_kb, stride_ks, stride_vb, stride_vs, PAGE_SIZE)
    for start in range(first, end, BLOCK_N):
        k_pos = start + cols
        k_valid = k_pos < end
        if PREFETCH:  # this tile's K/V were loaded during the last step; the next tile's go out now
            k, v = k_next, v_next
            k_next, v_next = _kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_heads, v_heads, head_valid, dim_valid,
                                      k_pos + BLOCK_N, end, stride_kb, stride_ks, stride_vb, stride_vs, PAGE_SIZE)
        else:
            k, v = _kv_tile(k_cache_ptr, v_cache_ptr, block_row, k_heads, v_heads, head_valid, dim_valid,
                            k_pos, end, stride_kb, stride_ks, stride_vb, stride_vs, PAGE_SIZE)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        scores = tl.sum(k * q[:, None, :], axis=2)  # (HEADS, BLOCK_N), base 2
        if HAS_BIAS:
            distance = tl.minimum(tl.maximum(k_pos - (context - 1), -REACH), REACH) + REACH
            scores += tl.load(bias_ptr + (heads * stride_bias)[:, None] + distance[None, :],
                              mask=head_valid[:, None], other=0.0) * 1.4426950408889634
        scores = tl.where(k_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if splits == 1:  # (a runtime value: one compile serves every split count)
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:  # (split, token, head, DIM_PAD) partials, their log-sum-exp at the same offsets over DIM_PAD
        part = split * stride_ps + token.to(tl.int64) * stride_pt + heads * DIM_PAD
        tl.store(part_out_ptr + part[:, None] + dims[None, :], out, mask=head_valid[:, None])
        # a split of no keys: -1e30, weight 0 beside any split with keys (and finite: a row of none merges to 0)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), -1e30)
        tl.store(part_lse_ptr + part // DIM_PAD, lse, mask=head_valid)


def decode_splits(rows: int, head_groups: int, max_context_len: int, block_n: int, step_bytes: int, device) -> int:
    """Key splits (a power of 2, for the merge) of a launch over ``rows`` x ``head_groups`` programs whose
    longest row has ``max_context_len`` keys and whose key tiles load ``step_bytes`` of K and V: enough
    programs for IN_FLIGHT_BYTES_PER_SM an SM, each split at least MIN_SPLIT_STEPS key tiles. Host values only
    (the batch bucket and the launch's longest context), so a CUDA graph's launch keeps its splits."""
    want = triton.cdiv(IN_FLIGHT_BYTES_PER_SM * num_sms(device), max(1, rows * head_groups * step_bytes))
    most = min(MAX_SPLITS, max(1, max_context_len // (MIN_SPLIT_STEPS * block_n)))
    splits = 1
    while splits < want and splits * 2 <= most:
        splits *= 2
    return splits


def one_query_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                               tiling: tuple[int, int, int, int], max_context_len: int,
                               cu_seqlens_q: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                               splits: int | None = None) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim), last dim contiguous; pools (blocks, page, heads, head_dim) by
    strides (bf16, fp16, fp32 or FP8 E4M3); block_tables (seqs, width) int32; context_lens (seqs,) int32
    -> out like q. ``cu_seqlens_q`` (seqs + 1,): row of sequence i's one new token (none: row i).
    ``bias``: a causal ``distance_bias`` table (kernels/t5_bias_attention.py) or None. ``tiling``:
    (HEADS a program, BLOCK_N keys a step, warps, stages), stages 2: the next key tile's loads issued
    before this one's arithmetic (PREFETCH; Triton's own pipelining, num_stages, does not apply to these
    loads: they feed no tl.dot); ``splits``: key splits (a power of 2;
    None: ``decode_splits``, merged by triton_attention's merge kernel); ``max_context_len``: the longest context
    the launch must cover."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert k_cache.shape[2] == num_heads, "one-query attention: heads == KV heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert bias is None or bias.is_contiguous()
    tables, lens, cu = dense(block_tables, context_lens, cu_seqlens_q)  # read at ptr + i
    heads_per_program, block_n, warps, stages = tiling
    heads_per_program = min(heads_per_program, triton.next_power_of_2(num_heads))
    groups = triton.cdiv(num_heads, heads_per_program)
    if splits is None:
        step_bytes = 2 * heads_per_program * block_n * head_dim * k_cache.element_size()
        splits = decode_splits(num_seqs, groups, max_context_len, block_n, step_bytes, q.device)
    assert splits >= 1 and splits & (splits - 1) == 0, splits
    split_keys = triton.cdiv(triton.cdiv(max(max_context_len, 1), splits), block_n) * block_n
    dim_pad = triton.next_power_of_2(head_dim)
    if splits > 1:
        part_out = torch.empty(splits, num_tokens, num_heads, dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        ps, pt, ph = part_out.stride()[:3]
    else:
        part_out = part_lse = out
        ps = pt = ph = 0
    _one_query_kernel[(num_seqs, groups, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, q if bias is None else bias, tables,
        lens if cu is None else cu, lens, scale * _LOG2E, num_heads, split_keys, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), 0 if bias is None else bias.stride(0), ps, pt,
        HAS_BIAS=bias is not None, REACH=0 if bias is None else (bias.shape[1] - 1) // 2, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, PAGE_SIZE=k_cache.shape[1], HEADS=heads_per_program, BLOCK_N=block_n,
        ONE_TOKEN_ROWS=cu is None, PREFETCH=stages > 1, num_warps=warps, num_stages=1,
        **pdl_options(q))
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, lens, lens, ps, pt, ph, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits, BY_SEQUENCE=False, DYNAMIC_SPLITS=False,
            SPLITS_PAD=merge_splits_pad(splits), num_warps=1, **pdl_options(q))
    return out
