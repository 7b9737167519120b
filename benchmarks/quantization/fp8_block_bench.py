"""Block-scaled FP8 linear (kernels/fp8_block.py) against bf16 ``F.linear``, microseconds from CUDA
graphs, per projection and per layer (the sum). Columns: bf16; bf16_skinny (kernels/linear.py ``linear``
after the engine's load-time choice, choose_skinny_weights: the skinny GEMM where it won, at most 16 rows);
the Triton block GEMM (group quantize launch + GEMM); skinny_block (kernels/fp8_block_skinny.py: the E4M3
weight widened in registers, activations unquantized, the fastest tiling of its load-time choice, at most
16 rows); cuBLAS's block-scaled GEMM through torch._scaled_mm (CUDA 12.9+ on sm90, else blank); the weight
dequantized in one pass for bf16 cuBLAS; what fp8_block_linear picks (after choose_fp8_block_skinny).
Since 2026-12-01 every path reads its weight from enough copies in turn to defeat the L2 cache
(kernels/fp8.py l2_defeating_copies), as a decode step streams it from HBM; earlier figures timed the
small weights (Qwen3-30B-A3B's 5-17 MB) partly from L2. The load-time choices' reports are printed first.

    python benchmarks/quantization/fp8_block_bench.py [--rows 1 16 64 256 512 2048 8192] [--model llama8b|qwen3_moe]

llama8b: Llama-3.1-8B's projections (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down
4096 x 14336); qwen3_moe: Qwen3-30B-A3B's dense ones (qkv 5120 x 2048, o 2048 x 4096).

H200, 2026-11-26, llama8b layer (the kernel then also had an in-kernel activation quantization,
149.9 / 149.6 / 304.7 / 981.4 / 7,298.1 us, slower everywhere, since removed): bf16 113.5 / 115.3 /
123.7 / 293.1 / 2,313.1 us at 1 / 16 / 64 / 512 / 4,096 rows, Triton block 95.9 / 101.0 / 125.0 /
461.2 / 3,449.5. H100 figures with cuBLAS's block-scaled GEMM: kernels/fp8_block.py, beside
CUBLAS_BLOCK_SCALED_MIN_ROWS.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fp8 import l2_defeating_copies  # noqa: E402
from kernels.fp8_block import (cublas_block_scaled_supported, dequantize_blocks_triton, fp8_block_linear,  # noqa: E402
                               fp8_block_linear_cublas, fp8_block_linear_triton, quantize_blocks)
from kernels.fp8_block_choice import choose_fp8_block_skinny  # noqa: E402
from kernels.fp8_block_skinny import VARIANT_ATTR, fp8_block_skinny_triton, skinny_options  # noqa: E402
from kernels.linear import MAX_SKINNY_ROWS, choose_skinny_weights, graph_time_ms, linear  # noqa: E402

MODELS = {"llama8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
          "qwen3_moe": {"qkv": (5120, 2048), "o": (2048, 4096)}}
COLUMNS = ("bf16", "bf16_skinny", "triton", "skinny_block", "cublas_block", "dequantized", "picked")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512, 2048, 8192])
    parser.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = MODELS[args.model]
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for name, (n, k) in shapes.items()}
    half_copies = {name: l2_defeating_copies(w) for name, w in weights.items()}
    block_copies = {}
    for name, w in weights.items():
        w_q, w_s = quantize_blocks(w)
        block_copies[name] = [(q, w_s) for q in l2_defeating_copies(w_q)]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"us from CUDA graphs, {args.model}")
    half_choice = choose_skinny_weights([w for copies in half_copies.values() for w in copies])
    block_choice = choose_fp8_block_skinny([q for copies in block_copies.values() for q, _ in copies], torch.bfloat16)
    for shape in sorted(block_choice):
        print(f"choice {shape[0]} x {shape[1]}: bf16 skinny {half_choice.get(shape)}; block-FP8 skinny "
              f"{block_choice[shape]}", flush=True)
    print("| rows | projection | " + " | ".join(COLUMNS) + " |\n|---:|---|" + "---:|" * len(COLUMNS))
    turn = iter(range(1 << 40))

    def next_of(copies):  # the copies in turn: each call reads its weight from HBM
        return copies[next(turn) % len(copies)]

    for rows in args.rows:
        layer = dict.fromkeys(COLUMNS, 0.0)
        for name, (n, k) in shapes.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            halves, blocked = half_copies[name], block_copies[name]
            paths = {"bf16": lambda: F.linear(x, next_of(halves)),
                     "triton": lambda: fp8_block_linear_triton(x, *next_of(blocked)),
                     "dequantized": lambda: F.linear(x, dequantize_blocks_triton(*next_of(blocked), x.dtype)),
                     "picked": lambda: fp8_block_linear(x, *next_of(blocked))}
            if rows <= MAX_SKINNY_ROWS:
                paths["bf16_skinny"] = lambda: linear(x, next_of(halves))
                best = block_choice[(n, k)]["best_variant"]  # (timed even where the block GEMM was kept)
                paths["skinny_block"] = lambda: fp8_block_skinny_triton(x, *next_of(blocked), **skinny_options(best))
            if cublas_block_scaled_supported(x, blocked[0][0]) and rows > 1:  # cuBLAS has no algorithm for one row
                paths["cublas_block"] = lambda: fp8_block_linear_cublas(x, *next_of(blocked))
            cells = []
            for column in COLUMNS:
                us = graph_time_ms(paths[column]) * 1000 if column in paths else float("nan")
                layer[column] += us
                cells.append(f"{us:.1f}")
            print(f"| {rows} | {name} {n} x {k} | " + " | ".join(cells) + " |", flush=True)
        print(f"| {rows} | layer | " + " | ".join(f"{layer[c]:.1f}" for c in COLUMNS) + " |", flush=True)
    marked = {shape: getattr(copies[0][0], VARIANT_ATTR, None) for shape, copies in
              ((shapes[name], copies) for name, copies in block_copies.items())}
    print(f"picked path's marks (tiling or False: the block GEMM): {marked}")


if __name__ == "__main__":
    main()
