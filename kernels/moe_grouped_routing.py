"""DeepSeek's expert routing: router logits (T, E) -> (topk_weights (T, K) float32, topk_ids (T, K) int32),
the inputs of the fused expert kernels (kernels/fused_moe.py ``fused_moe``, kernels/fused_moe_fp8.py).

The methods, by DeepSeek's names (engine.config MLA_TOPK_METHODS), following transformers'
DeepseekV2TopkRouter / DeepseekV3TopkRouter:

- ``greedy`` (V2, V2-Lite): softmax over all E in float32, the K largest;
- ``group_limited_greedy`` (V2): experts in ``n_group`` equal groups, each ranked by its best
  probability; only the ``topk_group`` best groups stay eligible, and the K largest among them;
- ``noaux_tc`` (V3, R1, Kimi-K2, Moonlight): sigmoid scores; the *choice* adds the per-expert
  ``score_bias`` (e_score_correction_bias) and ranks groups by the sum of their two best biased
  scores; the chosen experts' weights are their unbiased scores.

Then, where ``renormalize`` (norm_topk_prob), the K weights are divided by their sum (+1e-20, as
transformers' V3), and every weight is multiplied by ``scaling`` (routed_scaling_factor).

Plain torch on every device: a handful of small ops over (T, E) per sparse layer, beside the expert
GEMMs that dominate the layer. Decode steps of 1-16 tokens take kernels/moe_router.py instead (the
router product and every method here in one launch), whose reference this is.
"""
from __future__ import annotations

import torch


def route_grouped(router_logits: torch.Tensor, top_k: int, method: str, *, n_group: int = 1, topk_group: int = 1,
                  score_bias: torch.Tensor | None = None, renormalize: bool = False,
                  scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's routing of each token; router_logits (T, E) any float dtype."""
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + score_bias.float() if score_bias is not None else scores
        fill = float("-inf")
    elif method in ("greedy", "group_limited_greedy"):
        scores = choice = torch.softmax(logits, dim=-1)
        fill = 0.0
    else:
        raise ValueError(f"unknown routing method {method!r}; allowed: greedy, group_limited_greedy, noaux_tc")
    # (Each op here is a launch of a few microseconds a sparse layer at batch-1 decode, ~5% of
    # V2-Lite's step for the group scores and the scaling: they run only where they change the result.)
    if method != "greedy" and topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if method == "noaux_tc" else grouped.amax(dim=-1)
        groups = group_scores.topk(topk_group, dim=-1).indices  # (T, topk_group)
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(num_experts // n_group, dim=1), fill)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights if scaling == 1.0 else weights * scaling), ids.to(torch.int32)
