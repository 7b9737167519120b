"""Block-FP8 products at decode batch without quantizing the activations: the skinny GEMM's weight streaming
(kernels/linear.py) with 128 x 128 block scales.

Why: at 1-16 rows a product's time is its weight's bytes over memory bandwidth. kernels/fp8_block.py's decode path
(quantize the rows per 1 x 128 group, one launch; then its block GEMM, FP8 tensor-core dots) ran Qwen3-30B-A3B's
qkv (5120 x 2048, 5.2 MB of E4M3) and o_proj (2048 x 4096, 8.4 MB) at 9.47 us a call on an H200 (2026-12-01, a
batch-1 decode graph's profile; results/kernels.md session 27): slower than bf16's skinny GEMM over twice the bytes
(5.37 and 9.03 us). The quantize launch and the FP8 dot buy nothing where the weight read is the bound. Here the
E4M3 weight tiles are widened to x's dtype in registers (exact: every E4M3 value is a bf16 and an fp16 value) and
meet the rows unquantized in a bf16/fp16 tensor-core dot, as the skinny kernel's per-channel FP8 path does
(HAS_SCALE without X_SCALE), with the split-K and tilings of that kernel.

Scheme: weight (N, K) float8_e4m3fn, weight_scale (ceil(N / 128), ceil(K / 128)) float32, x (M, K) bf16/fp16 as it
is: y[m, n] = sum over K blocks b of s[n // 128, b] * (x[m, b] . w[n, b]), each block's dot accumulated in float32
and scaled before it joins the float32 sum (so a K step never straddles a 128-column block; the last block may be
partial), plus the bias, rounded once to x's dtype. The activations unquantized make it more exact than the W8A8
block scheme (fp8_block_linear_ref), not less: ``fp8_block_skinny_ref`` is its plain-torch oracle.

Where it runs: ``fp8_block_linear`` (kernels/fp8_block.py) on CUDA for at most MAX_SKINNY_ROWS rows, for a weight
marked at engine load by kernels/fp8_block_choice.py ``choose_fp8_block_skinny`` (it times this kernel's tilings
against quantize + block GEMM at 1 and 8 rows and marks the fastest tiling where it wins at both); every other
weight and row count as before.

Shapes: x (M, K) with unit column stride, M <= MAX_SKINNY_ROWS; weight (N, K) row-major; out (M, N).
"""
from __future__ import annotations

import os

import torch

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.e4m3_bits import bits_factor, widened_bits
from kernels.linear import (MAX_SKINNY_ROWS, _arrival_counters, _skinny_sum_splits_and_finish, last_arrival,
                            output_columns, padded_rows, product_epilogue, split_k_layout, variant_options)

SCALE_BLOCK = 128  # the checkpoints' 128 x 128 weight blocks (kernels/fp8_block.py's BLOCK is this one: it imports us)
# On a weight: the tiling kernels/fp8_block_choice.py chose for it (a SKINNY_BLOCK_VARIANTS tuple), or False (keep
# quantize + block GEMM). Unset: never timed (not a CUDA engine's load), the block GEMM too.
VARIANT_ATTR = "_fp8_block_skinny_variant"
# Tilings timed at load, (block_n, block_k, num_warps, num_stages[, split_k[, swap_ab[, waves]]]) as
# kernels/linear.py's variant_options reads them; block_k a multiple of 128 (each 128-column sub-block its own
# dot and scale, see the kernel). An E4M3 tile carries half a bf16 tile's bytes, so longer K tiles and deeper
# pipelines keep as many bytes in flight as the bf16 winners (kernels/linear.py SKINNY_VARIANTS); split-K 2-4 for
# products of few output tiles: Qwen3-30B-A3B's o_proj (2,048 features) makes 128 tiles of 16 on 132 SMs, so
# one program per tile leaves the wave's start and tail most of the time.
SKINNY_BLOCK_VARIANTS = (
    (16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 4), (32, 128, 4, 6), (16, 128, 4, 8),
    (32, 256, 4, 4, 2), (16, 256, 4, 4, 2), (16, 256, 4, 4, 4), (32, 128, 4, 6, 4), (16, 512, 4, 4, 2),
    (64, 256, 4, 4, 1, 1), (64, 128, 4, 6, 1, 1), (64, 256, 4, 4, 2, 1), (64, 128, 4, 6, 2, 1),
    (64, 128, 4, 6, 1, 1, 1), (64, 256, 4, 4, 2, 1, 1),
)
# BITS variants: an eighth element 1 widens the E4M3 tiles by bits (kernels/e4m3_bits.py: no conversion-unit
# instruction, where Triton's widening takes 1.5 a weight and that unit issues 16 lanes a clock an SM on the H200),
# the dot products multiplied back with the block scale. Timed by the load-time choice unless
# $TRITONLLM_FP8_BLOCK_BITS=0 (H200, 2026-12-01, session 28 call 7: (32, 128, 4, 6, 4, 0, 0, 1) chosen for
# Qwen3-30B-A3B's qkv and o_proj, 7.10 / 6.08 us at one row against the block GEMM's 9.14 / 12.58; 7.27 / 7.16 us a
# call in the decode graph against 8.03 / 7.84 with Triton's widening).
BITS_ENV = "TRITONLLM_FP8_BLOCK_BITS"
# ((16, 256, 4, 4) without a split took a 16-byte stack in its BITS form: (16, 128, 4, 8) instead; sm_90, Triton 3.9.)
# The last two keep a program's whole K share in flight with fewer buffers or more programs (sm_90 compiles: shared
# memory 24 / 32 KB a program against (32, 128, 4, 6, 4)'s 40): (32, 128, 4, 4, 4) took Qwen3-30B-A3B's o_proj
# (2048 x 4096) at 5.82 us a row against 6.06 (H200, session 29 call 2). Dropped as candidates after that call, slower
# than these at both Qwen3 shapes (each a compile at a cold load): (16, 256, 4, 4, 2), (64, 128, 4, 6, 1, 1),
# (16, 128, 2, 6, 4) and the one-program-an-SM (64, 128, 4, 6, 1, 1, 1) (qkv over 10.3 us a row against 7.12).
BITS_VARIANTS = ((16, 128, 4, 8, 1, 0, 0, 1), (32, 128, 4, 6, 4, 0, 0, 1), (64, 256, 4, 4, 2, 1, 0, 1),
                 (32, 128, 4, 4, 4, 0, 0, 1), (32, 128, 4, 5, 8, 0, 0, 1))
# Beside the BITS tilings the choice times only this one of Triton's widening (the winner before them, the reference
# a GPU run compares them with): each SKINNY_BLOCK_VARIANTS tiling is a compile at a cold load, and a BITS tiling
# does the same loads with fewer instructions (H200, 2026-12-01: with all 21 candidates and the experts' DOT / BITS
# tiles a cold load's kernel choices took 52.3 s against 12.1 s before).
PLAIN_BESIDE_BITS = ((32, 128, 4, 6, 4),)


def bits_variants() -> tuple:
    """BITS_VARIANTS unless $TRITONLLM_FP8_BLOCK_BITS=0 (read at every choice)."""
    return () if os.environ.get(BITS_ENV, "1").strip() == "0" else BITS_VARIANTS


def candidate_variants() -> tuple:
    """The tilings the load-time choice times: PLAIN_BESIDE_BITS and BITS_VARIANTS, or with
    $TRITONLLM_FP8_BLOCK_BITS=0 all of SKINNY_BLOCK_VARIANTS (read at every choice)."""
    bits = bits_variants()
    return PLAIN_BESIDE_BITS + bits if bits else SKINNY_BLOCK_VARIANTS


def fp8_block_skinny_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The scheme in plain torch: the weight's blocks dequantized, x (M, K) unquantized, float32 matmul (+ bias),
    rounded once to x's dtype."""
    rows, cols = weight.shape
    scale = weight_scale.float().repeat_interleave(SCALE_BLOCK, 0)[:rows].repeat_interleave(SCALE_BLOCK, 1)[:, :cols]
    out = x.float() @ (weight.float() * scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@jit(do_not_specialize=["M"])  # one compile for every row count
def _fp8_block_skinny_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om, ROWS,
    HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB_BLOCKS: tl.constexpr, SCALE_K: tl.constexpr, SPLIT_K: tl.constexpr, BALANCED: tl.constexpr,
    PDL: tl.constexpr, BITS: tl.constexpr = False, ASM: tl.constexpr = False,
):
    """One program: BLOCK_N output features (output_columns: BALANCED as in kernels/linear.py) for all M rows over
    its K range, streaming its E4M3 weight rows once. A K step is SUB_BLOCKS blocks of SCALE_K (128) columns; each
    block's tile is widened to x's dtype, dotted with the rows into a fresh float32 tile, scaled by its feature's
    block scale s[n // SCALE_K, k // SCALE_K] and added (a block's columns past the split's end are masked to
    zeros). SPLIT_K > 1: program (i, s) covers K from s * K_PER_SPLIT (a multiple of SUB_BLOCKS * SCALE_K, so
    splits never cut a block either), writes its float32 sums to part (SPLIT_K, M, N), and the last program to
    arrive at output tile i adds them in split order (deterministic) and runs the epilogue (bias, rounding). BITS: the
    tiles widened by bits (kernels/e4m3_bits.py, inline PTX where ASM), the block scale times bits_factor."""
    cols, col_ok = output_columns(N, ROWS, BLOCK_N, BALANCED)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    if SWAP_AB:  # the weight tile is the dot's first operand, K-major as loaded (see kernels/linear.py)
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_base = x_ptr + rows[:, None] * stride_xm
    s_base = s_ptr + (cols // SCALE_K) * stride_sn
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    pdl_prologue(PDL)
    for k0 in range(k_begin, k_end, SUB_BLOCKS * SCALE_K):
        for sub in tl.static_range(SUB_BLOCKS):
            block_start = k0 + sub * SCALE_K
            k = block_start + tl.arange(0, SCALE_K)
            k_ok = k < k_end
            x = tl.load(x_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            # (a block past K, whose tiles loaded zeros, reads the last block's scale: never out of bounds)
            scale = tl.load(s_base + tl.minimum(block_start, K - 1) // SCALE_K, mask=col_ok, other=0.0)
            if BITS:
                w = widened_bits(w, x.dtype, ASM)
                scale = scale * bits_factor(x.dtype)
            else:
                w = w.to(x.dtype)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(x)) * scale[:, None]
            else:
                acc += tl.dot(x, tl.trans(w)) * scale[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tl.store(part_ptr + (tl.program_id(1) * M + rows)[:, None] * N + cols[None, :], acc, mask=mask)
        if last_arrival(arrivals_ptr, tl.program_id(0), SPLIT_K):  # the splits' sums in split order, the epilogue
            _skinny_sum_splits_and_finish(part_ptr, bias_ptr, bias_ptr, bias_ptr, out_ptr, rows, cols, col_ok, mask, M,
                                          N, stride_om, HAS_BIAS, False, False, False, M_PAD, BLOCK_N, SPLIT_K, 0)
    else:
        product_epilogue(acc, acc, rows, cols, row_ok, col_ok, mask, bias_ptr, bias_ptr, bias_ptr, out_ptr, N,
                         stride_om, HAS_BIAS, False, False, False, 0)


def fp8_block_skinny_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, *, block_n: int = 16, block_k: int = 256,
                            num_warps: int = 4, num_stages: int = 4, split_k: int = 1, swap_ab: bool = False,
                            waves: int = 0, bits: bool = False) -> torch.Tensor:
    """fp8_block_skinny_ref on the kernel: x (M, K) bf16/fp16 with unit column stride, M <= MAX_SKINNY_ROWS;
    weight (N, K) E4M3 row-major; weight_scale (ceil(N / 128), ceil(K / 128)) float32. ``block_k``: a multiple of
    128. ``split_k``, ``swap_ab``, ``waves``: kernels/linear.py skinny_linear_triton's; ``bits``: BITS_VARIANTS'
    widening (float32 x too, on the interpreter)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_SKINNY_ROWS and x.stride(1) == 1 and weight.stride(1) == 1 and block_k % SCALE_BLOCK == 0
    assert weight_scale.shape == (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)), weight_scale.shape
    assert weight_scale.dtype == torch.float32 and (x.dtype in (torch.bfloat16, torch.float16) or bits)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    split_k, k_per_split = split_k_layout(k, block_k, split_k)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    bias, = dense(bias)  # read at bias_ptr + feature
    rows_per_program = min(block_n, triton.cdiv(n, waves * num_sms(x.device))) if waves > 0 else block_n
    tiles = triton.cdiv(n, rows_per_program)
    arrivals = _arrival_counters(x.device, tiles) if split_k > 1 else part
    _fp8_block_skinny_kernel[(tiles, split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, part, arrivals, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0), rows_per_program,
        HAS_BIAS=bias is not None, SWAP_AB=swap_ab, M_PAD=padded_rows(m), BLOCK_N=block_n,
        SUB_BLOCKS=block_k // SCALE_BLOCK, SCALE_K=SCALE_BLOCK, SPLIT_K=split_k, BALANCED=waves > 0,
        BITS=bits, ASM=bits and x.is_cuda, num_warps=num_warps, num_stages=num_stages, **pdl_options(x))
    return out


def skinny_variant(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """The tiling choose_fp8_block_skinny chose for ``weight`` when this kernel takes x (at most MAX_SKINNY_ROWS
    rows, bf16/fp16, unit column stride, on CUDA), else None."""
    if x.dim() != 2 or x.shape[0] > MAX_SKINNY_ROWS or x.stride(1) != 1 or x.dtype not in (torch.bfloat16,
                                                                                            torch.float16):
        return None
    variant = getattr(weight, VARIANT_ATTR, False)
    return variant if variant and use_triton(x) else None


def skinny_options(variant: tuple) -> dict:
    """fp8_block_skinny_triton's keyword arguments for a SKINNY_BLOCK_VARIANTS or BITS_VARIANTS tuple."""
    return {**variant_options(variant), "bits": len(variant) > 7 and bool(variant[7])}
