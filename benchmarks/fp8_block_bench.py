"""Block-scaled FP8 linear (kernels/fp8_block.py: group quantize launch + Triton GEMM) against bf16
``F.linear`` on Llama-3.1-8B's projections (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096,
down 4096 x 14336), microseconds of the four per layer from CUDA graphs.

    python benchmarks/fp8_block_bench.py [--rows 1 16 64 512 4096]

H200, 2026-11-26 (the kernel then also had an in-kernel activation quantization, timed beside:
149.9 / 149.6 / 304.7 / 981.4 / 7,298.1 us, slower everywhere, since removed):

| rows | bf16 | fp8_block |
|---:|---:|---:|
| 1 | 113.5 | 95.9 |
| 16 | 115.3 | 101.0 |
| 64 | 123.7 | 125.0 |
| 512 | 293.1 | 461.2 |
| 4096 | 2,313.1 | 3,449.5 |
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fp8_block import fp8_block_linear_triton, quantize_blocks  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
               for name, (n, k) in SHAPES.items()}
    blocks = {name: quantize_blocks(w) for name, w in weights.items()}
    print(f"device: {torch.cuda.get_device_name()}; us per layer (four projections), CUDA graphs")
    print("| rows | bf16 | fp8_block |")
    for rows in args.rows:
        xs = {name: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in SHAPES.items()}
        times = {"bf16": 0.0, "fp8_block": 0.0}
        for name in SHAPES:
            x, (w_q, w_s) = xs[name], blocks[name]
            times["bf16"] += graph_time_ms(lambda: F.linear(x, weights[name])) * 1000
            times["fp8_block"] += graph_time_ms(lambda: fp8_block_linear_triton(x, w_q, w_s)) * 1000
        print(f"| {rows} | {times['bf16']:.1f} | {times['fp8_block']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
