"""W4A16 from the one operand-order layout against cuBLAS bf16, M = 1 ... 1024, Llama-3.1-8B's TP1 shapes
(group 128 with zero points, bf16 activations, weights streamed from HBM: copies of the words together
over twice the L2, as kernels.wna16's load-time timing; device time from CUDA graph replays).

Per shape and M: cuBLAS on the bf16 weight (us, TFLOPS); the decode kernel's best MMA_VARIANTS tiling
(kernels/wna16_mma.py, M <= 16); from 16 rows the rows kernel's best ROWS_VARIANTS + ROWS_CANDIDATES tiling
(kernels/wna16_mma_rows.py; also at 16, where the decode kernel's two n8 blocks measured slow, and
at 1024, past the dispatch's 256, for the record) and past 16 rows dequantize
into the scratch + cuBLAS (kernels/wna16_mma_dense.py; the load-time timing picks between the two); the
best's ratio to cuBLAS (> 1: INT4 faster) and its error against the dequantized reference.
A second table: the dequantize kernel alone (kernels/wna16_mma_dense.py, the DENSE path's first
half) per shape and program tiling (row tiles, k blocks), us and GB/s of words read plus bf16 written,
beside a device copy of the bf16 weight (the bandwidth it should approach).

    python benchmarks/quantization/wna16_rows_bench.py --out rows.json --md rows.md [--rows 1,16,64,256,1024]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import wna16, wna16_mma_dense  # noqa: E402
from kernels.fp8 import l2_defeating_copies  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402
from kernels.wna16 import (DENSE, MAX_SKINNY_ROWS, MMA_VARIANTS, ROWS_VARIANTS, dequantized_weight,  # noqa: E402
                           prepare_wna16, quantize)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Rows-kernel tilings timed here beside ROWS_VARIANTS (those the engine times at load): num_stages 3 reads
# every next k block's words and x fragments ahead (the best ROWS_VARIANTS' splits); split-K 8 for the
# 64-row products of the narrower layers (qkv/o/down chose split 4, the largest timed); 8 warps without
# the prefetch (no prefetch won at 256 rows with 4 warps). All compile for sm_90 without spills.
ROWS_CANDIDATES = ((128, 32, 4, 3, 1, 7), (128, 32, 4, 3, 2, 7), (128, 32, 4, 3, 4, 7), (64, 32, 4, 3, 4, 7),
                   (128, 32, 4, 2, 8, 7), (128, 32, 8, 1, 1, 7))
DEQUANT_TILINGS = ((4, 2), (4, 4), (2, 4), (4, 8), (8, 4))  # (row tiles, k blocks) a program of the dequantize kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wna16_rows_bench.json")
    parser.add_argument("--md", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,16,64,256,1024")
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = ["| shape | M | cuBLAS bf16 us (TFLOPS) | INT4 decode kernel us | INT4 rows kernel: tiling, us | "
             "INT4 dequant + cuBLAS us | best INT4 / cuBLAS speed | rel. error |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    dequant_lines = ["| shape | bf16 copy us (GB/s) | "
                     + " | ".join(f"dequantize {t} us (GB/s)" for t in DEQUANT_TILINGS) + " |",
                     "|---|---:|" + "---:|" * len(DEQUANT_TILINGS)]
    results = {}
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            stored, scale, zero = quantize(torch.randn(n, k, device="cuda") * 0.02, 4, 128, symmetric=False)
            weight = prepare_wna16(stored, scale, zero, 4, torch.bfloat16, mma=True)
            assert weight.mma_only
            dense = dequantized_weight(weight, torch.bfloat16)
            copies = l2_defeating_copies(dense)
            layouts = [{**weight.kernel, "mma_words": w} for w in l2_defeating_copies(weight.kernel["mma_words"])]
            turn = iter(range(1 << 40))
            results[name] = {}
            target = weight.scratch.weight(n, k)
            moved = n * k * 2 + weight.kernel["mma_words"].numel() * 4 + weight.kernel["mma_meta"].numel() * 4
            copy_us = 1e3 * graph_time_ms(lambda: target.copy_(copies[next(turn) % len(copies)]))
            alone = {str(t): 1e3 * graph_time_ms(lambda: wna16_mma_dense.dequantize_mma(
                wna16._mma_layout(layouts[next(turn) % len(layouts)]), n, k, 128, torch.bfloat16, out=target, tiling=t))
                for t in DEQUANT_TILINGS if k % (64 * t[1]) == 0}
            results[name]["dequantize_us"] = {"bf16_copy": copy_us, **alone}
            dequant_lines.append(
                f"| {name} ({n}, {k}) | {copy_us:.1f} ({4 * n * k / copy_us / 1e3:.0f}) | " + " | ".join(
                    f"{alone[str(t)]:.1f} ({moved / alone[str(t)] / 1e3:.0f})" if str(t) in alone else "-"
                    for t in DEQUANT_TILINGS) + " |")
            print(dequant_lines[-1], flush=True)
            for m in [int(r) for r in args.rows.split(",") if r]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

                def timed(variant):
                    return 1e3 * graph_time_ms(lambda: wna16._product(x, weight, layouts[next(turn) % len(layouts)],
                                                                      variant))
                cublas = 1e3 * graph_time_ms(lambda: F.linear(x, copies[next(turn) % len(copies)]))
                decode = {str(v): timed(v) for v in MMA_VARIANTS} if m <= MAX_SKINNY_ROWS else {}
                rows = {str(v): timed(v) for v in ROWS_VARIANTS + ROWS_CANDIDATES} if m >= MAX_SKINNY_ROWS else {}
                dequant = timed(DENSE) if m > MAX_SKINNY_ROWS else None
                candidates = {**decode, **rows, **({DENSE: dequant} if dequant is not None else {})}
                best = min(candidates, key=candidates.get)
                variant = DENSE if best == DENSE else next(v for v in MMA_VARIANTS + ROWS_VARIANTS + ROWS_CANDIDATES
                                                           if str(v) == best)
                ref = F.linear(x.float(), dense.float())
                error = ((wna16._product(x, weight, weight.kernel, variant).float() - ref).norm() / ref.norm()).item()
                best_rows = min(rows, key=rows.get) if rows else None
                results[name][m] = {"cublas_us": cublas, "decode_us": decode, "rows_us": rows, "dequant_us": dequant,
                                    "best": best, "speed_vs_cublas": cublas / candidates[best], "rel_error": error}
                tflops = 2 * m * n * k / cublas / 1e6
                lines.append(f"| {name} ({n}, {k}) | {m} | {cublas:.1f} ({tflops:.0f}) | "
                             f"{min(decode.values()) if decode else float('nan'):.1f} | "
                             f"{best_rows or '-'}, {rows[best_rows] if rows else float('nan'):.1f} | "
                             f"{dequant if dequant is not None else float('nan'):.1f} | "
                             f"{cublas / candidates[best]:.2f}x | {error:.1e} |")
                print(lines[-1], flush=True)
            del weight, dense, copies, layouts
            Path(args.out).write_text(json.dumps(results, indent=1))  # after every shape: a timeout keeps what ran
            if args.md:
                Path(args.md).write_text("\n".join(lines + [""] + dequant_lines) + "\n")


if __name__ == "__main__":
    main()
