"""An MLA decode layer's attention in ONE launch: new latent row, W_UK absorb, latent attention and
W_UV, for decode rows (every sequence one new token), with no grid-wide dependency.

At batch-1 decode the three launches it replaces (kernels/mla_latent_write.py's
``latent_rope_write_absorb``, kernels/mla_attention.py's split attention and its combine + W_UV) are
latency, not bytes: ~15 us a layer on an H200 for ~0.5 MB (V2-Lite, short contexts). Here program
(t, h, vb) does all of row t's head h alone (T rows, H heads, R = kv_lora_rank, P = rope dims,
N = qk_nope_head_dim, V = v_head_dim)::

    q_lat   = W_UK_h^T q_nope[t, h]                       (R,)  rounded to the model dtype
    q_r     = rope(q_rope[t, h])                          (P,)  rounded to the model dtype
    c_new   = kv_a_norm(kv[t, :R]); k_new = rope(kv[t, R:])   the new token's row, in registers
    (program (t, 0, 0) also writes [c_new | k_new] into the token's pool slot; the other programs
    use their registers: no program reads the slot written in this launch)
    out_lat = softmax_k(scale (q_lat . c_k + q_r . kr_k)) c_k   over keys 0 .. ctx - 2 from the pool
                                                                 and the new key from registers
    out[t, h, vb * V / V_SPLIT ...] = W_UV_h[rows of vb] out_lat   rounded to the model dtype

Each program re-reads its head's W_UK (N x R) and the row's context latents (L2-resident after the
first of the H x V_SPLIT programs that read them). So the launch is worth it for short contexts:
one program walks ctx / BLOCK_N dependent tiles alone (an L2 round trip each), where the split
kernels spread them over up to 128 programs. At 16 heads the crossover is estimated at ~1-2k keys
(NOT measured); the load-time choice (engine/executor/decode_fusions.py) times a batch-1 graph step
at FUSED_TIMING_CONTEXT keys, and the model offers the fusion only up to FUSED_MAX_CONTEXT keys
(max_seq_len), keeping the split kernels beyond.

The same values as the three-launch path up to float32 summation order (scores and the value sum
here on CUDA cores in float32, where the split kernel rounds probabilities for its tensor-core
product). ``mla_decode_fused_ref``: the plain-torch reference (the three launches' references).
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.attention_metadata import AttentionMetadata
from kernels.head_matmul import head_matmul_ref
from kernels.mla_attention import mla_attention_ref
from kernels.mla_latent_write import latent_rope_write_ref
from kernels.online_softmax import online_softmax_step
from kernels.rmsnorm import _rms_normalized
from kernels.rotary import _position_cos_sin, _rotated_heads
from kernels.triton_attention import cache_value, slot_row

# (V_SPLIT, BLOCK_N, num_warps, DOT) settings the load-time choice times against the three launches.
# V_SPLIT programs a head (each recomputing the attention, writing V / V_SPLIT output columns):
# more programs in flight and fewer W_UV bytes each; BLOCK_N keys a tile step; DOT: the scores and
# the value sum as 16-row tensor-core products (the head in row 0), whose loads Triton pipelines
# (cp.async), else CUDA-core sums of the one head (loads not pipelined). sm_90 compile (Triton 3.9,
# bf16 pool; FP8 pool): (4, 32, 8, True) 128 registers, 55 KB shared (172, 52 KB); (4, 64, 8, True)
# 128, 93 KB (255, 86 KB); (4, 32, 8, False) 222, 64 KB (254, 16 KB); no spills (16 warps spilled).
SETTINGS = ((4, 32, 8, True), (4, 64, 8, True), (4, 32, 8, False))
FUSED_MAX_CONTEXT = 4096  # the model offers the fusion only for max_seq_len up to this (module docstring)
FUSED_TIMING_CONTEXT = 256  # keys in the load-time choice's timed step (engine_bench decodes at 128-384)
# Rows (sequences) a step takes the launch for: every row's programs re-read their heads' W_UK and W_UV
# (160 KB a program at V2-Lite's shape from L2; 20 MB a layer at 2 rows, 16 heads, V_SPLIT 4), which the
# three launches read once for all rows; the choice times batch 1 only. Larger decode steps keep them.
FUSED_MAX_ROWS = 2


def mla_decode_fused_ref(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                         slot_mapping: torch.Tensor, meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                         w_uv: torch.Tensor) -> torch.Tensor:
    """The three launches' references: latent write (+ rope of a copy of q_rope), W_UK, attention, W_UV.
    q_nope (T, H, N), q_rope (T, H, P), kv (T, R + P), w_uk (H, N, R), w_uv (H, V, R) -> (T, H, V)."""
    q_rope = latent_rope_write_ref(q_rope.clone(), kv, norm_weight, eps, positions, cos_sin_cache, cache,
                                   slot_mapping)
    out_lat = mla_attention_ref(head_matmul_ref(q_nope, w_uk), q_rope, cache, meta, scale)
    return head_matmul_ref(out_lat, w_uv.transpose(1, 2))


@jit
def _mla_decode_fused_kernel(q_nope_ptr, q_rope_ptr, kv_ptr, norm_w_ptr, positions_ptr, cos_sin_ptr, cache_ptr,
                             slots_ptr, tables_ptr, ctx_ptr, w_uk_ptr, w_uv_ptr, out_ptr, eps, scale, num_heads,
                             v_dim, stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, stride_bt,
                             stride_ukh, stride_ukn, stride_uvh, stride_uvv,
                             RANK: tl.constexpr, RANK_PAD: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                             HALF_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_PER: tl.constexpr, DOT: tl.constexpr,
                             DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (t, h, vb): the module docstring's sums for row t (sequence t), head h, output columns
    vb * V_PER ... (V_PER a multiple of BLOCK_V)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    vb = tl.program_id(2)
    dtype = kv_ptr.dtype.element_ty
    r = tl.arange(0, RANK_PAD)
    r_ok = r < RANK
    # W_UK absorbed into the query: q_lat = sum_n q_nope[n] W_UK[h, n, :] (head_matmul rounds to the dtype)
    q_lat = tl.zeros([RANK_PAD], tl.float32)
    for n0 in tl.static_range(0, NOPE, BLOCK_K):
        n = n0 + tl.arange(0, BLOCK_K)
        n_ok = n < NOPE
        qn = tl.load(q_nope_ptr + token * stride_qt + head * stride_qh + n, mask=n_ok, other=0.0).to(tl.float32)
        w = tl.load(w_uk_ptr + head * stride_ukh + n[:, None] * stride_ukn + r[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_K, RANK_PAD)
        q_lat += tl.sum(qn[:, None] * w, 0)
    q_lat = q_lat.to(dtype).to(tl.float32)
    # rope of this head's query (the pairs' halves (1, HALF_PAD), rounded as the in-place rotation stores them)
    cos, sin, half_idx, half_mask = _position_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos, HALF, HALF_PAD)
    _, _, _, _, q1, q2 = _rotated_heads(q_rope_ptr + head * stride_qh, token, stride_qt, 0, 1, cos, sin, half_idx,
                                        half_mask, 1, HALF, True)
    q1 = q1.to(dtype).to(tl.float32)
    q2 = q2.to(dtype).to(tl.float32)
    # the new token's row [c | k_r] as the pool holds it (kv_a_norm, rope, the pool's dtype)
    c = tl.load(kv_ptr + token * stride_kv + r, mask=r_ok, other=0.0)
    c_new = cache_value((_rms_normalized(c, RANK, eps, 0) * tl.load(norm_w_ptr + r, mask=r_ok, other=0.0)
                         .to(tl.float32)).to(dtype), cache_ptr)
    _, k_mask, first, second, k1, k2 = _rotated_heads(kv_ptr + RANK, token, stride_kv, 0, 1, cos, sin, half_idx,
                                                      half_mask, 1, HALF, True)
    k1 = cache_value(k1.to(dtype), cache_ptr)
    k2 = cache_value(k2.to(dtype), cache_ptr)
    slot = tl.load(slots_ptr + token)
    if (head == 0) & (vb == 0) & (slot >= 0):  # one program a row writes it; a slot < 0 (padding) none
        row = slot_row(cache_ptr, slot, stride_cb, stride_cs, PAGE)
        tl.store(row + r, c_new, mask=r_ok)
        tl.store(row + RANK + first, k1, mask=k_mask)
        tl.store(row + RANK + second, k2, mask=k_mask)
    c_new = c_new.to(tl.float32)
    # online softmax in float32, starting from the new key (position ctx - 1; none when ctx is 0)
    context_len = tl.load(ctx_ptr + token)
    has_new = context_len >= 1
    s_new = (tl.sum(q_lat * c_new, 0) + tl.sum(tl.sum(q1 * k1.to(tl.float32) + q2 * k2.to(tl.float32), 1), 0)) * scale
    m = tl.where(has_new, s_new, -float("inf"))
    denom = tl.where(has_new, 1.0, 0.0)
    acc = tl.where(has_new, c_new, 0.0)  # (RANK_PAD,)
    cached = context_len - 1  # keys 0 .. ctx - 2 are in the pool already
    if DOT:  # tensor-core products of 16 rows, the head in row 0 (the loads feed dots: Triton pipelines them)
        h0 = tl.arange(0, 16) == 0
        q_d = tl.where(h0[:, None], q_lat[None, :], 0.0).to(dtype)  # (16, RANK_PAD)
        q1_d = tl.where(h0[:, None], q1, 0.0).to(dtype)  # (16, HALF_PAD)
        q2_d = tl.where(h0[:, None], q2, 0.0).to(dtype)
        m_d = tl.zeros([16], tl.float32) + m
        denom_d = tl.zeros([16], tl.float32) + denom
        acc_d = tl.zeros([16, RANK_PAD], tl.float32) + acc[None, :]
        for start in range(0, cached, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < cached
            block = tl.load(tables_ptr + token * stride_bt + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
            rows = block * stride_cb + (keys % PAGE).to(tl.int64) * stride_cs
            lat = tl.load(cache_ptr + rows[:, None] + r[None, :], mask=key_ok[:, None] & r_ok[None, :],
                          other=0.0).to(dtype)  # (BLOCK_N, RANK_PAD)
            rope_mask = key_ok[:, None] & half_mask[None, :]
            kr1 = tl.load(cache_ptr + rows[:, None] + RANK + half_idx[None, :], mask=rope_mask, other=0.0).to(dtype)
            kr2 = tl.load(cache_ptr + rows[:, None] + RANK + HALF + half_idx[None, :], mask=rope_mask,
                          other=0.0).to(dtype)
            s = (tl.dot(q_d, tl.trans(lat), input_precision=DOT_PRECISION)
                 + tl.dot(q1_d, tl.trans(kr1), input_precision=DOT_PRECISION)
                 + tl.dot(q2_d, tl.trans(kr2), input_precision=DOT_PRECISION))  # (16, BLOCK_N)
            s = tl.where(key_ok[None, :], s * scale, -float("inf"))
            m_d, denom_d, acc_d = online_softmax_step(s, lat, m_d, denom_d, acc_d, DOT_PRECISION)
        denom = tl.sum(tl.where(h0, denom_d, 0.0), 0)
        acc = tl.sum(tl.where(h0[:, None], acc_d, 0.0), 0)
    else:  # CUDA-core products of the one head
        tile = tl.arange(0, BLOCK_N)
        # each tile's block ids loaded one tile ahead: a step waits on its rows only, not table then rows
        next_block = tl.load(tables_ptr + token * stride_bt + tile // PAGE, mask=tile < cached, other=0)
        for start in range(0, cached, BLOCK_N):
            keys = start + tile
            key_ok = keys < cached
            block = next_block.to(tl.int64)
            ahead = keys + BLOCK_N
            next_block = tl.load(tables_ptr + token * stride_bt + ahead // PAGE, mask=ahead < cached, other=0)
            rows = block * stride_cb + (keys % PAGE).to(tl.int64) * stride_cs
            lat = tl.load(cache_ptr + rows[:, None] + r[None, :], mask=key_ok[:, None] & r_ok[None, :],
                          other=0.0).to(tl.float32)  # (BLOCK_N, RANK_PAD)
            rope_mask = key_ok[:, None] & half_mask[None, :]
            kr1 = tl.load(cache_ptr + rows[:, None] + RANK + half_idx[None, :], mask=rope_mask,
                          other=0.0).to(tl.float32)
            kr2 = tl.load(cache_ptr + rows[:, None] + RANK + HALF + half_idx[None, :], mask=rope_mask,
                          other=0.0).to(tl.float32)
            s = (tl.sum(lat * q_lat[None, :], 1) + tl.sum(kr1 * q1 + kr2 * q2, 1)) * scale
            s = tl.where(key_ok, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 0))  # finite: the new key is in m already
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            denom = denom * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * lat, 0)
            m = m_new
    out_lat = (acc / tl.where(denom > 0, denom, 1.0)).to(dtype).to(tl.float32)  # the combine's rounding
    for v0 in tl.static_range(0, V_PER, BLOCK_V):
        v = vb * V_PER + v0 + tl.arange(0, BLOCK_V)
        v_ok = v < v_dim
        w = tl.load(w_uv_ptr + head * stride_uvh + v[:, None] * stride_uvv + r[None, :],
                    mask=v_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_V, RANK_PAD)
        tl.store(out_ptr + (token * num_heads + head) * v_dim + v,
                 tl.sum(w * out_lat[None, :], 1).to(out_ptr.dtype.element_ty), mask=v_ok)


def fuses(q_nope: torch.Tensor, meta: AttentionMetadata) -> bool:
    """The launch serves these rows: decode rows only (one new token a sequence, no tree), at most
    FUSED_MAX_ROWS of them."""
    return q_nope.shape[0] <= FUSED_MAX_ROWS and _decode_rows(q_nope, meta)


def _decode_rows(q_nope: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Rows the kernel computes right: one new token a sequence (row t = sequence t), no tree."""
    return (meta.is_decode_only and meta.tree_mask is None and 1 <= q_nope.shape[0] == meta.context_lens.shape[0]
            and q_nope.stride(2) == 1)


def mla_decode_fused(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                     slot_mapping: torch.Tensor, meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, setting: tuple = SETTINGS[0]) -> torch.Tensor:
    """The module docstring's launch on CUDA where ``fuses``, else the reference -> (T, H, V)."""
    args = (q_nope, q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping, meta, scale, w_uk,
            w_uv)
    if use_triton(kv) and fuses(q_nope, meta):
        return mla_decode_fused_triton(*args, setting)
    return mla_decode_fused_ref(*args)


def mla_decode_fused_triton(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                            slot_mapping: torch.Tensor, meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                            w_uv: torch.Tensor, setting: tuple = SETTINGS[0]) -> torch.Tensor:
    """The module docstring's launch for decode rows (any count: ``fuses`` caps it for the model) ->
    (T, H, V) in kv's dtype. q_nope / q_rope:
    views of the query (T, H, N) / (T, H, P) with equal strides (q_rope not modified); setting: one
    of SETTINGS."""
    assert _decode_rows(q_nope, meta)
    num_tokens, num_heads, nope = q_nope.shape
    rope, rank, v_dim = q_rope.shape[2], w_uk.shape[2], w_uv.shape[1]
    assert q_rope.stride()[:2] == q_nope.stride()[:2] and q_rope.stride(2) == 1, (q_nope.stride(), q_rope.stride())
    assert kv.shape == (num_tokens, rank + rope) and kv.stride(1) == 1 and cache.stride(-1) == 1
    assert w_uk.shape == (num_heads, nope, rank) and w_uk.stride(2) == 1 and w_uv.stride(2) == 1
    assert cos_sin_cache.shape[1] == rope and cos_sin_cache.dtype == torch.float32
    v_split, block_n, num_warps, dot = setting
    block_v = max(8, min(16, triton.next_power_of_2(triton.cdiv(v_dim, v_split))))
    v_per = triton.cdiv(triton.cdiv(v_dim, v_split), block_v) * block_v
    norm_weight, positions, slot_mapping, tables, lens = dense(norm_weight, positions, slot_mapping,
                                                               meta.block_tables, meta.context_lens)
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=kv.dtype, device=kv.device)
    _mla_decode_fused_kernel[(num_tokens, num_heads, triton.cdiv(v_dim, v_per))](
        q_nope, q_rope, kv, norm_weight, positions, cos_sin_cache, cache, slot_mapping, tables, lens, w_uk, w_uv, out,
        eps, scale, num_heads, v_dim, q_nope.stride(0), q_nope.stride(1), kv.stride(0), cos_sin_cache.stride(0),
        cache.stride(0), cache.stride(1), tables.stride(0), w_uk.stride(0), w_uk.stride(1), w_uv.stride(0),
        w_uv.stride(1), RANK=rank, RANK_PAD=triton.next_power_of_2(rank), NOPE=nope, HALF=rope // 2,
        HALF_PAD=max(16 if dot else 1, triton.next_power_of_2(rope // 2)), PAGE=cache.shape[1], BLOCK_N=block_n,
        BLOCK_K=min(16, triton.next_power_of_2(nope)), BLOCK_V=block_v, V_PER=v_per, DOT=dot,
        DOT_PRECISION="ieee" if kv.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **pdl_options(kv))
    return out
