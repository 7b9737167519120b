"""Triton kernels of the weight-only integer linear layers (kernels/wna16.py): the layout the weight
takes at load, one product kernel for every row count (decode and prefill), and a dequantizing
kernel for the largest batches (cuBLAS then multiplies the bf16/fp16 weight).

Kernel layout (``pack_kernel_layout``), for ``bits`` in (4, 8), P = 32 // bits codes an int32 word:
- K is cut into units of U = P * UNIT_WORDS columns (128 for 4 bits, 64 for 8; K padded with zero
  codes to a whole unit). Word r of unit u of row n holds in its bits [bits * j, bits * (j + 1))
  the code of column k = u * U + j * UNIT_WORDS + r. So shifting a (rows, UNIT_WORDS) tile of
  words by bits * j and masking gives the codes of UNIT_WORDS contiguous columns: each of the P
  slices of a unit meets a contiguous piece of x, and nothing is interleaved in registers.
- Rows in blocks of BLOCK_ROWS (N padded to a whole block): block b holds, unit after unit, the
  (BLOCK_ROWS, UNIT_WORDS) words of its rows. One program's tile of a unit is one contiguous
  4 KiB read (Marlin's point: wide, contiguous loads of the weight).
- ``scale`` (K // G, N) float16 by default (the checkpoints' own precision, against float32 in
  the stored format) and ``zero`` (K // G, N) uint8: transposed, so a slice's BLOCK_N scales are
  one contiguous load. The groups must be whole slices (G % UNIT_WORDS == 0, or G == K).

Dequantizing in registers: a code c becomes float32 2^23 + c by OR-ing it into the mantissa of
2^23 (no integer-to-float conversion, which runs at a quarter of the rate of an FMA on Hopper),
then (f - (2^23 + zero)) * scale: the subtraction is exact, so a weight is (c - zero) * scale
rounded once, as ``dequantize`` computes it, then rounded to the activations' dtype for the dot.

The product kernel computes out.T tiles: weight tile (BLOCK_N, UNIT_WORDS) per slice as the
first operand of a tensor-core dot (registers), x.T (UNIT_WORDS, BLOCK_M) the second. Decode
sizes use BLOCK_M = 16 (rows padded; the padding costs no bandwidth) and split K over SPLIT_K
programs where N alone gives too few programs (partial sums in float32, added in split order by
the tile's last program to arrive, as kernels/linear.py's skinny kernel does).
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import _arrival_counters

UNIT_WORDS = 16  # words of a row per unit, and the K of one slice's dot
BLOCK_ROWS = 64  # rows whose words of one unit lie together
_PACK_ROWS = 4096  # rows packed at a time at load (bounds the int64 scratch)


def unit_columns(bits: int) -> int:
    """U: the columns of x one unit of words covers."""
    return 32 // bits * UNIT_WORDS


def supports(in_features: int, group_size: int) -> bool:
    """Whether the kernels take this grouping: each slice of UNIT_WORDS columns in one group."""
    return group_size == in_features or group_size % UNIT_WORDS == 0


def pack_kernel_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                       scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """codes (N, K) uint8, scale/zero (N, K // G) -> the kernel layout (module docstring)."""
    n, k = codes.shape
    per_word, unit = 32 // bits, unit_columns(bits)
    units, n_pad = triton.cdiv(k, unit), triton.cdiv(n, BLOCK_ROWS) * BLOCK_ROWS
    padded = torch.zeros(n_pad, units * unit, dtype=torch.uint8, device=codes.device)
    padded[:n, :k] = codes
    shifts = (torch.arange(per_word, device=codes.device) * bits).view(1, 1, per_word, 1)
    words = torch.empty(n_pad, units * UNIT_WORDS, dtype=torch.int32, device=codes.device)
    for start in range(0, n_pad, _PACK_ROWS):
        chunk = padded[start:start + _PACK_ROWS].view(-1, units, per_word, UNIT_WORDS).long()
        packed = (chunk << shifts).sum(dim=2)  # (rows, units, UNIT_WORDS) in [0, 2^32)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
        words[start:start + _PACK_ROWS] = packed.view(-1, units * UNIT_WORDS).to(torch.int32)
    words = words.view(n_pad // BLOCK_ROWS, BLOCK_ROWS, units, UNIT_WORDS).transpose(1, 2).contiguous()
    return {"words": words.view(-1), "scale": scale.t().to(scale_dtype).contiguous(),
            "zero": zero.t().to(torch.uint8).contiguous()}


@jit
def _unit_tile_pointers(w_ptr, cols, K, UNIT: tl.constexpr):
    """Pointers to unit 0's words of rows ``cols`` (BLOCK_N, UNIT_WORDS); unit u is u * BLOCK_ROWS * UNIT_WORDS on.
    (The kernels spell UNIT_WORDS as 16 and BLOCK_ROWS as 64: Triton reads no plain globals.)"""
    words_per_row = tl.cdiv(K, UNIT) * 16
    r = tl.arange(0, 16)
    row_start = (cols // 64).to(tl.int64) * (64 * words_per_row) + (cols % 64) * 16
    return w_ptr + row_start[:, None] + r[None, :]


@jit
def _program_tile(M, N, K, UNITS_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, UNIT: tl.constexpr):
    """What one program of the decode/GEMM kernels covers: (tile, output columns, rows, their masks,
    and its units [u_begin, u_end) of K (program_id(1) of the split)). Programs along axis 0 go row
    tile first, so the programs that read one weight tile run together."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    cols = (tile // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    u_begin = tl.program_id(1) * UNITS_PER_SPLIT
    u_end = tl.minimum(u_begin + UNITS_PER_SPLIT, tl.cdiv(K, UNIT))
    return tile, cols, rows, cols < N, rows < M, u_begin, u_end


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
    as _program_tile assigns them."""
    PER_WORD: tl.constexpr = 32 // BITS
    UNIT: tl.constexpr = PER_WORD * 16
    tile, cols, rows, col_ok, row_ok, u_begin, u_end = _program_tile(M, N, K, UNITS_PER_SPLIT, BLOCK_N, BLOCK_M,
                                                                       UNIT)
    r = tl.arange(0, 16)
    w_base = _unit_tile_pointers(w_ptr, cols, K, UNIT)
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + r[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    pdl_prologue(PDL)
    for u in range(u_begin, u_end):
        words = tl.load(w_base + u * (64 * 16), mask=col_ok[:, None], other=0)
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            w = _dequantized_slice(words, scale_ptr, zero_ptr, cols[:, None], col_ok[:, None], k0, N, K, GROUP, j, BITS,
                                   x_ptr.dtype.element_ty)
            x = tl.load(x_base + k0, mask=row_ok[:, None] & (k0 + r < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
    _finish(tl.trans(acc), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om, tile,
            HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


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
    tile, cols, rows, col_ok, row_ok, u_begin, u_end = _program_tile(M, N, K, UNITS_PER_SPLIT, BLOCK_N, BLOCK_M,
                                                                       UNIT)
    r = tl.arange(0, 16)[None, None, :]
    w_base = _unit_tile_pointers(w_ptr, cols, K, UNIT)[None, :, :]  # (1, BLOCK_N, 16)
    x_base = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm + r  # (BLOCK_M, 1, 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N, 16], dtype=tl.float32)
    pdl_prologue(PDL)
    for u in range(u_begin, u_end):
        words = tl.load(w_base + u * (64 * 16), mask=col_ok[None, :, None], other=0)
        for j in tl.static_range(PER_WORD):
            k0 = u * UNIT + j * 16
            w = _dequantized_slice(words, scale_ptr, zero_ptr, cols[None, :, None], col_ok[None, :, None], k0, N, K,
                                   GROUP, j, BITS, tl.float32)
            x = tl.load(x_base + k0, mask=row_ok[:, None, None] & (k0 + r < K), other=0.0).to(tl.float32)
            acc += x * w
    _finish(tl.sum(acc, axis=2), rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N,
            stride_om, tile, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@jit
def _finish(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om, tile,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N): this program's sums. SPLIT_K > 1: stored to part (SPLIT_K, M, N); the
    tile's last program to arrive adds the SPLIT_K sums in split order (so the result does not depend
    on which finished last) and stores the output, then sets the tile's counter back to 0."""
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tl.store(part_ptr + (tl.program_id(1) * M + rows)[:, None] * N + cols[None, :], acc, mask=mask)
        # Every thread's sums are stored before the count goes up; the last arrival's acquire makes
        # the other programs' sums visible to it (kernels/linear.py's scheme).
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # unrolled: every load issued at once
                acc += tl.load(part_ptr + (split * M + rows)[:, None] * N + cols[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            _store_output(acc, rows, cols, col_ok, mask, bias_ptr, out_ptr, stride_om, HAS_BIAS)
            tl.store(arrivals_ptr + tile, 0)
    else:
        _store_output(acc, rows, cols, col_ok, mask, bias_ptr, out_ptr, stride_om, HAS_BIAS)


@jit
def _store_output(acc, rows, cols, col_ok, mask, bias_ptr, out_ptr, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def wna16_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, bits: int, group_size: int,
                 bias: torch.Tensor | None = None, *, block_n: int = 64, block_m: int = 16, num_warps: int = 4,
                 num_stages: int = 4, split_k: int = 1, fma: bool = False, kind: int | None = None) -> torch.Tensor:
    """x (M, K) with unit column stride @ the weight (N, K) in ``layout``.T (+ bias) -> (M, N) in x's dtype.
    ``kind``: 0 the tensor-core kernel, 1 the FMA kernel (a few rows), 2 / 3 the factored FMA /
    tensor-core kernels of kernels/wna16_decode.py where the grouping allows (else 1 / 0), 4 / 5
    the same with the next unit's words loaded before this one is multiplied (``prefetch``);
    ``fma``: kind 1 (when ``kind`` is not given)."""
    if kind is None:
        kind = 1 if fma else 0
    if kind >= 2:
        from kernels import wna16_decode

        dot = kind in (3, 5)
        if wna16_decode.supports(x.shape[1], group_size, bits):
            return wna16_decode.factored_matmul(x, layout, n, bits, group_size, bias, block_n=block_n, block_m=block_m,
                                                num_warps=num_warps, num_stages=num_stages, split_k=split_k,
                                                dot=dot, prefetch=int(kind >= 4))
        kind = 0 if dot else 1
    fma = kind == 1
    m, k = x.shape
    assert x.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    units = triton.cdiv(k, unit_columns(bits))
    split_k = max(1, min(split_k, units))
    units_per_split = triton.cdiv(units, split_k)
    split_k = triton.cdiv(units, units_per_split)  # no program without work
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    arrivals = _arrival_counters(x.device, tiles) if split_k > 1 else out
    kernel = _wna16_fma_kernel if fma else _wna16_kernel
    kernel[(tiles, split_k)](
        x, layout["words"], layout["scale"], layout["zero"], bias if bias is not None else out, out, part, arrivals,
        m, n, k, group_size, units_per_split, x.stride(0), out.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x))
    return out


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
    words = tl.load(_unit_tile_pointers(w_ptr, cols, K, UNIT) + u * (64 * 16), mask=col_ok[:, None], other=0)
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
