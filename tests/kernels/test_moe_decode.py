"""The one-launch decode experts (kernels/moe_decode.py): the reference against the grouped path's
references (CPU); the kernel against the reference at 1, 8 and 16 tokens, in the model dtype, FP8 per
channel and FP8 128 x 128 blocks, routed in the kernel or given, with gpt-oss's biases and clamped
SwiGLU (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1); the workspace left clean; the
Qwen3-30B-A3B and gpt-oss-20b shapes and CUDA-graph replays (GPU only).

Tolerances (||kernel - reference|| / ||reference||): the same products in another float32 order,
the activation rounded to the model dtype in both; 1e-5 in float32 (the interpreter), 1e-2 in
bf16 / fp16 (a gate or up value crossing a rounding moves its activation by 2^-8)."""
from __future__ import annotations


import pytest
import torch
from kernel_testing import low_precision_dtypes, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage, stack_bytes

from kernels.fp8 import quantize_rows
from kernels.fp8_block import quantize_blocks
from kernels.fused_moe import fused_moe_ref, route_tokens_ref
from kernels.fused_moe_fp8 import dequantize_experts
from kernels.moe_decode import (DECODE_TILE_CANDIDATES, DECODE_TILES, MAX_TOKENS, W_FP8_BLOCK, W_FP8_CHANNEL, W_INT4,
                                W_MODEL_DTYPE, _workspace, int4_tiles_fit, moe_decode, moe_decode_ref,
                                moe_decode_triton)
from kernels.moe_epilogue import ExpertEpilogue

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def distinct_logits(num_tokens, num_experts, *, seed):
    """Router logits without ties at the k-th place (steps of 0.05), so every routing agrees."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen) * 0.05 - 3.0 for _ in range(num_tokens)])


def experts(kind, hidden, inter, num_experts, *, seed, device="cpu"):
    """(gate_up, gate_up_scale, down, down_scale) of one weight kind: "model", "fp8_channel", "fp8_block"
    (made and quantized on ``device``: full-size shapes on the GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen, device=device) * inter**-0.5
    if kind == "model":
        return gate_up, None, down, None
    if kind == "fp8_block":
        return (*quantize_blocks(gate_up), *quantize_blocks(down))
    out = []
    for w in (gate_up, down):
        codes, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
        out += [codes.view(w.shape), scale.view(w.shape[:2])]
    return tuple(out)


def gpt_oss_epilogue(hidden, inter, num_experts, *, seed):
    return ExpertEpilogue(randn(num_experts, 2 * inter, seed=seed, scale=0.1), randn(num_experts, hidden, seed=seed + 1,
                          scale=0.1), "swiglu_clamped", 7.0)


# ---- CPU: the reference ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_reference_equals_the_grouped_reference_on_dequantized_weights(kind):
    """moe_decode_ref is fused_moe_ref (float32) on the dequantized experts: W8A16, one rounding."""
    hidden, inter, num_experts, top_k = 200, 192, 12, 4
    gate_up, gu_s, down, d_s = experts(kind, hidden, inter, num_experts, seed=1)
    x = randn(3, hidden, seed=2)
    weights, ids = route_tokens_ref(distinct_logits(3, num_experts, seed=3), top_k, True)
    out = moe_decode_ref(x, gate_up, down, weights, ids, gate_up_scale=gu_s, down_scale=d_s)
    plain = (gate_up, down) if kind == "model" else (dequantize_experts(gate_up, gu_s), dequantize_experts(down, d_s))
    assert relative_error(out, fused_moe_ref(x, *plain, weights, ids)) < 1e-6


def test_reference_with_biases_equals_the_grouped_reference():
    hidden, inter, num_experts, top_k = 64, 48, 6, 2
    gate_up, _, down, _ = experts("model", hidden, inter, num_experts, seed=4)
    epilogue = gpt_oss_epilogue(hidden, inter, num_experts, seed=5)
    x = randn(3, hidden, seed=6)
    weights, ids = route_tokens_ref(distinct_logits(3, num_experts, seed=7), top_k, True)
    out = moe_decode(x, distinct_logits(3, num_experts, seed=7), gate_up, down, top_k, True, epilogue=epilogue)
    assert relative_error(out, fused_moe_ref(x, gate_up, down, weights, ids, epilogue)) < 1e-6


# ---- Triton kernel (GPU; or TRITON_INTERPRET=1 on CPU) -----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_kernel_equals_reference(device, num_tokens, kind):
    """Routed in the kernel (Qwen3-MoE-like: renormalised top-4 of 12), H and I not multiples of the tiles."""
    hidden, inter, num_experts, top_k = 200, 192, 12, 4
    gate_up, gu_s, down, d_s = experts(kind, hidden, inter, num_experts, seed=10)
    logits = distinct_logits(num_tokens, num_experts, seed=11)
    weights, ids = route_tokens_ref(logits, top_k, True)
    for dtype in low_precision_dtypes(device):
        x = randn(num_tokens, hidden, seed=12).to(dtype)
        cast = (lambda w: w.to(dtype)) if kind == "model" else (lambda w: w)
        ref = moe_decode_ref(x, cast(gate_up), cast(down), weights, ids, gate_up_scale=gu_s, down_scale=d_s)
        on = [t.to(device) if t is not None else None for t in (x, logits.to(dtype), cast(gate_up), gu_s, cast(down), d_s)]
        out = moe_decode_triton(on[0], on[2], on[4], top_k=top_k, router_logits=on[1], renormalize=True,
                                gate_up_scale=on[3], down_scale=on[5])
        assert relative_error(out, ref) < TOLERANCES[dtype], (kind, dtype)
    ws, counts = _workspace(out.device, hidden)
    assert not ws.any() and not counts.any()  # the last program of each token cleaned up



@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,group_size", [(1, 64), (16, 64), (8, 0)])
def test_int4_experts_equal_the_dequantized_reference(device, num_tokens, group_size):
    """4-bit experts in kernels/fused_moe_wna16.py's kernel layout (groups of 64, or one a row), through
    moe_forward_wna16's switch on GPU: the reference multiplies the dequantized weights, rounded as the kernel rounds."""
    from kernels.fused_moe_wna16 import decode_fits, prepare_wna16_experts
    from kernels.wna16 import quantize

    hidden, inter, num_experts, top_k = 256, 128, 8, 2
    stored = [quantize(randn(num_experts, 2 * inter, hidden, seed=50, scale=hidden**-0.5), 4, group_size or hidden,
                       symmetric=False),
              quantize(randn(num_experts, hidden, inter, seed=51, scale=inter**-0.5), 4, group_size or inter,
                       symmetric=True)]
    dense = [prepare_wna16_experts(*w, 4, torch.float32, for_kernel=False).dense for w in stored]
    kernel = [prepare_wna16_experts(*(t.to(device) for t in w), 4, torch.float32, for_kernel=True) for w in stored]
    x = randn(num_tokens, hidden, seed=52)
    logits = distinct_logits(num_tokens, num_experts, seed=53)
    ref = moe_decode_ref(x, *dense, *route_tokens_ref(logits, top_k, True))
    assert decode_fits(x, *kernel)
    out = moe_decode_triton(x.to(device), kernel[0].kernel["weight"], kernel[1].kernel["weight"], top_k=top_k,
                            router_logits=logits.to(device), renormalize=True, gate_up_scale=kernel[0].kernel["scale"],
                            down_scale=kernel[1].kernel["scale"], gate_up_zero=kernel[0].kernel["zero"],
                            down_zero=kernel[1].kernel["zero"])
    assert relative_error(out, ref) < TOLERANCES[torch.float32]

@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_kernel_with_given_routing_biases_and_clamped_swiglu(device, num_tokens):
    """gpt-oss's epilogue, routing given (not renormalised), one expert shared by many tokens."""
    hidden, inter, num_experts, top_k = 96, 64, 4, 2
    gate_up, _, down, _ = experts("model", hidden, inter, num_experts, seed=20)
    epilogue = gpt_oss_epilogue(hidden, inter, num_experts, seed=21)
    weights, ids = route_tokens_ref(distinct_logits(num_tokens, num_experts, seed=22), top_k, False)
    x = randn(num_tokens, hidden, seed=23)
    ref = moe_decode_ref(x, gate_up, down, weights, ids, epilogue=epilogue)
    move = ExpertEpilogue(epilogue.gate_up_bias.to(device), epilogue.down_bias.to(device), "swiglu_clamped", 7.0)
    out = moe_decode_triton(x.to(device), gate_up.to(device), down.to(device), top_k=top_k,
                            topk_weights=weights.to(device), topk_ids=ids.to(device), epilogue=move,
                            tiles=(32, 64, 64, 4, 2))
    assert relative_error(out, ref) < TOLERANCES[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size shapes and CUDA graphs")
@pytest.mark.parametrize("shape", ["qwen3_30b_a3b", "gpt_oss_20b"])
@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_full_shapes_replayed_from_a_cuda_graph(shape, kind):
    """Qwen3-30B-A3B (E 128, top-8, H 2048, I 768) and gpt-oss-20b (32, top-4, 2880, 2880) at 1, 8 and 16
    tokens in bf16, eager and replayed 20 times from one graph: every replay equals the reference."""
    num_experts, top_k, hidden, inter = {"qwen3_30b_a3b": (128, 8, 2048, 768), "gpt_oss_20b": (32, 4, 2880, 2880)}[shape]
    gate_up, gu_s, down, d_s = experts(kind, hidden, inter, num_experts, seed=30, device="cuda")
    if kind == "model":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    for num_tokens in (1, 8, MAX_TOKENS):
        x = randn(num_tokens, hidden, seed=31).to("cuda", torch.bfloat16)
        logits = distinct_logits(num_tokens, num_experts, seed=32).to("cuda", torch.bfloat16)
        weights, ids = route_tokens_ref(logits, top_k, True)
        ref = moe_decode_ref(x, gate_up, down, weights, ids, gate_up_scale=gu_s, down_scale=d_s)
        run = lambda: moe_decode_triton(x, gate_up, down, top_k=top_k, router_logits=logits, renormalize=True,  # noqa: E731
                                        gate_up_scale=gu_s, down_scale=d_s)
        assert relative_error(run(), ref) < TOLERANCES[torch.bfloat16]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert relative_error(out, ref) < TOLERANCES[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the entries dispatch to Triton on CUDA tensors only")
def test_the_switch_routes_decode_sized_forwards_here(device, monkeypatch):
    """TRITONLLM_MOE_DECODE=fused: moe_forward and moe_forward_fp8 at 8 tokens give the one launch's result."""
    from kernels.fused_moe import moe_forward
    from kernels.fused_moe_fp8 import moe_forward_fp8
    from kernels.moe_decode import MOE_DECODE_ENV

    monkeypatch.setenv(MOE_DECODE_ENV, "fused")
    hidden, inter, num_experts, top_k = 64, 32, 6, 2
    x = randn(8, hidden, seed=40)
    logits = distinct_logits(8, num_experts, seed=41)
    weights, ids = route_tokens_ref(logits, top_k, False)
    for kind in ("model", "fp8_block"):
        gate_up, gu_s, down, d_s = experts(kind, hidden, inter, num_experts, seed=42)
        ref = moe_decode_ref(x, gate_up, down, weights, ids, gate_up_scale=gu_s, down_scale=d_s)
        on = [t.to(device) if t is not None else None for t in (x, logits, gate_up, gu_s, down, d_s)]
        if kind == "model":
            out = moe_forward(on[0], on[1], on[2], on[4], top_k, False)
        else:
            out = moe_forward_fp8(on[0], on[1], on[2], on[3], on[4], on[5], top_k, False)
        assert relative_error(out, ref) < TOLERANCES[torch.float32], kind


# ---- ahead of time for sm_90 on the CPU (TRITONLLM_AOT_SM90=1) ---------------------------------

AOT = AOT_SM90


@AOT
@pytest.mark.parametrize("kind", [W_MODEL_DTYPE, W_FP8_CHANNEL, W_FP8_BLOCK, W_INT4])
@pytest.mark.parametrize("tiles", sorted({*DECODE_TILES.values(), *DECODE_TILE_CANDIDATES}))
def test_compiles_for_sm90_without_spills(kind, tiles, tmp_path):
    """Triton's compiler and ptxas (no GPU needed) on the Qwen3-30B-A3B shape's kernel, routed in the
    kernel (4 bits: groups of 128), for every tiling the bench times: catches what the interpreter lets through, and spills."""
    from kernels.moe_decode import _moe_decode_kernel as fn

    block_i, block_k, block_h, warps, stages = tiles
    if kind == W_FP8_BLOCK and (block_k != 128 or 128 % block_i):
        pytest.skip("block-FP8 takes BLOCK_K 128 and BLOCK_I dividing 128")
    if kind == W_INT4 and not int4_tiles_fit(2048, 768, 128, 128, tiles):
        pytest.skip("4-bit experts in groups of 128: tiles within one group")
    w = {W_MODEL_DTYPE: "*bf16", W_INT4: "*u8"}.get(kind, "*fp8e4nv")
    pointers = dict(x_ptr="*bf16", logits_ptr="*bf16", ids_ptr="*i32", weights_ptr="*fp32", gu_ptr=w,
                    gu_scale_ptr="*fp32", gu_zero_ptr="*u8", d_ptr=w, d_scale_ptr="*fp32", d_zero_ptr="*u8",
                    gu_bias_ptr="*bf16", d_bias_ptr="*bf16", ws_ptr="*fp32", count_ptr="*i32", out_ptr="*bf16")
    const = dict(TOP_K=8, K_PAD=8, E_PAD=128, ROUTE_IN_KERNEL=True, RENORMALIZE=True, W_KIND=kind, HAS_BIAS=False,
                 ACTIVATION=0, SWIGLU_LIMIT=0.0, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_I=block_i, BLOCK_K=block_k,
                 BLOCK_H=block_h)
    # what a launch with these shapes specializes: 16-byte aligned pointers, sizes and strides divisible by 16
    aligned = ("hidden", "inter", "stride_x", "stride_l", "stride_o", "stride_gue", "stride_gun", "stride_de", "stride_dn",
               "group_size", "group_down")
    compiled = compile_for_sm90(fn, pointers, const, warps=warps, stages=stages, aligned_int=lambda name: name in aligned)
    assert "mma" in compiled.asm["ptx"]
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:  # ptxas's register use: no local memory (spills), at most a tiny stack frame
        assert "LOCAL:0 " in usage and stack_bytes(usage) <= 8, usage
