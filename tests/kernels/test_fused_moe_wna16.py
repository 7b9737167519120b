"""Fused MoE with weight-only integer experts: the reference is kernels/fused_moe.py's reference on
the dequantized experts (CPU); the kernel layout holds the stored codes (CPU); the Triton kernels
equal the reference (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1), also replayed
from a CUDA graph.

Tolerances (||kernel - reference|| / ||reference||, kernel_testing.TOLERANCE): the reference
multiplies the dequantized weights rounded to the activations' dtype (kernels/wna16.dequantize);
the kernels factor scale and zero out of the dot (OFF + code, exact in 16 bits, then
s * (dot - (OFF + z) * sum x) in float32, or on the FMA units for one token), so they multiply the
unrounded weights: they differ from the reference by its weights' rounding (2^-9 relative in bf16,
2^-12 in fp16, random in sign) and the order of accumulation, as for the model-dtype kernels
(tests/kernels/test_fused_moe.py). bf16 1e-2 and fp16 2e-3 are several times what that gives; fp32
(interpreter, IEEE dots) 1e-5.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

from kernels.fused_moe import fused_moe_ref, route_tokens_ref
from kernels.fused_moe_wna16 import kernel_layout, moe_forward_wna16, prepare_wna16_experts, tile_k
from kernels.wna16 import dequantize, pack_codes, quantize, unpack_codes


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def distinct_logits(num_tokens, num_experts, *, seed):
    """Router logits distinct even in bf16 (steps of 0.05), so no tie at the k-th place."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen) * 0.05 - 3.0 for _ in range(num_tokens)])


def quantized_problem(num_tokens, hidden, inter, num_experts, *, bits, group_size, seed):
    """x, router logits, and the stored (weight, scale, zero) of gate_up (E, 2I, H) and down (E, H, I);
    group_size 0: per channel. Gate_up asymmetric, down symmetric, so both zero schemes run."""
    x = randn(num_tokens, hidden, seed=seed)
    gate_up = quantize(randn(num_experts, 2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5), bits,
                       group_size or hidden, symmetric=False)
    down = quantize(randn(num_experts, hidden, inter, seed=seed + 2, scale=inter**-0.5), bits,
                    group_size or inter, symmetric=True)
    return x, distinct_logits(num_tokens, num_experts, seed=seed + 3), gate_up, down


# ---- CPU: the reference and the layout -----------------------------------------------------------

@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (4, 0), (8, 0)])
@pytest.mark.parametrize("num_tokens", [1, 11])
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_is_fused_moe_ref_on_dequantized_experts(bits, group_size, num_tokens, renormalize):
    x, logits, gate_up, down = quantized_problem(num_tokens, 128, 64, 8, bits=bits, group_size=group_size, seed=bits)
    experts = [prepare_wna16_experts(*stored, bits, torch.float32) for stored in (gate_up, down)]
    assert experts[0].kernel == {} and experts[0].group_size == (group_size or 128)
    dense = [dequantize(*stored, bits) for stored in (gate_up, down)]
    expected = fused_moe_ref(x, *dense, *route_tokens_ref(logits, 2, renormalize))
    assert torch.equal(moe_forward_wna16(x, logits, *experts, 2, renormalize), expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_layout_holds_the_stored_codes(bits):
    """4 bits: byte j of a row = column j (low nibble) | column K/2 + j (high); scale and zero
    transposed to (E, groups, N); no dequantized copy is kept."""
    weight, scale, zero = quantize(randn(3, 10, 64, seed=1), bits, 16, symmetric=False)
    experts = prepare_wna16_experts(weight, scale, zero, bits, torch.bfloat16, for_kernel=True)
    assert experts.dense is None and (experts.in_features, experts.group_size) == (64, 16)
    layout = experts.kernel
    codes = unpack_codes(weight, bits)
    if bits == 4:
        halves = torch.cat([layout["weight"] & 0xF, layout["weight"] >> 4], dim=-1)
        assert torch.equal(halves, codes)
    else:
        assert torch.equal(layout["weight"], pack_codes(codes, bits))
    assert layout["scale"].shape == (3, 4, 10) and torch.equal(layout["scale"], scale.transpose(1, 2))
    assert layout["zero"].dtype == torch.uint8 and torch.equal(layout["zero"], zero.transpose(1, 2))
    assert all(t.is_contiguous() for t in layout.values())
    assert kernel_layout(weight, scale, zero, bits)["weight"].shape == weight.shape


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_features,group_size", [(2048, 128), (768, 128), (384, 128), (96, 32), (160, 32),
                                                    (512, 64), (200, 200), (48, 16), (72, 24), (1536, 1536)])
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_tile_k_keeps_each_tile_in_one_group(bits, in_features, group_size, block_k):
    """Where tile_k says one group per tile, every tile the kernel reads (stored bytes k0 + [0, BLOCK_K);
    4 bits: columns k and K/2 + k) lies within the group of its first column."""
    if bits == 4 and in_features % 2:
        return
    size, one_group = tile_k(block_k, bits, in_features, group_size)
    assert size <= block_k and (size >= 16 or not one_group)
    if group_size % 16 == 0 and (bits == 8 or (in_features // 2) % 16 == 0):
        assert one_group  # every group size the engine builds (32, 64, 128, per channel)
    if not one_group:
        return
    stored = in_features // 2 if bits == 4 else in_features
    starts = [0, stored] if bits == 4 else [0]
    for k0 in range(0, stored, size):
        for start in starts:
            columns = [start + k for k in range(k0, min(k0 + size, stored))]
            assert {c // group_size for c in columns} == {(start + k0) // group_size}


# ---- Triton kernels (GPU; or TRITON_INTERPRET=1 on CPU) -----------------------------------------------

SHAPES = {  # (hidden, inter, num_experts, top_k): widths that take group size 128
    "E8_K2": (384, 128, 8, 2),     # Mixtral-like top-2; H/2 = 192, three g128 groups a row
    "E128_K8": (256, 128, 128, 8),  # Qwen3-MoE-like top-8 of 128: most experts get a token or two
}


def kernel_result(device, dtype, x, logits, stored, bits, top_k, renormalize=True):
    """(Triton output, reference output) on one problem: the single-token entry (routing in the
    kernel) for one token, else the routed entry with the reference's routing."""
    from kernels.fused_moe_wna16 import fused_moe_wna16_triton, moe_single_token_wna16_triton

    x, logits = x.to(dtype), logits.to(dtype)
    experts = [prepare_wna16_experts(*[t.to(device) for t in s], bits, dtype, for_kernel=True) for s in stored]
    dense = [dequantize(*s, bits, dtype) for s in stored]
    weights, ids = route_tokens_ref(logits, top_k, renormalize)
    expected = fused_moe_ref(x, *dense, weights, ids)
    if x.shape[0] == 1:
        out = moe_single_token_wna16_triton(x.to(device), logits.to(device), *experts, top_k, renormalize)
    else:
        out = fused_moe_wna16_triton(x.to(device), *experts, weights.to(device), ids.to(device))
    assert out.dtype == dtype and out.shape == x.shape
    return out, expected


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 700])  # routing in gate_up; blocks of 16; 16; 32 or 64
@pytest.mark.parametrize("group_size", [32, 128, 0])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_equals_reference(device, shape, num_tokens, group_size, bits):
    hidden, inter, num_experts, top_k = SHAPES[shape]
    x, logits, *stored = quantized_problem(num_tokens, hidden, inter, num_experts, bits=bits, group_size=group_size,
                                           seed=num_tokens + group_size)
    dtypes = low_precision_dtypes(device)
    if device == "cuda" and group_size != 128:
        dtypes = [torch.bfloat16]  # fp16 at every shape and size with group 128 (compile time)
    for dtype in dtypes:
        out, expected = kernel_result(device, dtype, x, logits, stored, bits, top_k)
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group_size,hidden,inter", [(4, 16, 48, 80), (8, 24, 72, 48), (4, 0, 200, 72), (8, 40, 200, 80)])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_kernel_odd_widths_and_groups(device, bits, group_size, hidden, inter, num_tokens):
    """Group sizes whose tiles straddle groups (the per-element scale lookup), and widths that are
    not multiples of a tile (H = 200: the last tile is part padding; per channel)."""
    x, logits, *stored = quantized_problem(num_tokens, hidden, inter, 8, bits=bits, group_size=group_size, seed=7)
    for dtype in low_precision_dtypes(device)[:1]:
        out, expected = kernel_result(device, dtype, x, logits, stored, bits, 2, renormalize=False)
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("factored", [True, False])
def test_every_block_size_and_operand_order(device, block_m, swap_ab, factored):
    """fused_moe_wna16_triton picks block_m, tiles, the operand order and the factored or
    dequantizing inner product by size; each choice must compute the same thing."""
    from kernels.fused_moe_wna16 import fused_moe_wna16_triton, wna16_gemm_config

    x, logits, *stored = quantized_problem(45, 256, 128, 12, bits=4, group_size=64, seed=block_m)
    dtype = low_precision_dtypes(device)[0]
    experts = [prepare_wna16_experts(*[t.to(device) for t in s], 4, dtype, for_kernel=True) for s in stored]
    weights, ids = route_tokens_ref(logits, 3, False)
    expected = fused_moe_ref(x.to(dtype), *[dequantize(*s, 4, dtype) for s in stored], weights, ids)
    config = {**wna16_gemm_config(block_m, 4), "SWAP_AB": swap_ab, "FACTORED": factored}
    out = fused_moe_wna16_triton(x.to(device, dtype), *experts, weights.to(device), ids.to(device), block_m=block_m,
                                 config=config)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{}, {"gate_up": (16, 32, 4), "down": (64, 16, 2)}, {"down": (8, 64, 4)}])
def test_single_token_paths(device, tiles):
    """One token: the FMA kernel (4 bits) for gate_up and / or down, or the grouped GEMM for either,
    over groups of 32 (BLOCK_W cut to 8 or 4 words) and widths with a part tile (H = 416)."""
    from kernels.fused_moe_wna16 import moe_single_token_wna16_triton, wna16_gemm_config

    x, logits, *stored = quantized_problem(1, 416, 96, 8, bits=4, group_size=32, seed=3)
    dtype = low_precision_dtypes(device)[0]
    experts = [prepare_wna16_experts(*[t.to(device) for t in s], 4, dtype, for_kernel=True) for s in stored]
    x, logits = x.to(dtype), logits.to(dtype)
    expected = fused_moe_ref(x, *[dequantize(*s, 4, dtype) for s in stored], *route_tokens_ref(logits, 2, True))
    out = moe_single_token_wna16_triton(x.to(device), logits.to(device), *experts, 2, True,
                                        config={**wna16_gemm_config(16, 4), "single_token": tiles})
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_tokens", [1, 4, 600])  # routing in gate_up, the align kernel, torch-ops alignment
def test_moe_forward_wna16_replays_from_a_cuda_graph(bits, num_tokens):
    """The public entry on CUDA (kernel layout, dense None) captures whole and replays with new
    router logits (other experts chosen) to the new answers."""
    x, _, *stored = quantized_problem(num_tokens, 256, 128, 32, bits=bits, group_size=128, seed=5)
    experts = [prepare_wna16_experts(*[t.cuda() for t in s], bits, torch.bfloat16) for s in stored]
    assert experts[0].dense is None and experts[0].kernel
    dense = [dequantize(*s, bits, torch.bfloat16) for s in stored]
    x = x.to("cuda", torch.bfloat16)
    logits = distinct_logits(num_tokens, 32, seed=5).to("cuda", torch.bfloat16)
    moe_forward_wna16(x, logits, *experts, 4, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward_wna16(x, logits, *experts, 4, True)
    for seed in (6, 7):
        logits.copy_(distinct_logits(num_tokens, 32, seed=seed))
        graph.replay()
        expected = fused_moe_ref(x.cpu(), *dense, *route_tokens_ref(logits.cpu(), 4, True))
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3-30B-A3B-sized experts: GPU only")
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048, 8192])
def test_every_batch_size_of_qwen3_30b_a3b_experts(num_tokens):
    """What moe_forward_wna16 picks at each of issue 53's sizes, 4 bits in groups of 128 (asymmetric
    gate_up, symmetric down), against the reference on the dequantized experts, bf16, Qwen3-30B-A3B's shape."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).bfloat16()
    stored = [quantize(torch.randn(128, 1536, 2048, device="cuda", generator=gen) * 2048**-0.5, 4, 128, symmetric=False),
              quantize(torch.randn(128, 2048, 768, device="cuda", generator=gen) * 768**-0.5, 4, 128, symmetric=True)]
    experts = [prepare_wna16_experts(*s, 4, torch.bfloat16) for s in stored]
    dense = [dequantize(*s, 4, torch.bfloat16) for s in stored]
    logits = torch.randn(num_tokens, 128, device="cuda", generator=gen).bfloat16()
    expected = fused_moe_ref(x, *dense, *route_tokens_ref(logits, 8, True))
    out = moe_forward_wna16(x, logits, *experts, 8, True)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
