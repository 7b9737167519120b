"""Decode kernels of the weight-only integer linear layers with the scale and zero factored out of
the inner product (kernels/wna16_layout.py's layout, tiles and split-K finish, as the kernels of
kernels/wna16_gemm.py use them):

    sum_k (q_k - z) s x_k = s * sum_k (q_k - z) x_k    over the columns of one group,

so a weight costs no multiply by its scale: the scale is applied once per unit of words (U = 128
columns for 4 bits, 64 for 8) and row, which needs every unit inside one group (the group a whole
number of units, or per channel). kernels/wna16.wna16_matmul sends the tilings of kinds 2 to 5
here where the grouping allows, and to kernels/wna16_gemm.py's kernels otherwise.

- ``_factored_fma_kernel`` (kind 2, a few rows, FMA units): codes are never shifted into place.
  A 16-bit half of a word holds P / 2 fields; field i masked in place is the integer q * 2^(b*i)
  (b the bit width), under 2^23, so OR-ing it into the mantissa of 2^23 gives the float32
  2^23 + q * 2^(b*i) exactly, and subtracting 2^23 + z * 2^(b*i) (one constant per row and field
  position, per unit) gives (q - z) * 2^(b*i) exactly. The activations of that slice are
  multiplied by 2^-(b*i) once per program (exact: a power of two), so a weight costs one LOP3
  (mask and OR), one FADD and one FFMA per row of x; the high half costs one shift per word.
- ``_factored_dot_kernel`` (kind 3, tensor cores, 16-row tiles): 4-bit codes become 16-bit
  floats OFF + q by OR-ing them into the mantissa of OFF (128 in bfloat16: 0x4300, 1024 in
  float16: 0x6400), exact, with Triton's shift, AND/OR and 16-bit bitcast (a PTX block turning two
  words into eight packed pairs, ``use_asm``, is written but does not compile yet). The
  dot sums (OFF + q) x in float32; per unit and row, s * (that - (OFF + z) * sum x) is added.
  8-bit codes go through float32 (2^23 + q - 2^23, exact) to the activations' dtype.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_prologue, tl
from kernels.wna16_layout import finish_tile, launch_product, product_tile, unit_columns


def supports(in_features: int, group_size: int, bits: int) -> bool:
    """Whether every unit of words lies inside one group (the factored kernels' condition)."""
    return group_size == in_features or group_size % unit_columns(bits) == 0


@jit
def _fma_unit(words, scale, zero, x_base, u, row_ok, K, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """One unit's (BLOCK_M, BLOCK_N, 16) float32 sums, scale applied (the FMA kernel's body)."""
    PER_WORD: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PER_WORD // 2
    UNIT: tl.constexpr = PER_WORD * 16
    MASK: tl.constexpr = (1 << BITS) - 1
    r = tl.arange(0, 16)[None, None, :]
    high = words >> 16
    part = tl.zeros([BLOCK_M, BLOCK_N, 16], dtype=tl.float32)
    for i in tl.static_range(HALF):
        # 2^23 + z * 2^(BITS * i), built as bits (exact)
        c = ((zero << (BITS * i)) | 0x4B000000).to(tl.float32, bitcast=True)
        for h in tl.static_range(2):
            k0 = u * UNIT + (h * HALF + i) * 16
            x = tl.load(x_base + k0, mask=row_ok[:, None, None] & (k0 + r < K), other=0.0).to(tl.float32)
            x = x * (1.0 / (1 << (BITS * i)))
            if h == 0:
                field = words & (MASK << (BITS * i))
            else:
                field = high & (MASK << (BITS * i))
            f = (field | 0x4B000000).to(tl.float32, bitcast=True) - c  # (q - z) * 2^(BITS * i)
            part += f * x
    return part * scale


@jit
def _unit_scale_zero(scale_ptr, zero_ptr, u, cols, col_ok, N, GROUP, UNIT: tl.constexpr):
    g = (u * UNIT) // GROUP
    scale = tl.load(scale_ptr + g * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + g * N + cols, mask=col_ok, other=0).to(tl.int32)
    return scale, zero


@jit(do_not_specialize=["M"])
def _factored_fma_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, GROUP, UNITS_PER_SPLIT, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = 0,
):
    """PREFETCH 1: the next unit's words, scales and zeros are loaded (into registers) before this
    unit is multiplied, so every program keeps a load in flight while it computes (without it the
    programs, all resident at once, alternate load and compute in step). LOOP_STAGES > 0: Triton's
    pipeliner on the unit loop instead (tl.range num_stages)."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    tile, cols, rows, col_ok, row_ok, u_begin, u_end, w_base, x_base, acc = product_tile(
        x_ptr, w_ptr, M, N, K, UNITS_PER_SPLIT, stride_xm, UNIT, True, BLOCK_N, BLOCK_M)
    pdl_prologue(PDL)
    if PREFETCH:
        ok = col_ok & (cols * 0 + u_begin < u_end)  # (a tensor, as the interpreter wants)
        words = tl.load(w_base + u_begin * (64 * 16), mask=ok[None, :, None], other=0)
        scale, zero = _unit_scale_zero(scale_ptr, zero_ptr, u_begin, cols, ok, N, GROUP, UNIT)
        for u in range(u_begin, u_end):
            ok = col_ok & (cols * 0 + u + 1 < u_end)
            words_next = tl.load(w_base + (u + 1) * (64 * 16), mask=ok[None, :, None], other=0)
            scale_next, zero_next = _unit_scale_zero(scale_ptr, zero_ptr, u + 1, cols, ok, N, GROUP, UNIT)
            acc += _fma_unit(words, scale[None, :, None], zero[None, :, None], x_base, u, row_ok, K, BITS, BLOCK_M,
                             BLOCK_N)
            words, scale, zero = words_next, scale_next, zero_next
    elif LOOP_STAGES > 0:
        for u in tl.range(u_begin, u_end, num_stages=LOOP_STAGES):
            words = tl.load(w_base + u * (64 * 16), mask=col_ok[None, :, None], other=0)
            scale, zero = _unit_scale_zero(scale_ptr, zero_ptr, u, cols, col_ok, N, GROUP, UNIT)
            acc += _fma_unit(words, scale[None, :, None], zero[None, :, None], x_base, u, row_ok, K, BITS, BLOCK_M,
                             BLOCK_N)
    else:
        for u in range(u_begin, u_end):
            words = tl.load(w_base + u * (64 * 16), mask=col_ok[None, :, None], other=0)
            scale, zero = _unit_scale_zero(scale_ptr, zero_ptr, u, cols, col_ok, N, GROUP, UNIT)
            acc += _fma_unit(words, scale[None, :, None], zero[None, :, None], x_base, u, row_ok, K, BITS, BLOCK_M,
                             BLOCK_N)
    finish_tile(tl.sum(acc, axis=2), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N,
                stride_om, tile, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


def _pairs_asm(magic2: str) -> str:
    """Two words ($8, $9) -> eight packed pairs $0..$7: field j of both words OR-ed into the mantissa
    of the 16-bit float whose two copies make ``magic2``. PRMT gathers the words' low (high) halves
    into one register; fields 0..3 (4..7) are then a shift and a LOP3 ((a & 0x000F000F) | magic2) each."""
    lines = ["{", ".reg .b32 lo, hi, t;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for j in range(8):
        src = "lo" if j < 4 else "hi"
        if j % 4:
            lines.append(f"shr.u32 t, {src}, {4 * (j % 4)};")
            src = "t"
        lines.append(f"lop3.b32 ${j}, {src}, 0x000f000f, {magic2}, 0xea;")
    return "\n".join(lines + ["}"])


if tl is not None:  # (Triton reads module globals that are constexprs)
    _PAIRS_ASM_BF16 = tl.constexpr(_pairs_asm("0x43004300"))
    _PAIRS_ASM_F16 = tl.constexpr(_pairs_asm("0x64006400"))


@jit
def _int4_pairs_asm(words, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """Eight tensors like ``words`` in ``dtype``: field j of each word OR-ed into the mantissa of the
    16-bit MAGIC (OFF + q); two words an asm block (``_pairs_asm``)."""
    if MAGIC == 0x4300:
        return tl.inline_asm_elementwise(_PAIRS_ASM_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                         dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype),
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_PAIRS_ASM_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                         dtype=(dtype, dtype, dtype, dtype, dtype, dtype, dtype, dtype),
                                         is_pure=True, pack=2)


@jit
def _dot_unit(words, scale, zero, x_base, u, row_ok, K, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, MAGIC: tl.constexpr, USE_ASM: tl.constexpr):
    """One unit's (BLOCK_N, BLOCK_M) float32 sums, scale and zero applied (the dot kernel's body)."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    OFF: tl.constexpr = 0.0 if MAGIC == 0 else 128.0 if MAGIC == 0x4300 else 1024.0
    dtype = x_base.dtype.element_ty
    r = tl.arange(0, 16)
    part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MAGIC != 0 and USE_ASM:
        qs = _int4_pairs_asm(words, MAGIC, dtype)
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            x = tl.load(x_base + k0, mask=row_ok[:, None] & (k0 + r < K)[None, :], other=0.0)
            x_sum += tl.sum(x.to(tl.float32), axis=1)
            part = tl.dot(qs[j], tl.trans(x), part)
    else:
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            x = tl.load(x_base + k0, mask=row_ok[:, None] & (k0 + r < K)[None, :], other=0.0)
            field = (words >> (BITS * j)) & ((1 << BITS) - 1)
            if MAGIC != 0:
                q = (field | MAGIC).to(tl.int16).to(dtype, bitcast=True)  # OFF + q, exactly
            else:
                q = ((field | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(dtype)
            x_sum += tl.sum(x.to(tl.float32), axis=1)
            part = tl.dot(q, tl.trans(x), part)
    return scale[:, None] * (part - (zero.to(tl.float32) + OFF)[:, None] * x_sum[None, :])


@jit(do_not_specialize=["M"])
def _factored_dot_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, GROUP, UNITS_PER_SPLIT, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, MAGIC: tl.constexpr, USE_ASM: tl.constexpr,
    PREFETCH: tl.constexpr = 0,
):
    """MAGIC: 0x4300 (bfloat16 x) or 0x6400 (float16), 0 for the float32 path (8 bits, float32 x).
    PREFETCH: as in _factored_fma_kernel."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    tile, cols, rows, col_ok, row_ok, u_begin, u_end, w_base, x_base, acc = product_tile(
        x_ptr, w_ptr, M, N, K, UNITS_PER_SPLIT, stride_xm, UNIT, False, BLOCK_N, BLOCK_M)
    pdl_prologue(PDL)
    if PREFETCH:
        ok = col_ok & (cols * 0 + u_begin < u_end)  # (a tensor, as the interpreter wants)
        words = tl.load(w_base + u_begin * (64 * 16), mask=ok[:, None], other=0)
        scale, zero = _unit_scale_zero(scale_ptr, zero_ptr, u_begin, cols, ok, N, GROUP, UNIT)
        for u in range(u_begin, u_end):
            ok = col_ok & (cols * 0 + u + 1 < u_end)
            words_next = tl.load(w_base + (u + 1) * (64 * 16), mask=ok[:, None], other=0)
            scale_next, zero_next = _unit_scale_zero(scale_ptr, zero_ptr, u + 1, cols, ok, N, GROUP, UNIT)
            acc += _dot_unit(words, scale, zero, x_base, u, row_ok, K, BITS, BLOCK_M, BLOCK_N, MAGIC, USE_ASM)
            words, scale, zero = words_next, scale_next, zero_next
    else:
        for u in range(u_begin, u_end):
            words = tl.load(w_base + u * (64 * 16), mask=col_ok[:, None], other=0)
            scale, zero = _unit_scale_zero(scale_ptr, zero_ptr, u, cols, col_ok, N, GROUP, UNIT)
            acc += _dot_unit(words, scale, zero, x_base, u, row_ok, K, BITS, BLOCK_M, BLOCK_N, MAGIC, USE_ASM)
    finish_tile(tl.trans(acc), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om,
                tile, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


def factored_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, bits: int, group_size: int,
                    bias: torch.Tensor | None = None, *, block_n: int = 64, block_m: int = 1, num_warps: int = 4,
                    num_stages: int = 4, split_k: int = 1, dot: bool = False, use_asm: bool = False,
                    prefetch: int = 0, loop_stages: int = 0) -> torch.Tensor:
    """kernels/wna16.wna16_matmul's product by the factored kernels (``dot``: the tensor-core one;
    ``use_asm``: its PTX dequantization of 4-bit codes, CUDA only, off: the call does not compile yet
    under Triton 3.6 (H200, 2026-11-26; to debug: the pack=2 tuple of eight outputs))."""
    assert supports(x.shape[1], group_size, bits)
    tiling = dict(block_n=block_n, block_m=block_m, num_warps=num_warps, num_stages=num_stages, split_k=split_k)
    if dot:
        magic = {torch.bfloat16: 0x4300, torch.float16: 0x6400}.get(x.dtype, 0) if bits == 4 else 0
        return launch_product(_factored_dot_kernel, x, layout, n, bits, group_size, bias, **tiling, MAGIC=magic,
                              USE_ASM=use_asm and x.is_cuda, PREFETCH=prefetch)
    return launch_product(_factored_fma_kernel, x, layout, n, bits, group_size, bias, **tiling, PREFETCH=prefetch,
                          LOOP_STAGES=loop_stages)
