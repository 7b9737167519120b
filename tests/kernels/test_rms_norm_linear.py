"""kernels/rms_norm_linear.py: residual add + RMSNorm (x's parts summed first) fused into the skinny
product, against its plain-torch reference (kernels/rmsnorm.py's rms_norm_ref, then F.linear).
GPU: bf16 at DeepSeek-V2-Lite's first product (3648 x 2048) and small shapes, each load-time
candidate tiling; CPU: Triton's interpreter (TRITON_INTERPRET=1) in float32, else skipped (the
reference path runs in tests/engine/test_deepseek.py)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import relative_error

# The reference rounds x / rms, then g * that; the kernel rounds g * x once and scales the float32 sums.
ROUNDING = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _inputs(m, parts, n, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = t(m, parts, k, scale=2.0) if parts > 1 else t(m, k, scale=2.0)
    return x, t(m, k), t(k, scale=0.2) + 1, t(n, k, scale=0.05)


@pytest.mark.parametrize("m,parts,n,k,residual", [(1, 8, 96, 80, True), (1, 1, 72, 320, True),
                                                   (1, 1, 37, 130, False), (1, 3, 64, 256, False)])
def test_rms_norm_linear_matches_reference(device, m, parts, n, k, residual):
    from kernels.rms_norm_linear import rms_norm_linear_ref, rms_norm_linear_triton
    from kernels.rms_norm_linear import TILINGS

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, res, g, w = _inputs(m, parts, n, k, dtype, device, seed=m * n + k)
    res = res if residual else None
    ref, ref_residual = rms_norm_linear_ref(x, res, g, 1e-6, w)
    # (16, 64, 4, 2, 2): split-K's squared-sum partials; the load-time candidates: plain, swapped + balanced
    for variant in [(16, 64, 4, 2, 2), *TILINGS]:
        out, new_residual = rms_norm_linear_triton(x, res, g, 1e-6, w, variant)
        assert relative_error(out, ref) < ROUNDING[dtype], variant
        assert relative_error(new_residual, ref_residual) < ROUNDING[dtype] / 10, variant  # (the parts' sum order)
    if not residual and parts == 1:  # nothing added or summed: x is the residual, as rms_norm returns it
        assert new_residual is x


@pytest.mark.gpu
def test_v2_lite_first_product_bf16():
    """V2-Lite's stacked [q_proj | kv_a_proj] (3648 x 2048) at one token, after a sparse layer's 8 expert rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.rms_norm_linear import rms_norm_linear_ref, rms_norm_linear_triton
    from kernels.rms_norm_linear import TILINGS

    x, res, g, w = _inputs(1, 8, 3648, 2048, torch.bfloat16, "cuda")
    ref, ref_residual = rms_norm_linear_ref(x, res, g, 1e-6, w)
    for variant in TILINGS:
        out, new_residual = rms_norm_linear_triton(x, res, g, 1e-6, w, variant)
        assert relative_error(out, ref) < ROUNDING[torch.bfloat16], variant
        assert relative_error(new_residual, ref_residual) < ROUNDING[torch.bfloat16] / 10, variant
