"""FP8 products of 17-128 rows on the skinny W8A8 kernel: the tree verify steps at batch 1.

Why: a tree verify step of a 16-64 node tree carries 17-65 tokens. Past MAX_SKINNY_ROWS (16) the
FP8 products went to cuBLASLt's row-wise-scaled GEMM (``torch._scaled_mm``), which at these row
counts streams the weights far slower than the skinny decode kernels: on an H200 (2026-11-29,
benchmarks/speculative/tree_bench.py, Llama-8B shape, batch 1) tree verify steps of 16, 32 and 64
nodes cost 5.41, 5.52 and 5.65 ms against 2.84 for a decode step, nearly the same for every tree
size, so the cost is the weights' read rate, not the rows (the H100 showed the same: ~5.6 ms for a
64-row step against ~3.5 for the skinny kernels, benchmarks/results/speculative.md). An FP8 8B
model's weights are ~7.5 GB: ~1.6 ms at the H200's bandwidth, while 65 rows of FP8 tensor-core work
on them is ~1 ms at peak, so a kernel that streams the weight once at the decode rate wins.

What: at engine load (engine/executor/runner.py choose_kernels), for each FP8 weight shape (plain,
or gated: [gate | up] with the SiLU fused) and each padded row count of WIDE_ROW_COUNTS the engine's
steps can reach, the skinny kernel with a wide-row tiling is timed against ``torch._scaled_mm`` at
that many rows (device time from CUDA graphs, weights copied past the L2 cache); where the kernel
wins by WIDE_MIN_GAIN the weight keeps {padded rows: tiling} (attribute fp8.WIDE_VARIANTS_ATTR),
which fp8_linear / fp8_gated_linear read. A shape where cuBLASLt wins keeps cuBLASLt: the choice
never makes a product slower than what the engine ran before (up to timing noise).

Tiling (WIDE_TILINGS, the first that fits the device's shared memory): swapped operands, so the
64-feature weight tile is the warpgroup MMA's first operand and the padded rows its second (N up
to 128); K tiles of 256 over 3 stages (at 128 rows: 32 KB of rows + 16 KB of weight, gated 32 KB,
a stage); split-K so the programs cover the SMs at least once (a 4,096-feature product is 64 tiles
of 64 features: 3 splits on 132 SMs), at most MAX_WIDE_SPLIT. The numbers are the decode path's
(the same E4M3 values multiplied exactly, both scales in the epilogue): one bf16 rounding from the
W8A8 reference, like every other FP8 path.

``TRITONLLM_FP8_WIDE_ROWS=0`` skips the choice (every such product stays on cuBLASLt).
"""
from __future__ import annotations

import os

import torch

from kernels._triton import num_sms, triton
from kernels.fp8 import FAST_ACCUM, WIDE_VARIANTS_ATTR, l2_defeating_copies, quantize_rows_triton
from kernels.linear import MAX_SKINNY_ROWS, MAX_WIDE_ROWS, graph_time_ms, padded_rows, skinny_linear_triton, variant_options

WIDE_ROW_COUNTS = (32, 64, 128)  # padded rows timed: 17-32, 33-64 and 65-128 rows
WIDE_TILINGS = ((64, 256, 4, 3), (64, 128, 4, 4))  # (block_n, block_k, warps, stages); swap_ab, split-K added
MAX_WIDE_SPLIT = 4
WIDE_MIN_GAIN = 0.97  # the kernel replaces cuBLASLt only where it takes at most this share of its time
WIDE_ROWS_ENV = "TRITONLLM_FP8_WIDE_ROWS"


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
def choose_fp8_wide_variants(weights: list[torch.Tensor], gated: list[torch.Tensor] = (),
                             row_counts: tuple[int, ...] = WIDE_ROW_COUNTS) -> dict[tuple, dict]:
    """Per distinct FP8 weight shape (key (N, K), gated ("gated", N, K)) and padded row count of
    ``row_counts``: {"kernel_us", "cublaslt_us", "tiling"} and, set on every weight of that shape,
    {rows: tiling} for the row counts where the kernel won. CUDA only; a no-op under WIDE_ROWS_ENV=0."""
    report: dict[tuple, dict] = {}
    if os.environ.get(WIDE_ROWS_ENV, "1") == "0":
        return report
    for weight, is_gated in [(w, False) for w in weights] + [(w, True) for w in gated]:
        key = (("gated",) if is_gated else ()) + tuple(weight.shape)
        if key not in report:
            report[key] = {m: _time_wide(weight, is_gated, m) for m in row_counts}
        setattr(weight, WIDE_VARIANTS_ATTR, {m: r["tiling"] for m, r in report[key].items()
                                             if r["tiling"] is not None and r["kernel_us"] < WIDE_MIN_GAIN * r["cublaslt_us"]})
    return report


def _time_wide(weight: torch.Tensor, gated: bool, rows: int) -> dict:
    """Device microseconds of the first WIDE_TILINGS tiling that fits against torch._scaled_mm, at ``rows``."""
    from triton.runtime.errors import OutOfResources

    n, k = weight.shape
    features = n // 2 if gated else n
    copies = l2_defeating_copies(weight)
    turn = iter(range(1 << 40))
    scale = torch.ones(n, dtype=torch.float32, device=weight.device)
    x, x_scale = quantize_rows_triton(torch.randn(rows, k, dtype=torch.bfloat16, device=weight.device))
    cublaslt = graph_time_ms(lambda: torch._scaled_mm(
        x, copies[next(turn) % len(copies)].t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
        out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)) * 1e3
    for tiling in WIDE_TILINGS:
        variant = wide_tiling(tiling, features, k, weight.device)

        def product():
            return skinny_linear_triton(x, copies[next(turn) % len(copies)], weight_scale=scale, x_scale=x_scale,
                                        out_dtype=torch.bfloat16, gated=gated, **variant_options(variant))
        try:
            product()  # compiles; a tiling past the device's shared memory drops out here
        except OutOfResources:
            continue
        return {"tiling": variant, "kernel_us": graph_time_ms(product) * 1e3, "cublaslt_us": cublaslt}
    return {"tiling": None, "kernel_us": float("inf"), "cublaslt_us": cublaslt}
