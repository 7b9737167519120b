"""kernels/gated_gemm.py: the [gate | up] product with its bias and SiLU-and-product in one GEMM, against the
unfused path (the product rounded, then SiLU-and-product as kernels/activation.py rounds it). Row and column
counts that are not tile multiples, K a multiple of the K tile or not (the masked K loop), per-thread loads and
TMA descriptors, with and without a bias. float16 under the interpreter (its bf16 dots are loose); on CUDA both."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip

from kernels.gated_gemm import gated_gemm, gated_gemm_ref

SMALL = (32, 32, 32, 4, 1, 0)
SMALL_TMA = (32, 32, 32, 4, 1, 1)


@pytest.mark.parametrize("k, tiling", [(80, SMALL), (96, SMALL_TMA)])
def test_gated_gemm_equals_product_then_silu_and_mul(device, k, tiling):
    m, n = 40, 48
    for dtype in (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(m, k, generator=g).to(dtype)
        weight = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
        bias = torch.randn(2 * n, generator=g).to(dtype)
        for b in (bias, None):
            want = gated_gemm_ref(x.float(), weight.float(), None if b is None else b.float())
            got = gated_gemm(x.to(device), weight.to(device), None if b is None else b.to(device), tiling).cpu()
            assert got.shape == (m, n) and got.dtype == dtype
            assert relative_error(got, want) < TOLERANCE[dtype]


def test_gated_gemm_refuses_float32_and_unpaired_weights():
    with pytest.raises(ValueError, match="16-bit rows"):
        gated_gemm(torch.zeros(4, 8), torch.zeros(6, 8))
    with pytest.raises(ValueError, match="16-bit rows"):
        gated_gemm(torch.zeros(4, 8, dtype=torch.float16), torch.zeros(6, 4, dtype=torch.float16))


@AOT_SM90
@pytest.mark.parametrize("tiling", [(128, 128, 64, 8, 3, 0), (128, 64, 64, 4, 4, 0)])
def test_gated_gemm_compiles_for_sm90_without_spills(tiling, tmp_path):
    """Triton's compiler and ptxas (no GPU) at the tower's candidate tilings (per-thread loads; the TMA form's
    descriptors need a launch): no local memory (spills) with two 128-column float32 accumulators."""
    from kernels.gated_gemm import GROUP_M, _gated_gemm_kernel

    block_m, block_n, block_k, warps, stages, _ = tiling
    pointers = dict(x_ptr="*bf16", w_ptr="*bf16", x_desc="*bf16", w_desc="*bf16", bias_ptr="*bf16", out_ptr="*bf16")
    const = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, EVEN_K=True,
                 TMA=False)
    compiled = compile_for_sm90(_gated_gemm_kernel, pointers, const, warps=warps, stages=stages,
                                aligned_int=lambda name: name != "M")
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage, usage
