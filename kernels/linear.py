"""Skinny matrix products (few tokens x weight): the decode step's weight streaming.

At decode time a linear layer multiplies a handful of rows (the batch) by a large weight, so
its time is the weight's bytes over memory bandwidth. cuBLAS does this well for most shapes,
but not all: on an H100 it ran Llama-8B's 4096x4096 ``o_proj`` at batch 1 with 64 CTAs on 132
SMs (1.65 TB/s against 2.8 for the other projections). The Triton kernel here tiles the
output features finely enough to cover every SM, streams each weight tile once, and puts the
few rows through one tensor-core dot (rows padded to 16; the padding costs no bandwidth).

``linear(x, weight, bias)`` is the public entry. A weight uses the Triton kernel only when it
was marked by ``choose_skinny_weights`` (at engine load, by timing both on the device), and
only for at most ``MAX_SKINNY_ROWS`` rows; everything else is ``F.linear``.

Shapes: x (M, K) contiguous rows; weight (N, K) row-major; bias (N,) or None; out (M, N).
"""
from __future__ import annotations

import contextlib
import gc
import os

import torch
import torch.nn.functional as F

from kernels import choice_cache
from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton

MAX_SKINNY_ROWS = 16
# Rows skinny_linear_triton takes at all: past MAX_SKINNY_ROWS the rows are padded to the next power of
# two (32, 64, 128) in the dot. Only load-time choices route such row counts here (kernels/wide_rows.py's
# tilings for tree verify steps, kept on the weight as {padded rows: tiling} under WIDE_ATTR).
MAX_WIDE_ROWS = 128
WIDE_ATTR = "_wide_variants"


def padded_rows(m: int) -> int:
    """The dot's row count for ``m`` rows: 16 up to MAX_SKINNY_ROWS, else the next power of two."""
    return max(16, 1 << max(m - 1, 0).bit_length())
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")  # the skinny kernel's epilogue activations (linear_activated)
_SKINNY_ATTR = "_use_skinny_gemm"  # on a weight: its chosen variant (see SKINNY_VARIANTS), or False
_GATED_ATTR = "_use_gated_skinny_gemm"  # the same, for gate_up weights run fused with SiLU-and-mul
_ACTIVATED_ATTR = "_use_activated_skinny_gemm"  # the same, for up weights run fused with their bias and activation
# Each of the three above + ONE_ROW_SUFFIX: the variant for exactly one row (batch-1 decode), chosen at 1 row alone.
# A shape whose tiling wins at 1 row but loses to cuBLAS at 8 (Qwen3-30B-A3B's 2048-wide attention products on an
# H200, 2026-11-30: 5.77 against 6.11 us at 1 row, 5.77 against 5.35 at 8) keeps cuBLAS from 2 rows on and the
# Triton kernel, inside the programmatic-launch chain, at batch 1.
ONE_ROW_SUFFIX = "_one_row"
# Tile shapes tried at load, (block_n, block_k, num_warps, num_stages[, split_k[, swap_ab]]): on an H100
# (2026-11-22) the best for Llama-8B's projections were (32, 256, 4, 4) for qkv/o_proj,
# (16, 256, 4, 6) for down_proj and (16, 512, 4, 4) for the lm_head. split_k > 1 splits the
# reduction over that many programs per output tile (partial sums in float32, which the tile's last
# program adds in a fixed order): a weight of a few tens of MB streams in ~10 us, so one
# program per output tile leaves a wave's start and tail as a large part of the time. swap_ab: the
# weight tile is the dot's first operand as it lies in memory and the rows its second (see the kernel).
SKINNY_VARIANTS = ((16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 6), (32, 128, 4, 6),
                   (32, 256, 4, 4, 2), (16, 256, 4, 6, 4))
# Tried too for bf16/fp16 weights (the FP8 choice, kernels/fp8.py, keeps SKINNY_VARIANTS and its own):
# balanced tilings (7th element ``waves``: each program takes cdiv(N, waves x SMs) features, so every SM
# streams an equal share), the winners of benchmarks/kernels/skinny_tiling_sweep.py on an H200
# (2026-11-29; microseconds at 1 row, graph replays, best before -> this tiling; cuBLAS where it had won).
# The choice stays the timed one: a shape keeps its tiling unless one of these times faster at load.
HALF_EXTRA_VARIANTS: tuple = (
    # 64-wide swap_ab tiles, one wave: Falcon qkv 4672x4544 15.0 -> 12.7, o_proj 4544x4544 14.9 -> 12.5
    # (142 tiles of 32 had left 10 SMs streaming two); Llama-8B qkv 14.9 -> 14.2, o_proj and BLOOM's
    # 4096x4096 10.5 -> 10.1, Llama down 4096x14336 31.2 -> 30.5.
    (64, 128, 4, 6, 1, 1, 1),
    # three waves: Falcon up 18176x4544 with its GELU 46.4 -> 44.5 (plain: cuBLAS 45.9 -> 43.0).
    (64, 128, 4, 6, 1, 1, 3),
    # one wave, split-K 2 (two programs an SM): Falcon down 4544x18176 cuBLAS 44.5 -> 41.7, BLOOM down
    # 4096x16384 cuBLAS 35.8 -> 34.4.
    (64, 128, 4, 4, 2, 1, 1),
    # one wave, 4 stages: BLOOM up 16384x4096 with its tanh GELU cuBLAS + GELU 35.3 -> 32.7, Llama
    # gate_up 28672x4096 with SiLU-and-mul cuBLAS + silu_and_mul 61.0 -> 56.3.
    (64, 128, 4, 4, 1, 1, 1),
)
# The up projection's bias and tanh GELU in cuBLASLt's GELU_BIAS epilogue (torch._addmm_activation): a
# load-time candidate of choose_activated_weights beside the tilings, for gelu_tanh with a bias (BLOOM).
# It rounds once (GELU of the fp32 accumulator plus bias), where the unfused path rounds the product first.
CUBLASLT_GELU = "cublaslt_gelu_bias"


def half_variants() -> tuple:
    """The tilings the load-time choice times for a bf16/fp16 weight."""
    return SKINNY_VARIANTS + HALF_EXTRA_VARIANTS


def variant_options(variant: tuple) -> dict:
    """skinny_linear_triton's keyword arguments for a (block_n, block_k, num_warps, num_stages[, split_k[,
    swap_ab[, waves]]]) tuple."""
    block_n, block_k, num_warps, num_stages, *rest = variant
    return {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages,
            "split_k": rest[0] if rest else 1, "swap_ab": bool(rest[1]) if len(rest) > 1 else False,
            "waves": rest[2] if len(rest) > 2 else 0}


@jit(do_not_specialize=["M"])  # one compile for every row count
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, x_scale_ptr, out_ptr, part_ptr, arrivals_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_om, ROWS,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr, X_SCALE: tl.constexpr,
    SWAP_AB: tl.constexpr, M_PAD: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    BALANCED: tl.constexpr = False, INT8_DOT: tl.constexpr = False,
):
    """One program: BLOCK_N output features for all M rows, streaming its (BLOCK_N, K) weight rows once.

    GATED: the weight holds 2N rows [gate | up] and the output is silu(x @ gate.T) * (x @ up.T),
    rounded as the unfused path rounds (each product to the output dtype, then silu, then the mul).
    HAS_SCALE: the weight is FP8 (kernels/fp8.py): each tile is widened to x's dtype for the dot and
    output feature n is multiplied by scale[n] (gated: scale[n] and scale[N + n]) before the bias.
    X_SCALE (with HAS_SCALE): x is FP8 too, row m standing for x[m] * x_scale[m] (kernels/fp8.py's
    W8A8 scheme): the tiles meet in an FP8 tensor-core dot, with no widening, and row m of the
    sums is multiplied by x_scale[m] with the weight scales.
    ACTIVATION (not with GATED): 0 none, else act(x @ w.T + bias) with act one of ACTIVATIONS
    (gelu, gelu_tanh, relu): the product plus bias rounded to the output dtype first, then the
    activation rounded again, as F.linear followed by the activation rounds (the LayerNorm
    families' MLP: the up projection's bias and activation cost no launch of their own).
    SWAP_AB: the dot is w (BLOCK_N, BLOCK_K) @ x.T (BLOCK_K, M_PAD) instead of x @ w.T: the weight
    tile, the large operand, is the MMA's first operand in the layout it is loaded in (K-major, as
    FP8 tensor-core dots want), and BLOCK_N may be 64 or more (one warpgroup MMA). The accumulators
    are transposed back before the epilogue; the sums are the same up to the order of accumulation.
    SPLIT_K > 1: program (i, s) covers K range [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) and writes its
    float32 sums to part (SPLIT_K, M, N) (gated: (SPLIT_K, M, 2N), up sums in columns N..2N-1); the
    program of output tile i that arrives last (``arrivals[i]`` counts them) adds the SPLIT_K sums
    in split order and runs the epilogue, then sets arrivals[i] back to 0. So the result does not
    depend on which program finished last, and no second kernel is launched.
    BALANCED: program i covers the ROWS <= BLOCK_N output features [i * ROWS, (i + 1) * ROWS) (a
    runtime count, the rest of its tile masked off: masked weight rows are never read), so that
    N splits into equal shares of a whole number of waves of the GPU (skinny_linear_triton's ``waves``).
    INT8_DOT (with HAS_SCALE and X_SCALE): x and the weight are int8 codes (kernels/int8_sq.py's
    SmoothQuant W8A8): int8 tensor-core dots into int32 accumulators, kept in int32 over the whole K
    range (split-K partial sums too, in an int32 part buffer) and converted to float32 once, before
    the epilogue. Why int32 and not float32 per K tile: a tile's sum is exact in float32
    (|sum| <= BLOCK_K * 127 * 127 < 2**24 for BLOCK_K <= 1024), but a float32 running sum over
    Llama's K = 14336 could pass 2**24 and round; int32 holds K * 127 * 127 exactly for K < 133,000,
    so the kernel has the exact integers, as int8_linear_ref (float64) and torch._int_mm do.
    """
    cols, col_ok = output_columns(N, ROWS, BLOCK_N, BALANCED)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    acc_type = tl.int32 if INT8_DOT else tl.float32
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=acc_type)
        acc_up = tl.zeros([BLOCK_N, M_PAD], dtype=acc_type)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=acc_type)
        acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=acc_type)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w_up_base = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn
    x_base = x_ptr + rows[:, None] * stride_xm
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    pdl_prologue(PDL)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(x_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_up = w
        if GATED:
            w_up = tl.load(w_up_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc, acc_up = _skinny_tile_dot(x, w, w_up, acc, acc_up, GATED, HAS_SCALE and not X_SCALE, SWAP_AB)
    if SWAP_AB:  # (BLOCK_N, M_PAD) -> the (M_PAD, BLOCK_N) tiles the rest of the kernel works on
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        width = 2 * N if GATED else N
        part = part_ptr + (tl.program_id(1) * M + rows)[:, None] * width + cols[None, :]
        tl.store(part, acc, mask=mask)  # (int32 sums into an int32 part buffer with INT8_DOT)
        if GATED:
            tl.store(part + N, acc_up, mask=mask)
        # Every thread's partial sums are stored before the count goes up (barrier, then a
        # release); the last arrival's acquire makes the other programs' sums visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            _skinny_sum_splits_and_finish(part_ptr, bias_ptr, scale_ptr, x_scale_ptr, out_ptr, rows, cols, col_ok, mask,
                                          M, N, stride_om, HAS_BIAS, GATED, HAS_SCALE, X_SCALE, M_PAD, BLOCK_N,
                                          SPLIT_K, ACTIVATION)
            tl.store(arrivals_ptr + tl.program_id(0), 0)
    else:
        product_epilogue(acc.to(tl.float32), acc_up.to(tl.float32), rows, cols, row_ok, col_ok, mask, bias_ptr,
                         scale_ptr, x_scale_ptr, out_ptr, N,
                         stride_om, HAS_BIAS, GATED, HAS_SCALE, X_SCALE, ACTIVATION)


@jit
def output_columns(N, ROWS, BLOCK_N: tl.constexpr, BALANCED: tl.constexpr):
    """(cols, col_ok) of this program's output tile: BLOCK_N features from program_id(0) * BLOCK_N,
    or with BALANCED the ROWS <= BLOCK_N features from program_id(0) * ROWS (the rest masked off)."""
    if BALANCED:
        cols = tl.program_id(0) * ROWS + tl.arange(0, BLOCK_N)
        return cols, (tl.arange(0, BLOCK_N) < ROWS) & (cols < N)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < N


@jit
def _skinny_tile_dot(x, w, w_up, acc, acc_up, GATED: tl.constexpr, WIDEN: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += x @ w.T (SWAP_AB: acc += w @ x.T), and the same for w_up when GATED; WIDEN: FP8
    weight tiles widen to x's dtype. The dot's result type is acc's: int32 for int8 tiles (INT8_DOT); out_dtype
    says so because tl.dot's default (float32) fails to compile against an int32 acc on the GPU (the CPU
    interpreter does not check it)."""
    if WIDEN:
        w = w.to(x.dtype)
        w_up = w_up.to(x.dtype)
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=acc.dtype)
        if GATED:
            acc_up = tl.dot(w_up, tl.trans(x), acc_up, out_dtype=acc_up.dtype)
    else:
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=acc.dtype)
        if GATED:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, out_dtype=acc_up.dtype)
    return acc, acc_up


@jit
def _skinny_sum_splits_and_finish(part_ptr, bias_ptr, scale_ptr, x_scale_ptr, out_ptr, rows, cols, col_ok, mask, M, N,
                                  stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
                                  X_SCALE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                                  SPLIT_K: tl.constexpr, ACTIVATION: tl.constexpr):
    """Add the SPLIT_K partial sums of one output tile in split order (deterministic), then the
    epilogue. The sums come from L2 (``.cg``): other programs wrote them during this kernel. They
    are added in the part buffer's type: float32, or int32 for int8 dots (exact, see INT8_DOT)."""
    width = 2 * N if GATED else N
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=part_ptr.dtype.element_ty)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=part_ptr.dtype.element_ty)
    for split in range(SPLIT_K):
        part = part_ptr + (split * M + rows)[:, None] * width + cols[None, :]
        acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_up += tl.load(part + N, mask=mask, other=0.0, cache_modifier=".cg")
    product_epilogue(acc.to(tl.float32), acc_up.to(tl.float32), rows, cols, rows < M, col_ok, mask, bias_ptr,
                     scale_ptr, x_scale_ptr, out_ptr, N,
                     stride_om, HAS_BIAS, GATED, HAS_SCALE, X_SCALE, ACTIVATION)


@jit
def product_epilogue(acc, acc_up, rows, cols, row_ok, col_ok, mask, bias_ptr, scale_ptr, x_scale_ptr, out_ptr, N,
                     stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
                     X_SCALE: tl.constexpr, ACTIVATION: tl.constexpr):
    """Scale, bias, the gate's SiLU-and-mul or the activation, rounding to the output dtype, store:
    (rows, BLOCK_N) float32 tiles (the skinny kernel's (M_PAD, BLOCK_N), kernels/int8_gemm.py's (BLOCK_M,
    BLOCK_N): one epilogue, so every int8 path scales and rounds alike). The row scale multiplies before the
    column scale: (sum * x_scale[m]) * scale[n], the order of int8_linear_ref (float32 products are not associative)."""
    if X_SCALE:
        row_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
        acc *= row_scale
        if GATED:
            acc_up *= row_scale
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scale_ptr + N + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32) * up
    if ACTIVATION != 0:
        acc = _activation(acc.to(out_ptr.dtype.element_ty).to(tl.float32), ACTIVATION)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _activation(x, ACTIVATION: tl.constexpr):
    """ACTIVATIONS[ACTIVATION - 1] of a float32 tile: gelu (erf), gelu_tanh, relu."""
    if ACTIVATION == 1:
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    if ACTIVATION == 2:  # tanh(z) = 2 sigmoid(2z) - 1
        return 0.5 * x * (2.0 * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x)))
    return tl.maximum(x, 0.0)


MAX_OUTPUT_TILES = 1 << 16  # split-K output tiles of one product: N up to 1M features at block_n 16
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def split_k_layout(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(programs along K, columns each covers: k_per_split) of the skinny kernels' split-K grid, for a K of ``k``
    columns asked to split ``split_k`` ways in whole BLOCK_K tiles: never more parts than tiles, and fewer where
    rounding the share up to whole tiles leaves the last ones without work (K of 5 tiles asked 4 ways: 2 tiles a
    part, so 3 parts). Every part covers k_per_split columns but the last, which covers the rest (>= 1)."""
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split  # no program without work


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 counters, all 0 between kernels (each kernel's last arrivals reset theirs).
    Shared by every split-K product on the device: kernels on one stream run one after another
    (a PDL kernel waits for its predecessor before it touches them). Allocated once, on first use,
    which is an eager warm-up run, never inside a CUDA-graph capture; never reallocated, since
    captured graphs hold its address."""
    assert tiles <= MAX_OUTPUT_TILES
    counters = _ARRIVALS.get(device)
    if counters is None:
        counters = _ARRIVALS[device] = torch.zeros(MAX_OUTPUT_TILES, dtype=torch.int32, device=device)
    return counters


@jit
def last_arrival(arrivals_ptr, index, expected):
    """True in the program that arrives last of ``expected`` at counter ``index`` of _arrival_counters' counters,
    which sets it back to 0 for the next launch. Every thread's stores before the call (its partial sums) are
    visible to that last program: a barrier, then a release; the last arrival's acquire."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + index, 1, sem="acq_rel", scope="gpu")
    last = arrived == expected - 1
    if last:
        tl.store(arrivals_ptr + index, 0)
    return last


@jit
def last_split_pair(first, second, part_ptr, arrivals_ptr, row, counter, cols, cols_ok, N, SPLIT: tl.constexpr):
    """Split-K of a tile's two (BLOCK,) float32 sums (a gated product's gate and up, kernels/moe_gemv.py and
    kernels/mxfp4_gemv.py): this program's, split program_id(2) of SPLIT, into row ``row * SPLIT + split`` of
    part_ptr ((rows * SPLIT, 2N) float32, columns [first | second]); returns (last, first, second): whether this
    program is the last of the SPLIT to arrive at counter ``counter`` (last_arrival), and in that one the SPLIT
    sums added in split order (deterministic; from L2, ``.cg``: other programs wrote them during this kernel),
    zeros in the others. SPLIT 1: (True, first, second), nothing stored."""
    if SPLIT == 1:
        return True, first, second
    part = part_ptr + (row * SPLIT + tl.program_id(2)).to(tl.int64) * (2 * N)
    tl.store(part + cols, first, mask=cols_ok)
    tl.store(part + N + cols, second, mask=cols_ok)
    last = last_arrival(arrivals_ptr, counter, SPLIT)
    first = tl.zeros_like(first)
    second = tl.zeros_like(second)
    if last:
        for split in tl.static_range(SPLIT):
            part = part_ptr + (row * SPLIT + split).to(tl.int64) * (2 * N)
            first += tl.load(part + cols, mask=cols_ok, other=0.0, cache_modifier=".cg")
            second += tl.load(part + N + cols, mask=cols_ok, other=0.0, cache_modifier=".cg")
    return last, first, second


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         *, block_n: int = 16, block_k: int = 512, num_warps: int = 4, num_stages: int = 4,
                         split_k: int = 1, swap_ab: bool = False, waves: int = 0, gated: bool = False,
                         weight_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None, activation: str | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for M <= MAX_WIDE_ROWS rows (padded to padded_rows(M) in the dot), fp32 accumulation; with ``gated``,
    silu(x @ weight[:N].T) * (x @ weight[N:].T) for weight (2N, K) (bias not supported). With
    ``weight_scale`` (rows of weight,) float32, weight is FP8 and row n counts as weight[n] * scale[n];
    with ``x_scale`` (M,) float32 too, x is FP8 and row m counts as x[m] * x_scale[m], and the
    result is ``out_dtype`` (the activations' dtype). x and weight both int8 (with both scales): the
    SmoothQuant W8A8 product of kernels/int8_sq.py, int8 dots with exact int32 sums (INT8_DOT in the
    kernel). ``out_dtype`` defaults to x's dtype; float32
    serves the logits. ``split_k``: programs per output tile along K (each a whole number of BLOCK_K tiles). ``swap_ab``: see the kernel.
    ``waves`` > 0: each program covers cdiv(N, waves x SMs) output features (at most block_n) instead of
    block_n, so every SM streams the same share of the weight in ``waves`` rounds (Falcon's 4544 features
    make 142 tiles of 32 on 132 SMs: 10 SMs stream two tiles while the rest wait).
    ``activation`` (one of ACTIVATIONS, not with ``gated``): act(x @ weight.T + bias), see the kernel."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert m <= MAX_WIDE_ROWS and x.stride(1) == 1 and weight.stride(1) == 1 and not (gated and bias is not None)
    assert x_scale is None or (out_dtype is not None and weight_scale is not None)
    assert activation is None or (activation in ACTIVATIONS and not gated)
    int8_dot = x.dtype == torch.int8
    assert int8_dot == (weight.dtype == torch.int8) and (not int8_dot or x_scale is not None)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    split_k, k_per_split = split_k_layout(k, block_k, split_k)
    part = torch.empty(split_k, m, 2 * n if gated else n, dtype=torch.int32 if int8_dot else torch.float32,
                       device=x.device) if split_k > 1 else out
    bias, weight_scale, x_scale = dense(bias, weight_scale, x_scale)  # read at ptr + feature / + row
    bias_arg = bias if bias is not None else weight
    scale_arg = weight_scale if weight_scale is not None else weight
    x_scale_arg = x_scale if x_scale is not None else scale_arg
    flags = dict(HAS_BIAS=bias is not None, GATED=gated, HAS_SCALE=weight_scale is not None,
                 X_SCALE=x_scale is not None, SWAP_AB=swap_ab, M_PAD=padded_rows(m), BLOCK_N=block_n,
                 ACTIVATION=ACTIVATIONS.index(activation) + 1 if activation else 0,
                 SPLIT_K=split_k, BALANCED=waves > 0, INT8_DOT=int8_dot, **pdl_options(x))
    rows_per_program = min(block_n, triton.cdiv(n, waves * num_sms(x.device))) if waves > 0 else block_n
    tiles = triton.cdiv(n, rows_per_program)
    arrivals = _arrival_counters(x.device, tiles) if split_k > 1 else part
    _skinny_gemm_kernel[(tiles, split_k)](
        x, weight, bias_arg, scale_arg, x_scale_arg, out, part, arrivals, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), rows_per_program, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **flags,
    )
    return out


def gated_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from kernels.activation import silu_and_mul

    return silu_and_mul(linear(x, weight))


def _skinny_variant(x: torch.Tensor, weight: torch.Tensor, attr: str = _SKINNY_ATTR):
    """The variant chosen at load for ``weight`` when the skinny kernel takes ``x``, else None:
    the decode tiling up to MAX_SKINNY_ROWS rows, past them the wide-row one (plain and gated products)."""
    if x.shape[0] > MAX_SKINNY_ROWS:
        return wide_variant(x, weight) if attr in (_SKINNY_ATTR, _GATED_ATTR) and x.is_contiguous() else None
    variant = getattr(weight, attr + ONE_ROW_SUFFIX, None) if x.shape[0] == 1 else None
    if variant is None:  # (a weight marked before the one-row choice existed, or more rows)
        variant = getattr(weight, attr, False)
    return variant if variant and x.is_contiguous() else None


def wide_variant(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """The tiling kernels/wide_rows.py chose at load for ``weight`` at x's row count (x (M, K) with
    unit column stride, MAX_SKINNY_ROWS < M <= MAX_WIDE_ROWS, by padded rows: 32, 64, 128), else None.
    (Only a CUDA engine's load marks weights, like the decode tilings.)"""
    if not MAX_SKINNY_ROWS < x.shape[0] <= MAX_WIDE_ROWS or x.stride(1) != 1:
        return None
    return getattr(weight, WIDE_ATTR, {}).get(padded_rows(x.shape[0]))


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for the fused gate_up weight (2 * inter, hidden) = [gate | up]:
    one skinny Triton kernel when the weight was marked at load (decode-size batches), else the
    product (cuBLAS or skinny) followed by kernels.activation.silu_and_mul."""
    variant = _skinny_variant(x, weight, _GATED_ATTR)
    if variant:
        return skinny_linear_triton(x, weight, gated=True, **variant_options(variant))
    return gated_linear_ref(x, weight)


def activation_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    """One of ACTIVATIONS as torch computes it (transformers' gelu, gelu_new / gelu_pytorch_tanh, relu)."""
    if activation == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def linear_activated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x @ weight.T + bias), act one of ACTIVATIONS (the non-gated MLP's up projection): one skinny
    Triton kernel with the bias and the activation in its epilogue when the weight was marked at
    load (choose_activated_weights), else the product (cuBLAS or skinny) then the activation."""
    variant = _skinny_variant(x, weight, _ACTIVATED_ATTR)
    if variant == CUBLASLT_GELU:
        if bias is not None and activation == "gelu_tanh":
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    elif variant:
        return skinny_linear_triton(x, weight, bias, activation=activation, **variant_options(variant))
    return activation_ref(linear(x, weight, bias), activation)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    variant = _skinny_variant(x, weight)
    if variant:
        return skinny_linear_triton(x, weight, bias, **variant_options(variant))
    return F.linear(x, weight, bias)


# aten::mm.dtype: cuBLAS writes a bf16/fp16 product's fp32 accumulators as they are (torch >= 2.8, CUDA).
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def linear_float32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as float32 (the logits): (M, K) x (N, K) -> (M, N) float32.

    The products store their fp32 accumulators as they are, never a rounded product and then a
    widening copy: a skinny batch through the Triton kernel (when the weight was marked at load),
    a larger half-precision batch on CUDA through cuBLAS. For Llama-8B's lm_head at 1,024 rows
    that saves an extra 0.8 GB of traffic (~0.4 ms on an H100); at batch 1 a kernel launch of the
    step's critical path. The logits are the unrounded accumulators (at least as exact)."""
    variant = _skinny_variant(x, weight)
    if variant:
        return skinny_linear_triton(x, weight, out_dtype=torch.float32, **variant_options(variant))
    if (_HAS_MM_OUT_DTYPE and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and x.shape[0] > MAX_SKINNY_ROWS):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return linear(x, weight).float()


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream() -> torch.cuda.Stream:
    """One side stream per device for the warm-up runs before a CUDA graph capture. Why one: torch
    keeps a cuBLAS workspace (32 MiB on Hopper) for every stream a GEMM ever ran on, for the life of
    the process, and a new torch.cuda.Stream() per capture cycles through its pool of 32 streams,
    so an engine's ~100 graph captures held ~1 GiB of workspaces beside its KV pool."""
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The current device's stream for CUDA-graph captures (``graph_capture`` says why not torch's default)."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **options):
    """``torch.cuda.graph(graph, **options)`` with Python's cyclic GC held off during the capture.
    Why: torch (2.13) no longer collects on entering a capture, so a GC pass tripped by an allocation
    inside it could free dead cycles holding CUDA graphs (an executor closed or failed earlier in the
    process) in this thread, and their cudaGraphExecDestroy is forbidden while this thread captures:
    the H200 run logged 16 "operation not permitted when stream is capturing (function reset)"
    warnings, then cudaErrorStreamCaptureInvalidated. (No gc.collect() first: it costs each of an
    engine's ~100 captures; the dead cycles are collected after, outside any capture.)"""
    # torch.cuda.graph's default capture stream is one for the process, made on whichever device captured
    # first: an executor on cuda:1 after one on cuda:0 captured on cuda:0's stream, so Triton launched its
    # kernels there ("Pointer argument cannot be accessed from Triton") and torch ops read unset buffers
    # (an index_select device assert, two executors on the H200 x2). One capture stream per device instead.
    options.setdefault("stream", capture_stream())
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **options):
            yield
    finally:
        if enabled:
            gc.enable()


def graph_time_ms(fn, repeat: int = 20) -> float:
    """Device time of one fn() call, replayed from a CUDA graph of ``repeat`` calls (no launch overhead)."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for _ in range(repeat):
            fn()
    return replay_time_ms(graph, replays=3) / repeat


def replay_time_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Device time of one replay of a captured ``graph``: one replay to warm up, then the mean of
    ``replays`` back to back, timed with CUDA events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def choose_skinny_weights(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 8)) -> dict[tuple[int, int], dict]:
    """Per distinct (N, K) weight shape, time cuBLAS and every tiling of half_variants() at each row
    count in ``rows``; a weight gets the one of least summed time when it beats cuBLAS by 1% at every row count
    (both are timed the same way, from graph replays, so the margin only absorbs timing noise).

    Timed on two copies of the shape alternately, so a weight smaller than L2 is not timed from
    L2. Returns per shape the timings (microseconds) and the choice, for the load log. A no-op
    off CUDA or without Triton.
    """
    return _choose_weights(weights, rows, _SKINNY_ATTR, gated=False)


def choose_gated_weights(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 8)) -> dict[tuple[int, int], dict]:
    """Like choose_skinny_weights for gate_up weights: the fused gated kernel against the unfused
    product + silu_and_mul; marks a weight with the best tiling when it wins by 1% at every size."""
    return _choose_weights(weights, rows, _GATED_ATTR, gated=True)


def choose_activated_weights(weights: list[torch.Tensor], activation: str, rows: tuple[int, ...] = (1, 8)
                             ) -> dict[tuple[int, int], dict]:
    """Like choose_skinny_weights for non-gated up weights: the skinny kernel with a bias and
    ``activation`` in its epilogue against the product with its bias then the activation; marks
    a weight with the best tiling when it wins by 1% at every size (linear_activated reads it).
    For gelu_tanh, cuBLASLt's GELU_BIAS epilogue (CUBLASLT_GELU) is a candidate too, where it is
    the tanh GELU on the device (_cublaslt_gelu_is_tanh); linear_activated uses it with a bias only."""
    return _choose_weights(weights, rows, _ACTIVATED_ATTR, gated=False, activation=activation)


@torch.inference_mode()
def _choose_weights(weights: list[torch.Tensor], rows: tuple[int, ...], attr: str, *, gated: bool,
                    activation: str | None = None) -> dict[tuple[int, int], dict]:
    """choose_skinny_weights / choose_gated_weights: each 2-D float16/bfloat16 CUDA weight marked
    (attribute ``attr``) with the choice timed once per shape (``_time_shape``)."""
    report: dict[tuple[int, int], dict] = {}
    for weight in weights:
        if not use_triton(weight) or weight.dim() != 2 or weight.dtype not in (torch.float16, torch.bfloat16):
            continue
        shape = tuple(weight.shape)
        if shape not in report:
            report[shape] = _cached_time_shape(shape, weight.dtype, weight.device, rows, gated=gated,
                                               activation=activation)
        setattr(weight, attr, report[shape]["variant"])
        one_row = report[shape].get("variant_one_row", report[shape]["variant"])
        setattr(weight, attr + ONE_ROW_SUFFIX, report[shape]["variant"] if one_row_choice_off() else one_row)
    return report


def _cached_time_shape(shape: tuple[int, int], dtype: torch.dtype, device, rows: tuple[int, ...], *, gated: bool,
                       activation: str | None) -> dict:
    """_time_shape through the persistent choice cache (kernels/choice_cache.py); a hit's report says
    "cached": True (its timings are those of the load that timed it)."""
    from kernels import activation as activation_module

    candidates = half_variants() + (CUBLASLT_GELU,) * (activation == "gelu_tanh")
    family = "gated" if gated else ("activated" if activation else "skinny")
    return choice_cache.timed_report(
        family, (shape, str(dtype), tuple(rows), activation), device,
        lambda: _time_shape(shape, dtype, device, rows, gated=gated, activation=activation),
        sources=(__file__, _triton_module_file(), activation_module.__file__), candidates=candidates,
        valid=lambda r: all(r.get(key, False) is False or r[key] in candidates for key in ("variant", "variant_one_row")))


def _triton_module_file() -> str:
    from kernels import _triton

    return _triton.__file__


def _time_shape(shape: tuple[int, int], dtype: torch.dtype, device, rows: tuple[int, ...],
                gated: bool = False, activation: str | None = None) -> dict:
    copies = [torch.randn(shape, dtype=dtype, device=device) * 0.02 for _ in range(2)]
    turn = [0]

    def next_weight() -> torch.Tensor:
        turn[0] += 1
        return copies[turn[0] % 2]

    tilings = half_variants()
    cublas, variants = {}, {v: {} for v in tilings}
    bias = torch.randn(shape[0], dtype=dtype, device=device) if activation else None
    lt_gelu = activation == "gelu_tanh" and _cublaslt_gelu_is_tanh(copies[0])
    if lt_gelu:
        variants[CUBLASLT_GELU] = {}
    for m in rows:
        x = torch.randn(m, shape[1], dtype=dtype, device=device)
        if gated:
            from kernels.activation import silu_and_mul

            cublas[m] = graph_time_ms(lambda: silu_and_mul(F.linear(x, next_weight()))) * 1e3
        elif activation:
            cublas[m] = graph_time_ms(lambda: activation_ref(F.linear(x, next_weight(), bias), activation)) * 1e3
        else:
            cublas[m] = graph_time_ms(lambda: F.linear(x, next_weight())) * 1e3
        for v in tilings:
            if v not in variants:
                continue  # it did not fit this kind at the first row count
            try:  # a tiling that outgrows shared memory here (gated: two weight tiles a stage) drops out
                skinny_linear_triton(x, next_weight(), bias, gated=gated, activation=activation, **variant_options(v))
            except _TOO_LARGE:
                del variants[v]
                continue
            variants[v][m] = graph_time_ms(lambda: skinny_linear_triton(
                x, next_weight(), bias, gated=gated, activation=activation, **variant_options(v))) * 1e3
        if lt_gelu:
            variants[CUBLASLT_GELU][m] = graph_time_ms(
                lambda: torch._addmm_activation(bias, x, next_weight().t(), use_gelu=True)) * 1e3
    best = min(variants, key=lambda v: sum(variants[v].values()))
    wins = all(variants[best][m] < 0.99 * cublas[m] for m in rows)
    report = {"cublas_us": cublas, "best_variant": best, "best_us": variants[best], "variant": best if wins else False}
    if 1 in rows and len(rows) > 1:  # batch 1 alone (ONE_ROW_SUFFIX)
        one = min(variants, key=lambda v: variants[v][1])
        report["variant_one_row"] = one if variants[one][1] < 0.99 * cublas[1] else False
    return report


ONE_ROW_ENV = "TRITONLLM_ONE_ROW_CHOICE"  # "0": batch 1 takes the choice of every row count (before 2026-11-30)


def one_row_choice_off() -> bool:
    """Whether ONE_ROW_ENV turns the batch-1 choice off (read at marking time, so a cached report serves both)."""
    return os.environ.get(ONE_ROW_ENV, "1") == "0"


try:
    from triton.runtime.errors import OutOfResources as _TOO_LARGE
except ImportError:  # no Triton: nothing is timed
    _TOO_LARGE = RuntimeError


def _cublaslt_gelu_is_tanh(weight: torch.Tensor) -> bool:
    """Whether torch._addmm_activation(use_gelu=True) computes the tanh GELU on this device for a
    weight of this shape and dtype (torch's CUDA fallback is tanh, its CPU path erf; cuBLASLt's
    epilogue is what is asked). A zero weight leaves GELU(bias), the bias swept over [-6, 3]: below
    -3 the two GELUs differ by 10% or more, far beyond one rounding (1/64 is allowed)."""
    if not weight.is_cuda:
        return False
    bias = torch.linspace(-6.0, 3.0, weight.shape[0], device=weight.device).to(weight.dtype)
    x = torch.ones(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    fused = torch._addmm_activation(bias, x, torch.zeros_like(weight).t(), use_gelu=True).float()[0]
    expected = F.gelu(bias.float(), approximate="tanh")
    return bool(((fused - expected).abs() <= expected.abs() / 64).all())
