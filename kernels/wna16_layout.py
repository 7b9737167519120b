"""The packed layout of the weight-only integer linear layers' kernels, and what every product
kernel over it shares (kernels/wna16_gemm.py's per-weight kernels, kernels/wna16_decode.py's
factored ones; kernels/wna16.py chooses between them): which tile and K units a program covers,
how its float32 sums become the output (split-K included), and the host launch.

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

Every product kernel takes the same leading arguments (``launch_product``) and computes its
(BLOCK_M, BLOCK_N) tile of out over its share of K's units. Decode sizes split K over SPLIT_K
programs where N alone gives too few programs: partial sums in float32, added in split order by
the tile's last program to arrive, as kernels/linear.py's skinny kernel does (``finish_tile``).
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, tl, triton
from kernels.linear import _arrival_counters

# The jit functions below spell UNIT_WORDS as 16 and BLOCK_ROWS as 64: Triton reads no plain globals.
UNIT_WORDS = 16  # words of a row per unit, and the K of one slice's dot
BLOCK_ROWS = 64  # rows whose words of one unit lie together
_PACK_ROWS = 4096  # rows packed at a time at load (bounds the int64 scratch)


def unit_columns(bits: int) -> int:
    """U: the columns of x one unit of words covers."""
    return 32 // bits * UNIT_WORDS


def supports(in_features: int, group_size: int) -> bool:
    """Whether the layout takes this grouping: each slice of UNIT_WORDS columns in one group."""
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
def unit_tile_pointers(w_ptr, cols, K, UNIT: tl.constexpr):
    """Pointers to unit 0's words of rows ``cols`` (BLOCK_N, UNIT_WORDS); unit u is u * BLOCK_ROWS * UNIT_WORDS on."""
    words_per_row = tl.cdiv(K, UNIT) * 16
    r = tl.arange(0, 16)
    row_start = (cols // 64).to(tl.int64) * (64 * words_per_row) + (cols % 64) * 16
    return w_ptr + row_start[:, None] + r[None, :]


@jit
def product_tile(x_ptr, w_ptr, M, N, K, UNITS_PER_SPLIT, stride_xm, UNIT: tl.constexpr, FMA: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """What one program of the product kernels covers, and where it starts: (tile, cols (BLOCK_N,)
    output columns, rows (BLOCK_M,), col_ok, row_ok, [u_begin, u_end) its units of K (program_id(1)
    of the split), w_base, x_base: unit 0's weight words of ``cols`` and x's first 16 columns of
    ``rows``, acc: float32 zeros). Programs along axis 0 go row tile first, so the programs that
    read one weight tile run together. Shapes: FMA (sums on the FMA units, reduced over the 16 at
    the end): w_base (1, BLOCK_N, 16), x_base (BLOCK_M, 1, 16), acc (BLOCK_M, BLOCK_N, 16); else
    (tensor-core dots of out.T): w_base (BLOCK_N, 16), x_base (BLOCK_M, 16), acc (BLOCK_N, BLOCK_M)."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    cols = (tile // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    u_begin = tl.program_id(1) * UNITS_PER_SPLIT
    u_end = tl.minimum(u_begin + UNITS_PER_SPLIT, tl.cdiv(K, UNIT))
    col_ok = cols < N
    row_ok = rows < M
    if FMA:
        r = tl.arange(0, 16)[None, None, :]
        w_base = unit_tile_pointers(w_ptr, cols, K, UNIT)[None, :, :]
        x_base = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm + r
        acc = tl.zeros([BLOCK_M, BLOCK_N, 16], dtype=tl.float32)
    else:
        r = tl.arange(0, 16)
        w_base = unit_tile_pointers(w_ptr, cols, K, UNIT)
        x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + r[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return tile, cols, rows, col_ok, row_ok, u_begin, u_end, w_base, x_base, acc


@jit
def finish_tile(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om, tile,
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


def launch_product(kernel, x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, bits: int, group_size: int,
                   bias: torch.Tensor | None, *, block_n: int, block_m: int, num_warps: int, num_stages: int,
                   split_k: int, **constexprs) -> torch.Tensor:
    """x (M, K) with unit column stride @ the weight (N, K) in ``layout``.T (+ bias) -> (M, N) in x's
    dtype, by ``kernel``: one of the product kernels, whose arguments are (x, words, scale, zero,
    bias, out, part, arrivals, M, N, K, GROUP, UNITS_PER_SPLIT, stride_xm, stride_om, BITS, HAS_BIAS,
    BLOCK_N, BLOCK_M, SPLIT_K, PDL) and then its own ``constexprs``. ``split_k`` is capped so that
    every program of the split has at least one unit of K."""
    m, k = x.shape
    assert x.stride(1) == 1
    bias, = dense(bias)  # read at bias_ptr + feature (the layout's tensors are packed at load)
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
    kernel[(tiles, split_k)](
        x, layout["words"], layout["scale"], layout["zero"], bias if bias is not None else out, out, part, arrivals,
        m, n, k, group_size, units_per_split, x.stride(0), out.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **constexprs, **pdl_options(x))
    return out
