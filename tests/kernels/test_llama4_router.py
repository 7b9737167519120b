"""Llama 4's one-launch top-1 routing (kernels/llama4_router.py) against its plain-torch reference, with and without
the post-attention norm inside it and the E4M3 rows of the shared expert's input; and the reference against the
unfused torch path engine/models/llama4.py runs for other batches (the router's product, topk, sigmoid, the
scaled rows). Triton: GPU, or TRITON_INTERPRET=1 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import QuantizedRows, quantize_rows, quantize_rows_triton
from kernels.llama4_router import route_top1_ref, route_top1_triton
from kernels.rmsnorm import rms_norm_ref
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip


def _inputs(tokens, experts, hidden, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    weight = (0.05 * torch.randn(experts, hidden, generator=gen)).to(dtype).to(device)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, weight, (residual, norm_weight, 1e-5)


def assert_top1(got_ids, want_ids, x, weight, norm):
    """The kernel's experts are the reference's, but where the reference's best two logits lie within a rounding of
    the model dtype (the kernel sums them in another order): there the one it took must be one of the two."""
    h = x if norm is None else rms_norm_ref(x, norm[1], norm[2], norm[0])[0]
    logits = (h.float() @ weight.float().T).to(x.dtype).float()
    top2 = logits.topk(2, dim=-1).values
    near = (top2[:, 0] - top2[:, 1]) <= 2 * torch.finfo(x.dtype).eps * top2[:, 0].abs()
    taken = logits.gather(1, got_ids.long())[:, 0]
    assert torch.equal(got_ids[~near], want_ids[~near]) and bool((taken[near] >= top2[near, 1]).all())


def test_reference_is_the_unfused_top1_path():
    x, weight, norm = _inputs(5, 16, 96, torch.float32, "cpu")
    top, ids = torch.nn.functional.linear(x, weight).topk(1, dim=-1)
    routing = route_top1_ref(x, weight, quantize=True)
    assert torch.equal(routing.ids, ids.to(torch.int32)) and torch.equal(routing.weights, torch.ones(5, 1))
    torch.testing.assert_close(routing.rows, x * torch.sigmoid(top), rtol=1e-6, atol=1e-6)
    codes, scale = quantize_rows(x)
    assert torch.equal(routing.shared_input.values.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(routing.shared_input.scale, scale) and routing.residual is None
    h, residual = rms_norm_ref(x, norm[1], norm[2], norm[0])
    normed = route_top1_ref(x, weight, norm=norm)
    assert torch.equal(normed.shared_input, h) and torch.equal(normed.residual, residual)
    assert torch.equal(normed.rows, route_top1_ref(h, weight).rows)
    tied = torch.zeros(2, 96)  # every logit 0: the lowest expert
    assert route_top1_ref(tied, weight).ids.flatten().tolist() == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,experts,hidden", [(1, 16, 512), (3, 5, 200), (16, 16, 1100)])
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("with_norm", [False, True])
def test_kernel_equals_the_reference(device, tokens, experts, hidden, quantize, with_norm):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, weight, norm = _inputs(tokens, experts, hidden, dtype, device, seed=tokens)
    norm = norm if with_norm else None
    got = route_top1_triton(x, weight, quantize=quantize, norm=norm)
    cpu_norm = None if norm is None else (norm[0].cpu(), norm[1].cpu(), norm[2])
    want = route_top1_ref(x.cpu(), weight.cpu(), quantize=quantize, norm=cpu_norm)
    assert_top1(got.ids.cpu(), want.ids, x.cpu(), weight.cpu(), cpu_norm)
    assert torch.equal(got.weights.cpu(), torch.ones(tokens, 1))
    # the sums (logits, the norm's) in another order: a value may move by a rounding of the model dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.rows.cpu(), want.rows, rtol=tolerance, atol=tolerance)
    if with_norm:
        assert torch.equal(got.residual.cpu(), want.residual)
    else:
        assert got.residual is None
    assert isinstance(got.shared_input, QuantizedRows) == quantize
    if not quantize:
        assert got.shared_input is x or torch.allclose(got.shared_input.cpu().float(), want.shared_input.float(),
                                                       rtol=tolerance, atol=tolerance)
        assert (got.shared_input is x) == (not with_norm)
        return
    # The E4M3 rows of h: the unfused path's quantize kernel on the kernel's own h, bit for bit (Triton 3.9's
    # interpreter rounds some values to E4M3 wrongly, alike in both kernels: test_fp8_block.py).
    h = route_top1_triton(x, weight, norm=norm).shared_input
    codes, scale = quantize_rows_triton(h)
    assert torch.equal(got.shared_input.values.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got.shared_input.scale, scale) and got.shared_input.dtype == dtype
    torch.testing.assert_close(got.shared_input.scale.cpu(), want.shared_input.scale, rtol=tolerance, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("with_norm", [False, True])
def test_stacked_shared_expert_rows_follow_the_routed_ones(device, with_norm):
    """shared_slot: rows [h * s; h], ids [top-1; slot], weights ones, as the reference (and its first half as
    without the slot)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, weight, norm = _inputs(4, 16, 300, dtype, device, seed=8)
    norm = norm if with_norm else None
    got = route_top1_triton(x, weight, norm=norm, shared_slot=16)
    cpu_norm = None if norm is None else (norm[0].cpu(), norm[1].cpu(), norm[2])
    want = route_top1_ref(x.cpu(), weight.cpu(), norm=cpu_norm, shared_slot=16)
    alone = route_top1_ref(x.cpu(), weight.cpu(), norm=cpu_norm)
    assert torch.equal(want.rows[:4], alone.rows) and torch.equal(want.rows[4:], alone.shared_input)
    assert_top1(got.ids[:4].cpu(), want.ids[:4], x.cpu(), weight.cpu(), cpu_norm)
    assert got.ids[4:].flatten().tolist() == want.ids[4:].flatten().tolist() == [16] * 4
    assert torch.equal(got.weights.cpu(), torch.ones(8, 1)) and got.rows.shape == (8, 300)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.rows.cpu(), want.rows, rtol=tolerance, atol=tolerance)
    assert got.shared_input.data_ptr() == got.rows[4:].data_ptr()
    if with_norm:
        assert torch.equal(got.residual.cpu(), want.residual)
    else:
        assert torch.equal(got.rows[4:], x)


@AOT_SM90
@pytest.mark.parametrize("with_norm,quantize,stacked", [(False, False, False), (False, True, False),
                                                        (True, False, True), (True, True, False)])
def test_kernel_compiles_for_sm90_without_spills(with_norm, quantize, stacked, tmp_path):
    """Triton's compiler and ptxas (no GPU) on the kernel at Scout's shape (16 experts, hidden 5,120, bf16): no local
    memory (spills)."""
    from kernels.llama4_router import _route_top1_kernel

    pointers = {name: "*bf16" for name in ("x_ptr", "res_ptr", "norm_w_ptr", "h_ptr", "res_out_ptr", "w_ptr",
                                           "rows_ptr")}
    pointers.update(ids_ptr="*i32", weights_ptr="*fp32", q_ptr="*fp8e4nv", scale_ptr="*fp32", part_ptr="*fp32",
                    peak_ptr="*fp32", count_ptr="*i32")
    const = dict(E_PAD=16, BLOCK_T=16, BLOCK_H=256, ROW_BLOCK=8192, S_PAD=32, HAS_NORM=with_norm, QUANTIZE=quantize,
                 STACKED=stacked, PRECISION="tf32", PDL=True)
    compiled = compile_for_sm90(_route_top1_kernel, pointers, const, warps=8, floats=("eps",),
                                aligned_int=lambda name: name.startswith("stride") or name == "H")
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage, usage


def test_the_launch_takes_scouts_router_not_mavericks():
    """Maverick's 128 experts' partials would not fit the last program's registers: it keeps the unfused path."""
    from kernels.llama4_router import route_top1_fits

    assert route_top1_fits(16, 5120) and route_top1_fits(4, 64)
    assert not route_top1_fits(128, 5120)
