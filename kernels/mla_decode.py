"""The decode form of latent attention (kernels/mla_attention.py, issue 55): every sequence one new
token, its key tiles read whole from one page each.

kernels/mla_attention.py's general kernel finds each key's page through its own block-table entry
(a gather of BLOCK_N entries, then BLOCK_N row addresses) and walks its keys one tile after the
other: each tile's loads wait on its block-table load and the tile before. At batch-1 decode that
kernel is latency, not bytes (H200, DeepSeek-V2-Lite's 16 heads: 23% of the copy bandwidth at 32k
keys). Here a tile of BLOCK_N keys starts at a multiple of BLOCK_N and BLOCK_N divides the page, so
the tile is one page's contiguous run of rows: one scalar block-table load gives its base, the rows
are [c | k_r] back to back (wide loads), and the loop is software-pipelined (``STAGES`` tiles in
flight: Triton's pipeliner turns the loads into cp.async copies issued ahead of their use).

Same outputs as the general kernel's DECODE form: one split writes out (T, H, R) itself; several
write partials (T, splits, H, R: float32 or 16-bit, kernels/mla_partials.py) and their log-sum-exps
(T, H, splits) for kernels/mla_attention.py's combine launches. Splits are a runtime value (the host
picks them from the batch shape: CUDA-graph safe), each spanning whole tiles, at least ``min_span`` keys.

FP8 pools: the E4M3 codes widened by bit moves (BITS: kernels/e4m3_bits.py, the queries and scales
exact powers of two, _bits_queries) rather than by the conversion unit, which bound them to 11-14% of
the copy bandwidth (session 24); 27-31% since (session 29, results/kernels.md). Grids of one wave
(one program an SM) of a 16-bit pool take the products with the keys as rows (KEYS_MAJOR: sm_90's
warpgroup MMA; kernels/mla_attention.py decode_tiling_for).
"""
from __future__ import annotations

import math
import os

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.e4m3_bits import widened_bits
from kernels.mla_partials import store_split_output

LOG2E = 1.0 / math.log(2.0)


@jit
def _tile(cache_ptr, table, start, last, stride_cb, stride_cs, RANK: tl.constexpr, ROPE: tl.constexpr,
          RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pool's rows start .. start + BLOCK_N - 1 of a sequence (block table ``table``) as stored:
    (latent (BLOCK_N, RANK_PAD), k_rope (BLOCK_N, ROPE_PAD)), zeros from ``last`` on. The tile is one
    page's contiguous run (start a multiple of BLOCK_N, which divides PAGE); a tile wholly past
    ``last`` (the prefetch after the final one) loads nothing."""
    return _tile_in(cache_ptr, _page_of(table, start, last, PAGE), start, last, stride_cb, stride_cs, RANK, ROPE,
                    RANK_PAD, ROPE_PAD, PAGE, BLOCK_N)


@jit
def _page_of(table, start, last, PAGE: tl.constexpr):
    """The pool block (int64) holding key ``start`` of a sequence (block table ``table``); 0 past ``last``."""
    return tl.load(table + start // PAGE, mask=start < last, other=0).to(tl.int64)


@jit
def _tile_page(table, start, block_next, last, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TABLE_AHEAD: tl.constexpr):
    """(the pool block of the tile at key ``start``, the next tile's block): TABLE_AHEAD hands back ``block_next``
    (looked up a tile earlier, before the loop for the first tile) and looks the next tile's up now, so the page is a
    loop-carried register (DECODE_TABLE_AHEAD); else the tile's page is looked up in its own step and ``block_next``
    passes through unused. The pipelined loops of this module and kernels/mla_decode_parts.py call it."""
    if TABLE_AHEAD:
        block = block_next
        block_next = _page_of(table, start + BLOCK_N, last, PAGE)
    else:
        block = _page_of(table, start, last, PAGE)
    return block, block_next


@jit
def _tile_in(cache_ptr, block, start, last, stride_cb, stride_cs, RANK: tl.constexpr, ROPE: tl.constexpr,
             RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """_tile's rows from pool block ``block`` (_page_of's, looked up by the caller)."""
    n = tl.arange(0, BLOCK_N)
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    key_ok = start + n < last
    rows = cache_ptr + block * stride_cb + (start % PAGE) * stride_cs + n[:, None] * stride_cs
    latent = tl.load(rows + r[None, :], mask=key_ok[:, None] & (r < RANK)[None, :], other=0.0)
    k_rope = tl.load(rows + RANK + p[None, :], mask=key_ok[:, None] & (p < ROPE)[None, :], other=0.0)
    return latent, k_rope


@jit
def _fold_tile(q_lat, q_rope, latent, k_rope, key_ok, m, denom, acc, score_scale, PROB_SCALE: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """One tile into the running (max, denominator, sum), scores in log2 units: the products' float32
    sums times ``score_scale`` (BLOCK_H,) (per head: _bits_queries). The value product
    takes the probabilities times PROB_SCALE (1, or the bits path's power of two: its latent at 2^-120 or
    2^-8, so the sum comes out at the latents' own scale; the denominator counts the plain ones). The tile
    holds a visible key (the loop visits only those), so the new max is finite."""
    scores = (tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
              + tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION))  # (BLOCK_H, BLOCK_N) f32
    scores = tl.where(key_ok[None, :], scores * score_scale[:, None], -float("inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    probs = tl.exp2(scores - m_new[:, None])
    weights = probs if PROB_SCALE == 1.0 else probs * PROB_SCALE
    acc = acc * alpha[:, None] + tl.dot(weights.to(latent.dtype), latent, input_precision=DOT_PRECISION)
    return m_new, denom * alpha + tl.sum(probs, 1), acc


@jit
def _fold_tile_keys_major(q_lat_t, q_rope_t, latent, k_rope, key_ok, m, denom, acc_t, score_scale,
                          PROB_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """_fold_tile with the keys as the products' rows: scores (BLOCK_N, BLOCK_H) = latent q_lat_t + k_rope
    q_rope_t (the queries transposed, (RANK_PAD, BLOCK_H) and (ROPE_PAD, BLOCK_H)), acc_t (RANK_PAD, BLOCK_H) +=
    latent^T probs. Why: the products' rows are then BLOCK_N and RANK_PAD (>= 64: sm_90's warpgroup MMA, the
    tile read from shared memory where the pipeliner put it) instead of BLOCK_H = 16 (mma.sync, every warp
    holding the whole 16 x 576 query in registers and each key tile staged through them twice)."""
    scores = (tl.dot(latent, q_lat_t, input_precision=DOT_PRECISION)
              + tl.dot(k_rope, q_rope_t, input_precision=DOT_PRECISION))  # (BLOCK_N, BLOCK_H) f32
    scores = tl.where(key_ok[:, None], scores * score_scale[None, :], -float("inf"))
    m_new = tl.maximum(m, tl.max(scores, 0))
    alpha = tl.exp2(m - m_new)
    probs = tl.exp2(scores - m_new[None, :])
    weights = probs if PROB_SCALE == 1.0 else probs * PROB_SCALE
    acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(latent), weights.to(latent.dtype),
                                            input_precision=DOT_PRECISION)
    return m_new, denom * alpha + tl.sum(probs, 0), acc_t


@jit
def _pow2(e):
    """2^e as float32 for integer tensors e in [-126, 127] (the exponent field alone: exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@jit
def _bits_queries(q_lat, q_rope, scale_log2, WIDE: tl.constexpr):
    """The queries and per-head score scale (BLOCK_H,) for a pool widened by bits (kernels/e4m3_bits.py):
    codes as WIDE at value * 2^-120 (bfloat16; float32 under the interpreter) or value * 2^-8 (float16).

    2^-8: float16 queries as they are (through float32: exact); products of a float16 query and a code at 2^-8
    stay float32 normals (>= 2^-24 * 2^-17), the scores times 2^8. 2^-120: each head's queries scaled by
    2^(120 - e), e = floor(log2 max |q_h|) over its latent and rope parts (at least -7, so the factor stays a float32),
    so the largest lands in [2^120, 2^121): exact (a power of two, under bfloat16's 2^128), and every product
    with a code (>= 2^-129, the smallest subnormal) of a query within 2^-100 of the head's largest is a float32
    normal -- nothing the tensor cores could flush; the scores times 2^e."""
    q_lat = q_lat.to(tl.float32)
    q_rope = q_rope.to(tl.float32)
    up, score_scale = _bits_query_scale(tl.maximum(tl.max(tl.abs(q_lat), 1), tl.max(tl.abs(q_rope), 1)), scale_log2,
                                        WIDE)
    return (q_lat * up[:, None]).to(WIDE), (q_rope * up[:, None]).to(WIDE), score_scale


@jit
def _bits_query_scale(q_max, scale_log2, WIDE: tl.constexpr):
    """_bits_queries' factors from q_max (BLOCK_H,), each head's largest |query| over its latent and rope parts:
    (the queries' factor, 1 for float16, and the per-head score scale), both (BLOCK_H,) float32 powers of two."""
    if WIDE == tl.float16:
        e = tl.full(q_max.shape, 8, tl.int32)
        up_e = tl.zeros(q_max.shape, tl.int32)
    else:
        e = tl.maximum(((q_max.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -7)  # 0 (or subnormal): -7
        up_e = 120 - e
    return _pow2(up_e), scale_log2 * _pow2(e)


@jit
def _widened(x, WIDE: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """A loaded tile as the products' dtype: FP8 codes by bits (BITS: kernels/e4m3_bits.py, at 2^-120 or
    2^-8), else Triton's conversion (exact: E4M3 and the 16-bit pools fit WIDE). The bits are widened once where
    the codes were loaded (not pure), the 16-bit tile reaching both products through shared memory (ldmatrix):
    marked pure, Triton moves the widening into each product's operand layout, and the value product's operand
    (keys along K, across the rows) then reads the codes from shared memory a byte at a time (sm_90 compile of
    (32, 4, 3): 128 ld.shared.b8 and 232 PRMTs a tile against 72 PRMTs). Session 29 call 4 (H200, V2-Lite, us a
    layer, not pure / pure / pure for the score product alone): 32 x 32k 458.8 / 516.1 / 579.4, 64 x 8k 249.7 /
    275.2 / 310.1, batch 1 x 32k 33.9 / 35.4 / 36.0."""
    if BITS:
        return widened_bits(x, WIDE, ASM, False)
    else:
        return x.to(WIDE)


@jit
def split_program(ctx_ptr, num_heads, splits, min_span, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (s, hb, split) of a decode launch over the latent cache (this kernel's and
    kernels/mla_decode_parts.py's): (seq (int64), heads (BLOCK_H,), split, head_ok, first, last, load_q). The split's
    keys are [first, last) of sequence seq's context: spans of whole BLOCK_N tiles, at least min_span keys;
    load_q: the heads whose queries the program loads (none for a split past the context)."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    context_len = tl.load(ctx_ptr + seq)
    span = tl.maximum(tl.cdiv(tl.cdiv(context_len, splits), BLOCK_N) * BLOCK_N, min_span)
    first = split * span
    last = tl.minimum(first + span, context_len)
    load_q = heads < tl.where(first < last, num_heads, 0)  # a split past the context loads nothing
    return seq, heads, split, heads < num_heads, first, last, load_q


@jit
def _mla_decode_kernel(q_lat_ptr, q_rope_ptr, cache_ptr, part_ptr, lse_ptr, block_tables_ptr, ctx_ptr, num_heads,
                       splits, min_span, scale_log2, stride_lt, stride_lh, stride_rt, stride_rh, stride_cb, stride_cs,
                       stride_bt, RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr,
                       ROPE_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       STAGES: tl.constexpr, PREFETCH: tl.constexpr, DIRECT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr = False,
                       ASM: tl.constexpr = False, KEYS_MAJOR: tl.constexpr = False,
                       TABLE_AHEAD: tl.constexpr = False):
    """Program (s, hb, split): sequence s's heads hb * BLOCK_H ... over split ``split`` of its keys
    0 .. context_len - 1 (its new token is the last). Scores in log2 units (scale_log2 = scale *
    log2 e: exp2 in the softmax); the lse written in natural-log units, as the combines read it.
    Every tile the loop visits holds a visible key (start < last), so the running max is finite
    from the first tile on; a split past the context visits none and writes only lse = -inf.
    BITS (FP8 pools): the codes widened by bit moves (kernels/e4m3_bits.py; ASM: its PTX, False under the
    interpreter), the queries and scales of _bits_queries, the value product's probabilities times the
    bits factor: no E4M3 conversion instruction (16 lanes a clock an SM on the H200) in the loop.
    KEYS_MAJOR (pipelined tilings, not PREFETCH): _fold_tile_keys_major's products, BLOCK_N >= 64 for sm_90's
    warpgroup MMA. TABLE_AHEAD (pipelined tilings): each tile's page looked up a tile ahead (DECODE_TABLE_AHEAD)."""
    pdl_prologue(PDL)
    seq, heads, split, head_ok, first, last, load_q = split_program(ctx_ptr, num_heads, splits, min_span, BLOCK_H,
                                                                    BLOCK_N)
    r = tl.arange(0, RANK_PAD)
    p = tl.arange(0, ROPE_PAD)
    n = tl.arange(0, BLOCK_N)
    q_lat = tl.load(q_lat_ptr + seq * stride_lt + heads[:, None] * stride_lh + r[None, :],
                    mask=load_q[:, None] & (r < RANK)[None, :], other=0.0)  # (BLOCK_H, RANK_PAD)
    q_rope = tl.load(q_rope_ptr + seq * stride_rt + heads[:, None] * stride_rh + p[None, :],
                     mask=load_q[:, None] & (p < ROPE)[None, :], other=0.0)  # (BLOCK_H, ROPE_PAD)
    if BITS:  # the products in the queries' 16-bit dtype (float32 under the interpreter), codes at 2^-120 / 2^-8
        WIDE: tl.constexpr = tl.float16 if q_lat.dtype == tl.float16 else q_lat.dtype
        q_lat, q_rope, score_scale = _bits_queries(q_lat, q_rope, scale_log2, WIDE)
        PROB_SCALE: tl.constexpr = 256.0 if WIDE == tl.float16 else 1.329227995784916e+36  # 2^8, 2^120
    else:
        WIDE: tl.constexpr = q_lat.dtype
        score_scale = tl.full([BLOCK_H], scale_log2, tl.float32)
        PROB_SCALE: tl.constexpr = 1.0
    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    if PREFETCH:  # registers hold the next tile while this one's products run (FP8 pools: see DECODE_TILING)
        latent_next, rope_next = _tile(cache_ptr, table, first, last, stride_cb, stride_cs, RANK, ROPE, RANK_PAD,
                                       ROPE_PAD, PAGE, BLOCK_N)
        for start in range(first, last, BLOCK_N):
            latent, k_rope = _widened(latent_next, WIDE, BITS, ASM), _widened(rope_next, WIDE, BITS, ASM)
            latent_next, rope_next = _tile(cache_ptr, table, start + BLOCK_N, last, stride_cb, stride_cs, RANK, ROPE,
                                           RANK_PAD, ROPE_PAD, PAGE, BLOCK_N)
            m, denom, acc = _fold_tile(q_lat, q_rope, latent, k_rope, start + n < last, m, denom, acc,
                                       score_scale, PROB_SCALE, DOT_PRECISION)
    elif KEYS_MAJOR:  # the products with the keys as rows (_fold_tile_keys_major), pipelined as below
        q_lat_t = tl.trans(q_lat)
        q_rope_t = tl.trans(q_rope)
        acc_t = tl.zeros([RANK_PAD, BLOCK_H], dtype=tl.float32)
        block_next = _page_of(table, first, last, PAGE)  # TABLE_AHEAD: the next tile's page, a tile ahead
        for start in tl.range(first, last, BLOCK_N, num_stages=STAGES):
            block, block_next = _tile_page(table, start, block_next, last, PAGE, BLOCK_N, TABLE_AHEAD)
            latent, k_rope = _tile_in(cache_ptr, block, start, last, stride_cb, stride_cs, RANK, ROPE, RANK_PAD,
                                      ROPE_PAD, PAGE, BLOCK_N)
            latent, k_rope = _widened(latent, WIDE, BITS, ASM), _widened(k_rope, WIDE, BITS, ASM)
            m, denom, acc_t = _fold_tile_keys_major(q_lat_t, q_rope_t, latent, k_rope, start + n < last, m,
                                                    denom, acc_t, score_scale, PROB_SCALE, DOT_PRECISION)
        acc = tl.trans(acc_t)
    else:  # Triton's pipeliner: cp.async copies into shared memory (TABLE_AHEAD: STAGES - 1 tiles ahead, else one)
        block_next = _page_of(table, first, last, PAGE)
        for start in tl.range(first, last, BLOCK_N, num_stages=STAGES):
            block, block_next = _tile_page(table, start, block_next, last, PAGE, BLOCK_N, TABLE_AHEAD)
            latent, k_rope = _tile_in(cache_ptr, block, start, last, stride_cb, stride_cs, RANK, ROPE, RANK_PAD,
                                      ROPE_PAD, PAGE, BLOCK_N)
            latent, k_rope = _widened(latent, WIDE, BITS, ASM), _widened(k_rope, WIDE, BITS, ASM)
            m, denom, acc = _fold_tile(q_lat, q_rope, latent, k_rope, start + n < last, m, denom, acc,
                                       score_scale, PROB_SCALE, DOT_PRECISION)
    lse = (m + tl.log2(tl.where(denom > 0, denom, 1.0))) / 1.4426950408889634  # natural-log units
    store_split_output(part_ptr, lse_ptr, acc, denom, lse, seq, heads, head_ok, r, num_heads, splits, split, RANK,
                       DIRECT)


# (BLOCK_N, num_warps, STAGES) of the decode kernel; STAGES 0: the next tile prefetched into registers
# instead of Triton's pipeliner (which leaves an FP8 pool's loads, converted before the products, unpipelined:
# sm_90 compile, Triton 3.9). BLOCK_N must divide the pool's page. H200, V2-Lite's 16 heads, graph replays
# (2026-11-30 18:00, benchmarks/kernels/mla_kernel_bench.py, us a layer at batch 1 x 1k / 8k / 32k and 32 x 1k /
# 8k / 32k; the general kernel 8.3 / 13.7 / 32.1 / 27.7 / 167.3 / 681.5): bf16 32 x 4 warps x 3 stages 6.7 /
# 11.6 / 24.9 / 24.4 / 130.1 / 541.4 (64 x 8 x 3 within 3% of it but at 32 x 1k, 32 x 8 x 3 and the register
# prefetch 32 x 8 x 0 slower everywhere); FP8 pools 32 x 8 x 0 8.1 / - / 31.7 / 36.5 / - / 1000.4 (general
# 8.7 / 39.1 / 31.0 / 998.8; 32 x 8 x 3 slower still).
DECODE_TILING = (32, 4, 3)
DECODE_TILING_FP8 = (32, 8, 0)
# FP8 pools widened by bits (BITS): the bf16 pool's tiling, the tile's 18 KB of codes pipelined as cp.async copies,
# widened in registers once (_widened). Session 29 calls 3-4 (H200, V2-Lite, us a layer): 32 x 32k 458.5
# (31% of the copy bandwidth) against 1,006.9 for the conversion and the general kernel before; 64 x 8k 248.4
# against 495.8; 8 x 8k 47.1 against 88.8; batch 1 even (8.9 / 33.8 us at 1k / 32k). (32, 8, 0) and (32, 8, 3)
# widened by bits were 1.4-1.5x slower than this at batch 32 (call 3).
DECODE_TILING_FP8_BITS = (32, 4, 3)
# The products with the keys as rows (_fold_tile_keys_major) at DECODE_TILING_ONE_WAVE, for 16-bit pools whose
# decode grid fits one wave of one program an SM (kernels/mla_attention.py decode_tiling_for). sm_90 compile (bf16
# pool): (64, 4, 2) takes warpgroup MMAs (68 a tile, no ldmatrix) in 168 KB of shared memory (one program an SM);
# (32, 4, 3) keys-minor: 68 mma.sync and 72 ldmatrix a tile in 56 KB, 168 registers (3 an SM). Session 29 call 4
# (H200, V2-Lite, us a layer, keys-major (64, 4, 2) / DECODE_TILING): where the grid fits the 132 SMs it won,
# 1 x 1k 7.3 / 7.7 (16 programs), 1 x 8k 15.5 / 16.5 (128), 1 x 32k 27.0 / 29.6 (128), 8 x 1k 10.4 / 13.6 (128);
# where it takes several waves it lost, 8 x 8k 46.1 / 43.8 (528), 32 x 1k 27.5 / 24.0 (256), 32 x 32k 398.5 /
# 349.4, 64 x 8k 226.5 / 194.7 (8 warps: slower everywhere). FP8 pools spill there (384-1,184 B of stack).
DECODE_TILING_ONE_WAVE = (64, 4, 2)
DECODE_ONE_WAVE_KEYS_MAJOR = True
# The latent in column parts (kernels/mla_decode_parts.py): 1, this module's kernel, or 2 / 4 / 8 parts of
# RANK_PAD / parts columns, at DECODE_TILING_PARTS[parts] unless a tiling is given.
# sm_90 compiles (ptxas, V2-Lite's 512 + 64, 16 heads, registers / shared memory a program): FP8 pool widened by bits,
# bf16 queries: this kernel (32, 4, 3) 255 / 74 KB (2 programs an SM), (16, 4, 3) 244; 2 parts (32, 4, 3) 222, 4
# parts (32, 4, 3) 193, (16, 4, 3) 160 / 45 KB (3 an SM; float16 queries 164); 8 parts (32, 4, 3) 140 / 71 KB (3 an
# SM; float16 queries 178), (16, 4, 3) 127 / 45 KB (4 an SM); none spilled, no byte loads from shared memory in the
# loop. bf16 pool: this kernel (32, 4, 3) 168 / 56 KB (3 an SM); 4 parts (32, 4, 3) 195; 8 parts (32, 4, 3) 134 (3 an
# SM), (16, 4, 3) 110 / 37.5 KB (4 an SM).
# Session 30 call 1 (H200, V2-Lite, us a layer, auto / auto+p8 = 8 parts at the same (32, 4, 3) tile; splits;
# grid programs = batch x splits, 16 heads in one head block): FP8 pool widened by bits 8 x 8k 47.4 / 45.5 (66
# splits: 528 programs), 8 x 32k 131.3 / 135.5 (528), 32 x 8k 128.0 / 133.3 (17: 544), 32 x 32k 463.8 / 409.9 (33:
# 1,056), 64 x 8k 249.9 / 222.0 (17: 1,088), 64 x 32k 988.0 / 742.8 (1,088); bf16 pool 8 x 8k 43.7 / 42.4, 8 x 32k
# 108.2 / 116.0, 32 x 8k 103.2 / 116.7, 32 x 32k 346.2 / 341.6, 64 x 8k 196.2 / 191.4, 64 x 32k 705.7 / 621.1. 8 parts
# won wherever the grid covered the 132 SMs 8 times (1,056-1,088 programs: the split policy's long splits, >= 384
# keys each; 3 programs an SM against 2 for the FP8 pool) and lost at 4 times (528-544: 8 x 32k, 32 x 8k by 3-13%)
# but for 8 x 8k (+3-4%, 124-key splits). So: DECODE_COLUMN_PARTS parts where the grid holds at least
# DECODE_PARTS_PROGRAMS_PER_SM programs an SM (kernels/mla_attention.py default_column_parts; between 4 and 8 times,
# the two coverings the split policy makes), unless parts or a tiling is asked for. Call 4 (the rule against the one-part
# kernel): FP8 64 x 32k 744.4 / 939.3, 64 x 8k 220.5 / 249.3, 32 x 32k 399.4 / 458.6; bf16 64 x 32k 629.6 (90% of the
# copy bandwidth) / 719.5; every other row within 1%.
DECODE_COLUMN_PARTS = 8
DECODE_PARTS_PROGRAMS_PER_SM = 6
DECODE_TILING_PARTS = {2: (16, 4, 3), 4: (16, 4, 3), 8: (32, 4, 3)}
# Each tile's page looked up a tile ahead (TABLE_AHEAD: the block-table entry a loop-carried register) instead of in
# the tile's own step. Why: with the lookup in the step, Triton's pipeliner puts the block-table load in stage 0 and
# the tile's copy in stage 1 whatever STAGES is, and gives the tile ONE shared-memory buffer: the copy of tile i + 1
# is issued after tile i's products have read the buffer and waited for at the top of step i + 1, so a program never
# overlaps its own loads with its products; only the other programs on the SM hide them (sm_90 compiles, session 30:
# STAGES 3 or 4, bf16 and FP8 pools alike, one (32, 512) buffer). Looked up ahead, the copy has no load in front of it
# in its step and gets STAGES - 1 buffers (STAGES 3: two; bf16 pool (32, 4, 3) 56 -> 93 KB and 168 -> 255
# registers with 136 B of spills, 2 programs an SM instead of 3; FP8 pool widened by bits 74 -> 92 KB, 255 -> 249
# registers, no spills, 2 an SM either way; 8 parts FP8 (32, 4, 3) 140 -> 180 registers, 71 -> 89 KB: 2 an SM, not
# 3). Off until measured.
# Session 30 call 4 (H200, V2-Lite, us a layer, the one-part kernel without / with it): it LOST everywhere, FP8 pool
# 8-12% (64 x 32k 939.3 / 1,052.8, 32 x 32k 458.6 / 500.8, 8 x 8k 47.1 / 51.4), bf16 pool 23-44% (64 x 32k 719.5 /
# 1,034.8, 32 x 8k 104.0 / 140.8): a program's own loads overlapping its products is not what bounds this kernel (the
# FP8 one kept its 2 programs an SM and still lost). 8 parts at (16, 4, 4) with it (3 buffers, 3 programs an SM):
# 2.6-3.7x slower than the default (FP8 64 x 32k 2,365.5 against 744.4). Kept, off, for A/B runs (+t).
DECODE_TABLE_AHEAD = False
# Not kept (session 30): FP8 pools' score product on sm_90's E4M3 warpgroup MMAs (keys as rows, 64-key tiles, the
# queries an E4M3 pair hi + lo / 16, the value product widened by bits in 8 column parts): 1.4-1.7x slower than the
# default at every measured shape (call 4: 32 x 32k 653.4 against 399.4 us, 8 x 32k 189.6 / 131.0, 1 x 1k 15.1 /
# 8.8; 1.7-2.7e-3 of the reference): Triton waits for each of its 26 warpgroup MMAs a step before the next.
# The decode kernel's split policy (kernels/mla_attention.py split_policy, mla_splits): (max_splits, min_span,
# programs_per_sm) -- up to 128 splits, the grid covering the GPU 8 times, 32 keys a split at least; and from
# DECODE_BATCHED_PROGRAMS (sequence x head-block) programs on, 128 keys a split at least (a split's float32
# partial, 32 KB for 16 heads of R = 512, then stays under a quarter of its latent bytes). Same sweep: at batch
# 32 the grid covering the GPU twice (9 splits) took 130.1 / 541.4 us at 8k / 32k, 8 times (33) 118.9 / 353.0
# (81% of the copy bandwidth); at batch 1 x 1k, 128-key splits (8) took 11.4 us against 6.7 for 32-key ones (32).
DECODE_SPLITS = (128, 32, 8)
DECODE_BATCHED_PROGRAMS = 16
DECODE_BATCHED_MIN_SPAN = 128
# ... but the grid covers the GPU 8 times only where each split then gets DECODE_LONG_SPAN keys at least, else 4
# times (DECODE_FEWER_PROGRAMS_PER_SM): shorter splits cost more in their start and partial than the extra
# programs bring. Session 29 call 3 (H200, V2-Lite, bf16 pool, us a layer, 8 times against 4 times the SMs):
# 8 x 8k 59.8 (128 splits of 64 keys) / 42.3 (64 of 128); 8 x 32k 123.6 (128 of 256) / 107.6 (66 of 512);
# 32 x 8k 116.1 (33 of 256) / 106.3 (17 of 512); where 8 times gives >= 482 keys a split it won: 32 x 32k 348.0
# (33 of 1,024) / 416.8, 64 x 8k 196.7 (17 of 512) / 224.2, 64 x 32k 717.2 / 839.0. Below that every batch
# picks the same either way (1k contexts: the min_span cap; batch 1: the 128-split cap). Call 4, this policy
# against the one before: bf16 8 x 8k 43.8 / 59.9, 8 x 32k 108.1 / 124.6, 32 x 8k 102.2 / 117.2 (71% of the copy
# bandwidth); FP8 widened by bits 8 x 8k 47.1 / 64.8, 8 x 32k 131.1 / 148.1, 32 x 8k 127.6 / 140.6; the rest even.
DECODE_LONG_SPAN = 384
DECODE_FEWER_PROGRAMS_PER_SM = 4


FP8_BITS_ENV = "TRITONLLM_MLA_FP8_BITS"  # "0" / "1": FP8 pools widened by Triton's conversion / by bits (A/B runs)
USE_FP8_BITS = True  # unset: this


def fp8_bits_enabled() -> bool:
    """Whether FP8 pools' codes are widened by bits in the decode kernel: FP8_BITS_ENV, else USE_FP8_BITS."""
    value = os.environ.get(FP8_BITS_ENV, "").strip()
    return USE_FP8_BITS if not value else value != "0"


def widens_by_bits(fp8_pool: bool, q_dtype: torch.dtype, on_cuda: bool, asked: bool | None = None) -> bool:
    """Whether the decode kernel widens the pool's codes by bits: an FP8 pool, ``asked`` (None:
    fp8_bits_enabled()), and queries of a 16-bit dtype (the products' dtype) or, off CUDA (Triton's
    interpreter, which runs no PTX), float32 ones too; float32 queries on the GPU keep the conversion."""
    wide_ok = q_dtype in (torch.bfloat16, torch.float16) or (q_dtype == torch.float32 and not on_cuda)
    return fp8_pool and wide_ok and (fp8_bits_enabled() if asked is None else asked)


def decode_kernel_default(fp8_pool: bool, programs: int, bits: bool = False) -> bool:
    """Where the decode kernel is the default (switched on, not asked for by name): every pool but an FP8 one
    widened by Triton's conversion from DECODE_BATCHED_PROGRAMS programs on, where the general kernel measured
    as fast or faster (batch 32 x 1k: 31.0 against 36.5 us; both ~14% of the copy bandwidth, bound by the FP8
    conversion, not the bytes). Widened by bits (``bits``), FP8 pools take it at every batch."""
    return not (fp8_pool and not bits and programs >= DECODE_BATCHED_PROGRAMS)


def decode_tile_fits(page: int, block_n: int) -> bool:
    """The decode kernel's tiles stay inside one page: BLOCK_N divides the page size."""
    return page % block_n == 0


def mla_decode_launch(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, scale: float, splits: int,
                      min_span: int, block_h: int, tiling: tuple[int, int, int] = DECODE_TILING,
                      bits: bool = False, keys_major: bool = False, table_ahead: bool = False) -> None:
    """One launch of _mla_decode_kernel over (sequences, head blocks, splits): ``part`` is the output
    (T, H, R) itself when splits == 1, else the partials; block_tables and context_lens dense
    (read at ptr + i). ``bits``: an FP8 pool's codes widened by bits (widens_by_bits says where it may).
    ``keys_major``: the products with the keys as rows (_fold_tile_keys_major; pipelined tilings only).
    ``table_ahead``: each tile's page looked up a tile ahead (DECODE_TABLE_AHEAD; pipelined tilings only).
    The caller (kernels/mla_attention.py) checks decode_tile_fits and combines."""
    block_n, num_warps, stages = tiling
    grid, args, meta = decode_launch_arguments(q_latent, q_rope, cache, block_tables, context_lens, part, lse, scale,
                                               splits, min_span, block_h, block_n, bits)
    _mla_decode_kernel[grid](*args, **meta, STAGES=max(1, stages), PREFETCH=stages == 0,
                             KEYS_MAJOR=keys_major and stages > 0, TABLE_AHEAD=table_ahead and stages > 0,
                             num_warps=num_warps)


def decode_launch_arguments(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, part: torch.Tensor,
                            lse: torch.Tensor, scale: float, splits: int, min_span: int, block_h: int, block_n: int,
                            bits: bool) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) both latent decode kernels share (_mla_decode_kernel and
    kernels/mla_decode_parts.py's): the grid (sequences, head blocks, splits), the tensors, sizes and strides, and the
    constexprs of the shapes, the output's form, the products' precision, the bits widening and PDL."""
    num_seqs, num_heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    assert decode_tile_fits(cache.shape[1], block_n) and min_span % block_n == 0, (cache.shape[1], block_n, min_span)
    args = (q_latent, q_rope, cache, part, lse, block_tables, context_lens, num_heads, splits, min_span,
            scale * LOG2E, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            cache.stride(0), cache.stride(1), block_tables.stride(0))
    meta = dict(RANK=rank, ROPE=rope, RANK_PAD=max(16, triton.next_power_of_2(rank)),
                ROPE_PAD=max(16, triton.next_power_of_2(rope)), PAGE=cache.shape[1], BLOCK_H=block_h,
                BLOCK_N=block_n, DIRECT=splits == 1,
                DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", BITS=bits,
                ASM=bits and q_latent.is_cuda, **pdl_options(q_latent))
    return (num_seqs, triton.cdiv(num_heads, block_h), splits), args, meta
