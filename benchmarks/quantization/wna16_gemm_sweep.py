"""The fused W4A16 GEMM (kernels/wna16_mma_gemm.py) per tiling against cuBLAS bf16 and against dequantize +
cuBLAS, at serving-concurrency rows (M = 64 ... 512), Llama-3.1-8B's TP1 shapes, from the one operand-order
layout (group 128 with zero points, bf16 activations, weights streamed from HBM: copies together over twice
the L2, as kernels.wna16's load-time timing; device time from CUDA graph replays).

Per shape and M: cuBLAS on the bf16 weight (us, TFLOPS); dequantize into the scratch + cuBLAS (DENSE); the
rows kernel at its best measured tiling (ROWS_REFERENCE); the fused GEMM's best tiling among TILINGS, its
time and its speed against cuBLAS (> 1: INT4 faster), and the largest error of any tiling against the
dequantized reference. The JSON keeps every tiling's time. A tiling that fails to compile or run is
recorded with its error and skipped; ``--budget-s`` stops the sweep (outputs written after every shape).

    python benchmarks/quantization/wna16_gemm_sweep.py --out sweep.json --md sweep.md [--rows 256,64,128,512]
    TRITON_INTERPRET=1 python benchmarks/quantization/wna16_gemm_sweep.py --tiny --rows 17,40   # CPU rehearsal
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.quantization.int4_sweep_shared import SHAPES, Sweep, sweep_arguments, warm_in_processes  # noqa: E402
from kernels import wna16  # noqa: E402
from kernels.wna16 import (DENSE, MMA_GEMM_KIND, MMA_GEMM_VARIANTS, dequantized_weight, prepare_wna16,  # noqa: E402
                           quantize)

# The rows kernel's best tiling at 64-256 rows (benchmarks/results/quantization.md, 2026-11-29 16:18).
ROWS_REFERENCE = (128, 32, 4, 3, 1, wna16.MMA_ROWS_KIND)
# (block_n, block_m, num_warps, num_stages, split_k, MMA_GEMM_KIND, block_k, weight first, nibbles: 2 joined by
# inline PTX, 1 joined by plain ops, 0 broadcast): MMA_GEMM_VARIANTS (what the engine times at load) and
# the best of those that lost in the sweeps of 2026-11-30 00:53 and 01:24 (benchmarks/results/quantization.md), as
# references. All compile for sm_90 with Triton 3.6 (the GPU machine's) and 3.9 without spills but split-K 4's
# 32 bytes (its finish).
TILINGS = MMA_GEMM_VARIANTS + tuple((bn, bm, w, s, sk, MMA_GEMM_KIND, bk, 1, j) for bn, bm, w, s, sk, bk, j in (
    (128, 256, 8, 3, 1, 64, 2),  # 8 warps at 256 rows: 6-40% more time than 64 x 256 at 01:24
    (128, 256, 8, 3, 1, 64, 1),  # the same without the inline PTX: 2.7% slower on gate_up at 01:24
))


def main() -> None:
    args = sweep_arguments(__doc__, "wna16_gemm_sweep.json", "256,64,128,512", 140.0, 4).parse_args()
    start = time.time()
    if args.warm_slice:
        _warm(*map(int, args.warm_slice.split("/")))
        return
    warm_in_processes(__file__, args, start)
    sweep = Sweep.from_args(args)
    device, dtype = sweep.device, sweep.dtype
    torch.manual_seed(0)
    lines = ["| shape | M | cuBLAS bf16 us (TFLOPS) | dequant + cuBLAS us | rows kernel us "
             "| fused GEMM best: tiling, us "
             "| fused / cuBLAS speed | fused / dequant speed | max rel. error |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    results: dict = {"tilings": [list(t) for t in TILINGS], "shapes": {}}
    with torch.inference_mode():
        for name, (n, k) in sweep.shapes_in_budget(start, args.budget_s):
            stored, scale, zero = quantize(torch.randn(n, k, device=device) * 0.02, 4, 128, symmetric=False)
            if args.tiny:
                from kernels import wna16_mma
                weight = wna16.WNA16Weight(out_features=n, in_features=k, bits=4, group_size=128, dtype=dtype)
                packed = wna16_mma.pack_mma_layout(wna16.unpack_codes(stored, 4), scale, zero)
                weight.kernel = {"mma_words": packed["words"], "mma_meta": packed["meta"]}
            else:
                weight = prepare_wna16(stored, scale, zero, 4, dtype, mma=True)
            assert weight.mma_only
            dense = dequantized_weight(weight, dtype)
            copies = sweep.copies(dense)
            layouts = [{**weight.kernel, "mma_words": w} for w in sweep.copies(weight.kernel["mma_words"])]
            turn = iter(range(1 << 40))
            results["shapes"][name] = {}
            for m in sweep.rows_in_budget(name, start, args.budget_s):
                x = torch.randn(m, k, device=device, dtype=dtype)
                ref = F.linear(x.float(), dense.float())

                timed = sweep.time_us

                def product(variant, layout):
                    return wna16.wna16_matmul(x, layout, n, 4, 128, **wna16.tile_options(variant))

                cublas = timed(lambda: F.linear(x, copies[next(turn) % len(copies)]))
                dequant = float("nan") if args.tiny else timed(
                    lambda: wna16._product(x, weight, layouts[next(turn) % len(layouts)], DENSE))
                rows = float("nan") if args.tiny else timed(
                    lambda: product(ROWS_REFERENCE, layouts[next(turn) % len(layouts)]))
                fused, errors, failed = {}, {}, {}
                for variant in TILINGS:
                    try:
                        out = product(variant, weight.kernel)
                        errors[str(variant)] = ((out.float() - ref).norm() / ref.norm()).item()
                        fused[str(variant)] = timed(lambda: product(variant, layouts[next(turn) % len(layouts)]))
                    except Exception as error:  # noqa: BLE001 - a sweep records what failed and goes on
                        failed[str(variant)] = f"{type(error).__name__}: {str(error)[:200]}"
                        print(f"{name} M={m} {variant}: {failed[str(variant)]}", flush=True)
                best = min(fused, key=lambda v: fused[v] if fused[v] == fused[v] else 0.0) if fused else None
                results["shapes"][name][m] = {"cublas_us": cublas, "dequant_us": dequant, "rows_us": rows,
                                              "fused_us": fused, "errors": errors, "failed": failed, "best": best}
                tflops = 2 * m * n * k / cublas / 1e6
                best_us = fused[best] if best else float("nan")
                lines.append(f"| {name} ({n}, {k}) | {m} | {cublas:.1f} ({tflops:.0f}) | {dequant:.1f} | {rows:.1f} | "
                             f"{best}, {best_us:.1f} | {cublas / best_us:.2f}x | {dequant / best_us:.2f}x | "
                             f"{max(errors.values(), default=float('nan')):.1e} |")
                print(lines[-1], flush=True)
                print("   " + "  ".join(f"{v}: {t:.1f}" for v, t in sorted(fused.items(), key=lambda i: i[1])),
                      flush=True)
            del weight, dense, copies, layouts
            Path(args.out).write_text(json.dumps(results, indent=1))  # after every shape: a timeout keeps what ran
            if args.md:
                Path(args.md).write_text("\n".join(lines) + "\n")
    print(f"done in {time.time() - start:.0f} s", flush=True)


def _warm(index: int, count: int) -> None:
    """Run this process's share of TILINGS (and slice 0: the rows reference and DENSE) once on the o shape, so
    that Triton compiles them into its disk cache (every shape here specializes the kernels alike: all sizes
    divisible by 16)."""
    n, k = SHAPES["o"]
    with torch.inference_mode():
        stored, scale, zero = quantize(torch.randn(n, k, device="cuda") * 0.02, 4, 128, symmetric=False)
        weight = prepare_wna16(stored, scale, zero, 4, torch.bfloat16, mma=True)
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        share = [v for i, v in enumerate(TILINGS + (ROWS_REFERENCE, DENSE)) if i % count == index]
        for variant in share:
            try:
                wna16._product(x, weight, weight.kernel, variant)
            except Exception as error:  # noqa: BLE001 - the sweep itself records the failure
                print(f"warm {variant}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
