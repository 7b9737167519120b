#!/usr/bin/env python3
"""SmoothQuant W8A8 INT8 decode products (``--quantization int8_sq``): the skinny int8 kernel
(kernels/int8_sq.py int8_skinny_linear: the Triton row quantizer, then kernels/linear.py's skinny kernel
with int8 tensor-core dots) against the path decode rows took before it (the same quantizer, the rows
padded to 17 for ``torch._int_mm``, the scales applied by torch) and against the bf16 model's skinny
kernel (kernels/linear.py skinny_linear_triton, no quantization), at 1, 8 and 16 rows on
Llama-3.1-8B's decode shapes: qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096 with its
SiLU-and-mul (gated), down 4096x14336. For reference also cuBLAS bf16 (F.linear, + silu_and_mul when
gated) and FP8 W8A8 (kernels/fp8.py: its row quantizer and the skinny kernel with FP8 dots).

Times are microseconds a call from CUDA-graph replays of 20 calls over copies of the weight that
together exceed twice the L2 cache (kernels.fp8.l2_defeating_copies), as the engine's load-time
choices time; the quantizers are inside the timed calls. Triton kernels launch with PDL where the
GPU has it (the engine's default), torch._int_mm and cuBLAS without. Each skinny path is the best of
its tilings (--int8-tilings, default the load-time candidates int8_sq.INT8_SKINNY_VARIANTS;
--fp8-tilings, --bf16-tilings; the best one is printed, and every int8 tiling's time in the JSON lines). Every int8
output is checked against int8_linear_ref first (relative difference printed).

    python benchmarks/quantization/int8_skinny_bench.py [--rows 1 8 16] [--out int8_skinny.md] [--json int8_skinny.json]

The markdown (dated, machine, commit: $BENCH_COMMIT first, benchmarks.common.git_commit) goes to
stdout and, with --out, to that file.
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
from kernels import int8_sq  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8 import (FP8_SKINNY_DEFAULT, QuantizedRows, _skinny_w8a8, l2_defeating_copies,  # noqa: E402
                         quantize_rows_triton, quantize_weight)
from kernels.linear import graph_time_ms, skinny_linear_triton, variant_options  # noqa: E402

# (name, N, K, gated): Llama-3.1-8B's decode products (gate_up's N is both halves: 2 x 14336).
SHAPES = (("qkv", 6144, 4096, False), ("o_proj", 4096, 4096, False), ("gate_up", 28672, 4096, True),
          ("down", 4096, 14336, False))
# (block_n, block_k, num_warps, num_stages[, split_k[, swap_ab[, waves]]]): the int8 load-time candidates.
INT8_TILINGS = int8_sq.INT8_SKINNY_VARIANTS
FP8_TILINGS = (FP8_SKINNY_DEFAULT, (64, 256, 4, 5, 1, 1), (16, 1024, 4, 4))
# HALF_EXTRA_VARIANTS' Llama-8B winners on an H200 (kernels/linear.py) and an older default.
BF16_TILINGS = ((64, 128, 4, 6, 1, 1, 1), (64, 128, 4, 4, 1, 1, 1), (32, 256, 4, 4))
DEVICE = "cuda"  # a CPU smoke test of the bookkeeping sets "cpu" (TRITON_INTERPRET=1, timings stubbed)


def int_mm_path(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool) -> torch.Tensor:
    """int8_linear's decode path before the skinny kernel: quantize, pad to 17 rows, torch._int_mm, scale in torch."""
    codes, x_scale = int8_sq.quantize_rows_int8_triton(x)
    m = codes.shape[0]
    codes = torch.cat([codes, codes.new_zeros(int8_sq.INT_MM_MIN_ROWS - m, codes.shape[1])])
    out = (torch._int_mm(codes, weight.t())[:m].float() * x_scale[:, None] * scale[None, :]).to(x.dtype)
    return silu_and_mul(out) if gated else out


def best(times: dict) -> tuple:
    """(tiling, us) of least time."""
    tiling = min(times, key=times.get)
    return tiling, times[tiling]


def time_shape(name: str, n: int, k: int, gated: bool, rows: list[int], args) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    dense = torch.randn(n, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    codes, scale = int8_sq.quantize_weight_int8(dense)
    fp8_w, fp8_s = quantize_weight(dense)
    results = []
    for kind, weight in (("int8", codes), ("fp8", fp8_w), ("bf16", dense)):
        copies = l2_defeating_copies(weight)
        turn = iter(range(1 << 40))

        def pick(copies=copies, turn=turn) -> torch.Tensor:
            return copies[next(turn) % len(copies)]

        for m in rows:
            entry = next((e for e in results if e["rows"] == m), None)
            if entry is None:
                entry = {"name": name, "n": n, "k": k, "gated": gated, "rows": m}
                results.append(entry)
            x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
            if kind == "int8":
                want = int8_sq.int8_linear_ref(x, codes, scale)
                want = silu_and_mul(want) if gated else want
                entry["int_mm_us"] = graph_time_ms(lambda: int_mm_path(x, pick(), scale, gated)) * 1e3
                entry["int_mm_rel"] = relative_difference(int_mm_path(x, codes, scale, gated), want)
                times, errors = {}, {}
                for tiling in args.int8_tilings:
                    errors[tiling] = relative_difference(
                        int8_sq.int8_skinny_linear(x, codes, scale, gated=gated, variant=tiling), want)
                    times[tiling] = graph_time_ms(lambda: int8_sq.int8_skinny_linear(
                        x, pick(), scale, gated=gated, variant=tiling)) * 1e3
                entry["int8_tiling"], entry["int8_us"] = best(times)
                entry["int8_rel"] = max(errors.values())
                entry["int8_all_us"] = {str(t): round(v, 2) for t, v in times.items()}
            elif kind == "fp8":
                times = {}
                for tiling in args.fp8_tilings:
                    times[tiling] = graph_time_ms(lambda: _skinny_w8a8(
                        QuantizedRows(*quantize_rows_triton(x), x.dtype), pick(), fp8_s, gated=gated,
                        variant=tiling)) * 1e3
                entry["fp8_tiling"], entry["fp8_us"] = best(times)
            else:
                times = {}
                for tiling in args.bf16_tilings:
                    times[tiling] = graph_time_ms(lambda: skinny_linear_triton(
                        x, pick(), gated=gated, **variant_options(tiling))) * 1e3
                entry["bf16_tiling"], entry["bf16_us"] = best(times)
                entry["cublas_us"] = graph_time_ms(
                    lambda: silu_and_mul(F.linear(x, pick())) if gated else F.linear(x, pick())) * 1e3
        del copies
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for e in results:
        print(json.dumps(json_ready(e)), flush=True)
    return results



def product_cells(e: dict) -> str:
    """A table row's first two cells: the product (name, N x K, gated) and its rows (int8_gemm_bench's too)."""
    return f"| {e['name']} {e['n']}x{e['k']}{' gated' if e['gated'] else ''} | {e['rows']}"


def tilings(text: str) -> tuple:
    return tuple(tuple(int(v) for v in item.split(",")) for item in text.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="names from SHAPES")
    parser.add_argument("--int8-tilings", type=tilings, default=INT8_TILINGS, help='"16,512,4,4 64,256,4,5,1,1"')
    parser.add_argument("--fp8-tilings", type=tilings, default=FP8_TILINGS)
    parser.add_argument("--bf16-tilings", type=tilings, default=BF16_TILINGS)
    parser.add_argument("--out", help="append the markdown here")
    parser.add_argument("--json", help="write every timing here")
    args = parser.parse_args()
    started = time.time()
    results = []
    for name, n, k, gated in SHAPES:
        if name in args.shapes:
            results.extend(time_shape(name, n, k, gated, args.rows, args))
    lines = [f"### SmoothQuant W8A8 INT8 decode products, skinny int8 kernel ({utc_now()})", "",
             f"{machine_summary(DEVICE)}, commit {git_commit()}: `{command_line(__file__)}` "
             f"({time.time() - started:.0f} s). Microseconds a call (CUDA-graph replays, L2-defeating weight copies, "
             "quantizers included); each skinny path the best of its tilings.", "",
             "| product | rows | int8 skinny (tiling) | int8 padded to 17 + _int_mm | speed-up | bf16 skinny (tiling) "
             "| cuBLAS bf16 | FP8 W8A8 skinny (tiling) | int8 skinny TB/s | rel. diff to int8_linear_ref |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in results:
        tb = e["n"] * e["k"] / (e["int8_us"] * 1e6)
        lines.append(
            f"{product_cells(e)} | {e['int8_us']:.1f} {e['int8_tiling']} | {e['int_mm_us']:.1f} "
            f"| {e['int_mm_us'] / e['int8_us']:.2f}x "
            f"| {e['bf16_us']:.1f} {e['bf16_tiling']} | {e['cublas_us']:.1f} | {e['fp8_us']:.1f} {e['fp8_tiling']} "
            f"| {tb:.2f} | {e['int8_rel']:.1e} (_int_mm {e['int_mm_rel']:.1e}) |")
    print_table("\n".join(lines) + "\n", args.out)
    write_json_rows(args.json, results)


if __name__ == "__main__":
    main()
