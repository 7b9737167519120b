"""Products of 17-128 rows on the skinny kernel (kernels/linear.py): the tree verify steps at batch 1.

Why: a tree verify step of a 16-64 node tree carries 17-65 tokens. Past MAX_SKINNY_ROWS (16) the
products went to cuBLAS / cuBLASLt, whose kernels at these row counts stream the weights slower than
the skinny decode kernels. On an H200 (2026-11-29, benchmarks/speculative/tree_bench.py, Llama-8B
shape, batch 1) FP8 tree verify steps of 16, 32 and 64 nodes cost 5.41, 5.52 and 5.65 ms against
2.84 for a decode step, nearly the same for every tree size: the cost is the weights' read rate, not
the rows (the H100 showed the same: ~5.6 ms for a 64-row FP8 step against ~3.5 for the skinny
kernels, benchmarks/results/speculative.md); bf16 trees cost 1.39-1.51x a decode step. An FP8 8B
model's weights are ~7.5 GB, ~1.6 ms at the H200's bandwidth, while 65 rows of FP8 tensor-core work
on them is ~1 ms at peak, so a kernel that streams each weight once at the decode rate wins.

What: at engine load (engine/executor/runner.py choose_kernels), for each weight shape (plain, or
gated: [gate | up] with the SiLU fused), FP8 or bf16/fp16, and each padded row count of
WIDE_ROW_COUNTS the engine's steps can reach, the skinny kernel with a wide-row tiling is timed
against what ran before at that many rows (FP8: ``torch._scaled_mm`` with row-wise scales; half:
``F.linear``, gated followed by silu_and_mul), device time from CUDA graphs, weights copied past the
L2 cache. Where the kernel wins by WIDE_MIN_GAIN the weight keeps {padded rows: tiling} (attribute
linear.WIDE_ATTR), which kernels/linear.py (linear, linear_float32_out, gated_linear) and
kernels/fp8.py (fp8_linear, fp8_gated_linear) read. Elsewhere the product stays where it was: the
choice never makes a product slower than before (up to timing noise).

Tiling (the first of the dtype's WIDE_TILINGS that fits the device's shared memory): swapped
operands, so the 64-feature weight tile is the warpgroup MMA's first operand and the padded rows its
second (N up to 128); K tiles of 256 bytes a row over 3 stages (at 128 rows: 32 KB of rows + 16 KB of
weight, gated 32, a stage), else 128 bytes over 4; split-K so the programs cover the SMs at least once
(a 4,096-feature product is 64 tiles of 64 features: 3 splits on 132 SMs), at most MAX_WIDE_SPLIT.
The numbers are the decode kernels' (FP8: the same E4M3 values multiplied exactly, both scales in the
epilogue), one rounding of the output dtype from the references.

On by default: the H200 run of 2026-11-29 (tree_bench, Llama-8B shape) had the kernel ahead at 32 and 64 rows
for every FP8 shape (e.g. 6144x4096: 9.8 / 12.4 us against 13.7) and for some bf16 ones, behind at 128 rows and on
other bf16 shapes (4096x4096 at 64 rows: 15.2 against 11.6 us), so the choice per (shape, padded rows) is what
makes the default path the faster one. ``TRITONLLM_WIDE_ROWS`` overrides it: ``0`` keeps every such product on
cuBLAS / cuBLASLt (nothing compiled or timed), ``1`` takes the kernel at every row count where a tiling compiles,
timed or not faster (for A/B runs; the timings are still reported).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import choice_cache
from kernels._triton import num_sms, triton
from kernels.activation import silu_and_mul
from kernels.fp8 import FAST_ACCUM, FP8_DTYPE, l2_defeating_copies, quantize_rows_triton
from kernels.linear import (MAX_SKINNY_ROWS, MAX_WIDE_ROWS, WIDE_ATTR, graph_time_ms, padded_rows, skinny_linear_triton,
                            variant_options)

WIDE_ROW_COUNTS = (32, 64, 128)  # padded rows timed: 17-32, 33-64 and 65-128 rows
# (block_n, block_k, warps, stages) per weight element size, tried in order; swap_ab and split-K added.
WIDE_TILINGS = {1: ((64, 256, 4, 3), (64, 128, 4, 4)), 2: ((64, 128, 4, 3), (64, 64, 4, 4))}
MAX_WIDE_SPLIT = 4
WIDE_MIN_GAIN = 0.97  # the kernel replaces the library product only where it takes at most this share of its time
WIDE_ROWS_ENV = "TRITONLLM_WIDE_ROWS"


def wide_tiling(tiling: tuple, n: int, k: int, device: torch.device) -> tuple:
    """``tiling`` (block_n, block_k, warps, stages) with split-K and swapped operands for an (n, k)
    weight: splits = SMs / output tiles rounded up, at most MAX_WIDE_SPLIT and the K tiles."""
    block_n, block_k = tiling[0], tiling[1]
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(MAX_WIDE_SPLIT, triton.cdiv(num_sms(device), tiles), triton.cdiv(k, block_k)))
    return tuple(tiling) + (split, 1)


def wide_row_counts(max_rows: int) -> tuple[int, ...]:
    """The padded row counts of WIDE_ROW_COUNTS that a step of at most ``max_rows`` rows reaches."""
    top = padded_rows(min(max_rows, MAX_WIDE_ROWS))
    return tuple(m for m in WIDE_ROW_COUNTS if max_rows > MAX_SKINNY_ROWS and m <= top)


@torch.inference_mode()
def choose_wide_variants(weights: list[torch.Tensor], gated: list[torch.Tensor] = (),
                         row_counts: tuple[int, ...] = WIDE_ROW_COUNTS) -> dict[tuple, dict]:
    """Per distinct weight (dtype, shape) (key (N, K) or ("gated", N, K), with "fp8" first for FP8
    weights) and padded row count of ``row_counts``: {"kernel_us", "library_us", "tiling"}; every
    weight of that shape gets {rows: tiling} for the row counts where the kernel won (every row count
    with a tiling when WIDE_ROWS_ENV=1 forces it). CUDA weights of FP8, bf16 or fp16 only; a no-op when
    WIDE_ROWS_ENV=0."""
    report: dict[tuple, dict] = {}
    mode = os.environ.get(WIDE_ROWS_ENV, "")
    if mode == "0" or not row_counts:
        return report
    forced = mode == "1"
    for weight, is_gated in [(w, False) for w in weights] + [(w, True) for w in gated]:
        if not weight.is_cuda or weight.dim() != 2 or weight.dtype not in (FP8_DTYPE, torch.bfloat16, torch.float16):
            continue
        key = (("fp8",) if weight.dtype == FP8_DTYPE else ()) + (("gated",) if is_gated else ()) + tuple(weight.shape)
        if key not in report:
            report[key] = {m: _cached_time_wide(weight, is_gated, m) for m in row_counts}
        setattr(weight, WIDE_ATTR, {m: r["tiling"] for m, r in report[key].items() if takes_kernel(r, forced)})
    return report


def takes_kernel(report: dict, forced: bool | None = None) -> bool:
    """Whether a timing report of ``_time_wide`` puts its row count on the kernel: a tiling that fits and
    WIDE_MIN_GAIN of the library's time, or any tiling under WIDE_ROWS_ENV=1 (``forced`` None: read it)."""
    if forced is None:
        forced = os.environ.get(WIDE_ROWS_ENV, "") == "1"
    return report["tiling"] is not None and (forced or report["kernel_us"] < WIDE_MIN_GAIN * report["library_us"])


def _cached_time_wide(weight: torch.Tensor, gated: bool, rows: int) -> dict:
    """_time_wide through the persistent choice cache (kernels/choice_cache.py); a hit says "cached": True."""
    from kernels import _triton, fp8, linear

    candidates = WIDE_TILINGS[weight.element_size()]
    return choice_cache.timed_report(
        "wide", (tuple(weight.shape), str(weight.dtype), gated, rows, FAST_ACCUM), weight.device,
        lambda: _time_wide(weight, gated, rows), sources=(__file__, linear.__file__, fp8.__file__, _triton.__file__),
        candidates=(candidates, MAX_WIDE_SPLIT),
        valid=lambda r: r["tiling"] is None or tuple(r["tiling"][:4]) in candidates)


def _time_wide(weight: torch.Tensor, gated: bool, rows: int) -> dict:
    """Device microseconds at ``rows`` of the first tiling that fits against the library product."""
    from triton.runtime.errors import OutOfResources

    n, k = weight.shape
    copies = l2_defeating_copies(weight)
    turn = iter(range(1 << 40))
    x = torch.randn(rows, k, dtype=torch.bfloat16 if weight.dtype == FP8_DTYPE else weight.dtype, device=weight.device)
    if weight.dtype == FP8_DTYPE:  # W8A8: the rows quantized, both scales in the kernel's epilogue
        x, x_scale = quantize_rows_triton(x)
        scale = torch.ones(n, dtype=torch.float32, device=weight.device)
        scales = {"weight_scale": scale, "x_scale": x_scale, "out_dtype": torch.bfloat16}
        library = graph_time_ms(lambda: torch._scaled_mm(
            x, copies[next(turn) % len(copies)].t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
            out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)) * 1e3
    else:
        scales = {}
        library = graph_time_ms(lambda: (silu_and_mul if gated else (lambda y: y))(
            F.linear(x, copies[next(turn) % len(copies)]))) * 1e3
    for tiling in WIDE_TILINGS[weight.element_size()]:
        variant = wide_tiling(tiling, n // 2 if gated else n, k, weight.device)

        def product():
            return skinny_linear_triton(x, copies[next(turn) % len(copies)], gated=gated, **scales,
                                        **variant_options(variant))
        try:
            product()  # compiles; a tiling past the device's shared memory drops out here
        except OutOfResources:
            continue
        return {"tiling": variant, "kernel_us": graph_time_ms(product) * 1e3, "library_us": library}
    return {"tiling": None, "kernel_us": float("inf"), "library_us": library}
