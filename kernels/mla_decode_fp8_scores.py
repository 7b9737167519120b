"""kernels/mla_decode.py's decode over an FP8 latent pool with the score product in FP8 on sm_90's warpgroup MMA
(issue 55): the codes read by the tensor cores as stored, widened for the value product only.

Why (sm_90 SASS of the decode kernel at (32, 4, 3), V2-Lite's 512 + 64, 16 heads; session 30): an FP8 tile goes
global -> shared (cp.async) -> registers (9 LDS.128 a thread) -> widened by bits (72 PRMT, 77 LOP3) -> shared again
(18 STS.128: the 16-bit tile, 37 KB, stored once and read by both products through ldmatrix) -> the products; the
bf16 pool's tile goes cp.async -> ldmatrix. With 16 heads the products are mma.sync with M = 16: the four warps
split the keys, so each reads the whole query (16 x 576, 18 KB) from shared memory every tile: 74 KB of the FP8
tile's ~216 KB of shared-memory traffic a 32-key step (bf16 pool: ~179 KB for twice the HBM bytes). 748 instructions
a warp a tile against 583, 255 registers (2 programs an SM against 3), and the widening sits between two barriers
in front of the score product's 36 dependent MMAs: one program's step is latency, and the SM holds 64 keys in
flight against the bf16 pool's 96.

Here the keys are the products' rows (BLOCK_N = 64: warpgroup MMA, the operands read from shared memory once a
warpgroup, not once a warp). The score product takes the codes straight from the pipelined buffer as E4M3
operands (wgmma ...e4m3.e4m3: Triton's mma.sync path on sm_90 has no FP8 form, it would widen them), the queries
quantized to E4M3 twice: a head's queries times 2^(7 - e) (e = floor(log2 max |q|) over its latent and rope parts,
the largest in [128, 256): E4M3 reaches 448) as hi = e4m3(q'), lo = e4m3((q' - hi) * 16), so hi + lo / 16 carries
q' to ~2^-9 of the head's largest query (bfloat16's rounding of the largest), and the scores are
(codes hi^T + codes lo^T / 16) * 2^(e - 7). The value product widens the latent codes by bits (kernels/e4m3_bits.py,
not pure: once where loaded) as kernels/mla_decode.py's keys-major form does, the probabilities times the bits
factor: an FP8 MMA takes both operands K-major, and the value product's K is the keys, across the stored rows (an
8-bit transpose: the byte-wise shared-memory reads kernels/e4m3_bits.py avoids). Accuracy: fp8_extremes' rows
(tests/kernels/test_mla_attention.py) against the float32 reference 2.7e-3 / 1.7e-3 relative, where bfloat16
queries' own rounding gives 7.8e-3 / 4.6e-3; the pair's reference within the queries' dtype's tolerance.

Same outputs and layout as the decode kernel (kernels/mla_partials.py: DIRECT or the splits' partials and
log-sum-exps), the same split arithmetic (kernels/mla_decode.py split_program). Off by default:
kernels/mla_decode.py DECODE_FP8_SCORES; kernels/mla_attention.py mla_attention_triton(fp8_scores=True).
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_prologue, tl
from kernels.mla_decode import _page_of, _pow2, _widened, decode_launch_arguments, split_program
from kernels.mla_decode_parts import _query_part
from kernels.mla_partials import store_split_output

# (BLOCK_N, num_warps, STAGES): one warpgroup, the keys the MMA's M = 64; 3 stages: 2 buffers with TABLE_AHEAD (sm_90:
# 230 registers, 104 KB, 2 programs an SM). 4 parts: 237 registers but 112 KB, one program an SM. Triton waits for
# each warpgroup MMA before the next (26 waits a step: 18 score, 8 value products), so fewer, wider parts would cut
# waits, but not within 2 programs' shared memory.
FP8_SCORES_TILING = (64, 4, 3)
FP8_SCORES_PARTS = 8  # the latent's column parts (kernel docstring)
E4M3_LO_FACTOR = tl.constexpr(16.0)  # lo = e4m3((q' - hi) * 16): |q' - hi| <= 8 (half a step at [128, 256)): <= 128


@jit
def _e4m3_pair(x, up):
    """x (BLOCK_H, K) float32 times ``up`` (BLOCK_H, 1) as E4M3 (hi, lo): hi + lo / 16 = x * up to E4M3's second
    rounding (module docstring). Inputs within E4M3's range (|x * up| < 256 here)."""
    scaled = x * up
    hi = _e4m3_rounded(scaled)
    lo = _e4m3_rounded((scaled - hi) * E4M3_LO_FACTOR)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)


@jit
def _e4m3_rounded(x):
    """float32 x (|x| <= 448) rounded to the nearest E4M3 value (ties to even), as float32: the conversion after it
    is exact. Why not Triton's conversion alone: Triton's interpreter rounds a value whose rounding carries into the
    next binade wrong (124.07 -> 64, not 128), so the tests could not check this kernel; on the GPU both agree. The
    step is 2^(e - 3) for x in [2^e, 2^(e+1)), e >= -6 (below: subnormals, 2^-9); x / step is an integer of at most
    5 bits, rounded by adding and taking away 1.5 * 2^23 (exact: float32's integers)."""
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    return ((x * _pow2(3 - e) + 12582912.0) - 12582912.0) * _pow2(e - 3)


@jit
def _mla_decode_fp8_scores_kernel(q_lat_ptr, q_rope_ptr, cache_ptr, part_ptr, lse_ptr, block_tables_ptr, ctx_ptr,
                                  num_heads, splits, min_span, scale_log2, stride_lt, stride_lh, stride_rt, stride_rh,
                                  stride_cb, stride_cs, stride_bt, RANK: tl.constexpr, ROPE: tl.constexpr,
                                  RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, PAGE: tl.constexpr,
                                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                                  DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                                  PARTS: tl.constexpr, ASM: tl.constexpr = False,
                                  TABLE_AHEAD: tl.constexpr = False):
    """Program (s, hb, split) as kernels/mla_decode.py _mla_decode_kernel's (its docstring: the split's keys, the
    log2-unit scores, the lse, a split past the context) over an FP8 pool (cache_ptr E4M3 codes): scores
    (BLOCK_N, BLOCK_H) from the codes and the queries' E4M3 pair, the sum transposed, (RANK_PAD, BLOCK_H) +=
    widened^T probs. The latent in PARTS column parts of W columns (as kernels/mla_decode_parts.py: tuples built
    and used part by part), so that only a (BLOCK_N, W) part is widened in registers at a time (the whole 64-key
    tile widened at once: 255 registers and 360 bytes of spills). The products' 16-bit dtype WIDE is the queries'
    (float32 under the interpreter, ASM False)."""
    W: tl.constexpr = RANK_PAD // PARTS
    pdl_prologue(PDL)
    seq, heads, split, head_ok, first, last, load_q = split_program(ctx_ptr, num_heads, splits, min_span, BLOCK_H,
                                                                    BLOCK_N)
    p = tl.arange(0, ROPE_PAD)
    n = tl.arange(0, BLOCK_N)
    heads_in = tl.where(load_q, heads * stride_lh, -1)
    q_row = q_lat_ptr + seq * stride_lt
    q_rope = tl.load(q_rope_ptr + seq * stride_rt + heads[:, None] * stride_rh + p[None, :],
                     mask=load_q[:, None] & (p < ROPE)[None, :], other=0.0)  # (BLOCK_H, ROPE_PAD)
    WIDE: tl.constexpr = tl.float16 if q_rope.dtype == tl.float16 else q_rope.dtype
    PROB_SCALE: tl.constexpr = 256.0 if WIDE == tl.float16 else 1.329227995784916e+36  # the bits factor: 2^8, 2^120
    q_rope = q_rope.to(tl.float32)
    q_max = tl.max(tl.abs(q_rope), 1)  # (BLOCK_H,) over the rope and every latent part
    q_parts = ()  # PARTS x (BLOCK_H, W) float32
    for i in tl.static_range(PARTS):
        q_part = _query_part(q_row, i * W, heads_in, RANK, W)
        q_max = tl.maximum(q_max, tl.max(tl.abs(q_part), 1))
        q_parts = q_parts + (q_part,)
    e = tl.maximum(((q_max.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -100)  # 0 (or tiny): -100
    up = _pow2(7 - e)[:, None]  # each head's largest query to [128, 256)
    score_scale = scale_log2 * _pow2(e - 7)  # (BLOCK_H,)
    rope_hi, rope_lo = _e4m3_pair(q_rope, up)
    rope_hi_t, rope_lo_t = tl.trans(rope_hi), tl.trans(rope_lo)  # (ROPE_PAD, BLOCK_H): K-major, wgmma's FP8 B
    his = ()  # PARTS x (W, BLOCK_H) E4M3: the latent queries' pair, transposed
    los = ()
    sums = ()  # PARTS x (W, BLOCK_H) float32: the running sum's parts, transposed
    for i in tl.static_range(PARTS):
        q_hi, q_lo = _e4m3_pair(q_parts[i], up)
        his = his + (tl.trans(q_hi),)
        los = los + (tl.trans(q_lo),)
        sums = sums + (tl.zeros([W, BLOCK_H], dtype=tl.float32),)
    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    block_next = _page_of(table, first, last, PAGE)
    for start in tl.range(first, last, BLOCK_N, num_stages=STAGES):  # cp.async copies, STAGES tiles in flight
        key_ok = start + n < last
        if TABLE_AHEAD:  # kernels/mla_decode.py DECODE_TABLE_AHEAD: the page looked up a tile ahead
            block = block_next
            block_next = _page_of(table, start + BLOCK_N, last, PAGE)
        else:
            block = _page_of(table, start, last, PAGE)  # one page's run of rows
        rows = (cache_ptr + block * stride_cb + (start % PAGE) * stride_cs + n * stride_cs)[:, None]  # (BLOCK_N, 1)
        k_rope = tl.load(rows + RANK + p[None, :], mask=key_ok[:, None] & (p < ROPE)[None, :], other=0.0)
        codes = ()  # PARTS x (BLOCK_N, W) E4M3, all loaded before the products (sm_90: 230 registers, 244 interleaved)
        for i in tl.static_range(PARTS):
            c = i * W + tl.arange(0, W)
            codes = codes + (tl.load(rows + c[None, :], mask=key_ok[:, None] & (c < RANK)[None, :], other=0.0),)
        hi = tl.dot(k_rope, rope_hi_t)  # (BLOCK_N, BLOCK_H) float32, E4M3 codes as stored
        lo = tl.dot(k_rope, rope_lo_t)
        for i in tl.static_range(PARTS):
            hi = tl.dot(codes[i], his[i], hi)
            lo = tl.dot(codes[i], los[i], lo)
        scores = (hi + lo * (1.0 / E4M3_LO_FACTOR)) * score_scale[None, :]
        scores = tl.where(key_ok[:, None], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))  # the loop visits only tiles holding a visible key: finite
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(scores - m_new[None, :])
        weights = (probs * PROB_SCALE).to(WIDE)
        denom = denom * alpha + tl.sum(probs, 0)
        m = m_new
        folded = ()
        for i in tl.static_range(PARTS):  # value * 2^-120 (2^-8 for float16), widened where loaded
            widened = _widened(codes[i], WIDE, True, ASM)
            folded = folded + (sums[i] * alpha[None, :] + tl.dot(tl.trans(widened), weights,
                                                                 input_precision=DOT_PRECISION),)
        sums = folded
    lse = (m + tl.log2(tl.where(denom > 0, denom, 1.0))) / 1.4426950408889634  # natural-log units
    w = tl.arange(0, W)
    for i in tl.static_range(PARTS):  # the lse with the first part only
        store_split_output(part_ptr, lse_ptr, tl.trans(sums[i]), denom, lse, seq, heads, head_ok, i * W + w,
                           num_heads, splits, split, RANK, DIRECT, i == 0)


def fp8_scores_fit(fp8_pool: bool, q_dtype: torch.dtype, on_cuda: bool) -> bool:
    """Where the FP8-score kernel runs: an FP8 pool, queries of a 16-bit dtype (the value product's) or, off CUDA
    (Triton's interpreter), float32 ones too."""
    return fp8_pool and (q_dtype in (torch.bfloat16, torch.float16) or (q_dtype == torch.float32 and not on_cuda))


def mla_decode_fp8_scores_launch(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, part: torch.Tensor,
                                 lse: torch.Tensor, scale: float, splits: int, min_span: int, block_h: int,
                                 tiling: tuple[int, int, int] = FP8_SCORES_TILING,
                                 parts: int = FP8_SCORES_PARTS, table_ahead: bool = False) -> None:
    """kernels/mla_decode.py mla_decode_launch's launch (same arguments and outputs) of the FP8-score kernel: an FP8
    pool (fp8_scores_fit), a pipelined ``tiling`` (STAGES >= 1; BLOCK_N >= 64 for the warpgroup MMA on sm_90), the
    latent in ``parts`` column parts; ``table_ahead``: each tile's page looked up a tile ahead (kernels/mla_decode.py
    DECODE_TABLE_AHEAD)."""
    block_n, num_warps, stages = tiling
    assert fp8_scores_fit(True, q_latent.dtype, q_latent.is_cuda) and stages >= 1, (q_latent.dtype, tiling)
    grid, args, meta = decode_launch_arguments(q_latent, q_rope, cache, block_tables, context_lens, part, lse, scale,
                                               splits, min_span, block_h, block_n, True)
    meta.pop("BITS")
    _mla_decode_fp8_scores_kernel[grid](*args, **meta, STAGES=stages, PARTS=parts, TABLE_AHEAD=table_ahead,
                                        num_warps=num_warps)
