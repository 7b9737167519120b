"""Fused MoE: the torch reference against a per-token loop (CPU), the Triton kernels against the
reference (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1).

Sizes are awkward on purpose: token counts that are not multiples of a block, hidden and expert
widths that are not multiples of the column or K tiles, and batches where some experts get no
token (an expert with no token must get no block and cost nothing).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import relative_error

from kernels.fused_moe import (
    fused_moe_ref,
    max_padded_assignments,
    moe_align_torch,
    route_tokens_ref,
)

# Per output dtype, ||kernel - reference|| / ||reference||. bf16: the kernel and the reference
# round the same products (gate, up, silu, the mul, the routed product) to bf16 but accumulate in
# a different order, so single elements may land one bf16 rounding (2^-8) apart and a few of
# those carry into the next GEMM; 1e-2 is ~4x what that gives. fp32 with IEEE dots: only the
# accumulation order differs.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_problem(num_tokens, hidden, inter, num_experts, top_k, *, seed, used_experts=None):
    """x, gate_up, down, router logits; ``used_experts`` restricts the routing to those experts
    (the others get -inf logits, so no token picks them)."""
    x = randn(num_tokens, hidden, seed=seed)
    gate_up = randn(num_experts, 2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5)
    down = randn(num_experts, hidden, inter, seed=seed + 2, scale=inter**-0.5)
    logits = randn(num_tokens, num_experts, seed=seed + 3)
    if used_experts is not None:
        blocked = torch.ones(num_experts, dtype=torch.bool)
        blocked[list(used_experts)] = False
        logits[:, blocked] = -float("inf")
    return x, gate_up, down, logits


def distinct_logits(num_tokens, num_experts, *, seed):
    """Router logits whose values differ even in bf16 (steps of 0.05 over [-3, 3.4]; bf16 steps
    there are <= 0.016): with a tie at the k-th place both choices would be right, and a kernel
    and the reference may take different ones."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=gen) * 0.05 - 3.0 for _ in range(num_tokens)])


def per_token_loop(x, gate_up, down, weights, ids):
    """The definition, one (token, slot) at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, k]) * (down[e].double() @ (F.silu(gate) * up))
    return out


# ---- CPU: the reference ----------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,used", [(1, None), (13, None), (29, (0, 3, 4)), (6, (7,))])
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_equals_per_token_loop(num_tokens, used, renormalize):
    x, gate_up, down, logits = make_problem(num_tokens, 40, 24, 8, 2, seed=num_tokens, used_experts=used)
    if used is not None and len(used) == 1:
        logits[:, 0] = 0.0  # top-2 of a single expert: a second, finite choice
    weights, ids = route_tokens_ref(logits, 2, renormalize)
    expected = per_token_loop(x, gate_up, down, weights, ids)
    out = fused_moe_ref(x, gate_up, down, weights, ids)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out.double() - expected).abs().max().item() < 1e-5
    if used is not None:
        assert set(ids.flatten().tolist()) <= set(used) | {0}  # experts outside got no token


def test_reference_with_no_tokens():
    x, gate_up, down, logits = make_problem(0, 16, 8, 8, 2, seed=0)
    weights, ids = route_tokens_ref(logits, 2, True)
    assert fused_moe_ref(x, gate_up, down, weights, ids).shape == (0, 16)


def test_routing_reference():
    logits = randn(5, 10, seed=3)
    weights, ids = route_tokens_ref(logits, 3, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.dtype == torch.int32
    assert torch.equal(ids.long(), probs.argsort(dim=-1, descending=True)[:, :3])
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    normalized, same_ids = route_tokens_ref(logits, 3, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(normalized.sum(-1), torch.ones(5))


def check_alignment(topk_ids, num_experts, block_m, sorted_ids, block_expert, num_padded, *, ordered=True):
    """The layout of kernels/moe_align.py's docstring, checked element by element. ``ordered``:
    assignments ascending within each expert, and the rows past num_padded hold the sentinel
    (the torch ops and the one-program kernel; the parallel kernels promise neither)."""
    flat = topk_ids.flatten().tolist()
    n = len(flat)
    sorted_ids, block_expert = sorted_ids.cpu().tolist(), block_expert.cpu().tolist()
    total = int(num_padded.item())
    assert len(sorted_ids) == max_padded_assignments(n, num_experts, block_m) >= total
    assert total % block_m == 0 and (not ordered or all(a == n for a in sorted_ids[total:]))
    counts = [flat.count(e) for e in range(num_experts)]
    assert total == sum(-(-c // block_m) * block_m for c in counts)
    placed = [a for a in sorted_ids[:total] if a != n]
    assert sorted(placed) == list(range(n))  # every assignment exactly once
    for b in range(total // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        real = [a for a in rows if a != n]
        assert real, f"block {b} holds only padding"
        assert all(flat[a] == block_expert[b] for a in real)
        assert rows[:len(real)] == real  # padding at the end
        assert not ordered or real == sorted(real)
    blocks_of = [block_expert[b] for b in range(total // block_m)]
    assert blocks_of == sorted(blocks_of)
    assert {e for e in range(num_experts) if counts[e] == 0}.isdisjoint(blocks_of)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 8, 2, 16), (3, 128, 8, 16), (37, 10, 2, 16),
                                                                  (200, 8, 2, 64), (5, 8, 2, 32)])
def test_alignment_layout_in_torch_ops(num_tokens, num_experts, top_k, block_m):
    _, _, _, logits = make_problem(num_tokens, 8, 8, num_experts, top_k, seed=num_tokens,
                                   used_experts=range(0, num_experts, 2))
    _, ids = route_tokens_ref(logits, top_k, True)
    check_alignment(ids, num_experts, block_m, *moe_align_torch(ids, num_experts, block_m))


# ---- Triton kernels (GPU; or TRITON_INTERPRET=1 on CPU) --------------------------------------

def kernel_dtypes(device):
    return [torch.bfloat16, torch.float32] if device == "cuda" else [torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 128, 8), (64, 10, 2), (33, 60, 4)])
def test_align_kernel_equals_torch_ops(device, num_tokens, num_experts, top_k):
    from kernels.fused_moe import moe_align_triton

    _, _, _, logits = make_problem(num_tokens, 8, 8, num_experts, top_k, seed=num_tokens,
                                   used_experts=range(1, num_experts, 3) if num_experts > top_k * 3 else None)
    _, ids = route_tokens_ref(logits, top_k, True)
    for block_m in (16, 64):
        kernel = moe_align_triton(ids.to(device), num_experts, block_m)
        check_alignment(ids, num_experts, block_m, *kernel)
        for got, expected in zip(kernel, moe_align_torch(ids, num_experts, block_m)):
            assert torch.equal(got.cpu(), expected.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (40, 128, 8), (300, 10, 2), (512, 128, 8),
                                                          (1500, 32, 4), (33, 60, 4)])
def test_parallel_align_kernels_lay_out_every_assignment(device, num_tokens, num_experts, top_k):
    """Chunks of 128 assignments racing for their experts' rows: the same blocks, in whatever
    order within an expert."""
    from kernels.moe_align import moe_align_parallel

    _, _, _, logits = make_problem(num_tokens, 8, 8, num_experts, top_k, seed=num_tokens + 1,
                                   used_experts=range(1, num_experts, 3) if num_experts > top_k * 3 else None)
    _, ids = route_tokens_ref(logits, top_k, True)
    for block_m in (16, 64):
        sorted_ids, block_expert, num_padded = moe_align_parallel(ids.to(device), num_experts, block_m)
        check_alignment(ids, num_experts, block_m, sorted_ids, block_expert, num_padded, ordered=False)
        _, torch_blocks, torch_padded = moe_align_torch(ids, num_experts, block_m)
        assert torch.equal(num_padded.cpu(), torch_padded)
        used = int(torch_padded) // block_m
        assert torch.equal(block_expert.cpu()[:used], torch_blocks[:used])


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_kernel_equals_reference(device, num_experts, top_k, renormalize):
    from kernels.fused_moe import route_tokens_triton

    logits = distinct_logits(19, num_experts, seed=num_experts)
    for dtype in kernel_dtypes(device):
        weights, ids = route_tokens_triton(logits.to(dtype).to(device), top_k, renormalize)
        ref_weights, ref_ids = route_tokens_ref(logits.to(dtype), top_k, renormalize)
        assert torch.equal(ids.cpu(), ref_ids)
        torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (60, 4), (12, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_route_as_their_float32_values(device, num_experts, top_k, dtype):
    """bf16 / fp16 logits take kernels/moe_routing.py's packed-key rounds (one integer max a round): the same ids
    and bit-identical weights as the same values in float32 (the float path), with ties (lowest expert first), -0
    beside +0, -inf and negative logits."""
    from kernels.fused_moe import route_tokens_triton

    logits = (torch.randn(5, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3).to(dtype)
    logits[0, :3] = logits[0, 5]  # a four-way tie
    logits[1] = logits[1].abs().neg()  # all negative
    logits[2, :] = 0.0
    logits[2, 1::2] = -0.0  # only zeros, of both signs: the lowest experts, in order
    logits[3, 7:] = float("-inf")
    for renormalize in (True, False):
        weights, ids = route_tokens_triton(logits.to(device), top_k, renormalize)
        float_weights, float_ids = route_tokens_triton(logits.float().to(device), top_k, renormalize)
        assert torch.equal(ids, float_ids) and torch.equal(weights, float_weights)
        assert ids[2].tolist() == list(range(top_k))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,used", [
    (1, 2048, 768, 128, 8, None),          # Qwen3-30B-A3B's expert shape, one decode token (no alignment)
    (1, 200, 72, 8, 2, None),              # one token, Mixtral-like
    (2, 200, 72, 8, 2, None),              # two tokens: aligned blocks
    (7, 200, 72, 8, 2, (1, 2, 5)),         # Mixtral-like top-2, five experts idle
    (70, 576, 136, 10, 2, None),           # enough tokens per expert for block_m 32
    (300, 256, 96, 8, 2, (0, 3, 4, 7)),    # 600 assignments: block_m 64, four experts idle
    (260, 128, 64, 16, 8, None),           # 2080 assignments: past the align kernel's limit
])
def test_fused_moe_kernel_equals_reference(device, num_tokens, hidden, inter, num_experts, top_k, used):
    from kernels.fused_moe import fused_moe_triton

    x, gate_up, down, logits = make_problem(num_tokens, hidden, inter, num_experts, top_k, seed=hidden,
                                            used_experts=used)
    weights, ids = route_tokens_ref(logits, top_k, True)
    for dtype in kernel_dtypes(device):
        args = [t.to(dtype) for t in (x, gate_up, down)]
        expected = fused_moe_ref(*args, weights, ids)
        out = fused_moe_triton(*[t.to(device) for t in args], weights.to(device), ids.to(device))
        assert out.dtype == dtype and out.shape == x.shape
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype
        rows = fused_moe_triton(*[t.to(device) for t in args], weights.to(device), ids.to(device), sum_experts=False)
        assert rows.shape == (num_tokens, top_k, hidden) and torch.equal(rows.sum(dim=1), out)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,num_experts,top_k", [(2048, 768, 128, 8), (200, 72, 8, 2), (96, 40, 60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_single_token_routes_inside_the_gate_up_launch(device, hidden, inter, num_experts, top_k, renormalize):
    """Batch-1 decode: routing fused into the gate_up launch gives the reference's output."""
    from kernels.fused_moe import moe_single_token_triton

    x, gate_up, down, _ = make_problem(1, hidden, inter, num_experts, top_k, seed=inter)
    logits = distinct_logits(1, num_experts, seed=hidden)
    for dtype in kernel_dtypes(device):
        args = [t.to(dtype) for t in (x, gate_up, down)]
        weights, ids = route_tokens_ref(logits.to(dtype), top_k, renormalize)
        expected = fused_moe_ref(*args, weights, ids)
        out = moe_single_token_triton(args[0].to(device), logits.to(dtype).to(device), args[1].to(device),
                                      args[2].to(device), top_k, renormalize)
        assert out.dtype == dtype and out.shape == (1, hidden)
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype
        rows = moe_single_token_triton(args[0].to(device), logits.to(dtype).to(device), args[1].to(device),
                                       args[2].to(device), top_k, renormalize, sum_experts=False)
        assert rows.shape == (1, top_k, hidden) and torch.equal(rows.sum(dim=1), out)


def test_moe_forward_is_routing_then_fused_moe():
    from kernels.fused_moe import moe_forward

    x, gate_up, down, logits = make_problem(9, 40, 24, 8, 2, seed=4)
    for renormalize in (True, False):
        expected = fused_moe_ref(x, gate_up, down, *route_tokens_ref(logits, 2, renormalize))
        assert torch.equal(moe_forward(x, logits, gate_up, down, 2, renormalize), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_block_size_and_tile_config(device, block_m):
    """fused_moe_triton picks block_m and tiles by size; each choice must compute the same thing."""
    from kernels.fused_moe import fused_moe_triton, gemm_config

    x, gate_up, down, logits = make_problem(45, 160, 48, 12, 3, seed=block_m, used_experts=range(0, 12, 2))
    weights, ids = route_tokens_ref(logits, 3, False)
    expected = fused_moe_ref(x, gate_up, down, weights, ids)
    for config_block in (16, 32, 64):
        out = fused_moe_triton(x.to(device), gate_up.to(device), down.to(device), weights.to(device),
                               ids.to(device), block_m=block_m, config=gemm_config(config_block))
        assert relative_error(out, expected) < TOLERANCE[torch.float32], config_block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="one token on CUDA: the one-token launches")
def test_one_token_with_shared_experts_appended():
    """DeepSeek's decode layout (two shared experts appended after the routed ones, in the last two slots,
    weight 1): the one-token launches give the reference's rows."""
    from kernels.fused_moe import fused_moe_triton

    routed, shared, top_k = 12, 2, 3
    x, gate_up, down, logits = make_problem(1, 256, 136, routed + shared, top_k, seed=31)
    weights, ids = route_tokens_ref(distinct_logits(1, routed, seed=31), top_k, True)
    ids = torch.cat([ids, torch.tensor([[routed, routed + 1]], dtype=ids.dtype)], dim=1)
    weights = torch.cat([weights, torch.ones(1, shared)], dim=1)
    args = [t.to("cuda", torch.bfloat16) for t in (x, gate_up, down)]
    expected = fused_moe_ref(*[t.cpu() for t in args], weights, ids)
    out = fused_moe_triton(*args, weights.cuda(), ids.cuda().to(torch.int32))
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
# Routing inside gate_up; the one-program align kernel; the parallel align kernels; sorted rows and
# grouped GEMMs (2,000 x top-4 of 32: 250 rows an expert).
@pytest.mark.parametrize("num_tokens", [1, 4, 600, 2000])
def test_moe_forward_replays_from_a_cuda_graph(num_tokens):
    """No host synchronisation inside: the whole routed MLP captures, and replays with new router
    logits (other experts chosen) give the new answers."""
    from kernels.fused_moe import moe_forward

    x, gate_up, down, _ = make_problem(num_tokens, 256, 128, 32, 4, seed=5)
    x, gate_up, down = (t.to("cuda", torch.bfloat16) for t in (x, gate_up, down))
    logits = distinct_logits(num_tokens, 32, seed=5).to("cuda", torch.bfloat16)
    moe_forward(x, logits, gate_up, down, 4, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, logits, gate_up, down, 4, True)
    for seed in (6, 7):
        logits.copy_(distinct_logits(num_tokens, 32, seed=seed))
        graph.replay()
        expected = fused_moe_ref(x.cpu(), gate_up.cpu(), down.cpu(), *route_tokens_ref(logits.cpu(), 4, True))
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


# ---- biases and gpt-oss's clamped SwiGLU (kernels/moe_epilogue.py) ----------------------------

def gpt_oss_epilogue(num_experts, hidden, inter, *, seed, dtype=torch.float32):
    """Biases large enough to move the products past the clamp (limit 7 on products of ~N(0, 1))."""
    from kernels.moe_epilogue import ExpertEpilogue

    return ExpertEpilogue(randn(num_experts, 2 * inter, seed=seed, scale=4.0).to(dtype),
                          randn(num_experts, hidden, seed=seed + 1).to(dtype), "swiglu_clamped", 7.0)


def test_reference_with_biases_and_clamped_swiglu_equals_the_definition():
    from kernels.moe_epilogue import SWIGLU_ALPHA

    x, gate_up, down, logits = make_problem(11, 24, 16, 6, 3, seed=12)
    epilogue = gpt_oss_epilogue(6, 24, 16, seed=13)
    weights, ids = route_tokens_ref(logits, 3, True)
    expected = torch.zeros(11, 24, dtype=torch.float64)
    for t in range(11):
        for k in range(3):
            e = int(ids[t, k])
            h = gate_up[e].double() @ x[t].double() + epilogue.gate_up_bias[e].double()
            gate, up = h[:16].clamp(max=7.0), h[16:].clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
            expected[t] += weights[t, k].double() * (down[e].double() @ act + epilogue.down_bias[e].double())
    got = fused_moe_ref(x, gate_up, down, weights, ids, epilogue)
    assert relative_error(got, expected) < 1e-5
    assert (gate_up[ids[:, 0].long()] @ x[:, :, None]).abs().max() < 7 < (epilogue.gate_up_bias.abs().max())


def test_epilogue_refuses_unknown_activations_and_stray_limits():
    from kernels.moe_epilogue import ExpertEpilogue

    with pytest.raises(ValueError, match="activation .gelu. is not supported; allowed: silu, swiglu_clamped, relu2"):
        ExpertEpilogue(activation="gelu")
    with pytest.raises(ValueError, match="swiglu_limit"):
        ExpertEpilogue(swiglu_limit=7.0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        ExpertEpilogue(activation="swiglu_clamped")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 200])  # single token (routing in the launch), small and 64-row blocks
def test_kernel_epilogue_with_biases_and_clamped_swiglu(device, num_tokens):
    from kernels.fused_moe import moe_forward

    x, gate_up, down, _ = make_problem(num_tokens, 96, 40, 8, 2, seed=num_tokens)
    logits = distinct_logits(num_tokens, 8, seed=num_tokens)
    for dtype in kernel_dtypes(device):
        epilogue = gpt_oss_epilogue(8, 96, 40, seed=3, dtype=dtype)
        args = [t.to(dtype) for t in (x, gate_up, down)]
        expected = fused_moe_ref(*args, *route_tokens_ref(logits.to(dtype), 2, True), epilogue)
        out = moe_forward(*[t.to(device) for t in (args[0], logits.to(dtype), args[1], args[2])], 2, True,
                          gate_up_bias=epilogue.gate_up_bias.to(device), down_bias=epilogue.down_bias.to(device),
                          activation="swiglu_clamped", swiglu_limit=7.0)
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype


# ---- large batches: sorted rows and grouped GEMMs (kernels/moe_grouped_mm.py) ------------------

def test_sort_assignments_groups_rows_by_expert():
    from kernels.moe_grouped_mm import sort_assignments

    _, _, _, logits = make_problem(29, 8, 8, 10, 3, seed=2, used_experts=(0, 2, 3, 7, 9))
    _, ids = route_tokens_ref(logits, 3, False)
    dest, order, offs = sort_assignments(ids, 10)
    for got, expected in zip(sort_assignments(ids, 10, by_sort=True), (dest, order, offs)):
        assert torch.equal(got, expected)
    flat = ids.reshape(-1).long()
    assert torch.equal(order[dest], torch.arange(flat.numel()))
    assert torch.equal(offs.long(), torch.cumsum(torch.bincount(flat, minlength=10), 0))
    assert torch.equal(flat[order], torch.sort(flat, stable=True).values)  # experts in order ...
    for expert in range(10):  # ... each expert's assignments in their own order
        assert torch.equal(torch.sort(order[flat[order] == expert]).values, order[flat[order] == expert])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("with_epilogue", [False, True])
def test_grouped_mm_path_equals_reference_on_cpu(with_epilogue):
    """torch's CPU grouped GEMM runs the same code path as CUDA's: sorting, the activation, the combine."""
    from kernels.moe_epilogue import PLAIN_SILU
    from kernels.moe_grouped_mm import fused_moe_grouped_mm

    x, gate_up, down, logits = make_problem(57, 64, 32, 8, 2, seed=8, used_experts=(0, 1, 4, 5, 6))
    args = [t.bfloat16() for t in (x, gate_up, down)]
    weights, ids = route_tokens_ref(logits, 2, True)
    epilogue = gpt_oss_epilogue(8, 64, 32, seed=9, dtype=torch.bfloat16) if with_epilogue else PLAIN_SILU
    expected = fused_moe_ref(*args, weights, ids, epilogue)
    got = fused_moe_grouped_mm(*args, weights, ids, epilogue)
    assert got.dtype == torch.bfloat16 and relative_error(got, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", [
    (1024, 2048, 768, 128, 8),  # Qwen3-30B-A3B's experts at a prefill chunk
    (700, 256, 96, 16, 4),      # some experts get no rows
])
def test_grouped_mm_path_equals_reference_on_gpu(device, num_tokens, hidden, inter, num_experts, top_k):
    from kernels.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_supported

    x, gate_up, down, logits = make_problem(num_tokens, hidden, inter, num_experts, top_k, seed=inter,
                                            used_experts=range(0, num_experts, 2) if num_experts == 16 else None)
    args = [t.to(device, torch.bfloat16) for t in (x, gate_up, down)]
    if not grouped_mm_supported(*args):
        pytest.skip("torch._grouped_mm needs sm90+ here")
    weights, ids = route_tokens_ref(logits, top_k, True)
    for epilogue_seed in (None, 4):
        from kernels.moe_epilogue import PLAIN_SILU
        epilogue = PLAIN_SILU if epilogue_seed is None else gpt_oss_epilogue(
            num_experts, hidden, inter, seed=epilogue_seed, dtype=torch.bfloat16)
        expected = fused_moe_ref(*[t.cpu() for t in args], weights, ids, epilogue)
        on_device = epilogue if epilogue_seed is None else type(epilogue)(
            epilogue.gate_up_bias.to(device), epilogue.down_bias.to(device), epilogue.activation, epilogue.swiglu_limit)
        got = fused_moe_grouped_mm(*args, weights.to(device), ids.to(device), on_device)
        assert relative_error(got, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3-30B-A3B-sized experts: GPU only")
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512, 2048, 8192])
def test_every_batch_size_of_qwen3_30b_a3b_experts(num_tokens):
    """What moe_forward picks at each size (single token, block-tiled tilings, sorted rows and
    grouped GEMMs) against the reference, bf16, on Qwen3-30B-A3B's expert shape."""
    from kernels.fused_moe import moe_forward

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(128, 1536, 2048, device="cuda", generator=gen) * 2048**-0.5).bfloat16()
    down = (torch.randn(128, 2048, 768, device="cuda", generator=gen) * 768**-0.5).bfloat16()
    logits = torch.randn(num_tokens, 128, device="cuda", generator=gen).bfloat16()
    expected = fused_moe_ref(x, gate_up, down, *route_tokens_ref(logits, 8, True))
    assert relative_error(moe_forward(x, logits, gate_up, down, 8, True), expected) < TOLERANCE[torch.bfloat16]


def test_warm_up_covers_every_variant_a_forward_may_pick():
    """Qwen3-30B-A3B's experts: one token, both alignments, each tiling's rows an expert, the
    grouped GEMMs, FP8's grouped GEMM; nothing past the engine's max_num_tokens."""
    from kernels.fused_moe import (GROUPED_MM_MIN_ROWS_PER_EXPERT, MODEL_DTYPE_TILINGS, SCALED_GROUPED_MM_MIN_ASSIGNMENTS,
                                   warm_up_token_counts)
    from kernels.moe_align import ALIGN_KERNEL_MAX_ASSIGNMENTS

    counts = warm_up_token_counts(128, 8, max_tokens=8192)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] <= 8192
    assert any(n * 8 <= ALIGN_KERNEL_MAX_ASSIGNMENTS for n in counts[1:])  # the one-program alignment
    assert any(n * 8 > ALIGN_KERNEL_MAX_ASSIGNMENTS for n in counts)  # the parallel alignment
    fewest = 0  # each tiling's rows an expert: (the previous row's limit, its own]; the last row's up to the grouped path
    for most_rows, *_ in MODEL_DTYPE_TILINGS:
        most = GROUPED_MM_MIN_ROWS_PER_EXPERT if most_rows is None else most_rows
        assert any(fewest < n * 8 / 128 <= most for n in counts), (fewest, most)
        fewest = most
    assert any(n * 8 / 128 >= GROUPED_MM_MIN_ROWS_PER_EXPERT for n in counts)
    assert SCALED_GROUPED_MM_MIN_ASSIGNMENTS // 8 in counts  # FP8's torch._scaled_grouped_mm from its first count
    assert warm_up_token_counts(128, 8, max_tokens=64)[-1] <= 64


# ---- non-gated relu^2 experts (Nemotron-H; kernels/moe_epilogue.py relu2) ----------------------

def relu2_problem(num_tokens, hidden, inter, num_experts, top_k, *, seed):
    x = randn(num_tokens, hidden, seed=seed)
    up = randn(num_experts, inter, hidden, seed=seed + 1, scale=hidden**-0.5)
    down = randn(num_experts, hidden, inter, seed=seed + 2, scale=inter**-0.5)
    weights, ids = route_tokens_ref(distinct_logits(num_tokens, num_experts, seed=seed), top_k, True)
    return x, up, down, weights, ids


def test_reference_with_relu2_experts_equals_the_definition():
    from kernels.moe_epilogue import ExpertEpilogue

    x, up, down, weights, ids = relu2_problem(9, 24, 16, 6, 2, seed=21)
    expected = torch.zeros(9, 24, dtype=torch.float64)
    for t in range(9):
        for k in range(2):
            e = int(ids[t, k])
            expected[t] += weights[t, k].double() * (down[e].double() @ F.relu(up[e].double() @ x[t].double()) ** 2)
    got = fused_moe_ref(x, up, down, weights, ids, ExpertEpilogue(activation="relu2"))
    assert relative_error(got, expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_kernel_with_relu2_experts_equals_reference(device, num_tokens):
    from kernels.fused_moe import fused_moe
    from kernels.moe_epilogue import ExpertEpilogue

    x, up, down, weights, ids = relu2_problem(num_tokens, 96, 40, 8, 2, seed=num_tokens)
    for dtype in kernel_dtypes(device):
        args = [t.to(dtype) for t in (x, up, down)]
        expected = fused_moe_ref(*args, weights, ids, ExpertEpilogue(activation="relu2"))
        out = fused_moe(*[t.to(device) for t in args], weights.to(device), ids.to(device), activation="relu2")
        assert relative_error(out, expected) < TOLERANCE[dtype], dtype
