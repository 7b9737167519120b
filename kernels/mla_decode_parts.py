"""kernels/mla_decode.py's pipelined decode kernel with the latent in column parts (issue 55): fewer registers.

The decode kernel holds, a program, the queries (BLOCK_H, RANK_PAD), the running sum (BLOCK_H, RANK_PAD) float32
and a key tile (BLOCK_N, RANK_PAD) at once, the score product taking the whole latent row as its K and the value
product the whole row as its N. For an FP8 pool widened by bits (kernels/e4m3_bits.py) ptxas gave it 255 registers
at (32, 4, 3): 2 programs an SM against the bf16 pool's 3 (168 registers), and FP8 pools reached 27-31% of the copy
bandwidth, slower in absolute time than bf16 pools of twice the bytes (session 29, benchmarks/results/kernels.md).

Here the latent's RANK_PAD columns are PARTS (2, 4 or 8) tensors of W = RANK_PAD / PARTS columns each: the
queries' parts q_i (BLOCK_H, W), a tile's parts c_i (BLOCK_N, W) loaded and widened each from its own codes, the
sum's parts acc_i (BLOCK_H, W). The same sums in another grouping::

    scores = q_rope k_rope^T + sum_i q_i c_i^T        (BLOCK_H, BLOCK_N) float32
    acc_i  = acc_i * alpha + P c_i                    each part its own product

The compiler then sees PARTS smaller products (their operand staging and accumulators live one part at a time)
where it saw one wide one. Same outputs and layout as the decode kernel (kernels/mla_partials.py: DIRECT or the
splits' partials and log-sum-exps); same split arithmetic, the same FP8 widening and query scaling
(kernels/mla_decode.py _bits_query_scale over every part). Pipelined tilings only (STAGES >= 1, keys as columns).
Off by default: kernels/mla_decode.py DECODE_COLUMN_PARTS.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_prologue, tl, triton
from kernels.mla_decode import _bits_query_scale, _page_of, _tile_page, _widened, decode_launch_arguments, split_program
from kernels.mla_partials import store_split_output

COLUMN_PARTS = (1, 2, 4, 8)  # 1: kernels/mla_decode.py's kernel itself
MIN_PART_COLUMNS = 16  # a part is the K of the score product and the N of the value product: tensor cores' minimum


@jit
def _query_part(q_ptr, col0, heads_in, RANK: tl.constexpr, W: tl.constexpr):
    """(BLOCK_H, W) float32: columns col0 .. col0 + W - 1 of the heads' latent queries (q_ptr: the token's first
    head's row; heads_in (BLOCK_H,) the heads' row offsets, -1 where the head is not loaded), zeros past RANK."""
    c = col0 + tl.arange(0, W)
    ok = (heads_in >= 0)[:, None] & (c < RANK)[None, :]
    return tl.load(q_ptr + tl.where(heads_in >= 0, heads_in, 0)[:, None] + c[None, :], mask=ok, other=0.0
                   ).to(tl.float32)


@jit
def _code_part(rows, key_ok, col0, RANK: tl.constexpr, W: tl.constexpr, WIDE: tl.constexpr, BITS: tl.constexpr,
               ASM: tl.constexpr):
    """(BLOCK_N, W) WIDE: columns col0 .. col0 + W - 1 of a tile's latent rows (``rows`` (BLOCK_N, 1) their
    addresses), widened from their own codes (kernels/mla_decode.py _widened, not pure: where loaded)."""
    c = col0 + tl.arange(0, W)
    codes = tl.load(rows + c[None, :], mask=key_ok[:, None] & (c < RANK)[None, :], other=0.0)
    return _widened(codes, WIDE, BITS, ASM)


@jit
def _mla_decode_parts_kernel(q_lat_ptr, q_rope_ptr, cache_ptr, part_ptr, lse_ptr, block_tables_ptr, ctx_ptr,
                             num_heads, splits, min_span, scale_log2, stride_lt, stride_lh, stride_rt, stride_rh,
                             stride_cb, stride_cs, stride_bt, RANK: tl.constexpr, ROPE: tl.constexpr,
                             RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, PAGE: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                             DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                             PARTS: tl.constexpr, BITS: tl.constexpr = False, ASM: tl.constexpr = False,
                             TABLE_AHEAD: tl.constexpr = False):
    """Program (s, hb, split) as kernels/mla_decode.py _mla_decode_kernel's (its docstring: the split's keys, the
    log2-unit scores, the lse, a split past the context), the latent in PARTS (2, 4 or 8) column parts of W columns:
    tuples of PARTS tensors, each built and used part by part (static loops: unrolled at compile time)."""
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
    q_max = tl.max(tl.abs(q_rope.to(tl.float32)), 1)  # (BLOCK_H,) over every part, for the bits path
    q_parts = ()  # PARTS x (BLOCK_H, W) float32
    for i in tl.static_range(PARTS):
        q_part = _query_part(q_row, i * W, heads_in, RANK, W)
        q_max = tl.maximum(q_max, tl.max(tl.abs(q_part), 1))
        q_parts = q_parts + (q_part,)
    if BITS:  # kernels/mla_decode.py _bits_queries over the parts: one power of two a head across all of them
        WIDE: tl.constexpr = tl.float16 if q_rope.dtype == tl.float16 else q_rope.dtype
        up, score_scale = _bits_query_scale(q_max, scale_log2, WIDE)
        up = up[:, None]
        PROB_SCALE: tl.constexpr = 256.0 if WIDE == tl.float16 else 1.329227995784916e+36  # 2^8, 2^120
    else:
        WIDE: tl.constexpr = q_rope.dtype
        up = 1.0
        score_scale = tl.full([BLOCK_H], scale_log2, tl.float32)
        PROB_SCALE: tl.constexpr = 1.0
    q_rope = (q_rope.to(tl.float32) * up).to(WIDE)
    queries = ()  # PARTS x (BLOCK_H, W) WIDE
    sums = ()  # PARTS x (BLOCK_H, W) float32: the running sum's parts
    for i in tl.static_range(PARTS):
        queries = queries + ((q_parts[i] * up).to(WIDE),)
        sums = sums + (tl.zeros([BLOCK_H, W], dtype=tl.float32),)
    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    block_next = _page_of(table, first, last, PAGE)
    for start in tl.range(first, last, BLOCK_N, num_stages=STAGES):  # cp.async copies, STAGES tiles in flight
        key_ok = start + n < last
        # one page's run of rows (TABLE_AHEAD: kernels/mla_decode.py DECODE_TABLE_AHEAD, looked up a tile ahead)
        block, block_next = _tile_page(table, start, block_next, last, PAGE, BLOCK_N, TABLE_AHEAD)
        rows = (cache_ptr + block * stride_cb + (start % PAGE) * stride_cs + n * stride_cs)[:, None]  # (BLOCK_N, 1)
        k_rope = _widened(tl.load(rows + RANK + p[None, :], mask=key_ok[:, None] & (p < ROPE)[None, :], other=0.0),
                          WIDE, BITS, ASM)
        scores = tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N) float32
        codes = ()  # PARTS x (BLOCK_N, W) WIDE: the tile's latent parts
        for i in tl.static_range(PARTS):
            code = _code_part(rows, key_ok, i * W, RANK, W, WIDE, BITS, ASM)
            scores += tl.dot(queries[i], tl.trans(code), input_precision=DOT_PRECISION)
            codes = codes + (code,)
        # kernels/mla_decode.py _fold_tile's online softmax (the loop visits only tiles holding a visible key)
        scores = tl.where(key_ok[None, :], scores * score_scale[:, None], -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(scores - m_new[:, None])
        weights = (probs if PROB_SCALE == 1.0 else probs * PROB_SCALE).to(WIDE)
        denom = denom * alpha + tl.sum(probs, 1)
        m = m_new
        folded = ()
        for i in tl.static_range(PARTS):
            folded = folded + (sums[i] * alpha[:, None] + tl.dot(weights, codes[i], input_precision=DOT_PRECISION),)
        sums = folded
    lse = (m + tl.log2(tl.where(denom > 0, denom, 1.0))) / 1.4426950408889634  # natural-log units
    w = tl.arange(0, W)
    for i in tl.static_range(PARTS):  # the lse with the first part only
        store_split_output(part_ptr, lse_ptr, sums[i], denom, lse, seq, heads, head_ok, i * W + w, num_heads, splits,
                           split, RANK, DIRECT, i == 0)


def column_parts_fit(rank: int, parts: int) -> bool:
    """Whether the latent's padded width splits into ``parts`` parts of at least MIN_PART_COLUMNS columns."""
    rank_pad = max(16, triton.next_power_of_2(rank))
    return parts in COLUMN_PARTS and rank_pad // parts >= MIN_PART_COLUMNS


def mla_decode_parts_launch(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, part: torch.Tensor,
                            lse: torch.Tensor, scale: float, splits: int, min_span: int, block_h: int,
                            tiling: tuple[int, int, int], parts: int, bits: bool = False,
                            table_ahead: bool = False) -> None:
    """kernels/mla_decode.py mla_decode_launch's launch (same arguments and outputs) of the column-parts kernel:
    ``parts`` 2, 4 or 8 (column_parts_fit), a pipelined ``tiling`` (STAGES >= 1); the caller checked both.
    ``table_ahead``: each tile's page looked up a tile ahead (kernels/mla_decode.py DECODE_TABLE_AHEAD)."""
    block_n, num_warps, stages = tiling
    assert parts in COLUMN_PARTS[1:] and column_parts_fit(q_latent.shape[-1], parts) and stages >= 1, (
        parts, q_latent.shape[-1], tiling)
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    grid, args, meta = decode_launch_arguments(q_latent, q_rope, cache, block_tables, context_lens, part, lse, scale,
                                               splits, min_span, block_h, block_n, bits)
    _mla_decode_parts_kernel[grid](*args, **meta, STAGES=stages, PARTS=parts, TABLE_AHEAD=table_ahead,
                                   num_warps=num_warps)
