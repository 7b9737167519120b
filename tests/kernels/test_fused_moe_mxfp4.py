"""Fused MoE with MXFP4 experts (gpt-oss): the widening is exact (every byte under every exponent,
against float64); the reference is the dequantized model's MLP, checked against a float64 loop
over tokens; the kernel layout holds the stored codes; the Triton kernels (GPU, or Triton's CPU
interpreter with TRITON_INTERPRET=1) equal the reference, also replayed from a CUDA graph.

Tolerances (||kernel - reference|| / ||reference||, kernel_testing.TOLERANCE): the kernels widen
each weight exactly to the activations' dtype, as the reference does, so the two multiply the same
weights and differ only in the order of accumulation (and the intermediate roundings of the
activations, as for the model-dtype kernels, tests/kernels/test_fused_moe.py): bf16 1e-2, fp16
2e-3, fp32 (interpreter, IEEE dots) 1e-5. Against the float64 loop the float32 reference is off by
its roundings only: 1e-5.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

from kernels.fused_moe import route_tokens_ref
from kernels.fused_moe_mxfp4 import (E2M1_VALUES, MXFP4Experts, dequantize_mxfp4_experts, fused_moe_mxfp4_ref,
                                     kernel_layout, moe_forward_mxfp4, prepare_mxfp4_experts)
from kernels.moe_epilogue import SWIGLU_ALPHA, ExpertEpilogue


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def distinct_logits(num_tokens, num_experts, *, seed):
    """Router logits distinct even in bf16 (steps of 0.05), so no tie at the k-th place."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen) * 0.05 - 3.0 for _ in range(num_tokens)])


def stored_experts(num_experts, rows, cols, *, seed, exponent):
    """Random codes (every byte alike) and exponents around ``exponent`` (weights ~ 2^(exponent - 127)
    times up to 6): codes (E, rows, cols / 2), scales (E, rows, cols / 32)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(exponent - 2, exponent + 1, (num_experts, rows, cols // 32), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    return codes, scales


def problem(num_tokens, hidden, inter, num_experts, *, seed, biases=True):
    """x, router logits, stored gate_up (E, 2I, H) and down (E, H, I), and the biases (E, 2I), (E, H)."""
    x = randn(num_tokens, hidden, seed=seed)
    gate_up = stored_experts(num_experts, 2 * inter, hidden, seed=seed + 1, exponent=127 - 5)  # ~ H^-0.5
    down = stored_experts(num_experts, hidden, inter, seed=seed + 2, exponent=127 - 5)
    bias = (randn(num_experts, 2 * inter, seed=seed + 4, scale=0.1), randn(num_experts, hidden, seed=seed + 5, scale=0.1))
    return x, distinct_logits(num_tokens, num_experts, seed=seed + 3), gate_up, down, bias if biases else (None, None)


def widened_float64(codes, scales):
    """The experts in float64 from the format's definition, value by value."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    low, high = values[codes.long() & 0xF], values[codes.long() >> 4]
    rows = torch.stack([low, high], dim=-1).flatten(-2)  # value 2j low nibble, 2j + 1 high
    return rows * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)


# ---- CPU: widening, reference and layout ---------------------------------------------------------

def test_widening_is_exact_for_every_byte_and_exponent():
    """Every byte (both nibbles, signed zeros) under every exponent whose values stay below 2^128
    (0, the subnormal 2^-127, to 252), against float64, in bfloat16 and float32."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 1, 256).repeat(1, 253, 1)
    scales = torch.arange(253, dtype=torch.int32).to(torch.uint8).view(1, 253, 1).repeat(1, 1, 16)
    expected = widened_float64(codes, scales)
    for dtype in (torch.bfloat16, torch.float32):
        widened = dequantize_mxfp4_experts(codes, scales, dtype)
        assert widened.dtype == dtype and torch.equal(widened.double(), expected)
    assert torch.equal(dequantize_mxfp4_experts(codes, scales, torch.bfloat16).signbit(), expected.signbit())


@pytest.mark.parametrize("activation,limit", [("silu", None), ("swiglu_clamped", 0.4)])
@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_equals_a_float64_loop_over_tokens(activation, limit, num_tokens, renormalize):
    """moe_forward_mxfp4 on CPU (float32): for each token, its top-k experts' MLPs (bias, activation,
    bias) weighted by the routing weights, computed in float64 from the format's definition."""
    x, logits, gate_up, down, (gu_bias, dn_bias) = problem(num_tokens, 64, 96, 6, seed=num_tokens)
    experts = [prepare_mxfp4_experts(*stored, torch.float32) for stored in (gate_up, down)]
    assert experts[0].kernel == {} and experts[0].dense.shape == (6, 192, 64)
    out = moe_forward_mxfp4(x, logits, *experts, 2, renormalize, gate_up_bias=gu_bias, down_bias=dn_bias,
                            activation=activation, swiglu_limit=limit)
    w_gate_up, w_down = widened_float64(*gate_up), widened_float64(*down)
    expected = torch.zeros(num_tokens, 64, dtype=torch.float64)
    for t in range(num_tokens):
        probs = torch.softmax(logits[t].double(), -1)
        weights, ids = torch.topk(probs, 2)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            h = w_gate_up[e] @ x[t].double() + gu_bias[e].double()
            gate, up = h[:96], h[96:]
            if activation == "silu":
                act = gate * torch.sigmoid(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
            expected[t] += w * (w_down[e] @ act + dn_bias[e].double())
    assert out.dtype == torch.float32 and relative_error(out, expected) < 1e-5


def test_reference_entry_is_fused_moe_ref_on_the_widened_experts():
    x, logits, gate_up, down, bias = problem(9, 64, 32, 4, seed=2)
    epilogue = ExpertEpilogue(*bias, "swiglu_clamped", 0.7)
    weights, ids = route_tokens_ref(logits, 3, True)
    experts = [prepare_mxfp4_experts(*stored, torch.float32) for stored in (gate_up, down)]
    out = moe_forward_mxfp4(x, logits, *experts, 3, True, gate_up_bias=bias[0], down_bias=bias[1],
                            activation="swiglu_clamped", swiglu_limit=0.7)
    assert torch.equal(out, fused_moe_mxfp4_ref(x, gate_up, down, weights, ids, epilogue))


@pytest.mark.parametrize("cols", [64, 96, 160, 128])
def test_kernel_layout_holds_the_stored_codes(cols):
    """Byte j of a row: column j (low nibble) and K_pad/2 + j (high), K_pad = K rounded up to 64 with
    zero codes; scales transposed to (E, K_pad / 32, N), the padding groups 127; no widened copy."""
    codes, scales = stored_experts(3, 10, cols, seed=cols, exponent=120)
    experts = prepare_mxfp4_experts(codes, scales, torch.bfloat16, for_kernel=True)
    assert experts.dense is None and experts.in_features == cols
    layout = experts.kernel
    half = experts.half_k
    assert half == -(-cols // 64) * 32 and layout["codes"].shape == (3, 10, half)
    columns = torch.cat([layout["codes"] & 0xF, layout["codes"] >> 4], dim=-1)  # (E, N, K_pad) codes
    stored = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    assert torch.equal(columns[..., :cols], stored) and not columns[..., cols:].any()
    assert layout["scales"].shape == (3, 2 * half // 32, 10)
    assert torch.equal(layout["scales"][:, :cols // 32], scales.transpose(1, 2))
    assert (layout["scales"][:, cols // 32:] == 127).all()
    assert all(t.is_contiguous() for t in layout.values())


def test_malformed_experts_and_large_exponents_are_refused():
    codes, scales = stored_experts(2, 4, 64, seed=0, exponent=120)
    with pytest.raises(ValueError, match="do not pair up"):
        prepare_mxfp4_experts(codes, scales[..., :1], torch.bfloat16)
    with pytest.raises(ValueError, match="uint8 codes"):
        prepare_mxfp4_experts(codes.to(torch.int16), scales, torch.bfloat16)
    scales[1, 2, 0] = 241
    with pytest.raises(ValueError, match="scales up to 241: the kernels take exponents up to 240"):
        kernel_layout(codes, scales)


# ---- Triton kernels (GPU; or TRITON_INTERPRET=1 on CPU) -----------------------------------------

SHAPES = {  # (hidden, inter, num_experts, top_k)
    "E8_K2": (128, 64, 8, 2),   # widths that are multiples of 64: no padding
    "E6_K4": (96, 160, 6, 4),   # 3 and 5 groups: K_pad pads a group; 160 rows: a part column tile
}


def kernel_result(device, dtype, x, logits, gate_up, down, bias, top_k, *, renormalize=True, config=None,
                  activation="swiglu_clamped", limit=0.6):
    """(Triton output, reference output) on one problem: the single-token entry (routing in the
    kernel) for one token, else the routed entry with the reference's routing."""
    from kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton, moe_single_token_mxfp4_triton

    x, logits = x.to(dtype), logits.to(dtype)
    bias = [None if b is None else b.to(dtype) for b in bias]
    epilogue = ExpertEpilogue(*bias, activation, limit if activation == "swiglu_clamped" else None)
    experts = [prepare_mxfp4_experts(*[t.to(device) for t in s], dtype, for_kernel=True) for s in (gate_up, down)]
    on_device = ExpertEpilogue(*[None if b is None else b.to(device) for b in bias], epilogue.activation,
                               epilogue.swiglu_limit)
    weights, ids = route_tokens_ref(logits, top_k, renormalize)
    expected = fused_moe_mxfp4_ref(x, gate_up, down, weights, ids, epilogue)
    if x.shape[0] == 1:
        out = moe_single_token_mxfp4_triton(x.to(device), logits.to(device), *experts, top_k, renormalize,
                                            config=config, epilogue=on_device)
    else:
        out = fused_moe_mxfp4_triton(x.to(device), *experts, weights.to(device), ids.to(device), config=config,
                                     epilogue=on_device)
    assert out.dtype == dtype and out.shape == x.shape
    return out, expected


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # routing in gate_up (FMA); grouped GEMM blocks of 16
def test_kernel_equals_reference(device, shape, num_tokens):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, gate_up, down, bias = problem(num_tokens, hidden, inter, num_experts, seed=num_tokens)
    for dtype in low_precision_dtypes(device):
        out, expected = kernel_result(device, dtype, x, logits, gate_up, down, bias, top_k)
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("fma", [None, (16, 1, 4), (32, 2, 4)])
def test_few_tokens_through_either_kernel(device, num_tokens, fma):
    """One token or a few: the FMA kernel at one or two groups a step, or the grouped GEMM (fma None),
    with the plain SwiGLU and no biases (the other epilogue)."""
    x, logits, gate_up, down, bias = problem(num_tokens, 96, 160, 6, seed=11, biases=False)
    dtype = low_precision_dtypes(device)[0]
    config = {"fma": None if fma is None else {"gate_up": fma, "down": fma}, "fma_max_assignments": 64}
    out, expected = kernel_result(device, dtype, x, logits, gate_up, down, bias, 2, renormalize=False,
                                  config=config, activation="silu")
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("block_k", [32, 64])
def test_every_block_size_and_tile(device, block_m, swap_ab, block_k):
    """fused_moe_mxfp4_triton picks block_m, tiles and the operand order by size; each choice must
    compute the same thing (K = 160 and 96: the last 64-byte step is part padding)."""
    from kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton

    x, logits, gate_up, down, bias = problem(45, 96, 160, 12, seed=block_m)
    dtype = low_precision_dtypes(device)[0]
    experts = [prepare_mxfp4_experts(*[t.to(device) for t in s], dtype, for_kernel=True) for s in (gate_up, down)]
    weights, ids = route_tokens_ref(logits, 3, False)
    epilogue = ExpertEpilogue(bias[0].to(dtype), bias[1].to(dtype), "swiglu_clamped", 0.6)
    expected = fused_moe_mxfp4_ref(x.to(dtype), gate_up, down, weights, ids, epilogue)
    gemm = {"BLOCK_N": 32, "BLOCK_K": block_k, "SWAP_AB": swap_ab, "num_warps": 4, "num_stages": 2}
    on_device = ExpertEpilogue(epilogue.gate_up_bias.to(device), epilogue.down_bias.to(device), "swiglu_clamped", 0.6)
    out = fused_moe_mxfp4_triton(x.to(device, dtype), *experts, weights.to(device), ids.to(device), block_m=block_m,
                                 config={"gemm": gemm}, epilogue=on_device)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_widened_scratch_path_and_the_widening_kernel(device):
    """From many rows an expert the experts are widened in one pass (dequantize_mxfp4_triton, equal
    to the reference's widening bit for bit) and kernels/fused_moe.py's GEMMs run on them."""
    from kernels.fused_moe_mxfp4 import dequantize_mxfp4_triton, fused_moe_mxfp4_triton

    x, logits, gate_up, down, bias = problem(30, 96, 160, 4, seed=3)
    dtype = low_precision_dtypes(device)[0]
    experts = [prepare_mxfp4_experts(*[t.to(device) for t in s], dtype, for_kernel=True) for s in (gate_up, down)]
    for stored, prepared in zip((gate_up, down), experts):
        assert torch.equal(dequantize_mxfp4_triton(prepared, dtype).cpu(), dequantize_mxfp4_experts(*stored, dtype))
    weights, ids = route_tokens_ref(logits, 2, True)
    epilogue = ExpertEpilogue(bias[0].to(dtype), bias[1].to(dtype), "swiglu_clamped", 0.6)
    expected = fused_moe_mxfp4_ref(x.to(dtype), gate_up, down, weights, ids, epilogue)
    on_device = ExpertEpilogue(epilogue.gate_up_bias.to(device), epilogue.down_bias.to(device), "swiglu_clamped", 0.6)
    out = fused_moe_mxfp4_triton(x.to(device, dtype), *experts, weights.to(device), ids.to(device),
                                 config={"dequantize_min_rows": 1}, epilogue=on_device)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
@pytest.mark.parametrize("num_tokens", [1, 4, 600, 1100])  # routing in gate_up, grouped GEMM blocks of 16, 64, widened
def test_moe_forward_mxfp4_replays_from_a_cuda_graph(num_tokens):
    """The public entry on CUDA (kernel layout, dense None) captures whole and replays with new
    router logits (other experts chosen) to the new answers."""
    x, _, gate_up, down, bias = problem(num_tokens, 256, 128, 32, seed=5)
    experts = [prepare_mxfp4_experts(*[t.cuda() for t in s], torch.bfloat16) for s in (gate_up, down)]
    assert isinstance(experts[0], MXFP4Experts) and experts[0].dense is None and experts[0].kernel
    x = x.to("cuda", torch.bfloat16)
    gu_bias, dn_bias = (b.to("cuda", torch.bfloat16) for b in bias)
    logits = distinct_logits(num_tokens, 32, seed=5).to("cuda", torch.bfloat16)
    kwargs = dict(gate_up_bias=gu_bias, down_bias=dn_bias, activation="swiglu_clamped", swiglu_limit=7.0)
    moe_forward_mxfp4(x, logits, *experts, 4, True, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward_mxfp4(x, logits, *experts, 4, True, **kwargs)
    epilogue = ExpertEpilogue(gu_bias.cpu(), dn_bias.cpu(), "swiglu_clamped", 7.0)
    for seed in (6, 7):
        logits.copy_(distinct_logits(num_tokens, 32, seed=seed))
        graph.replay()
        expected = fused_moe_mxfp4_ref(x.cpu(), gate_up, down, *route_tokens_ref(logits.cpu(), 4, True), epilogue)
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
