"""Weight-only integer linear kernels (kernels/wna16.py, kernels/wna16_gemm.py) on Llama-3.1-8B's
TP1 shapes: device time from CUDA graph replays (kernels.linear.graph_time_ms: no launch overhead).

    python benchmarks/quantization/wna16_kernel_bench.py --commit $(git rev-parse --short HEAD) --out results.md

- decode: the tiling choose_wna16_variants picks per shape at 1 and 8 rows (timed on copies of the
  weight that together exceed twice the L2 cache, so from HBM), as GB/s = (packed weight bytes +
  scale and zero bytes) / time; 4-bit group 128 and 8-bit per channel; cuBLAS bf16 at 1 row beside;
  the sum over a Llama-8B layer x 32 plus the bf16 lm_head gives the linear layers' tokens/s bound;
- GEMM: TFLOPS of wna16_linear (the dispatch), of a few GEMM tilings and of dequantize + cuBLAS, at
  M = 16 .. 8192, against bf16 cuBLAS on the dequantized weight (F.linear).
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.wna16 import wna16_matmul  # noqa: E402
from kernels.fp8 import l2_defeating_copies  # noqa: E402
from kernels.linear import graph_time_ms  # noqa: E402
from kernels.wna16 import (choose_wna16_variants, dequantized_weight, prepare_wna16, quantize, tile_options,  # noqa: E402
                           wna16_linear)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = (128256, 4096)
GEMM_ROWS = (16, 64, 256, 1024, 8192)
GEMM_CANDIDATES = {16: [(64, 16, 4, 4, 4, 0), (64, 16, 4, 4, 1, 0), (64, 16, 4, 4, 2, 0)],
                   64: [(64, 64, 4, 4, 1, 0), (64, 64, 4, 4, 2, 0), (128, 64, 8, 3, 1, 0), (64, 32, 4, 4, 2, 0)],
                   256: [(128, 128, 8, 3, 1, 0), (128, 64, 8, 3, 1, 0)],
                   1024: [(128, 256, 8, 3, 1, 0)]}


def quantized_weight(shape, bits: int, group_size: int, scale_dtype=torch.float16):
    weight = torch.randn(shape, device="cuda") * 0.02
    stored, scale, zero = quantize(weight, bits, group_size, symmetric=True)
    # kernels/wna16_layout.py's kernels (mma=False); the operand-order ones: wna16_mma_bench.py
    return prepare_wna16(stored, scale, zero, bits, torch.bfloat16, scale_dtype=scale_dtype, mma=False)


def weight_bytes(weight) -> int:
    groups = weight.in_features // weight.group_size
    return (weight.out_features * weight.in_features * weight.bits // 8 +
            groups * weight.out_features * (weight.kernel["scale"].element_size() + 1))


def decode_table(lines: list[str]) -> None:
    lines += ["", "Decode (the tilings choose_wna16_variants picks at M=1 / M=8, (block_n, block_m, warps, stages, "
              "split_k, kind); weights streamed from HBM):", "",
              "| weight | shape (N, K) | tiling | M=1 us | M=1 GB/s | M=8 us | M=8 GB/s | cuBLAS bf16 M=1 us |",
              "|---|---|---|---|---|---|---|---|"]
    for bits, group in ((4, 128), (8, None)):
        step_us = 0.0
        for name, shape in SHAPES.items():
            weight = quantized_weight(shape, bits, group or shape[1])
            report = choose_wna16_variants([weight], rows=(1, 8))
            (choice,) = report.values()
            dense = l2_defeating_copies(dequantized_weight(weight, torch.bfloat16))
            x = torch.randn(1, shape[1], device="cuda", dtype=torch.bfloat16)
            turn = iter(range(1 << 30))
            cublas = 1e3 * graph_time_ms(lambda: F.linear(x, dense[next(turn) % len(dense)]))
            nbytes = weight_bytes(weight)
            us1, us8 = choice["us"][1], choice["us"][8]
            step_us += us1
            label = f"W{bits} g{group}" if group else f"W{bits} per-channel"
            lines.append(f"| {name} {label} | {shape} | {choice['variant'][1]} / {choice['variant'][8]} | {us1:.1f} | {nbytes / us1 / 1e3:.0f} | "
                         f"{us8:.1f} | {nbytes / us8 / 1e3:.0f} | {cublas:.1f} |")
            print(lines[-1], flush=True)
            del weight, dense
        lm_head = torch.randn(LM_HEAD, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, LM_HEAD[1], device="cuda", dtype=torch.bfloat16)
        head_us = 1e3 * graph_time_ms(lambda: F.linear(x, lm_head))
        lines.append(f"| W{bits} layer sum x 32 + bf16 lm_head ({head_us:.0f} us) | | | {32 * step_us + head_us:.0f} | "
                     f"{1e6 / (32 * step_us + head_us):.0f} tok/s bound | | | |")
        print(lines[-1], flush=True)
        del lm_head


def gemm_table(lines: list[str]) -> None:
    lines += ["", "GEMM (W4 g128, bf16 activations; TFLOPS = 2MNK / time; weights timed as they lie, L2 included):", "",
              "| shape | M | cuBLAS bf16 | wna16_linear | dequant + cuBLAS | best Triton tiling (TFLOPS) |",
              "|---|---|---|---|---|---|"]
    for name, shape in SHAPES.items():
        weight = quantized_weight(shape, 4, 128)
        choose_wna16_variants([weight], rows=(1, 8))
        dense = dequantized_weight(weight, torch.bfloat16)
        for m in GEMM_ROWS:
            x = torch.randn(m, shape[1], device="cuda", dtype=torch.bfloat16)
            repeat = 20 if m <= 256 else 5 if m <= 1024 else 2
            tflops = lambda ms: 2 * m * shape[0] * shape[1] / ms / 1e9  # noqa: E731
            cublas = tflops(graph_time_ms(lambda: F.linear(x, dense), repeat))
            dispatch = tflops(graph_time_ms(lambda: wna16_linear(x, weight), repeat))
            via_dense = tflops(graph_time_ms(lambda: F.linear(x, dequantized_weight(weight, x.dtype)), repeat))
            tiles = {t: tflops(graph_time_ms(lambda: wna16_matmul(
                x, weight.kernel, shape[0], 4, 128, **tile_options(t)), repeat)) for t in GEMM_CANDIDATES.get(m, [])}
            best = max(tiles, key=tiles.get) if tiles else None
            lines.append(f"| {name} {shape} | {m} | {cublas:.0f} | {dispatch:.0f} | {via_dense:.0f} | "
                         + (f"{best}: {tiles[best]:.0f}" if best else "") + " |")
            print(lines[-1], "  all:", {t: round(v) for t, v in tiles.items()}, flush=True)
        del weight, dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="?")
    parser.add_argument("--out", default=None, help="write the markdown section here")
    parser.add_argument("--skip-gemm", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### {now}, {torch.cuda.get_device_name()}, commit {args.commit}", "",
             "`python benchmarks/quantization/wna16_kernel_bench.py`"]
    with torch.inference_mode():
        decode_table(lines)
        if not args.skip_gemm:
            gemm_table(lines)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
