"""kernels/int8_sq.py (SmoothQuant W8A8 INT8): the per-token quantizer kernel against the torch
reference (same codes, same scales), the scheme's reference against the dequantized float product,
and the CUDA path (torch._int_mm) against the reference."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error

from kernels import int8_sq


def test_weight_quantization_is_per_channel_symmetric():
    w = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]
    codes, scale = int8_sq.quantize_weight_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and codes.min() >= -127
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()  # half a step
    half = torch.tensor([[0.5, -0.5, 1.5, -2.5, 127.0]])  # ties round away from zero
    assert int8_sq.quantize_rows_int8(half)[0].tolist() == [[1, -1, 2, -3, 127]]


def test_reference_is_the_dequantized_product():
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    codes, scale = int8_sq.quantize_weight_int8(w)
    bias = torch.randn(24)
    xq, xs = int8_sq.quantize_rows_int8(x)
    expected = (xq.float() * xs[:, None]) @ (codes.float() * scale[:, None]).T + bias
    assert torch.allclose(int8_sq.int8_linear_ref(x, codes, scale, bias), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [40, 5000])  # one block, and several (the kernel's loop)
def test_quantize_kernel_matches_the_reference(device, cols):
    x = (torch.randn(3, cols) * torch.tensor([[1.0], [1e-3], [0.0]])).to(device)  # an all-zero row too
    codes, scale = int8_sq.quantize_rows_int8_triton(x)
    ref_codes, ref_scale = int8_sq.quantize_rows_int8(x)
    assert torch.equal(scale, ref_scale) and torch.equal(codes, ref_codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._int_mm path: CUDA only")
@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_cuda_path_matches_the_reference(m):
    w = torch.randn(264, 512, device="cuda")
    codes, scale = int8_sq.quantize_weight_int8(w)
    x = torch.randn(m, 512, device="cuda").to(torch.bfloat16)
    bias = torch.randn(264, device="cuda").to(torch.bfloat16)
    out = int8_sq.int8_linear(x, codes, scale, bias)
    assert relative_error(out, int8_sq.int8_linear_ref(x, codes, scale, bias)) < TOLERANCE[torch.bfloat16]
