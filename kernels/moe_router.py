"""A decode batch's whole expert routing in ONE launch: the router product, the scores, the top-k
(every DeepSeek method of kernels/moe_grouped_routing.py), norm_topk_prob and routed_scaling_factor,
and the shared experts appended as always-chosen slots; what the grouped expert GEMMs read next.

Shapes (T <= MAX_TOKENS tokens, H hidden, E routed experts, K = top_k, S = num_shared slots):
    x (T, H) model dtype; router weight (E, H) float32; score_bias (E,) float32 or None
    -> topk_weights (T, K + S) float32, topk_ids (T, K + S) int32, where slots 0..K-1 are
    route_grouped(x.float() @ weight.T, ...)'s (weights times ``scaling``) and slot K + j is
    expert E + j with weight 1.0 (engine/models/deepseek.py appends its shared experts to the routed
    ones as S experts of the routed width: a token's shared SwiGLU is the sum of those S).

Why: at batch-1 decode the routing around V2-Lite's grouped GEMMs was a float32 cast of x, cuBLAS's
gemv (two kernels), and for V3 about ten small torch launches (sigmoid, bias, group scores, topk,
gather, sum, scale) per sparse layer: ~12-14 us of launches against ~30 us of expert weights.

Grid: cdiv(E, BLOCK_E) programs. Program p computes the logits of experts p * BLOCK_E ... for all
T tokens (float32 products of x's values and the weight, summed over H in BLOCK_H chunks: one chunk
at V2-Lite's batch 1) into a (MAX_TOKENS, E) float32 workspace, then counts itself done (an acq_rel
atomic on a per-device counter); the program whose count completes the grid reads every logit back
(atomic adds of zero: L2, never a stale L1 line), routes the T rows and writes ids / weights, then
resets the counter to 0 for the next call. The top-k there: where T x E x E comparisons fit
(RANKED_VALUES: V2-Lite's 64 experts at 1-4 tokens) each expert's place in its token's order comes
from one comparison pass and one reduction, and the first K places write their own slots; else K
serial rounds of max / argmin (V3's 256 experts). Both order by choice descending, ties to the
lower index, so they pick alike.
No host synchronisation: CUDA graphs capture it.

Ties between equal scores go to the lowest expert index (torch.topk leaves their order unspecified).
``padding`` (T,) bool (engine/models/deepseek.py graph_padding_rows): those rows route as row 0,
so a graph's padding rows read no expert weights of their own.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton, weight_prefetch
from kernels.moe_grouped_routing import route_grouped
from kernels.rmsnorm import _rms_normalized, rms_norm_ref

MAX_TOKENS = 16
# The top-k by places (one (BLOCK_T, E, E) comparison, _top_k_rank) up to this many values (V2-Lite's
# 64 experts at 1-4 tokens), else K serial rounds (V3's 256 experts, wider batches).
RANKED_VALUES = 16384
METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def route_decode_ref(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, method: str, *, n_group: int = 1,
                     topk_group: int = 1, score_bias: torch.Tensor | None = None, renormalize: bool = False,
                     scaling: float = 1.0, num_shared: int = 0, padding: torch.Tensor | None = None,
                     round_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's outputs in plain torch: the engine's unfused routing (a float32 router
    product, then route_grouped) plus the shared slots. ``round_logits``: the logits rounded to x's dtype
    (a router Linear in the model dtype: Qwen3-MoE's)."""
    logits = x.float() @ router_weight.float().T
    if round_logits:
        logits = logits.to(x.dtype).float()
    if padding is not None:
        logits = torch.where(padding.reshape(-1, 1), logits[:1], logits)
    weights, ids = route_grouped(logits, top_k, method, n_group=n_group, topk_group=topk_group,
                                 score_bias=score_bias, renormalize=renormalize, scaling=scaling)
    if num_shared:
        num_tokens, num_experts = logits.shape
        shared = torch.arange(num_experts, num_experts + num_shared, device=x.device, dtype=torch.int32)
        ids = torch.cat([ids, shared.expand(num_tokens, -1)], dim=1)
        weights = torch.cat([weights, weights.new_ones(num_tokens, num_shared)], dim=1)
    return weights, ids


@jit
def _routing_scores(logits, bias, experts, e_ok, experts_per_group, METHOD: tl.constexpr, N_GROUP: tl.constexpr,
                    TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr):
    """logits (BLOCK_T, E_PAD) float32 -> (scores, choice) (BLOCK_T, E_PAD) float32 as route_grouped:
    the weights a chosen expert gets, and what the top-k ranks (group-limited where N_GROUP > TOPK_GROUP)."""
    if METHOD == 2:  # noaux_tc: sigmoid scores; the choice adds the bias; masked choices are -inf
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = scores + bias[None, :]
        fill = -float("inf")
    else:  # softmax over the E experts; masked choices are 0 (route_grouped's masked_fill)
        shifted = tl.where(e_ok[None, :], logits, -float("inf"))
        probs = tl.exp(shifted - tl.max(shifted, 1)[:, None])
        scores = probs / tl.sum(probs, 1)[:, None]
        choice = scores
        fill = 0.0
    if N_GROUP > TOPK_GROUP:  # group-limited: only the TOPK_GROUP best groups' experts stay eligible
        gid = experts // experts_per_group
        groups = tl.arange(0, G_PAD)
        group_score = tl.full([choice.shape[0], G_PAD], -float("inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = e_ok & (gid == g)
            member = tl.where(in_group[None, :], choice, -float("inf"))
            best = tl.max(member, 1)
            if METHOD == 2:  # V3: the sum of the group's two best (biased) scores
                best_id = tl.min(tl.where(member == best[:, None], experts[None, :], E_PAD), 1)
                best += tl.max(tl.where(experts[None, :] == best_id[:, None], -float("inf"), member), 1)
            group_score = tl.where(groups[None, :] == g, best[:, None], group_score)
        chosen_group = tl.zeros([choice.shape[0], G_PAD], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, 1)
            best_g = tl.min(tl.where(group_score == best[:, None], groups[None, :], G_PAD), 1)
            chosen_group = tl.where(groups[None, :] == best_g[:, None], 1, chosen_group)
            group_score = tl.where(groups[None, :] == best_g[:, None], -float("inf"), group_score)
        eligible = tl.zeros(choice.shape, tl.int32)
        for g in tl.static_range(N_GROUP):
            flag = tl.sum(tl.where(groups[None, :] == g, chosen_group, 0), 1)
            eligible = tl.where((gid == g)[None, :], flag[:, None], eligible)
        choice = tl.where(eligible > 0, choice, fill)
    return scores, choice


@jit
def _top_k_serial(scores, choice, experts, e_ok, TOP_K: tl.constexpr, OUT_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """(BLOCK_T, E_PAD) -> the TOP_K best choices' (unbiased weights, ids) in slots 0..TOP_K-1 of
    (BLOCK_T, OUT_PAD), best first: TOP_K rounds of max / argmin / gather (three reductions each)."""
    slots = tl.arange(0, OUT_PAD)
    chosen_w = tl.zeros([choice.shape[0], OUT_PAD], tl.float32)
    chosen_id = tl.zeros([choice.shape[0], OUT_PAD], tl.int32)
    available = tl.zeros(choice.shape, tl.int32) + e_ok[None, :].to(tl.int32)
    for k in tl.static_range(TOP_K):
        open_choice = tl.where(available > 0, choice, -float("inf"))
        best = tl.max(open_choice, 1)
        best_id = tl.min(tl.where((available > 0) & (open_choice == best[:, None]), experts[None, :], E_PAD), 1)
        picked = experts[None, :] == best_id[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), 1)  # the unbiased score
        chosen_w = tl.where(slots[None, :] == k, weight[:, None], chosen_w)
        chosen_id = tl.where(slots[None, :] == k, best_id[:, None], chosen_id)
        available = tl.where(picked, 0, available)
    return chosen_w, chosen_id


@jit
def _top_k_rank(choice, experts, e_ok):
    """(BLOCK_T, E_PAD) -> each expert's place (BLOCK_T, E_PAD) int32 in its token's order (choice
    descending, ties to the lower index; padding experts last): experts of place < K are the top-k, in
    the slot of their place. One pass of E_PAD x E_PAD comparisons and one reduction, where the serial
    top-k's K rounds take three reductions each (the last program's latency at batch-1 decode)."""
    mine = choice[:, :, None]  # (BLOCK_T, E_PAD, 1): the expert whose place is counted
    other = choice[:, None, :]  # (BLOCK_T, 1, E_PAD): the experts that may come before it
    before = (other > mine) | ((other == mine) & (experts[None, None, :] < experts[None, :, None]))
    before = before & e_ok[None, None, :]
    return tl.sum(before.to(tl.int32), 2)


@jit
def _route_decode_kernel(x_ptr, w_ptr, bias_ptr, pad_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr,
                         res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, eps, stride_r,
                         num_tokens, num_experts, hidden, experts_per_group, scaling, stride_x, stride_w,
                         TOP_K: tl.constexpr, N_SHARED: tl.constexpr, OUT_PAD: tl.constexpr, METHOD: tl.constexpr,
                         N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, G_PAD: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                         E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                         RANKED: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
                         ROUND_LOGITS: tl.constexpr = False):
    """Program p: the logits of experts p * BLOCK_E ... for every token; the last program routes them.
    RANKED: the top-k by places (_top_k_rank, (BLOCK_T, E_PAD, E_PAD) comparisons), else serially.
    PDL: launched while the launch before it ends (kernels/_triton.py pdl_prologue).
    NORM (BLOCK_H >= hidden): x is the attention's output, and every program first computes the layer's
    post-attention norm of x + residual as kernels/rmsnorm.py does (the sum rounded to x's dtype, float32
    statistics, the normalised value rounded before the weight, the output rounded); program 0 stores
    the new residual and the normed rows (what the expert GEMMs read next).
    PREFETCH (with NORM): the program's router rows, its one (BLOCK_E, BLOCK_H) load, go into registers
    before the PDL wait (weights: no kernel of the step writes them), while the o_proj product before it
    still runs (H200, V2-Lite batch-1 decode, call 34: 5.51 -> 5.21 us a launch).
    ROUND_LOGITS: each logit is rounded to x's dtype before the routing reads it (a router Linear in the
    model dtype returns them so: Qwen3-MoE, Mixtral)."""
    mine = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    mine_ok = mine < num_experts
    if NORM:
        h = tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        if PREFETCH:
            ws = tl.load(w_ptr + mine.to(tl.int64)[:, None] * stride_w + h[None, :],
                         mask=mine_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_E, BLOCK_H)
    pdl_prologue(PDL)
    tokens = tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    if NORM:
        rows_ok = t_ok[:, None] & h_ok[None, :]
        xs = tl.load(x_ptr + tokens[:, None] * stride_x + h[None, :], mask=rows_ok, other=0.0)
        xs = (xs.to(tl.float32) + tl.load(res_ptr + tokens[:, None] * stride_r + h[None, :], mask=rows_ok,
                                          other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        normed = _rms_normalized(xs, hidden, eps, 1)  # (BLOCK_T, BLOCK_H) float32
        normed = (tl.load(norm_w_ptr + h, mask=h_ok, other=0.0).to(tl.float32)[None, :] * normed).to(
            x_ptr.dtype.element_ty)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + tokens[:, None] * hidden + h[None, :], xs, mask=rows_ok)
            tl.store(normed_ptr + tokens[:, None] * hidden + h[None, :], normed, mask=rows_ok)
        if not PREFETCH:
            ws = tl.load(w_ptr + mine.to(tl.int64)[:, None] * stride_w + h[None, :],
                         mask=mine_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_E, BLOCK_H)
        acc += tl.sum(normed.to(tl.float32)[:, None, :] * ws[None, :, :], 2)
    else:
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < hidden
            xs = tl.load(x_ptr + tokens[:, None] * stride_x + h[None, :], mask=t_ok[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_H)
            ws = tl.load(w_ptr + mine.to(tl.int64)[:, None] * stride_w + h[None, :],
                         mask=mine_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_E, BLOCK_H)
            acc += tl.sum(xs[:, None, :] * ws[None, :, :], 2)
    if ROUND_LOGITS:
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + tokens[:, None] * num_experts + mine[None, :], acc, mask=t_ok[:, None] & mine_ok[None, :])
    tl.debug_barrier()  # every thread's stores are issued before the count's release
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:  # the last program: every logit is in the workspace
        experts = tl.arange(0, E_PAD)
        e_ok = experts < num_experts
        rows = tokens
        if HAS_PAD:  # a graph's padding rows route as row 0
            rows = tl.where(tl.load(pad_ptr + tokens, mask=t_ok, other=0) != 0, 0, tokens)
        ok = t_ok[:, None] & e_ok[None, :]
        logits = tl.atomic_add(logits_ptr + rows[:, None] * num_experts + experts[None, :],
                               tl.zeros([BLOCK_T, E_PAD], tl.float32), mask=ok, sem="relaxed")
        logits = tl.where(ok, logits, 0.0)
        bias = tl.zeros([E_PAD], tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + experts, mask=e_ok, other=0.0)
        scores, choice = _routing_scores(logits, bias, experts, e_ok, experts_per_group, METHOD, N_GROUP, TOPK_GROUP,
                                         G_PAD, HAS_BIAS, E_PAD)
        slots = tl.arange(0, OUT_PAD)
        row_out = tokens[:, None] * (TOP_K + N_SHARED)
        shared = (slots >= TOP_K) & (slots < TOP_K + N_SHARED)  # slot K + j: expert E + j, weight 1
        if N_SHARED > 0:
            tl.store(weights_ptr + row_out + slots[None, :], tl.zeros([BLOCK_T, OUT_PAD], tl.float32) + 1.0,
                     mask=t_ok[:, None] & shared[None, :])
            tl.store(ids_ptr + row_out + slots[None, :], tl.zeros([BLOCK_T, OUT_PAD], tl.int32) + num_experts
                     + slots[None, :] - TOP_K, mask=t_ok[:, None] & shared[None, :])
        if RANKED:  # each chosen expert writes its own slot (its place)
            place = _top_k_rank(choice, experts, e_ok)
            chosen = ok & (place < TOP_K)
            weight = scores
            if RENORMALIZE:
                total = tl.sum(tl.where(chosen, scores, 0.0), 1)
                weight = weight / (total[:, None] + 1e-20)
            weight = weight * scaling
            tl.store(weights_ptr + row_out + place, weight, mask=chosen)
            tl.store(ids_ptr + row_out + place, tl.zeros([BLOCK_T, E_PAD], tl.int32) + experts[None, :], mask=chosen)
        else:
            chosen_w, chosen_id = _top_k_serial(scores, choice, experts, e_ok, TOP_K, OUT_PAD, E_PAD)
            routed = slots[None, :] < TOP_K
            if RENORMALIZE:
                total = tl.sum(tl.where(routed, chosen_w, 0.0), 1)
                chosen_w = chosen_w / (total[:, None] + 1e-20)
            chosen_w = chosen_w * scaling
            keep = t_ok[:, None] & routed
            tl.store(weights_ptr + row_out + slots[None, :], chosen_w, mask=keep)
            tl.store(ids_ptr + row_out + slots[None, :], chosen_id, mask=keep)
        tl.store(count_ptr, 0)


_COUNTERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (MAX_TOKENS, E) float32, counter (1,) int32 zero between calls: the kernel leaves it so).
    Made on first use, before a graph captures (the engine's warm-up runs first); the layers of a step
    run one after another on one stream, so they share it."""
    key = (device, num_experts)
    if key not in _COUNTERS:
        _COUNTERS[key] = (torch.empty(MAX_TOKENS, num_experts, dtype=torch.float32, device=device),
                          torch.zeros(1, dtype=torch.int32, device=device))
    return _COUNTERS[key]


PRODUCT_VALUES = 8192  # a program's (BLOCK_T, BLOCK_E, BLOCK_H) product at most


def norm_fuses(num_tokens: int, hidden: int) -> bool:
    """route_decode_normed takes the norm in: the whole hidden row fits one product chunk (V2-Lite's 2048 at
    1-2 tokens)."""
    return 1 <= num_tokens <= MAX_TOKENS and max(2, triton.next_power_of_2(num_tokens)) * 2 * \
        triton.next_power_of_2(hidden) <= PRODUCT_VALUES


def route_decode_triton(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, method: str, *, n_group: int = 1,
                        topk_group: int = 1, score_bias: torch.Tensor | None = None, renormalize: bool = False,
                        scaling: float = 1.0, num_shared: int = 0, padding: torch.Tensor | None = None,
                        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, round_logits: bool = False):
    """(weights, ids); with ``norm`` = (residual, norm weight, eps): (weights, ids, normed x, new residual)
    (route_decode_normed). ``round_logits``: the logits rounded to x's dtype first (route_decode_ref's
    ``round_logits``)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert 1 <= num_tokens <= MAX_TOKENS and x.stride(1) == 1 and router_weight.stride(1) == 1
    assert method in METHODS, f"unknown routing method {method!r}; allowed: {', '.join(METHODS)}"
    group_limited = method != "greedy" and topk_group < n_group
    assert not group_limited or num_experts % n_group == 0
    logits, counter = _workspace(x.device, num_experts)
    out_k = top_k + num_shared
    weights = torch.empty(num_tokens, out_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, out_k, dtype=torch.int32, device=x.device)
    block_t = max(2, triton.next_power_of_2(num_tokens))
    e_pad = triton.next_power_of_2(num_experts)
    # Programs: two experts each (four from 512), each reading its rows of H in one pass where a
    # (BLOCK_T, BLOCK_E, BLOCK_H) product of <= 8,192 values holds them (V2-Lite batch 1: 32 programs, one
    # 16 KB load each): at decode sizes the launch is latency, one dependent load per H chunk.
    block_e = 2 if e_pad <= 256 else 4
    block_h = max(32, min(PRODUCT_VALUES // (block_t * block_e), triton.next_power_of_2(hidden)))
    residual, norm_weight, eps = norm if norm is not None else (x, x, 0.0)
    # read at ptr + expert / + token / + column
    score_bias, pad, norm_weight = dense(score_bias, padding.reshape(-1) if padding is not None else None, norm_weight)
    if norm is not None:
        assert block_e == 2 and norm_fuses(num_tokens, hidden) and residual.stride(1) == 1
        normed, residual_out = torch.empty_like(x), torch.empty_like(x)
    else:
        normed = residual_out = x
    pdl = pdl_options(x)
    # (the register load before the wait needs no PDL to be right: the CPU interpreter runs it too)
    prefetch = {"PREFETCH": True} if norm is not None and weight_prefetch("router", True) else {}
    _route_decode_kernel[(triton.cdiv(num_experts, block_e),)](
        x, router_weight, score_bias if score_bias is not None else router_weight, pad if pad is not None else x,
        logits, counter, weights, ids, residual, norm_weight, normed, residual_out, float(eps), residual.stride(0),
        num_tokens, num_experts, hidden,
        num_experts // n_group if group_limited else num_experts, float(scaling), x.stride(0), router_weight.stride(0),
        TOP_K=top_k, N_SHARED=num_shared, OUT_PAD=triton.next_power_of_2(out_k), METHOD=METHODS[method],
        N_GROUP=n_group if group_limited else 1, TOPK_GROUP=topk_group if group_limited else 1,
        G_PAD=max(2, triton.next_power_of_2(n_group if group_limited else 1)), HAS_BIAS=score_bias is not None,
        HAS_PAD=pad is not None, RENORMALIZE=renormalize, E_PAD=e_pad, BLOCK_T=block_t, BLOCK_E=block_e,
        RANKED=block_t * e_pad * e_pad <= RANKED_VALUES, NORM=norm is not None,
        BLOCK_H=block_h, ROUND_LOGITS=round_logits, num_warps=4, **pdl, **prefetch)
    return (weights, ids) if norm is None else (weights, ids, normed, residual_out)


def route_decode_normed(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        router_weight: torch.Tensor, top_k: int, method: str, **kwargs
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's post-attention norm and the routing of its output in one launch (where norm_fuses):
    (normed, new_residual) = rms_norm(x, norm_weight, eps, residual), then route_decode(normed, ...).
    Returns (topk_weights, topk_ids, normed, new_residual); the reference is those two calls."""
    if use_triton(x):
        return route_decode_triton(x, router_weight, top_k, method, norm=(residual, norm_weight, eps), **kwargs)
    normed, residual = rms_norm_ref(x, norm_weight, eps, residual)
    return (*route_decode_ref(normed, router_weight, top_k, method, **kwargs), normed, residual)


def route_decode(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, method: str, **kwargs
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights (T, K + S), topk_ids (T, K + S)) of 1..MAX_TOKENS tokens (module docstring): the one
    launch on CUDA, else the reference. kwargs: n_group, topk_group, score_bias, renormalize, scaling,
    num_shared, padding."""
    if use_triton(x):
        return route_decode_triton(x, router_weight, top_k, method, **kwargs)
    return route_decode_ref(x, router_weight, top_k, method, **kwargs)
