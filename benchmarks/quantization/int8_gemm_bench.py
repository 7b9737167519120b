#!/usr/bin/env python3
"""SmoothQuant W8A8 INT8 products past the decode rows (``--quantization int8_sq``, prefill and batched decode):
kernels/int8_gemm.py's Triton GEMM with the scaling (and the gated SiLU-and-mul) fused, against the path these
rows took before it (the Triton row quantizer, ``torch._int_mm`` into int32 (M, N), kernels/int8_sq.py
``_scaled`` in torch, + silu_and_mul when gated), against cuBLAS bf16 (F.linear, + silu_and_mul) and against
FP8 W8A8 (kernels/fp8.py fp8_linear / fp8_gated_linear at these rows: its row quantizer, ``torch._scaled_mm``
with row-wise scales, + silu_and_mul), at 64, 256, 512, 2048 and 8192 rows on Llama-3.1-8B's shapes: qkv
6144x4096, o_proj 4096x4096, gate_up 28672x4096 gated, down 4096x14336.

Times are microseconds a call from CUDA-graph replays (kernels.linear.graph_time_ms) over copies of the weight
that together exceed twice the L2 cache (kernels.fp8.l2_defeating_copies); TFLOPS = 2 M N K / time (N: all the
weight's rows, both halves when gated). The int8 GEMM is timed alone on quantized rows for every candidate
tiling (INT8_GEMM_TILINGS, gated INT8_GATED_TILINGS; every time in the JSON lines, the best printed), then with
the row quantizer (as o_proj and down_proj run it; qkv and gate_up get their rows from the norm); the int8
``_int_mm`` path and FP8 include their quantizer. Every int8 output is checked against int8_linear_ref.

    python benchmarks/quantization/int8_gemm_bench.py [--rows 64 256 512 2048 8192] [--out int8_gemm.md]
        [--json int8_gemm.json]

The markdown (dated, machine, commit: $BENCH_COMMIT first, benchmarks.common.git_commit) goes to stdout and,
with --out, to that file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import (command_line, git_commit, json_ready, machine_summary, print_table,  # noqa: E402
                               relative_difference, utc_now, write_json_rows)
from benchmarks.quantization.int8_skinny_bench import SHAPES, product_cells  # noqa: E402  (Llama-3.1-8B's)
from kernels import int8_gemm, int8_sq  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8 import fp8_gated_linear, fp8_linear, l2_defeating_copies, quantize_weight  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402

CALLS = 10  # calls a CUDA graph (the 8,192-row gate_up takes milliseconds each)
DEVICE = "cuda"  # a CPU smoke test of the bookkeeping sets "cpu" (TRITON_INTERPRET=1, timings stubbed)


def int_mm_path(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool) -> torch.Tensor:
    """int8_linear's path past 16 rows before the GEMM: quantize, torch._int_mm, scale in torch (+ silu_and_mul)."""
    rows = int8_sq.QuantizedRows(*int8_sq.quantize_rows_int8_triton(x), x.dtype)
    out = int8_sq._scaled(torch._int_mm(rows.values, weight.t()), rows, scale, None)
    return silu_and_mul(out) if gated else out


def gemm_path(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool, tiling: tuple) -> torch.Tensor:
    """The new path with the row quantizer: what int8_linear / int8_gated_linear run on model-dtype rows."""
    codes, x_scale = int8_sq.quantize_rows_int8_triton(x)
    return int8_gemm.int8_gemm(codes, x_scale, weight, scale, out_dtype=x.dtype, gated=gated, tiling=tiling)


def time_us(fn) -> float:
    return graph_time_ms(fn, repeat=CALLS) * 1e3


def time_shape(name: str, n: int, k: int, gated: bool, rows: list[int]) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    dense = torch.randn(n, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    codes, scale = int8_sq.quantize_weight_int8(dense)
    fp8_w, fp8_s = quantize_weight(dense)
    results = []
    for m in rows:
        x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
        entry = {"name": name, "n": n, "k": k, "gated": gated, "rows": m}
        want = int8_sq.int8_linear_ref(x, codes, scale)
        want = silu_and_mul(want) if gated else want
        q_codes, q_scale = int8_sq.quantize_rows_int8_triton(x)
        copies = l2_defeating_copies(codes)
        turn = iter(range(1 << 40))

        def pick(copies=copies, turn=turn) -> torch.Tensor:
            return copies[next(turn) % len(copies)]

        times, errors = {}, {}
        for tiling in int8_gemm.INT8_GATED_TILINGS if gated else int8_gemm.INT8_GEMM_TILINGS:
            try:
                out = int8_gemm.int8_gemm(q_codes, q_scale, codes, scale, out_dtype=x.dtype, gated=gated, tiling=tiling)
            except Exception as error:  # noqa: BLE001 (a tiling that does not compile here: reported, skipped)
                print(f"{name} {tiling}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            errors[tiling] = relative_difference(out, want)
            times[tiling] = time_us(lambda: int8_gemm.int8_gemm(q_codes, q_scale, pick(), scale, out_dtype=x.dtype,
                                                                  gated=gated, tiling=tiling))
        tiling = min(times, key=times.get)
        equal = None if gated else bool(torch.equal(gemm_path(x, codes, scale, gated, tiling), want))
        entry.update(gemm_tiling=tiling, gemm_us=times[tiling], gemm_rel=max(errors.values()), gemm_equal=equal,
                     gemm_all_us={str(t): round(v, 2) for t, v in times.items()},
                     default_tiling=int8_gemm.default_tiling(m, gated),
                     default_us=times.get(int8_gemm.default_tiling(m, gated)))
        entry["gemm_quantized_us"] = time_us(lambda: gemm_path(x, pick(), scale, gated, tiling))
        entry["int_mm_us"] = time_us(lambda: int_mm_path(x, pick(), scale, gated))
        entry["int_mm_rel"] = relative_difference(int_mm_path(x, codes, scale, gated), want)
        del copies
        copies = l2_defeating_copies(fp8_w)
        entry["fp8_us"] = time_us(lambda: (fp8_gated_linear(x, pick(copies), fp8_s) if gated
                                           else fp8_linear(x, pick(copies), fp8_s)))
        del copies
        copies = l2_defeating_copies(dense)
        entry["bf16_us"] = time_us(lambda: silu_and_mul(F.linear(x, pick(copies))) if gated
                                   else F.linear(x, pick(copies)))
        del copies
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(json_ready(entry)), flush=True)
        results.append(entry)
    return results


BIT_EQUAL = {True: "yes", False: "no", None: "gated"}



def tflops(e: dict, us: float) -> float:
    return 2 * e["rows"] * e["n"] * e["k"] / (us * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512, 2048, 8192])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="names from SHAPES")
    parser.add_argument("--out", help="append the markdown here")
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args()
    started = time.time()
    results = []
    for name, n, k, gated in SHAPES:
        if name in args.shapes:
            results.extend(time_shape(name, n, k, gated, args.rows))
    lines = [f"### SmoothQuant W8A8 INT8 products past the decode rows, Triton GEMM ({utc_now()})", "",
             f"{machine_summary(DEVICE)}, commit {git_commit()}: `{command_line(__file__)}` "
             f"({time.time() - started:.0f} s). Microseconds a call (CUDA-graph replays, L2-defeating weight copies), "
             "TFLOPS = 2 M N K / time; the int8 GEMM alone (best tiling: block_m, block_n, block_k, warps, stages) "
             "and with its row quantizer; the _int_mm path and FP8 with theirs.", "",
             "| product | rows | int8 GEMM (tiling) | TFLOPS | default tiling | + quantizer | quantizer + _int_mm + "
             "_scaled | speed-up | cuBLAS bf16 | TFLOPS | FP8 _scaled_mm | TFLOPS | int8 speed-up over bf16 "
             "| rel. diff to int8_linear_ref (bit-equal) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in results:
        default = f"{e['default_us']:.1f}" if e["default_us"] else "-"
        lines.append(
            f"{product_cells(e)} | {e['gemm_us']:.1f} {e['gemm_tiling']} | {tflops(e, e['gemm_us']):.0f} | {default} "
            f"| {e['gemm_quantized_us']:.1f} | {e['int_mm_us']:.1f} | {e['int_mm_us'] / e['gemm_quantized_us']:.2f}x "
            f"| {e['bf16_us']:.1f} | {tflops(e, e['bf16_us']):.0f} | {e['fp8_us']:.1f} | {tflops(e, e['fp8_us']):.0f} "
            f"| {e['bf16_us'] / e['gemm_quantized_us']:.2f}x | {e['gemm_rel']:.1e} ({BIT_EQUAL[e['gemm_equal']]};"
            f" _int_mm {e['int_mm_rel']:.1e}) |")
    print_table("\n".join(lines) + "\n", args.out)
    write_json_rows(args.json, results)


if __name__ == "__main__":
    main()
