"""W4A8 GEMM (issue 52's idea, not in the engine's dispatch): INT4 weights held in the operand-order words of
kernels/wna16_mma.py (the INT4 engine's one copy of the codes: no second weight layout), activations quantized
per token to FP8 E4M3 (kernels/fp8.py's row quantizer), FP8 tensor-core dots (wgmma .e4m3 on Hopper: twice the
bf16 rate).

Why: the fused W4A16 GEMM (kernels/wna16_mma_gemm.py) takes about cuBLAS bf16's time plus its dequantization at
256-512 rows (0.39-0.59x cuBLAS on an H200, benchmarks/results/quantization.md): the dequantization and the dots
do not overlap. With FP8 dots the dots take half the time, and the dequantization is cheaper per code: no scale
multiply on the weight (the group's scale is applied to the tile's partial sums instead), and the conversion to
E4M3 packs two codes an instruction.

Arithmetic, per (BLOCK_N, BLOCK_M) tile of out, for each K sub-step of one quantization group g:
    p = dot(q - z, x_q)            (q - z in [-15, 15]: exact in E4M3; x_q E4M3; float32 sums)
    acc += p * s[:, g]             (the group's float16 scale per weight row, exact in float32)
and once in the epilogue out = acc * x_scale (per row) (+ bias), rounded once to x's dtype. So the product is
that of the exact dequantized weight with x rounded to E4M3 per token (``w4a8_reference``): the FP8 scheme's
accuracy trade (about 4% relative per activation value, kernels/fp8.py) is in x alone, the weight stays exact.

``RESCALE`` (``rescale``): instead, acc is kept in units of the current group's scale and the dot accumulates
into it, acc = dot(q - z, x_q, acc * s_prev / s): one tile of sums in registers, not two (64 x 256 tiles of 4
warps spill with two), and the dot's accumulator chained as the W4A16 GEMM's is (what lets Triton keep a wgmma in
flight). Each ratio is one more float32 rounding per group (~2^-24 relative, far inside one output rounding);
a zero float16 scale counts as 1 (a group quantized from zeros holds q = z: exact; a checkpoint with s = 0 and
q != z would be misread), and the accumulation runs in the FP8 wgmma's own accumulator over the whole K (Triton's
default on sm_90: not promoted to float32), where the other mode starts each group's dot from zero.

FRAGMENT ORDER (``in_fragment_order``): the words hold, for lane (g, c), the codes of columns 2c, 2c + 1, 2c + 8,
2c + 9 of each 16-column slice (mma.m16n8k16's bf16 A fragment); the FP8 wgmma's A fragment wants 4c..4c+3 and
16+4c.. of each 32 columns, so Triton exchanges the codes through shared memory (64 st.shared a 128 x 128 step on
sm_90). A product is a sum over K: numbering the weight's columns so that each lane's codes land where the FP8
fragment wants them, and x's columns the same way (``fragment_order``: within each 64-column block; a quantizer
can write x so), gives the same sums with no exchange (sm_90 compile here: 0 st.shared, 128 x 128 of 8 warps
128 registers against 210). Made one 64-column block at a time (Triton tensors have at most 8 dimensions); a
128-column sub-step joins its two blocks side by side into one dot (no exchange either). Before the join, the two
64-column dots a step ran 17% slower than the plain order's one dot at 64 x 256 on an H200 with Triton 3.6
(2026-11-30; why was not measured).
HALF2 (``half2``, CUDA only): the codes of that order by inline PTX, each asm output one 32-bit register of the A
fragment (two codes a LOP3 into float16 halves 1024 + q, an HSUB2 of 1024 + z, a CVT e4m3x2.f16x2; exact): a
128 x 128 step's loop 388 instructions on sm_90 against 496 (W4A16 GEMM: 477); 64 x 256 of 4 warps 540 against
848 in the plain order.

Tiling: a step of BLOCK_K = KB * 64 columns; groups of 64 columns (KB 2) take two sub-dots a step (``SUB_KB``),
groups of BLOCK_K or more (or one a row) one. ``W_FIRST``: the weight the dot's A operand (registers; wgmma
reads FP8 A from registers too), else the B operand (stored to shared memory). Split-K as kernels/wna16_layout's
``finish_tile`` (the row scale is applied to each split's partial sums: linear, so the same up to rounding).
"""
from __future__ import annotations

import os

import torch

from kernels import wna16_mma
from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, QUANTIZE_ONE_PASS_MAX, QuantizedRows, quantize_rows, quantize_rows_triton
from kernels.linear import _arrival_counters
from kernels.wna16_layout import finish_tile
from kernels.wna16_mma_gemm import gemm_program
from kernels.wna16_mma_dense import _magic_nibble


@jit
def w4_code_tile(w_ptr, meta_ptr, t, b, N_PAD, GROUP, BLOCKS, TT: tl.constexpr, KB: tl.constexpr,
                 ASM: tl.constexpr):
    """Row tiles ``t`` (TT,) x k blocks ``b`` (KB,) of wna16_mma's layout -> (q - z) as E4M3 (TT * 16, KB * 64),
    rows 16 t.. and columns 64 b.. in order: kernels/wna16_mma_dense.mma_weight_tile's decoding (nibbles by
    tl.join; ASM: by inline PTX) without the scale, converted to E4M3 (exact: integers of magnitude <= 15)
    before the permute, so a quarter of the bytes move between threads."""
    word = (t.to(tl.int64)[:, None, None] * BLOCKS + b[None, :, None]) * 128 + tl.arange(0, 128)[None, None, :]
    g = tl.arange(0, 8)
    h = tl.arange(0, 2)
    n_code = t[:, None, None, None] * 16 + g[None, None, :, None] + 8 * h[None, None, None, :]  # (TT, 1, 8, 2)
    grp = (b * 64) // GROUP
    meta = tl.load(meta_ptr + grp[None, :, None, None] * N_PAD + n_code)  # (TT, KB, 8, 2): t, b, g, h
    zero = tl.reshape(((meta & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True), (TT, KB, 8, 1, 1, 1, 1, 2))
    words = tl.reshape(tl.load(w_ptr + word), (TT, KB, 8, 4, 4)).to(tl.uint32, bitcast=True)  # t, b, g, c, j
    f0h0 = tl.join(_magic_nibble(words, 0, ASM), _magic_nibble(words, 4, ASM))
    f1h0 = tl.join(_magic_nibble(words, 2, ASM), _magic_nibble(words, 6, ASM))
    f0h1 = tl.join(_magic_nibble(words, 1, ASM), _magic_nibble(words, 5, ASM))
    f1h1 = tl.join(_magic_nibble(words, 3, ASM), _magic_nibble(words, 7, ASM))
    q = tl.join(tl.join(f0h0, f1h0), tl.join(f0h1, f1h1))  # 2^23 + q at [t, b, g, c, j, e, f, h]
    w = (q - zero).to(tl.float8e4nv)  # q - z exactly
    return tl.reshape(tl.permute(w, (0, 7, 2, 1, 4, 6, 3, 5)), (TT * 16, KB * 64))  # (t h g), (b j f c e)


def _pair_asm(p: int) -> str:
    """PTX: words $1 (slice 2s) and $2 (slice 2s + 1), fp16x2 (1024 + z, 1024 + z) $3 -> $0: 4 E4M3 bytes, q - z of
    nibbles p and p + 4 of $1, then of $2: with p = h + 2f, row g + 8h, columns 4c..4c+3 of the 16 f.. of their 32 in
    fragment order, i.e. one register of the FP8 A fragment. Per two codes a LOP3 into float16 halves (1024 + q), an
    HSUB2 and a CVT."""
    return ("{ .reg .b32 a, b, t; .reg .b16 lo, hi; "
            f"shr.b32 t, $1, {4 * p}; lop3.b32 a, t, 0x000f000f, 0x64006400, 0xea; "
            f"shr.b32 t, $2, {4 * p}; lop3.b32 b, t, 0x000f000f, 0x64006400, 0xea; "
            "sub.f16x2 a, a, $3; sub.f16x2 b, b, $3; "
            "cvt.rn.satfinite.e4m3x2.f16x2 lo, a; cvt.rn.satfinite.e4m3x2.f16x2 hi, b; mov.b32 $0, {lo, hi}; }")


if tl is not None:  # Triton reads module globals that are constexprs
    _PAIR_ASM_0 = tl.constexpr(_pair_asm(0))
    _PAIR_ASM_1 = tl.constexpr(_pair_asm(1))
    _PAIR_ASM_2 = tl.constexpr(_pair_asm(2))
    _PAIR_ASM_3 = tl.constexpr(_pair_asm(3))


@jit
def _quad_bytes(quads):
    """int32 (...) -> their 4 bytes as uint8 (..., e, jj): byte 2 jj + e."""
    b0 = (quads & 0xFF).to(tl.uint8)
    b1 = ((quads >> 8) & 0xFF).to(tl.uint8)
    b2 = ((quads >> 16) & 0xFF).to(tl.uint8)
    b3 = ((quads >> 24) & 0xFF).to(tl.uint8)
    return tl.join(tl.join(b0, b1), tl.join(b2, b3))


@jit
def w4_code_block_half2(w_ptr, meta_ptr, t, b, N_PAD, GROUP, BLOCKS, TT: tl.constexpr):
    """``w4_code_block_in_fragment_order`` by inline PTX on float16 pairs (``_pair_asm``: CUDA only), each output
    register one register of the FP8 A fragment."""
    word = (t.to(tl.int64)[:, None] * BLOCKS + b) * 128 + tl.arange(0, 128)[None, :]
    g = tl.arange(0, 8)
    h = tl.arange(0, 2)
    n_code = t[:, None, None] * 16 + g[None, :, None] + 8 * h[None, None, :]  # (TT, 8, 2)
    meta = tl.load(meta_ptr + ((b * 64) // GROUP) * N_PAD + n_code)
    zero_h0, zero_h1 = tl.split(((meta & 0xFF) | 0x6400) * 0x10001)  # fp16x2 (1024 + z) per row g, g + 8
    even, odd = tl.split(tl.reshape(tl.load(w_ptr + word), (TT, 8, 4, 2, 2)))  # t, g, c, s (jj split off)
    zero_h0 = tl.broadcast_to(tl.reshape(zero_h0, (TT, 8, 1, 1)), (TT, 8, 4, 2))
    zero_h1 = tl.broadcast_to(tl.reshape(zero_h1, (TT, 8, 1, 1)), (TT, 8, 4, 2))
    r0 = tl.inline_asm_elementwise(_PAIR_ASM_0, "=r,r,r,r", [even, odd, zero_h0], dtype=tl.int32, is_pure=True, pack=1)
    r1 = tl.inline_asm_elementwise(_PAIR_ASM_1, "=r,r,r,r", [even, odd, zero_h1], dtype=tl.int32, is_pure=True, pack=1)
    r2 = tl.inline_asm_elementwise(_PAIR_ASM_2, "=r,r,r,r", [even, odd, zero_h0], dtype=tl.int32, is_pure=True, pack=1)
    r3 = tl.inline_asm_elementwise(_PAIR_ASM_3, "=r,r,r,r", [even, odd, zero_h1], dtype=tl.int32, is_pure=True, pack=1)
    regs = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [t, g, c, s, h, f]
    w = _quad_bytes(regs).to(tl.float8e4nv, bitcast=True)  # [t, g, c, s, h, f, e, jj]
    return tl.reshape(tl.permute(w, (0, 4, 1, 3, 5, 2, 7, 6)), (TT * 16, 64))  # (t h g), (s f c jj e)


@jit
def w4_code_block_in_fragment_order(w_ptr, meta_ptr, t, b, N_PAD, GROUP, BLOCKS, TT: tl.constexpr, ASM: tl.constexpr):
    """Row tiles ``t`` (TT,) x one k block ``b`` -> (q - z) as E4M3 (TT * 16, 64) with the block's columns in
    FRAGMENT ORDER: logical column 32 s + 16 f + 4 c + 2 jj + e holds the code of column 16 (2 s + jj) + 8 f + 2 c + e
    (``fragment_order``). Lane (g, c)'s codes then sit where the FP8 wgmma's A fragment wants them (rows g, g + 8;
    columns 4c..4c+3 and 16+4c.. of each 32), so no exchange between threads should be needed; x must come in the
    same column order. One block a call (Triton tensors have at most 8 dimensions)."""
    word = (t.to(tl.int64)[:, None] * BLOCKS + b) * 128 + tl.arange(0, 128)[None, :]
    g = tl.arange(0, 8)
    h = tl.arange(0, 2)
    n_code = t[:, None, None] * 16 + g[None, :, None] + 8 * h[None, None, :]  # (TT, 8, 2)
    meta = tl.load(meta_ptr + ((b * 64) // GROUP) * N_PAD + n_code)
    zero = tl.reshape(((meta & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True), (TT, 8, 1, 1, 1, 1, 1, 2))
    words = tl.reshape(tl.load(w_ptr + word), (TT, 8, 4, 2, 2)).to(tl.uint32, bitcast=True)  # t, g, c, s, jj
    f0h0 = tl.join(_magic_nibble(words, 0, ASM), _magic_nibble(words, 4, ASM))
    f1h0 = tl.join(_magic_nibble(words, 2, ASM), _magic_nibble(words, 6, ASM))
    f0h1 = tl.join(_magic_nibble(words, 1, ASM), _magic_nibble(words, 5, ASM))
    f1h1 = tl.join(_magic_nibble(words, 3, ASM), _magic_nibble(words, 7, ASM))
    q = tl.join(tl.join(f0h0, f1h0), tl.join(f0h1, f1h1))  # 2^23 + q at [t, g, c, s, jj, e, f, h]
    w = (q - zero).to(tl.float8e4nv)
    return tl.reshape(tl.permute(w, (0, 7, 1, 3, 6, 2, 4, 5)), (TT * 16, 64))  # (t h g), (s f c jj e)


@jit
def _group_scale(meta_ptr, n, b, N_PAD, GROUP):
    """The float16 scales (as float32) of weight rows ``n`` in the group of k block ``b``."""
    meta = tl.load(meta_ptr + ((b * 64) // GROUP) * N_PAD + n)
    return (meta >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit(do_not_specialize=["M", "N", "N_PAD", "GROUP", "BLOCKS", "BLOCKS_PER_SPLIT"])
def _w4a8_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, meta_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, N_PAD, GROUP, BLOCKS, BLOCKS_PER_SPLIT, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, TT: tl.constexpr, KB: tl.constexpr, SUB_KB: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, W_FIRST: tl.constexpr, RESCALE: tl.constexpr, FRAGMENT_ORDER: tl.constexpr,
    HALF2: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile, split): out rows [BLOCK_M i, +BLOCK_M) x columns [16 TT j, +16 TT) (tile = j * m_tiles + i)
    over k blocks [split * BLOCKS_PER_SPLIT, +BLOCKS_PER_SPLIT), KB blocks a step in sub-dots of SUB_KB blocks
    (one quantization group or part of one)."""
    BLOCK_N: tl.constexpr = TT * 16
    SUB_K: tl.constexpr = SUB_KB * 64
    # cols inside N_PAD (BLOCK_N divides it): the scales are read unmasked
    tile, rows, cols, row_ok, col_ok, t, kb_begin, kb_end = gemm_program(M, N, BLOCKS, BLOCKS_PER_SPLIT, TT, BLOCK_M)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + tl.arange(0, SUB_K)[None, :]  # (BLOCK_M, SUB_K)
    x_block = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + tl.arange(0, 64)[None, :]  # (BLOCK_M, 64)
    if W_FIRST:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    last = tl.full([BLOCK_N], 1.0, tl.float32)  # RESCALE: the scale acc is in units of (any, while acc is 0)
    pdl_prologue(PDL)
    for kb in range(kb_begin, kb_end, KB):
        for s in tl.static_range(KB // SUB_KB):
            b0 = kb + s * SUB_KB
            scale = _group_scale(meta_ptr, cols, b0, N_PAD, GROUP)
            if RESCALE:  # acc in units of this group's scale, then the dots accumulate into it (one tile of sums)
                scale = tl.where(scale == 0.0, 1.0, scale)
                ratio = last / scale
                last = scale
                if W_FIRST:
                    part = acc * ratio[:, None]
                else:
                    part = acc * ratio[None, :]
            elif W_FIRST:
                part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            else:
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if FRAGMENT_ORDER and SUB_KB == 2:  # the sub-step's two blocks side by side: one dot of 128 columns
                x = tl.load(x_rows + b0 * 64, mask=row_ok[:, None], other=0.0)
                if HALF2:
                    w0 = w4_code_block_half2(w_ptr, meta_ptr, t, b0, N_PAD, GROUP, BLOCKS, TT)
                    w1 = w4_code_block_half2(w_ptr, meta_ptr, t, b0 + 1, N_PAD, GROUP, BLOCKS, TT)
                else:
                    w0 = w4_code_block_in_fragment_order(w_ptr, meta_ptr, t, b0, N_PAD, GROUP, BLOCKS, TT, ASM)
                    w1 = w4_code_block_in_fragment_order(w_ptr, meta_ptr, t, b0 + 1, N_PAD, GROUP, BLOCKS, TT, ASM)
                w = tl.reshape(tl.permute(tl.join(w0, w1), (0, 2, 1)), (TT * 16, 128))
                if W_FIRST:
                    part = tl.dot(w, tl.trans(x), part)
                else:
                    part = tl.dot(x, tl.trans(w), part)
            elif FRAGMENT_ORDER:  # one 64-column block a dot, x in fragment order
                for blk in tl.static_range(SUB_KB):
                    x = tl.load(x_block + (b0 + blk) * 64, mask=row_ok[:, None], other=0.0)
                    if HALF2:
                        w = w4_code_block_half2(w_ptr, meta_ptr, t, b0 + blk, N_PAD, GROUP, BLOCKS, TT)
                    else:
                        w = w4_code_block_in_fragment_order(w_ptr, meta_ptr, t, b0 + blk, N_PAD, GROUP, BLOCKS, TT,
                                                            ASM)
                    if W_FIRST:
                        part = tl.dot(w, tl.trans(x), part)
                    else:
                        part = tl.dot(x, tl.trans(w), part)
            else:
                x = tl.load(x_rows + b0 * 64, mask=row_ok[:, None], other=0.0)
                w = w4_code_tile(w_ptr, meta_ptr, t, b0 + tl.arange(0, SUB_KB), N_PAD, GROUP, BLOCKS, TT, SUB_KB, ASM)
                if W_FIRST:
                    part = tl.dot(w, tl.trans(x), part)
                else:
                    part = tl.dot(x, tl.trans(w), part)
            if RESCALE:
                acc = part
            elif W_FIRST:
                acc += part * scale[:, None]
            else:
                acc += part * scale[None, :]
    if RESCALE:
        if W_FIRST:
            acc = acc * last[:, None]
        else:
            acc = acc * last[None, :]
    if W_FIRST:
        acc = tl.trans(acc)
    acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    finish_tile(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om, tile,
                HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


def supports(in_features: int, group_size: int, block_k: int) -> bool:
    """Whether a tiling's K step fits a layer: whole steps of whole 64-column blocks, and each sub-dot inside one
    group (groups of whole steps, or steps of whole groups of 64+ columns, or one group a row)."""
    if block_k % wna16_mma.KB_COLUMNS or in_features % block_k or in_features % wna16_mma.PAD_COLUMNS:
        return False
    return group_size == in_features or (group_size % wna16_mma.KB_COLUMNS == 0 and
                                         (group_size % block_k == 0 or block_k % group_size == 0))


def fragment_order(values: torch.Tensor) -> torch.Tensor:
    """x's columns (..., K) permuted within each 64-column block into ``w4_code_block_in_fragment_order``'s order:
    out[..., 64 b + 32 s + 16 f + 4 c + 2 jj + e] = values[..., 64 b + 16 (2 s + jj) + 8 f + 2 c + e]."""
    logical = torch.arange(64, device=values.device)
    s, f, c, jj, e = logical // 32, logical // 16 % 2, logical // 4 % 4, logical // 2 % 2, logical % 2
    source = 16 * (2 * s + jj) + 8 * f + 2 * c + e
    k = values.shape[-1]
    index = (torch.arange(0, k, 64, device=values.device)[:, None] + source[None, :]).reshape(-1)
    return values[..., index].contiguous()


@jit
def _fragment_column(p):
    """Where physical column ``p`` of x goes in fragment order (the inverse of ``fragment_order``'s gather)."""
    j = (p % 64) // 16
    return (p // 64) * 64 + (j // 2) * 32 + ((p // 8) % 2) * 16 + ((p // 2) % 4) * 4 + (j % 2) * 2 + p % 2


@jit
def _quantize_rows_in_fragment_order_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                                            PDL: tl.constexpr):
    """kernels/fp8.py's one-pass row quantizer (the same scale and rounding: kernels/e4m3_rows.py) with each value
    stored at its fragment-order column."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    pdl_prologue(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = e4m3_row_scale(tl.max(tl.abs(x), 0))
    tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + row * stride_q + _fragment_column(cols), to_e4m3(x, scale), mask=cols < K)


def quantize_rows_in_fragment_order(x: torch.Tensor) -> QuantizedRows:
    """x (M, K) per token in E4M3 with its columns in fragment order: ``fragment_order`` of kernels/fp8.py's
    quantize_rows, bit for bit; one Triton kernel for CUDA rows with unit column stride up to
    fp8.QUANTIZE_ONE_PASS_MAX wide (``quantize_rows_in_fragment_order_triton``), else the two in torch."""
    if use_triton(x) and x.stride(1) == 1 and x.shape[1] <= QUANTIZE_ONE_PASS_MAX and x.shape[1] % 64 == 0:
        return quantize_rows_in_fragment_order_triton(x)
    values, scale = quantize_rows(x)
    return QuantizedRows(fragment_order(values), scale, x.dtype)


def quantize_rows_in_fragment_order_triton(x: torch.Tensor) -> QuantizedRows:
    """The Triton kernel (x (M, K), K a multiple of 64 up to QUANTIZE_ONE_PASS_MAX, unit column stride; CUDA, or CPU
    under TRITON_INTERPRET=1)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and cols % 64 == 0 and cols <= QUANTIZE_ONE_PASS_MAX
    values = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quantize_rows_in_fragment_order_kernel[(rows,)](x, values, scale, cols, x.stride(0), values.stride(0),
                                                         BLOCK=block, num_warps=min(16, max(4, block // 512)),
                                                         **pdl_options(x))
    return QuantizedRows(values, scale, x.dtype)


def quantized_rows(x: torch.Tensor | QuantizedRows) -> QuantizedRows:
    """x per token in E4M3 (itself when it already is): kernels/fp8.py's quantizer (one Triton kernel on CUDA;
    the two agree bit for bit)."""
    if isinstance(x, QuantizedRows):
        return x
    values, scale = quantize_rows_triton(x) if use_triton(x) and x.stride(1) == 1 else quantize_rows(x)
    return QuantizedRows(values, scale, x.dtype)


def w4a8_matmul(x: torch.Tensor | QuantizedRows, layout: dict[str, torch.Tensor], n: int, group_size: int,
                bias: torch.Tensor | None = None, *, block_n: int = 128, block_m: int = 128, block_k: int = 128,
                num_warps: int = 8, num_stages: int = 3, split_k: int = 1, w_first: bool = True,
                rescale: bool = False, in_fragment_order: bool = False, x_permuted: bool = False,
                half2: bool = False, asm: bool = True) -> torch.Tensor:
    """x (M, K) bf16/fp16 (quantized per token here) or QuantizedRows @ the weight (N, K) in ``layout``
    ({"words", "meta"}: kernels/wna16_mma.py's).T (+ bias) -> (M, N) in x's dtype. Programs of (block_m,
    block_n) out tiles, block_k columns a step, K split over ``split_k`` programs; ``w_first``: the weight the
    dot's A operand; ``rescale``: the dots accumulate into one tile of sums (module docstring); ``asm``: the
    nibbles by inline PTX (CUDA only); ``in_fragment_order``: the weight made in the FP8 A fragment's column order
    and x permuted to it (``fragment_order``; ``x_permuted``: x's values already are); ``half2``: in fragment order on
    CUDA, the codes by inline PTX on float16 pairs (``w4_code_block_half2``). Runs wherever Triton runs
    (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if in_fragment_order and not x_permuted:
        rows = quantize_rows_in_fragment_order(x) if not isinstance(x, QuantizedRows) else \
            QuantizedRows(fragment_order(x.values), x.scale, x.dtype)
    else:
        rows = quantized_rows(x)
    m, k = rows.values.shape
    assert rows.values.stride(1) == 1
    n_pad = layout["meta"].shape[1]
    blocks = layout["words"].numel() // (n_pad // 16) // 128
    if blocks * wna16_mma.KB_COLUMNS != k or not supports(k, group_size, block_k):
        raise ValueError(f"x's K = {k} with group size {group_size}, block_k {block_k} and a layout of {blocks} "
                         f"64-column blocks: the W4A8 GEMM takes the layout's K in whole steps, each sub-dot in "
                         f"one group (``supports``)")
    if wna16_mma.PAD_ROWS % block_n:
        raise ValueError(f"block_n {block_n} must divide the words' {wna16_mma.PAD_ROWS}-row padding")
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.values.device)
    if m == 0:
        return out
    bias, = dense(bias)
    kb = block_k // wna16_mma.KB_COLUMNS
    sub_kb = kb if group_size == k or group_size >= block_k else group_size // wna16_mma.KB_COLUMNS
    steps = k // block_k
    split_k = max(1, min(split_k, steps))
    per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, per_split)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=out.device) if split_k > 1 else out
    arrivals = _arrival_counters(out.device, tiles) if split_k > 1 else out
    _w4a8_gemm_kernel[(tiles, split_k)](
        rows.values, rows.scale, layout["words"], layout["meta"], bias if bias is not None else out, out, part,
        arrivals, m, n, n_pad, group_size, blocks, per_split * kb, rows.values.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, TT=block_n // 16, KB=kb, SUB_KB=sub_kb, BLOCK_M=block_m, SPLIT_K=split_k,
        W_FIRST=bool(w_first), RESCALE=bool(rescale), FRAGMENT_ORDER=bool(in_fragment_order),
        HALF2=bool(half2) and bool(in_fragment_order) and out.is_cuda,
        ASM=asm and out.is_cuda, num_warps=num_warps,
        num_stages=num_stages, **pdl_options(out))
    return out


def w4a8_reference(x: torch.Tensor | QuantizedRows, layout: dict[str, torch.Tensor], n: int, group_size: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: x quantized per token to E4M3 (kernels/fp8.quantize_rows), the layout's weight dequantized
    exactly ((q - z) * s, float16 s: exact in float32; wna16_mma.mma_layout_weight), their product, the row
    scales and the bias in float64, rounded once to x's dtype."""
    rows = x if isinstance(x, QuantizedRows) else QuantizedRows(*quantize_rows(x), x.dtype)
    k = rows.values.shape[1]
    weight = wna16_mma.mma_layout_weight(layout, n, k, group_size).double()
    out = (rows.values.double() @ weight.t()) * rows.scale.double()[:, None]
    if bias is not None:
        out = out + bias.double()
    return out.to(rows.dtype)


# ---- the engine's opt-in (kernels/wna16.wna16_linear) ------------------------------------------------------------

ENV = "TRITONLLM_W4A8"  # "1": INT4 operand-order layers of MIN_OUT_FEATURES+ outputs multiply MIN_ROWS+ rows here
# Where the first H200 sweep (2026-11-30, benchmarks/results/quantization.md) found W4A8 faster than the W4A16 paths:
# from 256 rows on the wide layers (gate_up 1.30x the W4A16 GEMM, qkv 1.20x); at 64-128 rows within a few percent
# of it (the row quantize kernel then eats the gain), and on the 4096-output layers (o, down) at 256 rows even or
# slower (down 104 us against 91).
MIN_ROWS = 129
MIN_OUT_FEATURES = 6144
# The tiling for every such product: the sweep's fastest at 256-1024 rows on gate_up and qkv.
ENGINE_TILING = dict(block_n=64, block_m=256, num_warps=4, num_stages=3, split_k=1, block_k=128, w_first=True,
                     rescale=True, in_fragment_order=False)


def enabled() -> bool:
    """$TRITONLLM_W4A8 is "1" (read at every call, as kernels/wna16's switches): off by default, since rounding the
    activations to E4M3 is an accuracy trade (a few percent per product, kernels/fp8.py) the user chooses."""
    return os.environ.get(ENV, "") == "1"


def takes(rows: torch.Tensor, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an INT4 operand-order layer's product of ``rows`` runs here when enabled: MIN_ROWS+ rows of 16-bit
    activations on CUDA, MIN_OUT_FEATURES+ outputs, K whole 128-column steps with groups the steps take."""
    return (rows.shape[0] >= MIN_ROWS and out_features >= MIN_OUT_FEATURES and use_triton(rows)
            and rows.dtype in (torch.bfloat16, torch.float16) and supports(in_features, group_size, 128))


def engine_tiling(m: int, n: int) -> dict:
    """The tiling of the engine's products (ENGINE_TILING; by rows and outputs once measurements differ)."""
    return dict(ENGINE_TILING)


def w4a8_linear(rows: torch.Tensor, layout: dict[str, torch.Tensor], n: int, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows (M, K) quantized per token (one kernel), then the GEMM by ``engine_tiling``."""
    return w4a8_matmul(rows, layout, n, group_size, bias, **engine_tiling(rows.shape[0], n))
