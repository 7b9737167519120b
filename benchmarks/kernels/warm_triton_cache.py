#!/usr/bin/env python3
"""Compile every tiling an engine's load may time (the skinny GEMM candidates) into Triton's on-disk
cache from many processes at once, before a benchmark on a fresh GPU machine.

    python benchmarks/kernels/warm_triton_cache.py [--kinds bf16,fp8,int8] [--jobs 14]

Why: on a cold cache an engine's load compiles each candidate one after the other in its own process
(kernels/linear.py choose_skinny_weights / choose_gated_weights: half_variants(), 10 tilings, plain and
gated; kernels/fp8.py choose_fp8_skinny_variants: SKINNY_VARIANTS + FP8_EXTRA_VARIANTS, 27, plain and
gated; kernels/int8_sq.py choose_int8_skinny_variants: INT8_SKINNY_VARIANTS, 8, plain and gated, with the
int8 row quantizer): 20, 54 and 16 compiles of ~1 s, most of what made two GPU runs of 2026-11-29 end inside their
engines' load (tree_bench's FP8 load > 55 s). Here a pool of processes compiles them side by side; the
engine's load then reads them from the cache (same kernels, same constexprs, same specialization: the
products are launched as the load times them, on shapes whose sizes are multiples of 16 like the real
models', and the row count is not specialized: one compile serves 1-16 rows). Prints the kernels compiled,
the seconds, and any tiling that does not fit this device (as the load drops it too).

``--device cpu`` (under TRITON_INTERPRET=1) runs the same launches through the interpreter: a smoke
run of the job list, nothing cached.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: kernels

KINDS = ("bf16", "fp8", "int8")
N, K = 2048, 4096  # multiples of 16 (a gated weight is (2N, K)); the real models' sizes are too


def jobs(kinds: list[str]) -> list[tuple[str, tuple, bool]]:
    """(kind, tiling, gated) for every product the load may time."""
    from kernels.fp8 import FP8_EXTRA_VARIANTS
    from kernels.int8_sq import INT8_SKINNY_VARIANTS
    from kernels.linear import SKINNY_VARIANTS, half_variants

    tilings = {"bf16": half_variants(), "fp8": SKINNY_VARIANTS + FP8_EXTRA_VARIANTS, "int8": INT8_SKINNY_VARIANTS}
    return [(kind, tiling, gated) for kind in kinds for tiling in tilings[kind] for gated in (False, True)]


_inputs: dict = {}


def _launch(job: tuple[str, tuple, bool], device: str) -> tuple[tuple, float, str]:
    """One product as the load times it (kernels/linear.py _time_shape, kernels/fp8.py
    _fastest_fp8_variant, kernels/int8_sq.py _fastest_int8_variant): its first launch compiles it, or reads it
    from the cache."""
    import torch

    from kernels.fp8 import quantize_rows_triton, quantize_weight
    from kernels.int8_sq import int8_skinny_linear, quantize_weight_int8
    from kernels.linear import skinny_linear_triton, variant_options

    kind, tiling, gated = job
    if kind == "int8":  # int8_skinny_linear as the load times it: bf16 rows quantized by its Triton kernel
        if kind not in _inputs:
            torch.manual_seed(0)
            _inputs[kind] = (torch.randn(1, K, dtype=torch.bfloat16, device=device),
                             *quantize_weight_int8(torch.randn(2 * N, K, device=device)))
        x, codes, scale = _inputs[kind]
        started = time.perf_counter()
        try:
            if gated:
                int8_skinny_linear(x, codes, scale, gated=True, variant=tiling)
            else:
                int8_skinny_linear(x, codes[:N], scale[:N], variant=tiling)
            if device != "cpu":
                torch.cuda.synchronize()
            outcome = "ok"
        except Exception as error:  # (as below)
            outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
        return job, time.perf_counter() - started, outcome
    if kind not in _inputs:
        torch.manual_seed(0)
        rows = 1
        if kind == "fp8":
            weight, scale = quantize_weight(torch.randn(2 * N, K, device=device) * 0.02)
            x, x_scale = quantize_rows_triton(torch.randn(rows, K, dtype=torch.bfloat16, device=device))
            _inputs[kind] = (x, weight, dict(weight_scale=scale[:N], x_scale=x_scale, out_dtype=torch.bfloat16),
                             dict(weight_scale=scale, x_scale=x_scale, out_dtype=torch.bfloat16))
        else:
            x = torch.randn(rows, K, dtype=torch.bfloat16, device=device)
            _inputs[kind] = (x, torch.randn(2 * N, K, dtype=torch.bfloat16, device=device) * 0.02, {}, {})
    x, weight, plain_options, gated_options = _inputs[kind]
    started = time.perf_counter()
    try:
        if gated:
            skinny_linear_triton(x, weight, gated=True, **gated_options, **variant_options(tiling))
        else:
            skinny_linear_triton(x, weight[:N], **plain_options, **variant_options(tiling))
        if device != "cpu":
            torch.cuda.synchronize()
        outcome = "ok"
    except Exception as error:  # a tiling too large for this device's shared memory: the load drops it too
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return job, time.perf_counter() - started, outcome


def _worker(args: tuple) -> tuple[tuple, float, str]:
    job, device = args
    return _launch(job, device)


def warm(kinds: list[str], processes: int, device: str = "cuda", limit: int = 0) -> dict:
    """Every product of ``kinds`` (``limit``: the first of each kind only), launched once by a pool of processes."""
    todo = [job for kind in kinds for job in jobs([kind])[:limit or None]]
    started = time.perf_counter()
    if processes <= 1:
        results = [_launch(job, device) for job in todo]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = list(pool.imap_unordered(_worker, [(job, device) for job in todo]))
    seconds = time.perf_counter() - started
    failed = [(job, outcome) for job, _, outcome in results if outcome != "ok"]
    slowest = sorted(results, key=lambda r: -r[1])[:5]
    named = [f"{kind} {tiling}{' gated' if gated else ''} {s:.1f} s" for (kind, tiling, gated), s, _ in slowest]
    print(f"warm_triton_cache: {len(results)} products ({', '.join(kinds)}) in {seconds:.1f} s on {processes} "
          f"processes; compile + first launch, slowest: {', '.join(named)}", flush=True)
    for (kind, tiling, gated), outcome in failed:
        print(f"  not compiled: {kind} {tiling}{' gated' if gated else ''}: {outcome}", flush=True)
    return {"products": len(results), "seconds": seconds, "failed": len(failed)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="bf16,fp8,int8", help=f"comma-separated subset of {KINDS}")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (multiprocessing.cpu_count() or 2) - 2)),
                        help="processes (default: the cores less two, at most 14)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (a smoke run)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N products of each kind (smoke runs)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; allowed: {list(KINDS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("warm_triton_cache: no CUDA device, nothing compiled", flush=True)
            return {"products": 0, "seconds": 0.0, "failed": 0}
    return warm(kinds, args.jobs, args.device, args.limit)


if __name__ == "__main__":
    main()
