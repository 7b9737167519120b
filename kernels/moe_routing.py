"""Top-k routing of each token over the experts: router logits (T, E) -> (topk_weights (T, K)
float32, topk_ids (T, K) int32), softmax in float32 over all E, the K largest, renormalised to sum
to one where the family says so (Mixtral always; Qwen3-MoE with norm_topk_prob; gpt-oss, whose
softmax over its top-k logits is the same thing).

``_top_k_of_row`` is also called inside the single-token expert kernels, so one decode token's
routing costs no launch of its own.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton


def route_tokens_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (topk_weights (T, K) float32, topk_ids (T, K) int32).

    Softmax over all experts in float32, the K largest probabilities, divided by their sum when
    ``renormalize`` (Mixtral always; Qwen3-MoE when norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@jit
def _top_k_of_row(row_ptr, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    """(weights (K_PAD,) float32, ids (K_PAD,) int32; slots >= TOP_K hold 0) of one row of router
    logits: softmax over its E logits, then K rounds of arg-max (lowest index on ties), each
    removing the chosen expert. bfloat16 / float16 logits: _top_k_of_half_row (one reduction a round)."""
    experts = tl.arange(0, E_PAD)
    raw = tl.load(row_ptr + experts, mask=experts < num_experts, other=-float("inf"))
    if raw.dtype.primitive_bitwidth == 16:
        return _top_k_of_half_row(raw, experts, num_experts, TOP_K, K_PAD, RENORMALIZE)
    logits = raw.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    probs = tl.where(experts < num_experts, probs, -1.0)
    slots = tl.arange(0, K_PAD)
    chosen_w = tl.zeros([K_PAD], dtype=tl.float32)
    chosen_id = tl.zeros([K_PAD], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        best_id = tl.min(tl.where(probs == best, experts, E_PAD), 0)
        chosen_w = tl.where(slots == k, best, chosen_w)
        chosen_id = tl.where(slots == k, best_id, chosen_id)
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    return chosen_w, chosen_id


@jit
def _top_k_of_half_row(raw, experts, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    """_top_k_of_row for 16-bit logits ``raw`` (E_PAD,) (-inf past num_experts), the same weights and ids: each
    logit and its expert packed into one int32 key, (order << 16) | (65535 - expert), where order is the logit's bit
    pattern made monotonic (negative patterns' magnitude bits flipped; -0 as +0), so one integer max a round finds
    the largest logit and, among equal ones, the lowest expert, where the float path takes a max and then a min of
    the tied indices (two warp reductions a round: ~1.4 us of a Qwen3-30B-A3B decode gate_up program's start, by its
    sm_90 code). Softmax is monotonic, so the largest logits are the largest probabilities; each weight is
    exp(logit - max) / sum as the float path computes it, the same float. (Two distinct logits whose float32
    probabilities round equal, only possible where exp underflows, rank by logit here and by index there.)
    E_PAD <= 65536 experts."""
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
    order = tl.where(bits == -32768, 0, tl.where(bits < 0, bits ^ 0x7FFF, bits))
    key = tl.where(experts < num_experts, (order << 16) | (65535 - experts), -2147483648)
    slots = tl.arange(0, K_PAD)
    top = tl.max(key, 0)
    top_logit = _key_logit(top, raw.dtype)  # (the row's largest logit: the softmax's shift)
    chosen = tl.where(slots == 0, top, -2147483648)
    for k in tl.static_range(1, TOP_K):
        key = tl.where(key == top, -2147483648, key)
        top = tl.max(key, 0)
        chosen = tl.where(slots == k, top, chosen)
    total = tl.sum(tl.exp(raw.to(tl.float32) - top_logit), 0)
    filled = slots < TOP_K
    chosen_w = tl.where(filled, tl.exp(_key_logit(chosen, raw.dtype) - top_logit) / total, 0.0)
    chosen_id = tl.where(filled, 65535 - (chosen & 65535), 0)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    return chosen_w, chosen_id


@jit
def _key_logit(key, dtype: tl.constexpr):
    """The float32 logit of _top_k_of_half_row's keys (the upper 16 bits' order back to ``dtype``'s pattern)."""
    order = key >> 16
    bits = tl.where(order < 0, order ^ 0x7FFF, order)
    return bits.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    """One program per token: its top-k (_top_k_of_row) into weights / ids (T, K)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    chosen_w, chosen_id = _top_k_of_row(logits_ptr + token * stride_l, num_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def route_tokens_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1 and 1 <= top_k <= num_experts
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                     TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                     E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                     num_warps=1 if num_experts <= 128 else 4, **pdl_options(router_logits))
    return weights, ids


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of each token (see route_tokens_ref): Triton on CUDA, else the reference."""
    if use_triton(router_logits):
        return route_tokens_triton(router_logits, top_k, renormalize)
    return route_tokens_ref(router_logits, top_k, renormalize)
