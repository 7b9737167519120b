"""Batches past the operand-order decode kernel (kernels/wna16_mma.py, 1-16 rows) that the rows kernel
(kernels/wna16_mma_rows.py) does not take (past 256 rows, or where the load-time timing found this
faster): the weight is dequantized from the SAME operand-order words into a reusable bf16/fp16
scratch weight, then cuBLAS multiplies it. So an INT4 layer holds its codes once (the mma-order words), not a second
time in kernels/wna16_layout.py's layout for 17+ rows.

Dequantized value (as kernels/wna16.dequantize with the float16 scale the layout holds):
    w[n, k] = ((q[n, k] - z[n, g]) * s[n, g]) computed in float32 (exact difference, one rounding),
    then rounded once to the activations' dtype; g = k // G (0 per channel).
``dequantize_mma_ref`` (plain torch, from ``wna16_mma.mma_layout_weight``, which decodes the words
by the PTX fragment table) and the Triton kernel give bit-identical weights.

Scratch (``DenseScratch``): one flat buffer per (device, dtype), sized at load (``reserve``, from
kernels/wna16.prepare_wna16) for the largest layer; every product of a layer past 16 rows writes its
(N, K) weight into the buffer's first N * K elements and multiplies from there. The buffer is
allocated at load, never per call, so its address is static and CUDA graphs captured over it
replay correctly. Invariant: the products that share a buffer run in one stream's order (each
dequantize is consumed by its matmul before the next layer's dequantize), as an engine's forward
does. A reserve that grows an already used buffer allocates a larger one and keeps the old one
alive (graphs captured earlier still point at it); before first use it is simply replaced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import wna16_mma
from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton

ROWS_PER_PROGRAM = 64
COLUMNS_PER_PROGRAM = 128  # whole 128-column chunks: wna16_mma.supports() makes K a multiple


class DenseScratch:
    """A flat buffer of ``dtype`` on ``device`` for dequantized weights, grown at load only."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.buffer: torch.Tensor | None = None
        self.used = False
        self.retired: list[torch.Tensor] = []  # used buffers replaced by larger ones (captured graphs hold them)

    def reserve(self, elements: int) -> None:
        """Make the buffer hold at least ``elements`` (at load, before any capture)."""
        if self.buffer is not None and self.buffer.numel() >= elements:
            return
        if self.buffer is not None and self.used:
            self.retired.append(self.buffer)
        self.buffer = None  # free the smaller one first
        self.buffer = torch.empty(elements, dtype=self.dtype, device=self.device)
        self.used = False

    def weight(self, n: int, k: int) -> torch.Tensor:
        """The buffer's first n * k elements as an (n, k) weight."""
        if self.buffer is None or self.buffer.numel() < n * k:
            raise RuntimeError(f"dense scratch of {0 if self.buffer is None else self.buffer.numel()} elements "
                               f"cannot hold a ({n}, {k}) weight; reserve() it at load")
        self.used = True
        return self.buffer[:n * k].view(n, k)


_SCRATCH: dict[tuple[str, torch.dtype], DenseScratch] = {}


def dense_scratch(device: torch.device, dtype: torch.dtype) -> DenseScratch:
    """The scratch shared by the layers of ``device`` and ``dtype`` (one buffer, the largest layer's)."""
    key = (str(torch.device(device)), dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = DenseScratch(torch.device(device), dtype)
    return _SCRATCH[key]


def dequantize_mma_ref(layout: dict[str, torch.Tensor], n: int, k: int, group_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Plain torch: the (N, K) weight in ``dtype`` from the operand-order ``layout`` ({"words", "meta"})."""
    return wna16_mma.mma_layout_weight(layout, n, k, group_size).to(dtype)


@jit
def _dequantize_mma_kernel(w_ptr, meta_ptr, out_ptr, N, K, N_PAD, GROUP, BLOCKS,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): out[i * BLOCK_R .., j * BLOCK_C ..]. Element (n, col) reads nibble h + 2f + 4e of
    word [n // 16][col // 64][lane 4g + c][slice j] (wna16_mma's layout: row n = 16t + g + 8h, column
    64b + 16j + 8f + 2c + e). A 16 x 64 tile reads exactly its 512 bytes of words (rows g and g + 8
    share them); the stores are contiguous along K."""
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = n < N
    tile, rr = n // 16, n % 16
    g, h = rr % 8, rr // 8
    b, cc = col // 64, col % 64
    j, f, c, e = cc // 16, (cc // 8) % 2, (cc // 2) % 4, cc % 2
    word_index = ((tile.to(tl.int64)[:, None] * BLOCKS + b[None, :]) * 32 + (4 * g)[:, None] + c[None, :]) * 4 \
        + j[None, :]
    shift = 4 * (h[:, None] + 2 * f[None, :] + 4 * e[None, :])
    pdl_prologue(PDL)
    words = tl.load(w_ptr + word_index, mask=row_ok[:, None], other=0)
    q = ((words >> shift) & 0xF).to(tl.float32)
    grp = col // GROUP
    meta = tl.load(meta_ptr + grp[None, :] * N_PAD + n[:, None], mask=row_ok[:, None], other=0)
    scale = (meta >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = (meta & 0xFF).to(tl.float32)
    w = (q - zero) * scale
    if BF16:  # round to nearest even by hand: Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds)
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w = w.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + col[None, :], w, mask=row_ok[:, None] & (col < K)[None, :])


def dequantize_mma(layout: dict[str, torch.Tensor], n: int, k: int, group_size: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel: the (N, K) weight in ``dtype`` from ``layout``, written into ``out`` (an (N, K)
    contiguous tensor, e.g. a DenseScratch view) or a new tensor. Runs wherever Triton runs (CUDA, or
    CPU tensors under TRITON_INTERPRET=1)."""
    assert k % COLUMNS_PER_PROGRAM == 0
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=layout["words"].device)
    assert out.shape == (n, k) and out.is_contiguous() and out.dtype == dtype
    n_pad = layout["meta"].shape[1]
    blocks = layout["words"].numel() // (n_pad // 16) // 128
    grid = (triton.cdiv(n, ROWS_PER_PROGRAM), k // COLUMNS_PER_PROGRAM)
    _dequantize_mma_kernel[grid](layout["words"], layout["meta"], out, n, k, n_pad, group_size, blocks,
                                 BLOCK_R=ROWS_PER_PROGRAM, BLOCK_C=COLUMNS_PER_PROGRAM, BF16=dtype == torch.bfloat16,
                                 num_warps=4,
                                 **pdl_options(out))
    return out


def mma_dense_linear(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, group_size: int,
                     scratch: DenseScratch | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ the weight in ``layout``.T (+ bias), M past 16: dequantized into ``scratch`` (CUDA with
    Triton; a temporary for another dtype) then cuBLAS; elsewhere the reference's weight (a temporary:
    CPU paths keep no scratch)."""
    k = x.shape[1]
    if use_triton(x):  # the scratch where it matches x's dtype (the layer's), else a temporary
        out = scratch.weight(n, k) if scratch is not None and scratch.dtype == x.dtype else None
        dense = dequantize_mma(layout, n, k, group_size, x.dtype, out=out)
    else:
        dense = dequantize_mma_ref(layout, n, k, group_size, x.dtype)
    return F.linear(x, dense, bias)
