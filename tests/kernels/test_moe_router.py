"""kernels/moe_router.py: the one-launch decode routing (router product + DeepSeek's routing methods +
shared slots) against its plain-torch reference (the engine's unfused routing), at 1, 8 and 16 tokens,
on the GPU or Triton's CPU interpreter (TRITON_INTERPRET=1); tiny shapes. The counter is left at 0."""
from __future__ import annotations

import os

import pytest
import torch

from kernels import moe_router
from kernels.moe_router import METHODS, _workspace, route_decode_ref, route_decode_triton

# (method, experts, top_k, settings): V2-Lite-like greedy (two shared experts), V2's group-limited
# greedy, V3's sigmoid + bias + group-limited top-k with norm_topk_prob and routed_scaling_factor.
CASES = {
    "greedy": ("greedy", 12, 3, dict(num_shared=2)),
    "group_limited_greedy": ("group_limited_greedy", 16, 3, dict(n_group=4, topk_group=2, renormalize=True)),
    "noaux_tc": ("noaux_tc", 16, 4, dict(n_group=4, topk_group=2, renormalize=True, scaling=2.5, num_shared=1)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("ranked", [True, False], ids=["ranked", "serial"])
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_one_launch_routing_equals_the_reference(device, case, num_tokens, ranked, monkeypatch):
    """Both top-k forms (the places pass where T x E x E fits, the serial rounds) pick as route_grouped."""
    monkeypatch.setattr(moe_router, "RANKED_VALUES", 1 << 20 if ranked else 0)
    method, num_experts, top_k, settings = CASES[case]
    hidden = 40  # not a multiple of the H chunk
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.randn(num_experts, hidden, generator=gen) * hidden ** -0.5
    if method == "noaux_tc":
        settings = {**settings, "score_bias": torch.randn(num_experts, generator=gen) * 0.1}
    ref_w, ref_ids = route_decode_ref(x, weight, top_k, method, **settings)
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in settings.items()}
    w, ids = route_decode_triton(x.to(device), weight.to(device), top_k, method, **on)
    assert torch.equal(ids.cpu(), ref_ids) and ids.shape == (num_tokens, top_k + settings.get("num_shared", 0))
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)
    assert not _workspace(ids.device, num_experts)[1].any()  # the last program reset the counter


@pytest.mark.gpu
def test_padding_rows_route_as_row_zero(device):
    method, num_experts, top_k, settings = CASES["noaux_tc"]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 24, generator=gen)
    weight = torch.randn(num_experts, 24, generator=gen)
    settings = {**settings, "score_bias": torch.zeros(num_experts)}
    padding = torch.tensor([False, False, True, True])
    ref_w, ref_ids = route_decode_ref(x, weight, top_k, method, padding=padding, **settings)
    assert torch.equal(ref_ids[2], ref_ids[0]) and not torch.equal(ref_ids[1], ref_ids[0])
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in settings.items()}
    w, ids = route_decode_triton(x.to(device), weight.to(device), top_k, method, padding=padding[:, None].to(device),
                                 **on)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,prefetch", [(1, "router"), (2, "router"), (1, "0")])
def test_post_attention_norm_in_the_same_launch(device, num_tokens, prefetch, monkeypatch):
    """route_decode_normed's launch: the new residual and normed rows as rms_norm's, and the routing of
    the normed rows as route_decode's (V2-Lite-like greedy with two shared slots); with
    $TRITONLLM_WEIGHT_PREFETCH=router (the default) the router rows are loaded before the (PDL) wait, with 0
    after it (the launch before call 34): the same sums."""
    from kernels._triton import WEIGHT_PREFETCH_ENV
    from kernels.moe_router import norm_fuses, route_decode_normed
    from kernels.rmsnorm import rms_norm_ref

    monkeypatch.setenv(WEIGHT_PREFETCH_ENV, prefetch)

    method, num_experts, top_k, settings = CASES["greedy"]
    hidden = 40
    assert norm_fuses(num_tokens, hidden) and not norm_fuses(4, 2048)
    gen = torch.Generator().manual_seed(11 + num_tokens)
    x, residual = torch.randn(num_tokens, hidden, generator=gen), torch.randn(num_tokens, hidden, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
    weight = torch.randn(num_experts, hidden, generator=gen) * hidden ** -0.5
    want_normed, want_residual = rms_norm_ref(x, norm_weight, 1e-6, residual)
    want_w, want_ids = route_decode_ref(want_normed, weight, top_k, method, **settings)
    assert all(torch.equal(a, b) for a, b in zip(route_decode_normed(x, residual, norm_weight, 1e-6, weight, top_k,
                                                                     method, **settings),
                                                 (want_w, want_ids, want_normed, want_residual)))
    w, ids, normed, new_residual = route_decode_triton(
        x.to(device), weight.to(device), top_k, method, norm=(residual.to(device), norm_weight.to(device), 1e-6),
        **settings)
    torch.testing.assert_close(new_residual.cpu(), want_residual)
    torch.testing.assert_close(normed.cpu(), want_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_qwen3_moe_routing_of_the_normed_rows_rounds_the_logits(device):
    """Qwen3-MoE's use (engine/models/moe.py forward_normed): half-precision rows and router (float16: the
    interpreter rounds float32 to bfloat16 by truncation), no shared slots, norm_topk_prob, and the logits rounded to
    their dtype as its router Linear returns them (round_logits): the norm as rms_norm's, the routing as
    route_tokens' of the rounded logits of the normed rows."""
    from kernels.moe_routing import route_tokens_ref
    from kernels.rmsnorm import rms_norm_ref

    num_experts, top_k, hidden = 16, 4, 64
    gen = torch.Generator().manual_seed(5)
    x, residual = [torch.randn(1, hidden, generator=gen).half() for _ in range(2)]
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).half()
    weight = (torch.randn(num_experts, hidden, generator=gen) * hidden ** -0.5).half()
    want_normed, want_residual = rms_norm_ref(x, norm_weight, 1e-6, residual)
    logits = (want_normed.float() @ weight.float().T).half()
    want_w, want_ids = route_tokens_ref(logits, top_k, True)
    ref_w, ref_ids = route_decode_ref(want_normed, weight, top_k, "greedy", renormalize=True, round_logits=True)
    assert torch.equal(ref_ids, want_ids) and torch.equal(ref_w, want_w)
    w, ids, normed, new_residual = route_decode_triton(
        x.to(device), weight.to(device), top_k, "greedy", renormalize=True, round_logits=True,
        norm=(residual.to(device), norm_weight.to(device), 1e-6))
    assert torch.equal(new_residual.cpu(), want_residual)
    torch.testing.assert_close(normed.cpu(), want_normed, rtol=2e-3, atol=2e-3)  # (an rsqrt apart: a float16 step)
    # the routing of the launch's own normed rows (its sums in another order: a logit may round a step apart)
    want_w, want_ids = route_tokens_ref((normed.cpu().float() @ weight.float().T).half(), top_k, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(os.environ.get("TRITONLLM_AOT_SM90") != "1",
                    reason="set TRITONLLM_AOT_SM90=1 to compile for sm_90 on this machine (~5-10 s a kernel)")
@pytest.mark.parametrize("shape", ["v2_lite", "v3"])
@pytest.mark.parametrize("block_t", [2, 16])
def test_compiles_for_sm90(shape, block_t):
    """Triton's compiler and ptxas (no GPU needed) at V2-Lite's (64 experts, greedy top-6, 2 shared) and
    V3's (256 experts, noaux_tc in 8 groups, top-8, 1 shared) launch: what the interpreter lets through."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.moe_router import _route_decode_kernel as fn

    v3 = shape == "v3"
    e_pad, block_e = (256, 2) if v3 else (64, 2)
    const = dict(TOP_K=8 if v3 else 6, N_SHARED=1 if v3 else 2, OUT_PAD=16 if v3 else 8,
                 METHOD=METHODS["noaux_tc" if v3 else "greedy"], N_GROUP=8 if v3 else 1, TOPK_GROUP=4 if v3 else 1,
                 G_PAD=8 if v3 else 2, HAS_BIAS=v3, HAS_PAD=True, RENORMALIZE=v3, E_PAD=e_pad, BLOCK_T=block_t,
                 BLOCK_E=block_e, BLOCK_H=min(2048, 8192 // (block_t * block_e)),
                 RANKED=block_t * e_pad * e_pad <= moe_router.RANKED_VALUES, NORM=not v3 and block_t == 2,
                 PDL=block_t == 2, PREFETCH=not v3 and block_t == 2)  # (V2-Lite's normed launch: rows into registers)
    pointers = dict(x_ptr="*bf16", w_ptr="*fp32", bias_ptr="*fp32", pad_ptr="*i1", logits_ptr="*fp32",
                    count_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i32", res_ptr="*bf16", norm_w_ptr="*bf16",
                    normed_ptr="*bf16", res_out_ptr="*bf16")
    names = fn.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in const else "fp32" if n in ("scaling", "eps") else "i32")
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in pointers or n in ("hidden", "stride_x",
                                                                                                   "stride_w")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "atom" in compiled.asm["ptx"]
