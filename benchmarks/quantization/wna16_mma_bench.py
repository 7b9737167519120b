"""The operand-order W4A16 decode kernel (kernels/wna16_mma.py) beside the kernels before it, on
Llama-3.1-8B's TP1 shapes, group 128 with zero points, bf16 activations, weights streamed from HBM
(copies together over twice the L2, kernels.wna16's load-time timing), device time from CUDA graph
replays. Per shape and row count: the best tiling of the kernels before (SKINNY_VARIANTS up to 16
rows, MID_VARIANTS incl. dequantize + cuBLAS at 64 / 256; weights prepared with mma=False), the best
operand-order tiling (M <= 16) and past 16 rows the operand-order layer's own path (dequantize the
same words into its scratch + cuBLAS, kernels/wna16_mma_dense.py), cuBLAS on the bf16 weight; GB/s = (packed codes + float16 scales + uint8 zeros) / time, against
the ~4.2 TB/s HBM copy rate. Also the kernel's error against the dequantized reference.

    python benchmarks/quantization/wna16_mma_bench.py --out mma.json --md mma.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fp8 import l2_defeating_copies  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402
from kernels.wna16 import (MAX_SKINNY_ROWS, choose_wna16_variants, dequantized_weight, prepare_wna16,  # noqa: E402
                           quantize, tile_options, wna16_linear, wna16_matmul)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16)
MID = (64, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wna16_mma_bench.json")
    parser.add_argument("--md", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--mid-rows", default=",".join(map(str, MID)), help="row counts past 16 ('' for none)")
    args = parser.parse_args()
    torch.manual_seed(0)
    results, lines = {}, ["| shape | M | before: tiling, us, GB/s | operand order: tiling, us, GB/s | cuBLAS bf16 us | "
                          "rel. error |", "|---|---:|---|---|---:|---:|"]
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            stored, scale, zero = quantize(torch.randn(n, k, device="cuda") * 0.02, 4, 128, symmetric=False)
            before = prepare_wna16(stored, scale, zero, 4, torch.bfloat16, mma=False)
            weight = prepare_wna16(stored, scale, zero, 4, torch.bfloat16, mma=True)
            nbytes = n * k // 2 + (k // 128) * n * 3
            mid = tuple(int(m) for m in args.mid_rows.split(",") if m)
            report = next(iter(choose_wna16_variants([before], rows=ROWS, mid_rows=mid).values()))
            report_new = next(iter(choose_wna16_variants([weight], rows=ROWS, mid_rows=()).values()))
            dense = dequantized_weight(weight, torch.bfloat16)
            copies = l2_defeating_copies(dense)
            entry = {}
            for m in ROWS + mid:
                old = report["all_us"][m]
                best_old = min(old, key=old.get)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if m <= MAX_SKINNY_ROWS:
                    new = report_new["all_us"][m]
                else:  # the one path past 16 rows (the scratch is one buffer: no copies to defeat the L2)
                    new = {"dense": 1e3 * graph_time_ms(lambda: wna16_linear(x, weight))}
                best_new = min(new, key=new.get)
                turn = iter(range(1 << 30))
                cublas = 1e3 * graph_time_ms(lambda: F.linear(x, copies[next(turn) % len(copies)]))
                error = None
                if best_new is not None:
                    out = wna16_matmul(x, weight.kernel, n, 4, 128, **tile_options(best_new)) \
                        if m <= MAX_SKINNY_ROWS else wna16_linear(x, weight)
                    ref = F.linear(x.float(), dense.float())
                    error = ((out.float() - ref).norm() / ref.norm()).item()
                entry[m] = {"before": [str(best_old), old[best_old]],
                            "mma": [str(best_new), new[best_new]] if best_new else None,
                            "cublas_us": cublas, "rel_error": error, "all_mma_us": {str(v): t for v, t in new.items()}}
                gbs = lambda us: nbytes / us / 1e3  # noqa: E731
                mma = f"{best_new}, {new[best_new]:.1f}, {gbs(new[best_new]):.0f}" if best_new else "-"
                lines.append(f"| {name} ({n}, {k}) | {m} | {best_old}, {old[best_old]:.1f}, {gbs(old[best_old]):.0f} | "
                             f"{mma} | {cublas:.1f} | {error if error is None else f'{error:.1e}'} |")
                print(lines[-1], flush=True)
            results[name] = entry
            del weight, before, dense, copies
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.md:
        Path(args.md).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
