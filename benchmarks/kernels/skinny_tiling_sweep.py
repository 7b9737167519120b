#!/usr/bin/env python3
"""Skinny-GEMM tilings (kernels/linear.py) on the exact decode weight shapes of BLOOM-7B1, Falcon-7B
and Llama-3.1-8B, at 1 and 8 rows, against cuBLAS: which tilings the load-time choice should try.

    python benchmarks/kernels/skinny_tiling_sweep.py --out sweep.json [--models falcon7b,bloom7b1,llama8b]
        [--candidates extra]  # the load-time set plus EXTRA_CANDIDATES (default), or "current" alone

Each (shape, kind) is timed as ``kernels.linear._time_shape`` times it at load (graph replays of 20
calls over two copies of the weight, PDL as the engine launches before its PDL choice): the plain
product, the up projection with its bias and activation (BLOOM's gelu_tanh, Falcon's gelu: the
unfused side is F.linear(bias) + the activation), Llama's gate_up with SiLU-and-mul (gated). Every
tiling's output is checked against the float64 product first. For BLOOM's up projection it also
times cuBLASLt's GELU_BIAS epilogue (torch._addmm_activation), for information.

The set it prints as ``selected`` is the load-time set (kernels.linear.half_variants()) plus, for each
(shape, kind), the candidate of least summed time over the row counts (the load-time rule) when it
beats the current set's best by --margin; ``--selected-out`` writes it as JSON (to run the engine with
that set, assign its new tilings to kernels.linear.HALF_EXTRA_VARIANTS before the engine loads).
2026-11-29 on an H200 the balanced EXTRA_CANDIDATES below gave HALF_EXTRA_VARIANTS; benchmarks/results/engine.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

# Tilings tried beside the load-time set: (block_n, block_k, warps, stages[, split_k[, swap_ab[, waves]]]).
# Balanced (waves > 0): each program covers cdiv(N, waves x SMs) features of its block_n tile, so every
# SM streams the same share of the weight. (2026-11-29, first H200 sweep: more split-K, 16-wide tiles
# on 2 or 8 warps and 64-wide swap_ab tiles of the fixed tiling won no shape by 2%; see
# benchmarks/results/engine.md.)
EXTRA_CANDIDATES = (
    (64, 128, 4, 6, 1, 0, 1), (64, 128, 4, 6, 1, 1, 1), (64, 256, 4, 4, 1, 1, 1), (64, 128, 4, 4, 1, 1, 1),
    (64, 128, 4, 4, 2, 1, 1), (32, 128, 4, 6, 1, 0, 2), (32, 256, 4, 4, 1, 0, 2), (64, 128, 4, 6, 1, 1, 3),
    (128, 128, 8, 4, 1, 1, 2),
)

# (name, N, K, kind): kind "plain", "gated", or an activation (the up projection with its bias).
SHAPES = {
    "falcon7b": [("qkv", 4672, 4544, "plain"), ("o_proj", 4544, 4544, "plain"), ("up", 18176, 4544, "plain"),
                 ("up", 18176, 4544, "gelu"), ("down", 4544, 18176, "plain")],
    "bloom7b1": [("qkv", 12288, 4096, "plain"), ("o_proj", 4096, 4096, "plain"), ("up", 16384, 4096, "plain"),
                 ("up", 16384, 4096, "gelu_tanh"), ("down", 4096, 16384, "plain")],
    "llama8b": [("qkv", 6144, 4096, "plain"), ("o_proj", 4096, 4096, "plain"), ("gate_up", 28672, 4096, "gated"),
                ("down", 4096, 14336, "plain")],
}
ROWS = (1, 8)
DEVICE, DTYPE = "cuda", "bfloat16"  # a CPU smoke test of the bookkeeping: "cpu", "float32" (TRITON_INTERPRET=1)


def _compile(job: tuple) -> tuple | None:
    """One tiling in one specialization, launched once on small tensors (same integer
    specializations as the real shapes: every dimension a multiple of 16), so the process that
    times them finds it in Triton's cache."""
    variant, kind, pdl = job
    import torch

    from kernels._triton import set_pdl
    from kernels.linear import skinny_linear_triton, variant_options

    set_pdl(pdl)

    try:
        x = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEVICE)
        w = torch.randn(512, 4096, dtype=torch.bfloat16, device=DEVICE)
        if kind == "gated":
            skinny_linear_triton(x, w, gated=True, **variant_options(variant))
        elif kind == "plain":
            skinny_linear_triton(x, w, **variant_options(variant))
        else:
            skinny_linear_triton(x, w, torch.zeros(512, dtype=torch.bfloat16, device=DEVICE), activation=kind,
                                 **variant_options(variant))
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - reported, the tiling then drops out of the sweep
        return variant, f"{kind} pdl={pdl}", f"{type(exc).__name__}: {str(exc)[:200]}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="falcon7b,bloom7b1,llama8b")
    parser.add_argument("--candidates", default="extra", choices=["extra", "current"])
    parser.add_argument("--margin", type=float, default=0.02, help="a new tiling joins when this much faster")
    parser.add_argument("--compile-workers", type=int, default=min(14, os.cpu_count() or 1))
    parser.add_argument("--out", default=None)
    parser.add_argument("--selected-out", default=None)
    args = parser.parse_args(argv)

    import multiprocessing

    import torch
    import torch.nn.functional as F

    from kernels.activation import silu_and_mul
    from kernels.linear import (_cublaslt_gelu_is_tanh, activation_ref, graph_time_ms, half_variants,
                                skinny_linear_triton, variant_options)

    dtype = getattr(torch, DTYPE)
    current = tuple(tuple(v) for v in half_variants())
    candidates = current + tuple(v for v in EXTRA_CANDIDATES if v not in current) if args.candidates == "extra" \
        else current
    shapes = [(model, *shape) for model in args.models.split(",") for shape in SHAPES[model]]
    kinds = sorted({s[4] for s in shapes})
    started = time.time()
    # PDL on (as the load-time timing launches); off too for the plain and gelu_tanh kinds, which an
    # engine process times again with PDL off once its first model chose it off (BLOOM's executor).
    jobs = [(v, k, True) for v in candidates for k in kinds] + [
        (v, k, False) for v in candidates for k in kinds if k in ("plain", "gelu_tanh")]
    if args.compile_workers > 0:
        with ProcessPoolExecutor(args.compile_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failures = [f for f in pool.map(_compile, jobs) if f]
    else:
        failures = []
    for failure in failures:
        print("compile failed:", *failure)
    broken = {f[0] for f in failures}
    candidates = tuple(v for v in candidates if v not in broken)
    print(f"compiled {len(candidates)} tilings x {len(kinds)} kinds in {time.time() - started:.1f} s", flush=True)

    rows_out, selected = [], list(current)
    for model, name, n, k, kind in shapes:
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        copies = [torch.randn(n, k, dtype=dtype, device=DEVICE, generator=gen) * 0.02 for _ in range(2)]
        bias = None if kind in ("plain", "gated") else torch.randn(n, dtype=dtype, device=DEVICE) * 0.1
        turn = [0]

        def weight() -> torch.Tensor:
            turn[0] += 1
            return copies[turn[0] % 2]

        entry = {"model": model, "name": name, "n": n, "k": k, "kind": kind, "cublas_us": {}, "tilings": {},
                 "errors": {}, "weight_MB": n * k * 2 / 1e6}
        for m in ROWS:
            x = torch.randn(m, k, dtype=dtype, device=DEVICE, generator=gen)
            if kind == "gated":
                def ref(w):
                    return silu_and_mul(F.linear(x, w))
                precise = silu_and_mul(F.linear(x.double(), copies[0].double()).to(dtype))
            elif kind == "plain":
                def ref(w):
                    return F.linear(x, w)
                precise = F.linear(x.double(), copies[0].double())
            else:
                def ref(w):
                    return activation_ref(F.linear(x, w, bias), kind)
                precise = activation_ref(F.linear(x.double(), copies[0].double(), bias.double()), kind)
            entry["cublas_us"][m] = graph_time_ms(lambda: ref(weight())) * 1e3
            if kind == "gelu_tanh" and DEVICE == "cuda":
                entry["addmm_gelu_is_tanh"] = _cublaslt_gelu_is_tanh(copies[0])
                entry.setdefault("addmm_gelu_us", {})[m] = graph_time_ms(
                    lambda: torch._addmm_activation(bias, x, weight().t(), use_gelu=True)) * 1e3
                fused = torch._addmm_activation(bias, x, copies[0].t(), use_gelu=True)
                entry.setdefault("addmm_gelu_rel_err", {})[m] = _rel(fused, precise)
            for v in candidates:
                options = dict(variant_options(v), gated=kind == "gated",
                               activation=None if kind in ("plain", "gated") else kind)
                out = skinny_linear_triton(x, copies[0], bias, **options)
                entry["errors"].setdefault(str(v), {})[m] = _rel(out, precise)
                entry["tilings"].setdefault(str(v), {})[m] = graph_time_ms(
                    lambda: skinny_linear_triton(x, weight(), bias, **options)) * 1e3
        ok = [v for v in candidates if max(entry["errors"][str(v)].values()) < 1e-2]
        bad = [str(v) for v in candidates if v not in ok]

        def total(v):
            return sum(entry["tilings"][str(v)].values())

        best_current = min((v for v in current if v in ok), key=total)
        best = min(ok, key=total)
        entry.update(best_current=str(best_current), best=str(best), wrong=bad,
                     chosen_before=str(best_current) if all(entry["tilings"][str(best_current)][m] < 0.99 * entry["cublas_us"][m] for m in ROWS) else "cublas")
        if best not in current and total(best) < (1 - args.margin) * total(best_current):
            entry["joins"] = True
            if best not in selected:
                selected.append(best)
        rows_out.append(entry)
        del copies
        torch.cuda.empty_cache()
        _print_row(entry)

    # what the load-time rule picks from the selected set, per (shape, kind)
    for entry in rows_out:
        pick = min((v for v in selected if str(v) in entry["tilings"] and str(v) not in entry["wrong"]),
                   key=lambda v: sum(entry["tilings"][str(v)].values()))
        wins = all(entry["tilings"][str(pick)][m] < 0.99 * entry["cublas_us"][m] for m in ROWS)
        entry["chosen_after"] = str(pick) if wins else "cublas"
    print("\n| model | weight | kind | before (us at 1 / 8 rows) | after | TB/s at 1 row before -> after |")
    print("|---|---|---|---|---|---|")
    for e in rows_out:
        before, after = (_us(e, e[key]) for key in ("chosen_before", "chosen_after"))
        tb = [e["weight_MB"] / t[1] for t in (before, after)]
        print(f"| {e['model']} | {e['name']} {e['n']}x{e['k']} | {e['kind']} | {e['chosen_before']} "
              f"{before[1]:.1f} / {before[8]:.1f} | {e['chosen_after']} {after[1]:.1f} / {after[8]:.1f} | "
              f"{tb[0]:.2f} -> {tb[1]:.2f} |")
    print("selected", json.dumps(selected))
    result = {"candidates": [list(v) for v in candidates], "selected": [list(v) for v in selected],
              "shapes": rows_out, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "seconds": time.time() - started}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.selected_out:
        Path(args.selected_out).write_text(json.dumps([list(v) for v in selected]))
    return result


def _rel(out, precise) -> float:
    return float((out.double() - precise.double()).norm() / precise.double().norm().clamp_min(1e-30))


def _us(entry: dict, choice: str) -> dict:
    return entry["cublas_us"] if choice == "cublas" else {int(m): t for m, t in entry["tilings"][choice].items()}


def _print_row(e: dict) -> None:
    ranked = sorted(e["tilings"], key=lambda v: sum(e["tilings"][v].values()))[:4]
    mb = e["weight_MB"]
    parts = [f"cublas {e['cublas_us'][1]:.1f}/{e['cublas_us'][8]:.1f} ({mb / e['cublas_us'][1]:.2f} TB/s)"]
    if "addmm_gelu_us" in e:
        parts.append(f"addmm_gelu {e['addmm_gelu_us'][1]:.1f}/{e['addmm_gelu_us'][8]:.1f} "
                     f"err {max(e['addmm_gelu_rel_err'].values()):.1e} tanh {e.get('addmm_gelu_is_tanh')}")
    parts += [f"{v} {e['tilings'][v][1]:.1f}/{e['tilings'][v][8]:.1f} ({mb / e['tilings'][v][1]:.2f})" for v in ranked]
    print(f"{e['model']} {e['name']} {e['n']}x{e['k']} {e['kind']}: best-current {e['best_current']}, "
          + "; ".join(parts) + (f"; WRONG {e['wrong']}" if e["wrong"] else ""), flush=True)


if __name__ == "__main__":
    main()
