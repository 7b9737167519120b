"""kernels/head_matmul.py: per-head products of 1..16 tokens (MLA's W_UK / W_UV) against torch.einsum,
on the GPU (bf16) or Triton's interpreter (float32): a strided query view, a transposed weight view,
sizes not multiples of the tiles."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from kernels.head_matmul import head_matmul_ref, head_matmul_triton


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_per_head_products_equal_einsum(device, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    heads, nope, rank = 3, 24, 40
    q = torch.randn(num_tokens, heads, nope + 8, generator=gen)  # the nope part is a strided view
    w_uk = torch.randn(heads, nope, rank, generator=gen)
    w_uv = torch.randn(heads, 20, rank, generator=gen)  # used transposed: (H, R, V)
    for dtype in low_precision_dtypes(device):
        on = [t.to(dtype).to(device) for t in (q, w_uk, w_uv)]
        q_lat = head_matmul_triton(on[0][..., :nope], on[1])
        want = head_matmul_ref(q[..., :nope].to(dtype).double(), w_uk.to(dtype).double())
        assert relative_error(q_lat, want) < TOLERANCE[dtype]
        out = head_matmul_triton(q_lat, on[2].transpose(1, 2))
        want = head_matmul_ref(q_lat.cpu().double(), w_uv.to(dtype).double().transpose(1, 2))
        assert out.shape == (num_tokens, heads, 20) and relative_error(out, want) < TOLERANCE[dtype]
