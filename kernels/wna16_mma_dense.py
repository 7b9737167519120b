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


if tl is not None:  # Triton reads module globals that are constexprs
    # PTX: the nibble of word $1 at bit $2 into the mantissa of 2^23 ($0): a shift and one LOP3 ((t & 0xF) | magic)
    _NIBBLE_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, $2; lop3.b32 $0, t, 0xf, 0x4b000000, 0xea; }")


@jit
def _magic_nibble(words, p: tl.constexpr, ASM: tl.constexpr):
    """Nibble p of each uint32 word as float32 2^23 + q (q in the mantissa: exact). ASM: one shift + one LOP3
    by inline PTX (ptxas makes the plain ops a shift, an SGXT and a LOP3); not under Triton's interpreter."""
    if ASM:
        shift = tl.full(words.shape, 4 * p, tl.uint32)  # a constant: ptxas folds it into the shift
        bits = tl.inline_asm_elementwise(_NIBBLE_ASM, "=r,r,r", [words, shift], dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)
    return (((words >> (4 * p)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


@jit
def mma_weight_tile(w_ptr, meta_ptr, t, b, N_PAD, GROUP, BLOCKS, TT: tl.constexpr, KB: tl.constexpr,
                    DTYPE: tl.constexpr, ROUND_BY_HAND: tl.constexpr, JOINED: tl.constexpr = False,
                    ASM: tl.constexpr = False):
    """Row tiles ``t`` (TT,) x k blocks ``b`` (KB,) of wna16_mma's layout (all inside the padded words)
    -> their dequantized weight (TT * 16, KB * 64) in ``DTYPE``, rows 16 t.. and columns 64 b.. in order.
    A (tile, block)'s 128 words are contiguous, read as (TT, KB, 128) int32, 16 bytes a thread (the
    words' order: lane 4g + c, slice j -> g, c, j). Each word's 8 nibbles h + 2f + 4e are codes of rows
    16t + g + 8h, columns 64b + 16j + 8f + 2c + e, so the codes are computed in the words' order (t, b,
    g, c, j, e, f, h) and permuted to the weight's (t, h, g, b, j, f, c, e) = (row, column) order (Triton
    moves them between threads through shared memory once). Per code: a LOP3 (q in the float32 mantissa
    of 2^23: exact), a FADD ((2^23 + q) - (2^23 + z) = q - z exactly), a FMUL by the float16 scale (exact
    in float32), one rounding to DTYPE (ROUND_BY_HAND: round-to-nearest-even bfloat16 by integer ops, for
    Triton's interpreter, which truncates float32 -> bfloat16 where the GPU rounds). JOINED: the nibbles
    made by tl.join, so each thread holds all 8 of its words' codes (no STS in the GEMM's weight-first
    dot on sm_90, 140 registers; the dequantize kernel keeps the broadcast: 20 STS against 48); with ASM
    (CUDA only) each code by inline PTX (``_magic_nibble``)."""
    word = (t.to(tl.int64)[:, None, None] * BLOCKS + b[None, :, None]) * 128 + tl.arange(0, 128)[None, None, :]
    g = tl.arange(0, 8)
    h = tl.arange(0, 2)
    n_code = t[:, None, None, None] * 16 + g[None, None, :, None] + 8 * h[None, None, None, :]  # (TT, 1, 8, 2)
    grp = (b * 64) // GROUP  # GROUP == K per channel: 0
    meta_index = grp[None, :, None, None] * N_PAD + n_code  # (TT, KB, 8, 2): t, b, g, h
    words = tl.reshape(tl.load(w_ptr + word), (TT, KB, 8, 4, 4))  # t, b, g, c, j
    meta = tl.load(meta_ptr + meta_index)
    scale = (meta >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    zero = ((meta & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + z
    scale = tl.reshape(scale, (TT, KB, 8, 1, 1, 1, 1, 2))  # t, b, g, (c, j, e, f), h
    zero = tl.reshape(zero, (TT, KB, 8, 1, 1, 1, 1, 2))
    if JOINED:  # the 8 nibbles as register dims (e, f, h), joined innermost first: nibble h + 2f + 4e at [e, f, h]
        words = words.to(tl.uint32, bitcast=True)  # logical shifts
        f0h0 = tl.join(_magic_nibble(words, 0, ASM), _magic_nibble(words, 4, ASM))
        f1h0 = tl.join(_magic_nibble(words, 2, ASM), _magic_nibble(words, 6, ASM))
        f0h1 = tl.join(_magic_nibble(words, 1, ASM), _magic_nibble(words, 5, ASM))
        f1h1 = tl.join(_magic_nibble(words, 3, ASM), _magic_nibble(words, 7, ASM))
        q = tl.join(tl.join(f0h0, f1h0), tl.join(f0h1, f1h1))  # 2^23 + q
    else:  # broadcast against the 8 shifts (Triton lays the new dims out as it likes)
        nibble = tl.reshape(4 * tl.arange(0, 8), (2, 2, 2))  # e, f, h: shift 4 (h + 2f + 4e)
        codes = (words[:, :, :, :, :, None, None, None] >> nibble[None, None, None, None, None, :, :, :]) & 0xF
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q
    w = (q - zero) * scale  # t, b, g, c, j, e, f, h
    if ROUND_BY_HAND:
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w = w.to(DTYPE)
    return tl.reshape(tl.permute(w, (0, 7, 2, 1, 4, 6, 3, 5)), (TT * 16, KB * 64))  # (t h g), (b j f c e)


@jit
def _dequantize_mma_kernel(w_ptr, meta_ptr, out_ptr, N, K, N_PAD, GROUP, BLOCKS,
                           TT: tl.constexpr, KB: tl.constexpr, ROUND_BY_HAND: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): out rows [16 TT i, +16 TT) x columns [64 KB j, +64 KB), i.e. TT row tiles x KB k
    blocks of wna16_mma's layout (``mma_weight_tile``), stored contiguous along K."""
    t = tl.program_id(0) * TT + tl.arange(0, TT)  # row tiles (all < N_PAD / 16: the words are padded)
    b = tl.program_id(1) * KB + tl.arange(0, KB)  # k blocks (K is whole blocks)
    pdl_prologue(PDL)
    w = mma_weight_tile(w_ptr, meta_ptr, t, b, N_PAD, GROUP, BLOCKS, TT, KB, out_ptr.dtype.element_ty, ROUND_BY_HAND)
    n = tl.program_id(0) * (TT * 16) + tl.arange(0, TT * 16)
    col = tl.program_id(1) * (KB * 64) + tl.arange(0, KB * 64)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + col[None, :], w, mask=(n < N)[:, None])


def dequantize_tiling(n: int, k: int) -> tuple[int, int]:
    """(row tiles, k blocks) a program: 64 x 256 (16 KB of words in, 32 KB of bf16 out a program of 4 warps:
    8 words, 4 x 16-byte loads in flight a thread) where K allows, else 64 x 128."""
    return 4, 4 if k % (4 * wna16_mma.KB_COLUMNS) == 0 else 2


def dequantize_mma(layout: dict[str, torch.Tensor], n: int, k: int, group_size: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None, tiling: tuple[int, int] | None = None) -> torch.Tensor:
    """The Triton kernel: the (N, K) weight in ``dtype`` from ``layout``, written into ``out`` (an (N, K)
    contiguous tensor, e.g. a DenseScratch view) or a new tensor; ``tiling`` (row tiles, k blocks) a
    program (default ``dequantize_tiling``). Runs wherever Triton runs (CUDA, or CPU tensors under
    TRITON_INTERPRET=1)."""
    assert k % COLUMNS_PER_PROGRAM == 0
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=layout["words"].device)
    assert out.shape == (n, k) and out.is_contiguous() and out.dtype == dtype
    tiles, kb = tiling or dequantize_tiling(n, k)
    assert k % (kb * wna16_mma.KB_COLUMNS) == 0 and wna16_mma.PAD_ROWS % (16 * tiles) == 0
    n_pad = layout["meta"].shape[1]
    blocks = layout["words"].numel() // (n_pad // 16) // 128
    grid = (triton.cdiv(n, 16 * tiles), k // (kb * wna16_mma.KB_COLUMNS))
    _dequantize_mma_kernel[grid](layout["words"], layout["meta"], out, n, k, n_pad, group_size, blocks,
                                 TT=tiles, KB=kb, ROUND_BY_HAND=dtype == torch.bfloat16 and not out.is_cuda,
                                 num_warps=4, **pdl_options(out))
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
