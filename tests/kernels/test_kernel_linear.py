"""Skinny (decode-size) matrix products: the Triton kernel against F.linear.

Odd row counts (1, 3, 16), output widths that are not multiples of the 16-feature tile, and
reduction lengths that are not multiples of the 512-element K tile. Both sides accumulate in
fp32 from the same bf16/fp16 inputs and round once at the end, in a different order, so they
agree to about one output rounding (ROUNDING) rather than bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import low_precision_dtypes, relative_error

import torch.nn.functional as F

ROUNDING = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (200, 576), (37, 1000)])
def test_skinny_linear_matches_f_linear(device, m, n, k):
    from kernels.linear import skinny_linear_triton

    gen = torch.Generator().manual_seed(m * n + k)
    for dtype in low_precision_dtypes(device):
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device)
        precise = F.linear(x.double(), w.double(), bias.double())
        assert relative_error(skinny_linear_triton(x, w, bias), precise) < ROUNDING[dtype]
        assert relative_error(skinny_linear_triton(x, w), F.linear(x.double(), w.double())) < ROUNDING[dtype]


def test_linear_without_a_marked_weight_is_f_linear():
    from kernels.linear import linear

    x, w = torch.randn(2, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on a CUDA device")
def test_choose_skinny_weights_marks_by_measurement():
    from kernels.linear import choose_skinny_weights, linear

    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    report = choose_skinny_weights([w])
    assert getattr(w, "_use_skinny_gemm") == report[(4096, 4096)]["use_triton"]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    assert relative_error(linear(x, w), F.linear(x.double(), w.double())) < ROUNDING[torch.bfloat16]
