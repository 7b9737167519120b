"""Runs an operand-order W4A16 kernel a few times on one Llama-8B shape, for ncu: kernels/wna16_mma.py's
decode kernel up to 16 rows, kernels/wna16_mma_rows.py's past 16 (block_n, warps, split_k[, stages: 2 prefetches]),
or given a kernels/wna16.py kind-8 9-tuple, kernels/wna16_mma_gemm.py's fused GEMM:
  ncu --set full -k regex:_mma_decode -c 2 python benchmarks/quantization/wna16_mma_profile.py gate_up 1 128,4,4,2
  ncu --set full -k regex:_mma_rows -c 2 python benchmarks/quantization/wna16_mma_profile.py gate_up 64 128,4,1,2
  ncu --set full -k regex:_mma_gemm -c 2 python benchmarks/quantization/wna16_mma_profile.py gate_up 256 \
      128,256,8,3,1,8,64,1,2"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels import wna16_mma, wna16_mma_rows  # noqa: E402
from kernels.wna16 import MMA_GEMM_KIND, quantize, tile_options, unpack_codes, wna16_matmul  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

if __name__ == "__main__":
    name, m = sys.argv[1], int(sys.argv[2])
    values = [int(v) for v in sys.argv[3].split(",")]
    block_n, warps, split, *prefetch = values
    n, k = SHAPES[name]
    stored, scale, zero = quantize(torch.randn(n, k, device="cuda") * 0.02, 4, 128, symmetric=False)
    layout = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if len(values) == 9:  # a kind-8 tiling: the fused GEMM
        assert values[5] == MMA_GEMM_KIND, values
        for _ in range(3):
            wna16_matmul(x, {"mma_words": layout["words"], "mma_meta": layout["meta"]}, n, 4, 128,
                         **tile_options(tuple(values)))
        torch.cuda.synchronize()
        sys.exit(0)
    kernel = wna16_mma.mma_matmul if m <= 16 else wna16_mma_rows.mma_rows_matmul
    for _ in range(3):
        kernel(x, layout, n, 128, tiles=block_n // (16 * warps), num_warps=warps, split_k=split,
               prefetch=bool(prefetch and prefetch[0] > 1))
    torch.cuda.synchronize()
