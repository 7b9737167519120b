#!/usr/bin/env python3
"""The skinny product's L2 weight prefetch before its PDL wait (kernels/linear.py PREFETCH), on and off,
as a decode step runs it: right behind another kernel (the RMSNorm that feeds it), weights cold.

    python benchmarks/kernels/skinny_prefetch_bench.py [--shapes 3648x2048,2048x2048] [--rows 1]
        [--variants all | "16:512:4:4,32:256:4:4:2"] [--out prefetch.json]

Per (shape, tiling) four figures, microseconds a call from graph replays (kernels.linear.graph_time_ms):
``pair`` = rms_norm then the product (the product's prefetch can run while the norm does), and
``alone`` = the product after the product (how the load-time choice times it), each with
$TRITONLLM_WEIGHT_PREFETCH=0 (off) and skinny (on); ``norm`` = the norm alone, so pair - norm is what the
product adds to a step. The products cycle through enough copies of the weight (>= 192 MB) that none
is read from L2 by an earlier call. cuBLAS (F.linear) rows are the reference. Each tiling's output is
checked against F.linear first (prefetch on). Default shapes: DeepSeek-V2-Lite's stacked q_proj +
kv_a_proj (3072 + 576 rows) and o_proj (2048 x 2048).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels._triton import WEIGHT_PREFETCH_ENV  # noqa: E402
from kernels.linear import graph_time_ms, half_variants, skinny_linear_triton, variant_options  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402

COLD_BYTES = 192 << 20


def parse_variants(text: str) -> list[tuple]:
    if text == "all":
        return list(half_variants())
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="3648x2048,2048x2048", help="NxK weight shapes, comma-separated")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--variants", default="all", help='"all" (the load-time set) or block_n:block_k:warps:stages[:...]')
    parser.add_argument("--calls", type=int, default=20, help="calls a graph")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    results = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(2, -(-COLD_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for _ in range(copies)]
        x = torch.randn(args.rows, k, dtype=dtype, device=device)
        residual = torch.randn(args.rows, k, dtype=dtype, device=device)
        norm_weight = torch.rand(k, dtype=dtype, device=device) + 0.5
        turn = [0]

        def weight() -> torch.Tensor:
            turn[0] += 1
            return weights[turn[0] % copies]

        def product(fn):
            return lambda: fn(x, weight())

        def pair(fn):
            return lambda: fn(rms_norm(x, norm_weight, 1e-6, residual)[0], weight())

        norm_us = graph_time_ms(lambda: rms_norm(x, norm_weight, 1e-6, residual), args.calls) * 1e3
        cublas = {"pair": graph_time_ms(pair(F.linear), args.calls) * 1e3,
                  "alone": graph_time_ms(product(F.linear), args.calls) * 1e3}
        print(f"{shape} rows {args.rows} ({copies} copies): norm {norm_us:.2f} us; cuBLAS pair {cublas['pair']:.2f} "
              f"alone {cublas['alone']:.2f}", flush=True)
        row = {"shape": [n, k], "rows": args.rows, "norm_us": norm_us, "cublas": cublas, "variants": {}}
        for variant in parse_variants(args.variants):
            options = variant_options(variant)

            def skinny(a, w, options=options):
                return skinny_linear_triton(a, w, **options)

            figures = {}
            try:
                for setting in ("0", "1"):
                    os.environ[WEIGHT_PREFETCH_ENV] = "skinny" if setting == "1" else "0"
                    got = skinny(x, weights[0]).float()
                    want = F.linear(x, weights[0]).float()
                    error = ((got - want).abs().max() / want.abs().max()).item()
                    figures[setting] = {"pair": graph_time_ms(pair(skinny), args.calls) * 1e3,
                                        "alone": graph_time_ms(product(skinny), args.calls) * 1e3, "rel_err": error}
            except Exception as exc:  # a tiling that does not fit (shared memory) drops out
                print(f"{shape} {':'.join(map(str, variant))}: {type(exc).__name__}", flush=True)
                continue
            off, on = figures["0"], figures["1"]
            row["variants"][":".join(map(str, variant))] = figures
            print(f"{shape} {':'.join(map(str, variant)):<16} pair off {off['pair']:6.2f} on {on['pair']:6.2f} | "
                  f"alone off {off['alone']:6.2f} on {on['alone']:6.2f} | GB/s pair-norm on "
                  f"{n * k * 2 / max(on['pair'] - norm_us, 1e-3) / 1e3:6.0f} | err {on['rel_err']:.1e}", flush=True)
        os.environ.pop(WEIGHT_PREFETCH_ENV, None)
        results.append(row)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
