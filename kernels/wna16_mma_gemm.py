"""W4A16 GEMM for 17+ rows (decode at serving concurrency, 64-512 rows) from the SAME operand-order
words as the 1-16-row kernel (kernels/wna16_mma.py: int32 [N/16][K/64][32 lanes][4 slices]; meta
int32 (groups, N_pad) = fp16 scale bits << 16 | zero), with Triton's own tensor-core dots (wgmma on
Hopper) and large tiles.

Why beside kernels/wna16_mma_rows.py: that kernel issues mma.sync itself on 32 rows of x a program,
so at 256 rows every weight word is read and dequantized by 8 programs, and mma.sync runs well below
wgmma's rate on Hopper (H200, 2026-11-29: 0.39-0.51x cuBLAS bf16 at 256 rows). Dequantize + cuBLAS
writes and re-reads the whole bf16 weight every product (~4 ms of an 8B decode step). Here a program
owns a (BLOCK_M, BLOCK_N) tile of out with BLOCK_M up to 256 rows: per K step it dequantizes its
(BLOCK_N, BLOCK_K) weight tile once in registers (``wna16_mma_dense.mma_weight_tile``: the dequantize
kernel's exact arithmetic, so the product equals dequantize + matmul up to summation order) and
multiplies it with tl.dot, which Triton lowers to wgmma with x's tiles brought into shared memory by
its software pipeline (num_stages). The dequantization is paid once per BLOCK_M rows.

Two operand orders (``w_first``): out_tile = dot(x (BLOCK_M, BLOCK_K), w.T), the weight the dot's B
operand (Triton stores it to shared memory, where wgmma reads B: 64 STS.U16 a 128 x 128 step on sm_90);
or out_tile.T = dot(w, x.T), the weight the A operand, which wgmma reads from registers (no store). The
second won on every Llama-8B shape and M = 64-512 on an H200 (2026-11-30, benchmarks/results/quantization.md,
by benchmarks/quantization/wna16_gemm_sweep.py): the engine's tilings all take it.

Each step's dot waits for its weight tile's dequantization: issuing the dot before dequantizing the next tile (so
that the asynchronous wgmma might overlap it) took 15-28% more time on every shape (H200, 2026-11-30 01:24 sweep,
benchmarks/results/quantization.md) and was taken out.

Split-K (``split_k``) for the narrow layers, where N / BLOCK_N programs do not fill the GPU:
kernels/wna16_layout.finish_tile's scheme (float32 partial sums, added in split order by the tile's
last program to arrive).
"""
from __future__ import annotations

import torch

from kernels import wna16_mma
from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import _arrival_counters
from kernels.wna16_layout import finish_tile
from kernels.wna16_mma_dense import mma_weight_tile


def k_steps(in_features: int, block_k: int) -> int:
    """K steps of ``block_k`` columns (a multiple of 64 that divides K; wna16_mma.supports makes K whole 128s)."""
    if block_k % wna16_mma.KB_COLUMNS or in_features % block_k:
        raise ValueError(f"block_k {block_k} must be a multiple of {wna16_mma.KB_COLUMNS} dividing K = {in_features}")
    return in_features // block_k


def takes(in_features: int, block_n: int, block_k: int) -> bool:
    """Whether a tiling fits a layer: whole K steps, and row tiles inside the padded words."""
    return block_k % wna16_mma.KB_COLUMNS == 0 and in_features % block_k == 0 and wna16_mma.PAD_ROWS % block_n == 0


@jit
def gemm_program(M, N, BLOCKS, BLOCKS_PER_SPLIT, TT: tl.constexpr, BLOCK_M: tl.constexpr):
    """What program (tile, split) of a GEMM over the operand-order words covers (this one's and
    kernels/w4a8_gemm.py's): out rows [BLOCK_M i, +BLOCK_M) x columns [16 TT j, +16 TT) (tile = j * m_tiles + i: the
    programs of one weight tile run together), k blocks [split * BLOCKS_PER_SPLIT, +BLOCKS_PER_SPLIT). Returns
    (tile, rows, cols, row_ok, col_ok, t: the weight's 16-row tiles (inside N_PAD: BLOCK_N divides it), kb_begin,
    kb_end)."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    n_tile = tile // m_tiles
    rows = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * (TT * 16) + tl.arange(0, TT * 16)
    t = n_tile * TT + tl.arange(0, TT)
    kb_begin = tl.program_id(1) * BLOCKS_PER_SPLIT
    kb_end = tl.minimum(kb_begin + BLOCKS_PER_SPLIT, BLOCKS)
    return tile, rows, cols, rows < M, cols < N, t, kb_begin, kb_end


# Sizes unspecialized (one compile serves every layer and batch: Triton would otherwise compile again for each
# size's divisibility by 16); the strides stay specialized (16-byte row starts let x and out move in vectors).
@jit(do_not_specialize=["M", "N", "N_PAD", "GROUP", "BLOCKS", "BLOCKS_PER_SPLIT"])
def _mma_gemm_kernel(
    x_ptr, w_ptr, meta_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, N_PAD, GROUP, BLOCKS, BLOCKS_PER_SPLIT, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, TT: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
    W_FIRST: tl.constexpr, JOINED: tl.constexpr, ASM: tl.constexpr, ROUND_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile, split): out rows [BLOCK_M i, +BLOCK_M) x columns [16 TT j, +16 TT) (tile = j *
    m_tiles + i: the programs of one weight tile run together) over k blocks [split * BLOCKS_PER_SPLIT,
    +BLOCKS_PER_SPLIT) (a multiple of KB), KB blocks (KB * 64 columns) a step."""
    BLOCK_N: tl.constexpr = TT * 16
    BLOCK_K: tl.constexpr = KB * 64
    tile, rows, cols, row_ok, col_ok, t, kb_begin, kb_end = gemm_program(M, N, BLOCKS, BLOCKS_PER_SPLIT, TT, BLOCK_M)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]  # (BLOCK_M, BLOCK_K)
    if W_FIRST:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_prologue(PDL)
    for kb in range(kb_begin, kb_end, KB):
        x = tl.load(x_rows + kb * 64, mask=row_ok[:, None], other=0.0)
        w = mma_weight_tile(w_ptr, meta_ptr, t, kb + tl.arange(0, KB), N_PAD, GROUP, BLOCKS, TT, KB,
                            out_ptr.dtype.element_ty, ROUND_BY_HAND, JOINED, ASM)  # (BLOCK_N, BLOCK_K)
        if W_FIRST:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_FIRST:
        acc = tl.trans(acc)
    finish_tile(acc, rows, cols, row_ok, col_ok, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, stride_om, tile,
                HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


def mma_gemm_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, group_size: int,
                    bias: torch.Tensor | None = None, *, block_n: int = 128, block_m: int = 128, block_k: int = 128,
                    num_warps: int = 8, num_stages: int = 3, split_k: int = 1, w_first: bool = True,
                    joined: int = 1) -> torch.Tensor:
    """x (M, K) bf16/fp16 with unit column stride @ the weight (N, K) in ``layout``.T (+ bias) -> (M, N) in
    x's dtype. Programs of (block_m, block_n) out tiles, block_k columns a step (``takes``), K split over
    ``split_k`` programs (capped so that every split has a step); ``w_first``: the weight as the dot's A
    operand (module docstring); ``joined``: 1 the nibbles made by tl.join (``mma_weight_tile``), 2 that with each
    nibble by inline PTX on CUDA, 0 the dequantize kernel's broadcast. Runs wherever Triton runs (CUDA, or CPU
    tensors under TRITON_INTERPRET=1)."""
    m, k = x.shape
    assert x.stride(1) == 1
    # The kernel reads x unmasked along K and one scale per 64-column block: a layout padded past K, or groups
    # splitting a block, would give wrong sums, not an error.
    n_pad = layout["meta"].shape[1]
    blocks = layout["words"].numel() // (n_pad // 16) // 128  # the words: (N_pad / 16, blocks, 32, 4) flattened
    if blocks * wna16_mma.KB_COLUMNS != k or not wna16_mma.supports(k, group_size, 4, x.dtype):
        raise ValueError(f"x's K = {k} in {x.dtype} with group size {group_size} and a layout of {blocks} 64-column "
                         f"blocks: the GEMM takes the layout's K (wna16_mma.supports: whole 128 columns, groups of "
                         f"whole 64-column blocks or one a row, float16/bfloat16)")
    if not takes(k, block_n, block_k):
        raise ValueError(f"tiling block_n {block_n}, block_k {block_k} does not fit K = {k}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bias, = dense(bias)  # read at bias_ptr + feature
    kb = block_k // wna16_mma.KB_COLUMNS
    steps = k_steps(k, block_k)
    split_k = max(1, min(split_k, steps))
    per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, per_split)  # no split without a step
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    arrivals = _arrival_counters(x.device, tiles) if split_k > 1 else out
    _mma_gemm_kernel[(tiles, split_k)](
        x, layout["words"], layout["meta"], bias if bias is not None else out, out, part, arrivals,
        m, n, n_pad, group_size, blocks, per_split * kb, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, TT=block_n // 16, KB=kb, BLOCK_M=block_m, SPLIT_K=split_k, W_FIRST=w_first,
        JOINED=joined > 0, ASM=joined == 2 and x.is_cuda,
        ROUND_BY_HAND=x.dtype == torch.bfloat16 and not x.is_cuda,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x))
    return out
