"""Triton kernels of the weight-only integer linear layers (kernels/wna16.py) that dequantize every
weight: one product kernel for every row count (decode and prefill) on the tensor cores, one on the
FMA units for a few rows, and a dequantizing kernel for the largest batches (cuBLAS then multiplies
the bf16/fp16 weight). The weight's layout, the tiles and the split-K finish are
kernels/wna16_layout.py's, shared with the factored kernels of kernels/wna16_decode.py.

Dequantizing in registers: a code c becomes float32 2^23 + c by OR-ing it into the mantissa of
2^23 (no integer-to-float conversion, which runs at a quarter of the rate of an FMA on Hopper),
then (f - (2^23 + zero)) * scale: the subtraction is exact, so a weight is (c - zero) * scale
rounded once, as ``dequantize`` computes it, then rounded to the activations' dtype for the dot.

The product kernel computes out.T tiles: weight tile (BLOCK_N, UNIT_WORDS) per slice as the
first operand of a tensor-core dot (registers), x.T (UNIT_WORDS, BLOCK_M) the second. Decode
sizes use BLOCK_M = 16 (rows padded; the padding costs no bandwidth) and split K over SPLIT_K
programs where N alone gives too few programs (kernels/wna16_layout.finish_tile).
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.wna16_layout import finish_tile, launch_product, product_tile, unit_columns, unit_tile_pointers


@jit
def _dequantized_slice(words, scale_ptr, zero_ptr, cols, col_ok, k0, N, K, GROUP, j: tl.constexpr,
                       BITS: tl.constexpr, dtype: tl.constexpr):
    """Slice j of a word tile (.., BLOCK_N, UNIT_WORDS) as weights in ``dtype``: columns k0 .. k0 + 15.
    ``cols``/``col_ok``: the tile's output features, shaped to broadcast against it (.., BLOCK_N, 1)."""
    group_ok = col_ok & (cols * 0 + k0 < K)  # (a tensor, as the interpreter wants)
    g = k0 // GROUP
    scale = tl.load(scale_ptr + g * N + cols, mask=group_ok, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + g * N + cols, mask=group_ok, other=0).to(tl.float32) + 8388608.0
    codes = (words >> (BITS * j)) & ((1 << BITS) - 1)
    f = (codes | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + code, exactly
    return ((f - zero) * scale).to(dtype)


@jit(do_not_specialize=["M"])  # one compile for every row count
def _wna16_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, GROUP, UNITS_PER_SPLIT, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    """One program: out[rows, cols].T over its share of K's units (program_id(1) of SPLIT_K), tiles
    as product_tile assigns them."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    tile, cols, rows, col_ok, row_ok, u_begin, u_end, w_base, x_base, acc = product_tile(
        x_ptr, w_ptr, M, N, K, UNITS_PER_SPLIT, stride_xm, UNIT, False, BLOCK_N, BLOCK_M)
    r = tl.arange(0, 16)
    pdl_prologue(PDL)
    for u in range(u_begin, u_end):
        words = tl.load(w_base + u * (64 * 16), mask=col_ok[:, None], other=0)
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            w = _dequantized_slice(words, scale_ptr, zero_ptr, cols[:, None], col_ok[:, None], k0, N, K, GROUP, j, BITS,
                                   x_ptr.dtype.element_ty)
            x = tl.load(x_base + k0, mask=row_ok[:, None] & (k0 + r < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
    finish_tile(tl.trans(acc), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om,
                tile, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@jit(do_not_specialize=["M"])
def _wna16_fma_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, GROUP, UNITS_PER_SPLIT, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    """_wna16_kernel for a few rows on the FMA units instead of the tensor cores: the weights are
    dequantized to float32 in the layout they are loaded in and multiplied into (BLOCK_M, BLOCK_N,
    16) float32 sums, reduced over the 16 once at the end. No layout change of the weight tile
    (which the tensor-core operand needs), at BLOCK_M FMAs a weight."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    tile, cols, rows, col_ok, row_ok, u_begin, u_end, w_base, x_base, acc = product_tile(
        x_ptr, w_ptr, M, N, K, UNITS_PER_SPLIT, stride_xm, UNIT, True, BLOCK_N, BLOCK_M)
    r = tl.arange(0, 16)[None, None, :]
    pdl_prologue(PDL)
    for u in range(u_begin, u_end):
        words = tl.load(w_base + u * (64 * 16), mask=col_ok[None, :, None], other=0)
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            w = _dequantized_slice(words, scale_ptr, zero_ptr, cols[None, :, None], col_ok[None, :, None], k0, N, K,
                                   GROUP, j, BITS, tl.float32)
            x = tl.load(x_base + k0, mask=row_ok[:, None, None] & (k0 + r < K), other=0.0).to(tl.float32)
            acc += x * w
    finish_tile(tl.sum(acc, axis=2), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N,
                stride_om, tile, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


def dequantizing_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, bits: int, group_size: int,
                        bias: torch.Tensor | None = None, *, block_n: int = 64, block_m: int = 16, num_warps: int = 4,
                        num_stages: int = 4, split_k: int = 1, fma: bool = False) -> torch.Tensor:
    """x (M, K) with unit column stride @ the weight (N, K) in ``layout``.T (+ bias) -> (M, N) in x's
    dtype, each weight dequantized in registers: the tensor-core kernel, or with ``fma`` the FMA
    kernel (a few rows). kernels/wna16.wna16_matmul's kinds 0 and 1."""
    kernel = _wna16_fma_kernel if fma else _wna16_kernel
    return launch_product(kernel, x, layout, n, bits, group_size, bias, block_n=block_n, block_m=block_m,
                          num_warps=num_warps, num_stages=num_stages, split_k=split_k)


@jit
def _dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, GROUP, BITS: tl.constexpr,
                       BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One program: one unit of BLOCK_N rows, written as the dense (N, K) weight."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    u = tl.program_id(1)
    col_ok = cols < N
    r = tl.arange(0, 16)
    pdl_prologue(PDL)
    words = tl.load(unit_tile_pointers(w_ptr, cols, K, UNIT) + u * (64 * 16), mask=col_ok[:, None], other=0)
    for j in tl.static_range(PER_WORD):
        k0 = u * UNIT + j * 16
        w = _dequantized_slice(words, scale_ptr, zero_ptr, cols[:, None], col_ok[:, None], k0, N, K, GROUP, j, BITS,
                               out_ptr.dtype.element_ty)
        tl.store(out_ptr + cols.to(tl.int64)[:, None] * K + k0 + r[None, :], w,
                 mask=col_ok[:, None] & (k0 + r < K)[None, :])


def dequantize_layout(layout: dict[str, torch.Tensor], n: int, k: int, bits: int, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight (N, K) in ``dtype`` from its kernel layout: the same values the product kernel multiplies."""
    out = torch.empty(n, k, dtype=dtype, device=layout["words"].device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, unit_columns(bits)))
    _dequantize_kernel[grid](layout["words"], layout["scale"], layout["zero"], out, n, k, group_size,
                             BITS=bits, BLOCK_N=64, num_warps=4, **pdl_options(out))
    return out
