"""Which W4A16 path wins at serving-size batches (17-256 rows) on this GPU: the load-time timing of
kernels.wna16.choose_wna16_variants over MID_VARIANTS and DENSE (dequantize + cuBLAS), beside
cuBLAS on bf16 weights, for Llama-3.1-8B's four shapes (int4, groups of 128).

    python benchmarks/quantization/wna16_mid_rows_probe.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.linear import graph_time_ms  # noqa: E402
from kernels.wna16 import DENSE, MID_ROWS, choose_wna16_variants, prepare_wna16, quantize  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    print(torch.cuda.get_device_name())
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda") * 0.02
        prepared = prepare_wna16(*quantize(weight, 4, 128, symmetric=False), 4, torch.bfloat16, mma=False)
        report = choose_wna16_variants([prepared], rows=())[(4, 128, n, k)]
        dense_weight = weight.to(torch.bfloat16)
        for m in MID_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = 1e3 * graph_time_ms(lambda: F.linear(x, dense_weight))
            times = report["all_us"][m]
            chosen = report["variant"][m]
            print(f"{name} M={m}: chosen {chosen} {times[chosen]:.1f} us; dequant+cuBLAS {times[DENSE]:.1f} us; "
                  f"cuBLAS bf16 {cublas:.1f} us")


if __name__ == "__main__":
    main()
