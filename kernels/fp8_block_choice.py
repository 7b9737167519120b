"""The engine load's choice between block-FP8 products' two decode paths, per weight shape: kernels/fp8_block_skinny.py
(the E4M3 weight widened in registers, the rows unquantized) in one of its tilings, or kernels/fp8_block.py's quantize
+ block GEMM. kernels/fp8_block.py ``fp8_block_linear`` reads the mark (fp8_block_skinny.VARIANT_ATTR) at up to
MAX_SKINNY_ROWS rows.

Timed at 1 and 8 rows, as the other skinny choices (kernels/linear.py choose_skinny_weights): batch 1 and a small
batch. 9-16 rows run the same programs as 8 (both kernels pad the rows to one 16-row dot tile and stream the weight
once), so the verdict at 8 holds there; past 16 the block GEMM's row tiles (and from 128 rows cuBLAS) are the
prefill paths, unchanged.
"""
from __future__ import annotations

import time

import torch

from kernels import _triton, choice_cache, e4m3_bits, e4m3_rows, fp8_block, fp8_block_skinny, linear
from kernels._triton import triton, use_triton
from kernels.fp8 import FP8_DTYPE, l2_defeating_copies
from kernels.fp8_block import fp8_block_linear_triton
from kernels.fp8_block_skinny import (SCALE_BLOCK, VARIANT_ATTR, candidate_variants, fp8_block_skinny_triton,
                                      skinny_options)
from kernels.linear import _TOO_LARGE, graph_time_ms

# The margin, as kernels/linear.py's: both paths are timed from graph replays, so 1% only absorbs noise.
WIN_MARGIN = 0.99


@torch.inference_mode()
def choose_fp8_block_skinny(weights: list[torch.Tensor], dtype: torch.dtype, rows: tuple[int, ...] = (1, 8)
                            ) -> dict[tuple[int, int], dict]:
    """Per distinct (N, K) of the block-FP8 CUDA ``weights`` (E4M3, their scales block-wise), the activations in
    ``dtype``: kernels/fp8_block_skinny.py's candidate_variants() and quantize + block GEMM
    (fp8_block_linear_triton, the path it replaces) timed at each of ``rows`` from CUDA graphs over copies that
    defeat the L2 cache; each weight marked (VARIANT_ATTR) with the tiling of least summed time where it beats the
    block GEMM by WIN_MARGIN at every row count, else False. Through the persistent choice cache
    (kernels/choice_cache.py). Returns the reports per shape (timings in microseconds) for the load log. A no-op
    off CUDA, or for activations other than bf16/fp16."""
    report: dict[tuple[int, int], dict] = {}
    if dtype not in (torch.bfloat16, torch.float16):
        return report
    for weight in weights:
        if not use_triton(weight) or weight.dim() != 2 or weight.dtype != FP8_DTYPE:
            continue
        shape = tuple(weight.shape)
        if shape not in report:
            report[shape] = choice_cache.timed_report(
                "fp8_block_skinny", (shape, str(dtype), tuple(rows)), weight.device,
                lambda: _time_shape(shape, dtype, weight.device, rows), sources=_sources(),
                candidates=candidate_variants(),
                valid=lambda r: r.get("variant", False) is False or r["variant"] in candidate_variants())
        setattr(weight, VARIANT_ATTR, report[shape]["variant"])
    return report


def _sources() -> tuple[str, ...]:
    """The files of the kernels the choice times (kernels/choice_cache.py's key)."""
    return (__file__, fp8_block_skinny.__file__, linear.__file__, fp8_block.__file__, _triton.__file__,
            e4m3_rows.__file__, e4m3_bits.__file__)


def _time_shape(shape: tuple[int, int], dtype: torch.dtype, device, rows: tuple[int, ...]) -> dict:
    """The report choose_fp8_block_skinny keeps for a shape: both paths' microseconds at each row count
    ("variant_us": every candidate's), the choice, and "seconds": this timing's wall time, compiles included."""
    began = time.perf_counter()
    n, k = shape
    weight = (torch.randn(n, k, device=device) * 64).to(FP8_DTYPE)
    copies = [(w, torch.rand(triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK), device=device) * 1e-3)
              for w in l2_defeating_copies(weight)]
    turn = iter(range(1 << 40))

    def next_copy():
        return copies[next(turn) % len(copies)]

    candidates = candidate_variants()
    block_gemm, variants = {}, {v: {} for v in candidates}
    for m in rows:
        x = torch.randn(m, k, dtype=dtype, device=device)
        block_gemm[m] = graph_time_ms(lambda: fp8_block_linear_triton(x, *next_copy())) * 1e3
        for v in candidates:
            if v not in variants:
                continue  # it did not fit at the first row count
            try:  # a tiling that outgrows shared memory on this device drops out
                fp8_block_skinny_triton(x, *next_copy(), **skinny_options(v))
            except _TOO_LARGE:
                del variants[v]
                continue
            variants[v][m] = graph_time_ms(lambda: fp8_block_skinny_triton(x, *next_copy(), **skinny_options(v))) * 1e3
    best = min(variants, key=lambda v: sum(variants[v].values()))
    wins = all(variants[best][m] < WIN_MARGIN * block_gemm[m] for m in rows)
    return {"block_gemm_us": block_gemm, "best_variant": best, "best_us": variants[best],
            "variant": best if wins else False, "variant_us": variants, "seconds": time.perf_counter() - began}

