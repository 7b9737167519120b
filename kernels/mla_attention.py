"""Multi-head latent attention (DeepSeek-V2/V3) over a paged pool of latents, in the absorbed form.

The pool of one layer holds one vector per token, not one per head: the token's compressed latent
c (kv_lora_rank = R values, already through kv_a_layernorm) followed by its shared rope key k_r
(qk_rope_head_dim = P values, already rotated)::

    cache: (num_blocks, tokens_per_block, R + P)    row = [ c (R) | k_r (P) ]

A head's key is [W_UK_h c | k_r] and its value W_UV_h c (W_UK, W_UV: the two halves of kv_b_proj).
Absorbing W_UK into the query (q_lat_h = W_UK_h^T q_nope_h, R values) makes every head attend over
the same latent rows, multi-query style, and leaves W_UV for after the weighted sum::

    score(h, t, k) = scale * (q_lat[t, h] . c[k] + q_rope[t, h] . k_r[k])
    out_lat[t, h]  = sum_k softmax_k(score) c[k]          (R values; the caller applies W_UV_h)

This is exact algebra (the same sums in another order), so one function serves prefill chunks,
decode rows and cached prefixes alike: the new tokens of sequence i sit at positions
context_len - q_len ... context_len - 1 and see every key up to their own position (the paged
layout of kernels/attention.py: block tables, cu_seqlens_q, context_lens, slot_mapping).
A decode step reads R + P values a token a layer (576 for DeepSeek-V3, 1,152 bytes in bf16) where
per-head K/V would read 2 x 128 heads x 128-192 values.

``mla_attention`` dispatches: the Triton kernel on CUDA, the plain-torch reference elsewhere (the
CPU path and the kernel tests' oracle). FP8 pools hold the rows unscaled (kernels/attention.py
``to_cache_dtype``).
"""
from __future__ import annotations

import os

import torch

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.attention import KV_FP8_DTYPE, _as_bytes_if_fp8, gather_blocks, to_cache_dtype
from kernels.attention_metadata import AttentionMetadata
from kernels.head_matmul import head_matmul
from kernels.mla_decode import (DECODE_BATCHED_MIN_SPAN, DECODE_BATCHED_PROGRAMS, DECODE_FEWER_PROGRAMS_PER_SM,
                                DECODE_LONG_SPAN, DECODE_SPLITS, DECODE_TILING, DECODE_TILING_FP8,
                                DECODE_TILING_FP8_BITS, DECODE_TILING_ONE_WAVE, decode_kernel_default,
                                decode_tile_fits, mla_decode_launch, widens_by_bits)
from kernels import mla_decode
from kernels.mla_decode_parts import COLUMN_PARTS, column_parts_fit, mla_decode_parts_launch
from kernels.mla_partials import store_split_output
from kernels.online_softmax import online_softmax_step


def write_latent_cache_ref(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """cache[slot] = [latent | k_rope] for every new token; latent (T, R), k_rope (T, P), cache
    (num_blocks, tokens_per_block, R + P) with any strides. Slots < 0 (padding rows) are skipped."""
    keep = slot_mapping >= 0
    rows, slot_mapping = torch.cat([latent, k_rope], dim=-1)[keep], slot_mapping[keep]
    block_size = cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    _as_bytes_if_fp8(cache)[blocks, offsets] = _as_bytes_if_fp8(to_cache_dtype(rows, cache.dtype))


@jit
def _write_latent_kernel(latent_ptr, k_rope_ptr, cache_ptr, slots_ptr, stride_l, stride_r, stride_cb, stride_cs,
                         RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
                         PAGE: tl.constexpr, FP8: tl.constexpr):
    """Program t: token t's row into its slot; a slot < 0 (a CUDA graph's padding row) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        r = tl.arange(0, RANK_PAD)
        p = tl.arange(0, ROPE_PAD)
        c = tl.load(latent_ptr + token * stride_l + r, mask=r < RANK, other=0.0).to(tl.float32)
        k = tl.load(k_rope_ptr + token * stride_r + p, mask=p < ROPE, other=0.0).to(tl.float32)
        if FP8:  # E4M3 has no infinity: clamp first (kernels/attention.py to_cache_dtype)
            c = tl.minimum(tl.maximum(c, -448.0), 448.0)
            k = tl.minimum(tl.maximum(k, -448.0), 448.0)
        tl.store(row + r, c.to(cache_ptr.dtype.element_ty), mask=r < RANK)
        tl.store(row + RANK + p, k.to(cache_ptr.dtype.element_ty), mask=p < ROPE)


def write_latent_cache_triton(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> None:
    num_tokens, rank = latent.shape
    rope = k_rope.shape[-1]
    assert latent.stride(-1) == 1 and k_rope.stride(-1) == 1 and cache.stride(-1) == 1
    slot_mapping, = dense(slot_mapping)  # read at slots_ptr + token
    if num_tokens:
        _write_latent_kernel[(num_tokens,)](
            latent, k_rope, cache, slot_mapping, latent.stride(0), k_rope.stride(0), cache.stride(0), cache.stride(1),
            RANK=rank, ROPE=rope, RANK_PAD=triton.next_power_of_2(rank), ROPE_PAD=triton.next_power_of_2(rope),
            PAGE=cache.shape[1], FP8=cache.dtype == KV_FP8_DTYPE, num_warps=1)


def write_latent_cache(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' latent rows (write_latent_cache_ref): Triton on CUDA, else the reference."""
    if use_triton(latent):
        return write_latent_cache_triton(latent, k_rope, cache, slot_mapping)
    return write_latent_cache_ref(latent, k_rope, cache, slot_mapping)


def mla_attention_ref(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """The module docstring's sums in plain torch, float32 math, one sequence at a time.

    q_latent (T, H, R), q_rope (T, H, P), cache (num_blocks, tokens_per_block, R + P) -> out_lat
    (T, H, R) in q_latent's dtype. With ``meta.tree_mask`` a sequence's new tokens see only their
    tree ancestors among them (and every cached key)."""
    rank = q_latent.shape[-1]
    block_size = cache.shape[1]
    out = torch.empty_like(q_latent)
    for i, start, end, context_len in meta.host_sequences():
        q_len = end - start
        blocks = meta.block_tables[i, :-(-context_len // block_size)].long()
        rows = gather_blocks(cache, blocks).reshape(-1, cache.shape[-1])[:context_len].float()  # (keys, R + P)
        latent, k_rope = rows[:, :rank], rows[:, rank:]
        scores = (torch.einsum("qhr,kr->hqk", q_latent[start:end].float(), latent)
                  + torch.einsum("qhp,kp->hqk", q_rope[start:end].float(), k_rope)) * scale
        q_pos = torch.arange(context_len - q_len, context_len, device=q_latent.device)[:, None]
        k_pos = torch.arange(context_len, device=q_latent.device)[None, :]
        hidden = k_pos > q_pos
        if meta.tree_mask is not None:  # the new tokens are a token tree: each sees its ancestors among them
            hidden[:, context_len - q_len:] = ~meta.tree_mask[start:end, :q_len].to(hidden.device)
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,kr->qhr", torch.softmax(scores, dim=-1), latent).to(q_latent.dtype)
    return out


@jit
def _mla_attention_kernel(q_lat_ptr, q_rope_ptr, cache_ptr, part_ptr, lse_ptr, block_tables_ptr, token_seq_ptr,
                          cu_ptr, ctx_ptr, tree_ptr, num_seqs, num_heads, splits, min_span, scale,
                          stride_lt, stride_lh, stride_rt, stride_rh, stride_cb, stride_cs, stride_bt, stride_tm,
                          RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          DIRECT: tl.constexpr, HAS_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          DECODE: tl.constexpr, PDL: tl.constexpr):
    """Program (t, hb, s): token t's heads hb * BLOCK_H ... over split s of its sequence's latent rows
    0..its position, online softmax in float32. The latent tile read for a step serves all BLOCK_H
    heads (the score GEMM and the value GEMM both take it); with H heads each row is read H / BLOCK_H
    times, once per head group (the groups of a split run side by side, so the later reads are L2's).

    Splits: each spans whole BLOCK_N tiles, at least min_span keys (a multiple of BLOCK_N), so a
    short context uses only its first few of ``splits`` (the grid's third dimension: the host picks
    it from the batch shape, graph-safe) and the others end at once, writing only an lse of -inf.
    Both are runtime values: one compiled kernel serves every batch size.

    DIRECT (one split): the normalised output goes straight to part = out (T, H, RANK) in the
    queries' dtype, zeros for a token of no sequence. Otherwise part is (T, splits, H, RANK) float32
    (HALF_PARTIALS: the queries' 16-bit dtype),
    written only where the split saw a key, and lse (T, H, splits) its log-sum-exp (-inf: no visible
    key, past the position or all hidden by the tree; _mla_combine_kernel reads only the others).

    A token of no sequence (token_seq >= num_seqs: a prefill graph's padding rows, whose cu_seqlens
    end before them) reads nothing; its combined output is 0.

    HAS_TREE (tree verification): tree_ptr is AttentionMetadata.tree_mask as int8 (T, max q_len);
    a new key j of the sequence (key >= prefix_len) is seen only where tree[t, j] != 0. A node's
    ancestors sit in earlier slots, so walking keys 0 .. q_pos still covers every visible one.

    DECODE (every sequence one new token, T = num_seqs: AttentionMetadata.is_decode_only, a decode
    graph's buckets included): token t is sequence t's last position, read without the token map and
    cu_seqlens (one dependent load fewer before the first key tile: the kernel is latency there).
    PDL (this kernel and the combines): launched while the launch before ends (kernels/_triton.py)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    if DECODE:
        seq = token
        context_len = tl.load(ctx_ptr + seq)
        q_pos = context_len - 1  # it sees keys 0 .. q_pos
        prefix_len = q_pos
    else:
        seq = tl.load(token_seq_ptr + token).to(tl.int64)
        seq_ok = seq < num_seqs
        seq = tl.where(seq_ok, seq, 0)
        context_len = tl.load(ctx_ptr + seq)
        q_start = tl.load(cu_ptr + seq)
        q_end = tl.load(cu_ptr + seq + 1)
        # this token's position: it sees keys 0 .. q_pos (a padding token none: -1)
        q_pos = tl.where(seq_ok, context_len - (q_end - token), -1)
        prefix_len = context_len - (q_end - q_start)  # keys before the step's new tokens (all visible)
    span = tl.maximum(tl.cdiv(tl.cdiv(q_pos + 1, splits), BLOCK_N) * BLOCK_N, min_span)
    first, last = split * span, tl.minimum((split + 1) * span, q_pos + 1)
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    load_q = heads < tl.where(first < last, num_heads, 0)  # a split past the position (short contexts) loads nothing
    q_lat = tl.load(q_lat_ptr + token * stride_lt + heads[:, None] * stride_lh + r[None, :],
                    mask=load_q[:, None] & (r < RANK)[None, :], other=0.0)  # (BLOCK_H, RANK_PAD)
    q_rope = tl.load(q_rope_ptr + token * stride_rt + heads[:, None] * stride_rh + p[None, :],
                     mask=load_q[:, None] & (p < ROPE)[None, :], other=0.0)  # (BLOCK_H, ROPE_PAD)
    for start in range(first, last, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < last
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        row = block * stride_cb + (keys % PAGE).to(tl.int64) * stride_cs
        latent = tl.load(cache_ptr + row[:, None] + r[None, :], mask=key_ok[:, None] & (r < RANK)[None, :],
                         other=0.0).to(q_lat.dtype)  # (BLOCK_N, RANK_PAD)
        k_rope = tl.load(cache_ptr + row[:, None] + RANK + p[None, :],
                         mask=key_ok[:, None] & (p < ROPE)[None, :], other=0.0).to(q_lat.dtype)  # (BLOCK_N, ROPE_PAD)
        scores = (tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
                  + tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION))  # (BLOCK_H, BLOCK_N) f32
        visible = key_ok
        if HAS_TREE:  # new keys: only the row's tree ancestors and itself; cached keys read as visible
            bits = tl.load(tree_ptr + token * stride_tm + (keys - prefix_len),
                           mask=key_ok & (keys >= prefix_len), other=1)
            visible = visible & (bits != 0)
        scores = tl.where(visible[None, :], scores * scale, -float("inf"))
        m, denom, acc = online_softmax_step(scores, latent, m, denom, acc, DOT_PRECISION)
    store_split_output(part_ptr, lse_ptr, acc, denom, m + tl.log(tl.where(denom > 0, denom, 1.0)), token, heads,
                       head_ok, r, num_heads, splits, split, RANK, DIRECT)


@jit
def _split_totals(lse_ptr, token, head, num_heads, splits, SPLITS_PAD: tl.constexpr):
    """(token, head)'s splits at a glance: (the largest lse, 0 where none is live; the softmax numerators'
    total over the splits; one past the last live split (lse > -inf), 0 where none is)."""
    s = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_ptr + (token * num_heads + head) * splits + s, mask=s < splits, other=-float("inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == -float("inf"), 0.0, top)
    return top, tl.sum(tl.exp(lse - top), 0), tl.max(tl.where(lse > -float("inf"), s + 1, 0), 0)


@jit
def _weighted_partials(part_ptr, lse_ptr, token, head, num_heads, splits, top, end, r, r_ok, RANK: tl.constexpr,
                       BLOCK_R: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """(BLOCK_R,) float32: columns r of the live splits' partials of (token, head) weighted by exp(lse - top),
    the splits 0 .. end - 1 (_split_totals: none live past them) SPLIT_CHUNK at a time: one masked 2-D load a
    chunk takes its live splits at once (their requests in flight together); a split of lse -inf is not read.
    The loop's length is the device's count, so a decode graph sized for long contexts reads at a short one
    only the chunk its few live splits fill, not every split its grid holds."""
    num = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, end, SPLIT_CHUNK):
        s = s0 + tl.arange(0, SPLIT_CHUNK)
        lse = tl.load(lse_ptr + (token * num_heads + head) * splits + s, mask=s < end, other=-float("inf"))
        live = lse > -float("inf")
        rows = (token * splits + s) * num_heads + head
        part = tl.load(part_ptr + rows[:, None] * RANK + r[None, :], mask=live[:, None] & r_ok[None, :],
                       other=0.0).to(tl.float32)  # (SPLIT_CHUNK, BLOCK_R)
        num += tl.sum(part * tl.exp(lse - top)[:, None], 0)
    return num


@jit
def _mla_combine_kernel(part_ptr, lse_ptr, out_ptr, num_heads, splits, RANK: tl.constexpr, SPLITS_PAD: tl.constexpr,
                        BLOCK_R: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (t, h, rb): columns rb * BLOCK_R ... of out[t, h] = the splits' outputs part[t, s, h]
    weighted by softmax over s of lse[t, h, s]. A split of lse -inf (no visible key) is neither read
    nor counted; a row with none at all (a token of no sequence) comes out 0."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    top, total, end = _split_totals(lse_ptr, token, head, num_heads, splits, SPLITS_PAD)
    num = _weighted_partials(part_ptr, lse_ptr, token, head, num_heads, splits, top, end, r, r < RANK, RANK, BLOCK_R,
                             SPLIT_CHUNK)
    out = num / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (token * num_heads + head) * RANK + r, out.to(out_ptr.dtype.element_ty), mask=r < RANK)


@jit
def _mla_combine_values_kernel(part_ptr, lse_ptr, w_ptr, out_ptr, num_heads, splits, v_dim, stride_wh, stride_wv,
                               RANK: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_V: tl.constexpr, SPLIT_CHUNK: tl.constexpr, LATENT_DTYPE: tl.constexpr,
                               PDL: tl.constexpr):
    """Program (t, h, vb): columns vb * BLOCK_V ... of out[t, h] = W_UV_h applied to the combined latent
    output (_mla_combine_kernel's row, rounded to LATENT_DTYPE as it stores it), w (H, V, R). The
    combine and the per-head W_UV product in one launch: each program reads its head's live partials
    whole (BLOCK_R columns at a time, SPLIT_CHUNK splits a load) and BLOCK_V rows of W_UV_h."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < v_dim
    top, total, end = _split_totals(lse_ptr, token, head, num_heads, splits, SPLITS_PAD)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < RANK
        num = _weighted_partials(part_ptr, lse_ptr, token, head, num_heads, splits, top, end, r, r_ok, RANK, BLOCK_R,
                                 SPLIT_CHUNK)
        latent = (num / tl.where(total > 0, total, 1.0)).to(LATENT_DTYPE)
        w = tl.load(w_ptr + head * stride_wh + v[:, None] * stride_wv + r[None, :], mask=v_ok[:, None] & r_ok[None, :],
                    other=0.0)  # (BLOCK_V, BLOCK_R)
        acc += tl.sum(w.to(tl.float32) * latent.to(tl.float32)[None, :], 1)
    tl.store(out_ptr + (token * num_heads + head) * v_dim + v, acc.to(out_ptr.dtype.element_ty), mask=v_ok)


MIN_SPAN = 32  # keys a split takes at least (one 32-key tile). A split costs its program's query load
# and a (BLOCK_H, R) float32 partial written and read back (32 KB for 16 heads of R = 512), but at the
# short contexts of batch-1 decode the kernel is latency, not bytes: each 32-key tile a program walks is
# a dependent block-table + row load and two products (H200, V2-Lite's 16 heads: ~7.0 us a layer at 1
# tile a split (ctx 128), 10.2 us at 2 (ctx 384, 64-key spans)), so one tile a split until the splits
# run out (MAX_SPLITS, or the GPU covered twice) and the spans grow.
MAX_SPLITS = 128  # batch-1 decode of 16 heads (DeepSeek-V2-Lite, V3 at TP 8): one program a split, so
# splits up to 2 x 132 SMs would cover the GPU; 128 of 256 keys each at 32k context (partials: 4 MB
# against 38 MB of latent rows). The old cap of 16 left 16 programs on 132 SMs.
# The splits' partials (T, splits, H, R) in the queries' 16-bit dtype instead of float32 (normalized outputs,
# rounded as the output itself is): half their bytes, written by the attention launch and read by the combine.
# At batch 32 x 8k (33 splits of 256 keys) float32 partials are 32 KB a split against 295 KB of latent rows:
# 11% more bytes written and 11% more read. (The log-sum-exps stay float32.)
HALF_PARTIALS = False
USE_DECODE_KERNEL = True  # decode-only steps through kernels/mla_decode.py (mla_attention_triton; its figures there)
MLA_DECODE_ENV = "TRITONLLM_MLA_DECODE"  # "1" / "0": the decode kernel or the general one (A/B runs); unset: the above


def decode_kernel_enabled() -> bool:
    """Whether decode-only steps take kernels/mla_decode.py's kernel: MLA_DECODE_ENV, else USE_DECODE_KERNEL."""
    value = os.environ.get(MLA_DECODE_ENV, "").strip()
    return USE_DECODE_KERNEL if not value else value != "0"


def mla_splits(num_tokens: int, num_heads: int, block_h: int, device, max_splits: int = MAX_SPLITS,
               max_context_len: int | None = None, min_span: int = MIN_SPAN, programs_per_sm: int = 2) -> int:
    """Key splits per (token, head block): enough programs to cover the GPU twice at small batches
    (batch-1 decode of 16 heads is one program unsplit), 1 once the tokens alone do, and never more
    than the longest context can fill with min_span keys each (``max_context_len``: AttentionMetadata's,
    the engine's max_seq_len in a CUDA graph, so the grid stays valid at every replay): the splits past
    those would only end at once and widen the combine (H200, V2-Lite's 16 heads, batch 1 at 1k keys:
    16 splits 14.6 us against 17.1 for 128 of which 16 saw keys), and one split writes the output
    itself, with no combine launch. Never on the contexts themselves: the kernel sizes each split's
    span from its token's own context, so any count covers every key. ``programs_per_sm``: how many
    times the grid covers the GPU (2 by default; the bench sweeps it)."""
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    splits = min(max_splits, triton.cdiv(programs_per_sm * num_sms(device), programs))
    if max_context_len is not None:
        splits = min(splits, triton.cdiv(max_context_len, min_span))
    return max(1, splits)


def decode_splits(num_tokens: int, num_heads: int, block_h: int, device, max_splits: int,
                  max_context_len: int | None, min_span: int, long_span: int) -> int:
    """The decode kernel's splits where the caller gave no programs_per_sm: mla_splits with the grid covering
    the GPU DECODE_SPLITS' times (8) where each split then gets ``long_span`` keys of ``max_context_len`` at
    least (0: always), else DECODE_FEWER_PROGRAMS_PER_SM times (kernels/mla_decode.py: the measured cases)."""
    many = mla_splits(num_tokens, num_heads, block_h, device, max_splits, max_context_len, min_span,
                      DECODE_SPLITS[2])
    if long_span and max_context_len is not None and max_context_len < many * long_span:
        return mla_splits(num_tokens, num_heads, block_h, device, max_splits, max_context_len, min_span,
                          DECODE_FEWER_PROGRAMS_PER_SM)
    return many


def decode_tiling_for(fp8_pool: bool, bits: bool, page: int, num_tokens: int, num_heads: int, block_h: int, device,
                      max_context_len: int | None, splits: int | None = None, max_splits: int | None = None,
                      min_span: int | None = None, programs_per_sm: int | None = None,
                      long_span: int | None = None) -> tuple[tuple[int, int, int], bool]:
    """The decode kernel's default (tiling, keys_major): an FP8 pool's DECODE_TILING_FP8_BITS (widened by bits)
    or DECODE_TILING_FP8; a 16-bit pool's DECODE_TILING_ONE_WAVE with the keys as rows where its tile fits the
    page and its grid (``splits``, else launch_splits' at that tile) holds no more programs than the GPU has SMs
    (kernels/mla_decode.py DECODE_ONE_WAVE_KEYS_MAJOR: one program an SM, the keys-major kernel's residency, won
    there and lost over several waves), else DECODE_TILING. Host values only (graph-safe)."""
    if fp8_pool:
        return (DECODE_TILING_FP8_BITS if bits else DECODE_TILING_FP8), False
    wave = DECODE_TILING_ONE_WAVE
    if mla_decode.DECODE_ONE_WAVE_KEYS_MAJOR and decode_tile_fits(page, wave[0]):
        count = splits or launch_splits(num_tokens, num_heads, block_h, device, True, wave[0], max_context_len,
                                        max_splits, min_span, programs_per_sm, long_span)[0]
        if count * num_tokens * triton.cdiv(num_heads, block_h) <= num_sms(device):
            return wave, True
    return DECODE_TILING, False


def launch_splits(num_tokens: int, num_heads: int, block_h: int, device, decode_kernel: bool, block_n: int,
                  max_context_len: int | None, max_splits: int | None = None, min_span: int | None = None,
                  programs_per_sm: int | None = None, long_span: int | None = None) -> tuple[int, int]:
    """(splits, min_span) of a launch (mla_attention_triton's; the bench's split column): split_policy's values,
    then decode_splits for the decode kernel where programs_per_sm is not given, else mla_splits."""
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    given_programs_per_sm = programs_per_sm
    max_splits, min_span, programs_per_sm = split_policy(decode_kernel, block_n, max_splits, min_span, programs_per_sm,
                                                         programs)
    if decode_kernel and given_programs_per_sm is None:
        return decode_splits(num_tokens, num_heads, block_h, device, max_splits, max_context_len, min_span,
                             DECODE_LONG_SPAN if long_span is None else long_span), min_span
    return mla_splits(num_tokens, num_heads, block_h, device, max_splits, max_context_len, min_span,
                      programs_per_sm), min_span


def split_policy(decode_kernel: bool, block_n: int, max_splits: int | None = None, min_span: int | None = None,
                 programs_per_sm: int | None = None, programs: int = 1) -> tuple[int, int, int]:
    """(max_splits, min_span, programs_per_sm) for mla_splits: each given value kept, the others the
    kernel's own (kernels/mla_decode.py's DECODE_SPLITS for the decode kernel, its min_span
    DECODE_BATCHED_MIN_SPAN from DECODE_BATCHED_PROGRAMS (token x head-block) ``programs`` on;
    MAX_SPLITS / MIN_SPAN / 2 for the general one); min_span raised to a whole tile (``block_n``)."""
    own = DECODE_SPLITS if decode_kernel else (MAX_SPLITS, MIN_SPAN, 2)
    if decode_kernel and programs >= DECODE_BATCHED_PROGRAMS:
        own = (own[0], DECODE_BATCHED_MIN_SPAN, own[2])
    max_splits, min_span, programs_per_sm = (own[i] if v is None else v
                                             for i, v in enumerate((max_splits, min_span, programs_per_sm)))
    min_span = max(min_span, block_n)
    assert min_span % block_n == 0, (min_span, block_n)
    return max_splits, min_span, programs_per_sm


def mla_attention_triton(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, *, block_h: int = 16, block_n: int = 32, splits: int | None = None,
                         min_span: int | None = None, max_splits: int | None = None, num_warps: int | None = None,
                         w_uv: torch.Tensor | None = None, decode_kernel: bool | None = None,
                         decode_tiling: tuple[int, int, int] | None = None,
                         programs_per_sm: int | None = None, fp8_bits: bool | None = None,
                         combine_chunk: int | None = None, half_partials: bool | None = None,
                         keys_major: bool | None = None,
                         long_span: int | None = None, parts: int | None = None,
                         table_ahead: bool | None = None) -> torch.Tensor:
    """mla_attention_ref on the GPU (or Triton's interpreter): one program per (token, BLOCK_H heads,
    key split), the splits' outputs combined by their log-sum-exps (_mla_combine_kernel). Two
    launches (one with a single split) besides cu_seqlens' token map; no host sync (CUDA-graph safe):
    each token's sequence comes from cu_seqlens_q on the device. ``min_span`` (a multiple of
    ``block_n``) and ``max_splits``: see MIN_SPAN / MAX_SPLITS (tests shorten the span to split short
    contexts; the bench sweeps them with block_h, block_n and num_warps).

    ``w_uv`` (H, V, R) with unit stride along R: returns (T, H, V), W_UV applied per head -- by the combine
    launch itself where there is one (mla_attention_values), else by kernels/head_matmul.py after.

    Decode-only steps (no token tree) take kernels/mla_decode.py's kernel where ``decode_kernel`` (None:
    decode_kernel_enabled() and kernels/mla_decode.py decode_kernel_default) and its tile fits the page:
    ``decode_tiling`` (BLOCK_N, num_warps, STAGES), None for decode_tiling_for's (an FP8 pool:
    DECODE_TILING_FP8_BITS where its codes are widened by bits, ``fp8_bits``, None: kernels/mla_decode.py
    widens_by_bits, else DECODE_TILING_FP8; a 16-bit pool DECODE_TILING, or keys-major DECODE_TILING_ONE_WAVE where
    its grid fits one wave); ``block_n`` and ``num_warps`` then serve the general kernel only. The split policy's
    ``max_splits``, ``min_span`` and ``programs_per_sm`` left None take the kernel's own (split_policy).
    ``combine_chunk``: the splits a combine load takes (None: COMBINE_SPLIT_CHUNK; 0: all the grid's at once, the
    combine before session 29). ``half_partials`` (None: HALF_PARTIALS): the splits' partials in the queries' 16-bit
    dtype, not float32. ``keys_major`` (None: decode_tiling_for's choice): the decode kernel's products with the
    keys as rows. ``long_span``:
    decode_splits' (None: DECODE_LONG_SPAN; 0: the grid always covers the GPU DECODE_SPLITS' times, the policy
    before). ``parts``: the decode kernel's latent in 2, 4 or 8 column parts (kernels/mla_decode_parts.py), at
    DECODE_TILING_PARTS' unless ``decode_tiling`` is given; asked for by name, a latent too narrow for them
    (column_parts_fit), a register prefetch tiling or keys as rows is a ValueError; None: default_column_parts' (by
    the grid, where no tiling is given). ``table_ahead`` (None: kernels/mla_decode.py DECODE_TABLE_AHEAD, off:
    it lost): the decode kernels' tile pages looked up a tile ahead (pipelined tilings)."""
    num_tokens, num_heads, rank = q_latent.shape
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1 and cache.stride(-1) == 1
    if num_tokens == 0:
        return torch.empty_like(q_latent) if w_uv is None else q_latent.new_empty(num_tokens, num_heads, w_uv.shape[1])
    decode = meta.is_decode_only and meta.tree_mask is None and num_tokens == meta.context_lens.shape[0]
    fp8_pool = cache.dtype == KV_FP8_DTYPE
    bits = widens_by_bits(fp8_pool, q_latent.dtype, q_latent.is_cuda, fp8_bits)
    asked_parts = parts
    parts = _column_parts(parts, rank, decode_tiling, keys_major)
    tiling, keys_major_default = decode_tiling, False
    if tiling is None and parts > 1:
        tiling = mla_decode.DECODE_TILING_PARTS[parts]
    if tiling is None:
        tiling, keys_major_default = decode_tiling_for(
            fp8_pool, bits, cache.shape[1], num_tokens, num_heads, block_h, q_latent.device, meta.max_context_len,
            splits, max_splits, min_span, programs_per_sm, long_span)
    keys_major = keys_major_default if keys_major is None else keys_major
    programs = num_tokens * triton.cdiv(num_heads, block_h)
    if decode_kernel is None:
        decode_kernel = decode_kernel_enabled() and decode_kernel_default(fp8_pool, programs, bits)
    use_decode = decode_kernel and decode and decode_tile_fits(cache.shape[1], tiling[0])
    planned, min_span = launch_splits(num_tokens, num_heads, block_h, q_latent.device, use_decode,
                                      tiling[0] if use_decode else block_n, meta.max_context_len, max_splits, min_span,
                                      programs_per_sm, long_span)
    splits = splits or planned
    if use_decode and asked_parts is None and decode_tiling is None:
        parts = default_column_parts(rank, tiling, keys_major, programs * splits, q_latent.device, cache.shape[1])
        if parts > 1:
            tiling = mla_decode.DECODE_TILING_PARTS[parts]
    table_ahead = mla_decode.DECODE_TABLE_AHEAD if table_ahead is None else table_ahead
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)  # (T, H, R) contiguous
    if splits == 1:
        part, lse = out, out  # DIRECT: the kernel writes the output itself (lse unused)
    else:
        half = HALF_PARTIALS if half_partials is None else half_partials
        part_dtype = q_latent.dtype if half and q_latent.dtype in (torch.bfloat16, torch.float16) else torch.float32
        part = torch.empty(num_tokens, splits, num_heads, rank, dtype=part_dtype, device=q_latent.device)
        lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q_latent.device)
    if use_decode and parts > 1:
        tables, lens = dense(meta.block_tables, meta.context_lens)  # read at ptr + i (tables: + row * row stride)
        mla_decode_parts_launch(q_latent, q_rope, cache, tables, lens, part, lse, scale, splits, min_span, block_h,
                                tiling, parts, bits, table_ahead)
    elif use_decode:
        tables, lens = dense(meta.block_tables, meta.context_lens)  # read at ptr + i (tables: + row * row stride)
        mla_decode_launch(q_latent, q_rope, cache, tables, lens, part, lse, scale, splits, min_span, block_h, tiling,
                          bits, keys_major, table_ahead)
    else:
        _mla_general_launch(q_latent, q_rope, cache, meta, part, lse, scale, splits, min_span, block_h, block_n,
                            num_warps, decode)
    return _combine(q_latent, part, lse, out, splits, w_uv, combine_chunk)


def default_column_parts(rank: int, tiling: tuple[int, int, int], keys_major: bool, programs: int, device,
                         page: int) -> int:
    """The decode kernel's column parts where none were asked for (kernels/mla_decode.py DECODE_COLUMN_PARTS, the
    rule and its figures there): DECODE_COLUMN_PARTS where the launch's grid (``programs``: tokens x head blocks x
    splits) covers the GPU's SMs at least DECODE_PARTS_PROGRAMS_PER_SM times, the latent splits into such parts
    (column_parts_fit), the default ``tiling`` is pipelined with the keys as columns and DECODE_TILING_PARTS' tile
    divides both it (so the splits counted for it stand: their min_span is a multiple of it) and the ``page``;
    else 1. The caller then launches at DECODE_TILING_PARTS[parts]. Host values only (graph-safe)."""
    n = mla_decode.DECODE_COLUMN_PARTS
    if n == 1 or keys_major or tiling[2] < 1 or not column_parts_fit(rank, n):
        return 1
    block_n = mla_decode.DECODE_TILING_PARTS[n][0]
    if tiling[0] % block_n or not decode_tile_fits(page, block_n):
        return 1
    return n if programs >= mla_decode.DECODE_PARTS_PROGRAMS_PER_SM * num_sms(device) else 1


def _column_parts(parts: int | None, rank: int, tiling: tuple[int, int, int] | None, keys_major: bool | None) -> int:
    """mla_attention_triton's ``parts`` resolved before the split count: None is 1 here (default_column_parts decides
    once the grid is known); a number asked for must fit (column_parts_fit, a pipelined tiling, keys not as rows;
    ValueError)."""
    def fits(n: int) -> bool:
        return n == 1 or (column_parts_fit(rank, n) and (tiling is None or tiling[2] >= 1) and not keys_major)

    if parts is None:
        return 1
    if parts not in COLUMN_PARTS or not fits(parts):
        raise ValueError(f"parts={parts!r}: the decode kernel's latent splits into 1, 2, 4 or 8 column parts of at "
                         f"least 16 columns (this latent: {rank}), under a pipelined tiling (STAGES >= 1; got {tiling}) "
                         f"with the keys as columns (keys_major={keys_major})")
    return parts


def _mla_general_launch(q_latent, q_rope, cache, meta, part, lse, scale, splits, min_span, block_h, block_n,
                        num_warps, decode):
    """_mla_attention_kernel over (tokens, head blocks, splits) into ``part`` / ``lse``."""
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    grid = (num_tokens, triton.cdiv(num_heads, block_h), splits)
    # Token trees: the mask as bytes (kernels/triton_attention.py does the same); None reads nothing.
    tree = None if meta.tree_mask is None else meta.tree_mask.to(torch.int8)
    # read at ptr + i (block_tables and tree: + row * row stride + j), so views become dense
    tables, cu, lens, tree = dense(meta.block_tables, meta.cu_seqlens_q, meta.context_lens, tree)
    token_seq, = (lens,) if decode else dense(meta.token_sequences(num_tokens))
    _mla_attention_kernel[grid](
        q_latent, q_rope, cache, part, lse, tables, token_seq, cu,
        lens, lens if tree is None else tree, lens.shape[0], num_heads, splits,
        min_span, scale, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), tables.stride(0), 0 if tree is None else tree.stride(0),
        RANK=rank, ROPE=rope, RANK_PAD=max(16, triton.next_power_of_2(rank)),
        ROPE_PAD=max(16, triton.next_power_of_2(rope)), PAGE=cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        DIRECT=splits == 1, HAS_TREE=tree is not None, DECODE=decode,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (4 if block_h <= 16 else 8), **pdl_options(q_latent))


def _combine(q_latent, part, lse, out, splits, w_uv, split_chunk=None):
    """The splits' partials into out (T, H, R), or through W_UV into (T, H, V) (mla_attention_triton).
    ``split_chunk``: the splits a combine load takes (None: COMBINE_SPLIT_CHUNK; 0: all the grid's at once)."""
    num_tokens, num_heads, rank = q_latent.shape
    splits_pad = max(2, triton.next_power_of_2(splits))
    chunk = min(splits_pad, split_chunk if split_chunk is not None else COMBINE_SPLIT_CHUNK) or splits_pad
    if splits > 1 and w_uv is not None:
        assert w_uv.shape[::2] == (num_heads, rank) and w_uv.stride(2) == 1, (tuple(w_uv.shape), w_uv.stride())
        v_dim = w_uv.shape[1]
        values = torch.empty(num_tokens, num_heads, v_dim, dtype=q_latent.dtype, device=q_latent.device)
        # (SPLIT_CHUNK, BLOCK_R) partials and (BLOCK_V, BLOCK_R) weights of <= COMBINE_VALUES a step on 8
        # warps: the whole latent row at once for chunks of up to 32 splits.
        block_r = max(16, min(triton.next_power_of_2(rank), COMBINE_VALUES // chunk))
        block_v = max(16, min(32, triton.next_power_of_2(v_dim)))
        _mla_combine_values_kernel[(num_tokens, num_heads, triton.cdiv(v_dim, block_v))](
            part, lse, w_uv, values, num_heads, splits, v_dim, w_uv.stride(0), w_uv.stride(1), RANK=rank,
            SPLITS_PAD=splits_pad, BLOCK_R=block_r, BLOCK_V=block_v, SPLIT_CHUNK=chunk,
            LATENT_DTYPE=_TL_DTYPES[q_latent.dtype], num_warps=8, **pdl_options(q_latent))
        return values
    if splits > 1:
        block_r = min(64, triton.next_power_of_2(rank))
        _mla_combine_kernel[(num_tokens, num_heads, triton.cdiv(rank, block_r))](
            part, lse, out, num_heads, splits, RANK=rank, SPLITS_PAD=splits_pad, BLOCK_R=block_r, SPLIT_CHUNK=chunk,
            num_warps=max(1, min(4, chunk * block_r // 1024)), **pdl_options(q_latent))  # <= 64 values a thread
    return out if w_uv is None else head_matmul(out, w_uv.transpose(1, 2))


COMBINE_VALUES = 16384
# The splits one combine load takes (_weighted_partials), the loop over them as long as the device's live
# splits: a decode graph's grid holds the splits of the longest context it may serve (128 for V2-Lite at
# max_seq_len 4096), and at 128-384-token contexts 4-12 of them have keys. Before (all the grid's splits in
# one load, the latent row in BLOCK_R = 16384 / 128 columns a step) the combine with W_UV took 8.79 us a layer
# there against 4.42 at max_seq_len 1024 (H200, V2-Lite batch 1, session 29 call 1).
COMBINE_SPLIT_CHUNK = 32
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def mla_attention_values(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, w_uv: torch.Tensor) -> torch.Tensor:
    """mla_attention's output through W_UV per head: (T, H, R) -> (T, H, V) = out_lat[t, h] @ w_uv[h].T,
    w_uv (H, V, R). On CUDA the splits' combine applies it in the same launch (one launch fewer a layer
    at decode, the latent rows never stored), else kernels/head_matmul.py after the attention."""
    if use_triton(q_latent):
        return mla_attention_triton(q_latent, q_rope, cache, meta, scale, w_uv=w_uv)
    return head_matmul(mla_attention_ref(q_latent, q_rope, cache, meta, scale), w_uv.transpose(1, 2))


def mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """Latent attention (module docstring): Triton on CUDA (token trees, ``meta.tree_mask``, included),
    else the reference."""
    if use_triton(q_latent):
        return mla_attention_triton(q_latent, q_rope, cache, meta, scale)
    return mla_attention_ref(q_latent, q_rope, cache, meta, scale)
