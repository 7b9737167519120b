"""Fused MoE with FP8 experts (kernels/fused_moe_fp8.py), per-channel and 128 x 128 block scales:
the reference (CPU) against a per-token loop and against the unquantized MLP; the Triton grouped
GEMM against the reference (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1: on CPU tensors
the activations are quantized by the reference, which matters, since the interpreter's own E4M3
conversion loses a mantissa carry into the next binade); torch._scaled_grouped_mm and CUDA-graph
replays (GPU).

Tolerances (||kernel - reference|| / ||reference||): kernel and reference multiply the same E4M3
values with the same scales; they differ in the order of float32 accumulation, and the SwiGLU
output is rounded to the model dtype and quantized to E4M3 again for down. Where accumulation order
moves a row's largest value across a rounding of the model dtype (2^-8 of it in bf16, 2^-11 in
fp16), that row's scale moves by as much and about 2^-8 / 2^-4 = 1/16 of its elements (1/128 in
fp16) land on the neighbouring E4M3 value (2^-3 apart): such a row moves by up to ~1.5%, and a few
of them put a test's whole error at 3e-3 to 1e-2 (H200, 2026-11-26). Bounds: 2e-2 for bf16 and
fp16, 1e-3 for float32 (the interpreter), whose rounding is 2^-24; a wrong scale or row is O(1)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import low_precision_dtypes, relative_error

from kernels.fp8 import FP8_DTYPE, quantize_rows
from kernels.fp8_block import dequantize_groups, quantize_blocks, quantize_groups
from kernels.fused_moe import fused_moe_ref, route_tokens_ref
from kernels.fused_moe_fp8 import (dequantize_experts, fused_moe_fp8_ref, fused_moe_fp8_triton, moe_forward_fp8,
                                   moe_single_token_fp8_triton, scale_groups)

TOLERANCES = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}  # module docstring


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def quantize_experts(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> (E4M3, scale (E, N) per channel or (E, ceil(N/128), ceil(K/128)) per block)."""
    if granularity == "block":
        return quantize_blocks(weight)
    codes, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]))
    return codes.view(weight.shape), scale.view(weight.shape[:2])


def distinct_logits(num_tokens, num_experts, *, seed):
    """Router logits distinct even in bf16 (steps of 0.05), so no tie at the k-th place."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen) * 0.05 - 3.0 for _ in range(num_tokens)])


def problem(num_tokens, hidden, inter, num_experts, granularity, *, seed):
    x = randn(num_tokens, hidden, seed=seed)
    gate_up = quantize_experts(randn(num_experts, 2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5), granularity)
    down = quantize_experts(randn(num_experts, hidden, inter, seed=seed + 2, scale=inter**-0.5), granularity)
    return x, distinct_logits(num_tokens, num_experts, seed=seed + 3), gate_up, down


# ---- CPU: the reference --------------------------------------------------------------------------

def test_scale_granularity_is_read_from_the_scales_shape():
    weight = torch.zeros(4, 300, 200, dtype=FP8_DTYPE)
    assert scale_groups(weight, torch.ones(4, 300)) == (1, 0)
    assert scale_groups(weight, torch.ones(4, 3, 2)) == (128, 128)
    with pytest.raises(ValueError, match=r"fit neither per channel \(\(4, 300\)\) nor 128 x 128 blocks"):
        scale_groups(weight, torch.ones(4, 3, 3))


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_reference_is_a_per_token_loop_over_its_experts(granularity):
    """Each token alone: x quantized, each chosen expert's gate/up product rounded to the dtype,
    SiLU times up, that quantized, down, times the routing weight, summed over the token's experts."""
    x, logits, (gu, gu_s), (dn, dn_s) = problem(9, 320, 128, 6, granularity, seed=1)
    weights, ids = route_tokens_ref(logits, 2, True)
    quantized = (lambda t: dequantize_groups(*quantize_groups(t))) if granularity == "block" else \
        (lambda t: quantize_rows(t)[0].float() * quantize_rows(t)[1][:, None])
    dense_gu, dense_dn = dequantize_experts(gu, gu_s), dequantize_experts(dn, dn_s)
    expected = torch.zeros(9, 320)
    for t in range(9):
        for k in range(2):
            e = ids[t, k].item()
            gate, up = (quantized(x[t:t + 1]) @ dense_gu[e].T).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            expected[t] += weights[t, k] * (quantized(act) @ dense_dn[e].T)[0]
    assert relative_error(fused_moe_fp8_ref(x, gu, gu_s, dn, dn_s, weights, ids), expected) < TOLERANCES[torch.float32]


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_reference_is_the_unquantized_mlp_within_fp8_rounding(granularity):
    """Against fused_moe_ref on the dequantized experts (weights exact, activations not rounded):
    the two activation roundings (~2.6% RMS each, fewer for 1 x 128 groups) stay under 5%."""
    x, logits, gate_up, down = problem(40, 256, 128, 8, granularity, seed=2)
    weights, ids = route_tokens_ref(logits, 2, False)
    dense = [dequantize_experts(*stored) for stored in (gate_up, down)]
    out = fused_moe_fp8_ref(x, *gate_up, *down, weights, ids)
    assert relative_error(out, fused_moe_ref(x, *dense, weights, ids)) < 0.05


def test_moe_forward_on_cpu_is_the_reference():
    x, logits, gate_up, down = problem(5, 256, 128, 8, "block", seed=3)
    weights, ids = route_tokens_ref(logits, 2, True)
    assert torch.equal(moe_forward_fp8(x, logits, *gate_up, *down, 2, True),
                       fused_moe_fp8_ref(x, *gate_up, *down, weights, ids))


# ---- Triton kernels (GPU; or TRITON_INTERPRET=1 on CPU) -----------------------------------------

SHAPES = {  # (hidden, inter, num_experts, top_k); hidden 320: partial 128-column blocks in both GEMMs
    "E8_K2": (320, 128, 8, 2),
    "E32_K4": (256, 256, 32, 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [2, 40, 300])  # blocks of 16, 16 or 32, 32 or 64 rows
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_kernel_equals_reference(device, shape, num_tokens, granularity):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, gate_up, down = problem(num_tokens, hidden, inter, num_experts, granularity, seed=num_tokens)
    for dtype in low_precision_dtypes(device):
        weights, ids = route_tokens_ref(logits.to(dtype), top_k, True)
        expected = fused_moe_fp8_ref(x.to(dtype), *gate_up, *down, weights, ids)
        out = fused_moe_fp8_triton(x.to(dtype).to(device), *[t.to(device) for t in gate_up + down],
                                   weights.to(device), ids.to(device))
        assert out.dtype == dtype and out.shape == x.shape
        assert relative_error(out, expected) < TOLERANCES[dtype]
        rows = fused_moe_fp8_triton(x.to(dtype).to(device), *[t.to(device) for t in gate_up + down],
                                    weights.to(device), ids.to(device), sum_experts=False)
        assert rows.shape == (num_tokens, top_k, hidden) and torch.equal(rows.sum(dim=1), out)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_single_token_routes_inside_the_kernel(device, granularity, shape):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, gate_up, down = problem(1, hidden, inter, num_experts, granularity, seed=5)
    for dtype in low_precision_dtypes(device):
        weights, ids = route_tokens_ref(logits.to(dtype), top_k, False)
        expected = fused_moe_fp8_ref(x.to(dtype), *gate_up, *down, weights, ids)
        out = moe_single_token_fp8_triton(x.to(dtype).to(device), logits.to(dtype).to(device),
                                          *[t.to(device) for t in gate_up + down], top_k, False)
        assert relative_error(out, expected) < TOLERANCES[dtype]
        rows = moe_single_token_fp8_triton(x.to(dtype).to(device), logits.to(dtype).to(device),
                                           *[t.to(device) for t in gate_up + down], top_k, False, sum_experts=False)
        assert rows.shape == (1, top_k, hidden) and torch.equal(rows.sum(dim=1), out)


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="needs torch._scaled_grouped_mm")
@pytest.mark.parametrize("num_tokens", [3, 600])
def test_scaled_grouped_mm_path_equals_reference(num_tokens):
    """Per-channel experts through torch._scaled_grouped_mm (sm90): same scheme; its fast FP8
    accumulation (kernels.fp8.FAST_ACCUM) adds ~1e-3 relative to the bf16 bound (measured 1.07e-2)."""
    from kernels.fused_moe_fp8 import fused_moe_fp8_grouped_mm, scaled_grouped_mm_supported

    x, logits, gate_up, down = problem(num_tokens, 256, 256, 32, "channel", seed=6)
    x = x.bfloat16().cuda()
    gate_up, down = [t.cuda() for t in gate_up], [t.cuda() for t in down]
    if not scaled_grouped_mm_supported(x, *gate_up):
        pytest.skip("torch._scaled_grouped_mm with row-wise scales needs an sm90 GPU")
    weights, ids = route_tokens_ref(logits.bfloat16(), 4, True)
    expected = fused_moe_fp8_ref(x.cpu(), *[t.cpu() for t in gate_up + down], weights, ids)
    out = fused_moe_fp8_grouped_mm(x, *gate_up, *down, weights.cuda(), ids.cuda())
    assert relative_error(out, expected) < TOLERANCES[torch.bfloat16]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_replayed_from_a_cuda_graph(granularity):
    """Routing, alignment, quantization and both GEMMs captured (one token: routing inside the
    kernel; 8 and 96 tokens: aligned blocks of 16 and 32 rows)."""
    hidden, inter, num_experts, top_k = SHAPES["E32_K4"]
    _, _, gate_up, down = problem(1, hidden, inter, num_experts, granularity, seed=7)
    gate_up, down = [t.cuda() for t in gate_up], [t.cuda() for t in down]
    inputs = [(torch.zeros(n, hidden, device="cuda", dtype=torch.bfloat16),
               torch.zeros(n, num_experts, device="cuda", dtype=torch.bfloat16)) for n in (1, 8, 96)]
    for x, logits in inputs:
        moe_forward_fp8(x, logits, *gate_up, *down, top_k, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [moe_forward_fp8(x, logits, *gate_up, *down, top_k, True) for x, logits in inputs]
    for seed, (x, logits) in enumerate(inputs):
        x.copy_(randn(*x.shape, seed=20 + seed).to(x))
        logits.copy_(distinct_logits(x.shape[0], num_experts, seed=30 + seed).to(logits))
    graph.replay()
    for (x, logits), out in zip(inputs, outs):
        weights, ids = route_tokens_ref(logits.cpu(), top_k, True)
        expected = fused_moe_fp8_ref(x.cpu(), *[t.cpu() for t in gate_up + down], weights, ids)
        assert relative_error(out, expected) < TOLERANCES[torch.bfloat16]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048, 8192])
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_every_batch_size_of_qwen3_30b_a3b_experts(num_tokens, granularity):
    """What moe_forward_fp8 picks at each of issue 53's sizes (one token with the routing inside,
    the block-tiled Triton GEMM, per channel from SCALED_GROUPED_MM_MIN_ASSIGNMENTS torch._scaled_grouped_mm)
    against the reference, bf16 activations, Qwen3-30B-A3B's expert shape."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).bfloat16()
    gate_up = quantize_experts(torch.randn(128, 1536, 2048, device="cuda", generator=gen) * 2048**-0.5, granularity)
    down = quantize_experts(torch.randn(128, 2048, 768, device="cuda", generator=gen) * 768**-0.5, granularity)
    logits = torch.randn(num_tokens, 128, device="cuda", generator=gen).bfloat16()
    expected = fused_moe_fp8_ref(x, *gate_up, *down, *route_tokens_ref(logits, 8, True))
    assert relative_error(moe_forward_fp8(x, logits, *gate_up, *down, 8, True), expected) < TOLERANCES[torch.bfloat16]
