"""Llama 4's one-launch top-1 routing (kernels/llama4_router.py) against its plain-torch reference, and the
reference against the unfused torch path engine/models/llama4.py runs for other batches (the router's
product, topk, sigmoid, the scaled rows). Triton: GPU, or TRITON_INTERPRET=1 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import quantize_rows, quantize_rows_triton
from kernels.llama4_router import route_top1_ref, route_top1_triton


def _inputs(tokens, experts, hidden, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (0.05 * torch.randn(experts, hidden, generator=gen)).to(dtype).to(device)
    return x, weight


def test_reference_is_the_unfused_top1_path():
    x, weight = _inputs(5, 16, 96, torch.float32, "cpu")
    top, ids = torch.nn.functional.linear(x, weight).topk(1, dim=-1)
    want = x * torch.sigmoid(top)
    rows, got_ids, ones, quantized = route_top1_ref(x, weight, quantize=True)
    assert torch.equal(got_ids, ids.to(torch.int32)) and torch.equal(ones, torch.ones(5, 1))
    torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-6)
    codes, scale = quantize_rows(x)
    assert torch.equal(quantized.values.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(quantized.scale, scale)
    tied = torch.zeros(2, 96)  # every logit 0: the lowest expert
    assert route_top1_ref(tied, weight)[1].flatten().tolist() == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,experts,hidden", [(1, 16, 512), (3, 5, 200), (16, 16, 1100)])
@pytest.mark.parametrize("quantize", [False, True])
def test_kernel_equals_the_reference(device, tokens, experts, hidden, quantize):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, weight = _inputs(tokens, experts, hidden, dtype, device, seed=tokens)
    rows, ids, ones, quantized = route_top1_triton(x, weight, quantize=quantize)
    want_rows, want_ids, _, want_q = route_top1_ref(x.cpu(), weight.cpu(), quantize=quantize)
    assert torch.equal(ids.cpu(), want_ids) and torch.equal(ones.cpu(), torch.ones(tokens, 1))
    # the logits' sums in another order: the score may move by a rounding of the model dtype
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(rows.cpu(), want_rows, rtol=tolerance, atol=tolerance)
    assert (quantized is None) == (not quantize)
    if quantize:  # the unfused path's quantize kernel, bit for bit (on the GPU also the reference's codes;
        # Triton 3.9's interpreter rounds some values to E4M3 wrongly, alike in both kernels: test_fp8_block.py)
        codes, scale = quantize_rows_triton(x)
        assert torch.equal(quantized.values.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(quantized.scale, scale) and quantized.dtype == dtype
        torch.testing.assert_close(quantized.scale.cpu(), want_q.scale)
