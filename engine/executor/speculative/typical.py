"""Medusa's typical acceptance over a token tree (Cai et al. 2024, "Medusa", section 3.3.1): how a
sampled request verifies a tree. Plain torch on the CPU, no executor state.

A drafted node x below parent a is accepted when its parent's path is and

    p_a(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_a)))

where p_a is the target's law at a (the request's temperature, top-k/top-p and penalties applied:
what the sampler would draw from there) and H(p_a) its entropy. Of the accepted nodes the deepest
wins (ties: the lowest index, i.e. the most likely ranks, as Medusa takes its first longest
candidate); the tokens on its root path are emitted, then one token drawn from the target's law at
its end. Every emitted token therefore has p > 0 under the target.

Not distribution-preserving: a likely-enough draft is kept where sampling would often have drawn
another token, so the output leans towards the heads' guesses (Medusa's published trade-off for
speed). As the temperature goes to 0 the law is a point mass at the argmax: only the argmax child
clears the threshold and the bonus is the argmax, so the ids are greedy decoding's.

The thresholds are Medusa's published defaults; the reference backend names no parameter for
them, so they are not exposed.
"""
from __future__ import annotations

import torch

POSTERIOR_THRESHOLD = 0.09  # epsilon: a hard cap on the threshold (confident laws)
POSTERIOR_ALPHA = 0.3  # delta: the threshold scales with exp(-entropy) (flat laws accept less likely drafts)


def typical_thresholds(probs: torch.Tensor, posterior_threshold: float = POSTERIOR_THRESHOLD,
                       posterior_alpha: float = POSTERIOR_ALPHA) -> torch.Tensor:
    """probs (nodes, vocab), rows summing to 1 -> (nodes,) the acceptance threshold of each node's children."""
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # 0 * log 0 counts as 0
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)


def accept_typical_tree(parents: list[int], token_ids: list[int], probs: torch.Tensor,
                        generator: torch.Generator) -> tuple[list[int], list[int]]:
    """parents/token_ids of a tree (node 0 the root, parents[0] == -1, parents[i] < i), probs
    (nodes, vocab) on the CPU: the target's law after each node's path -> (path: the accepted node
    indices from the root, the tokens to emit: the accepted drafts then one drawn token)."""
    probs = probs.double()
    thresholds = typical_thresholds(probs).tolist()
    n = len(parents)
    node_index = torch.tensor(parents[1:], dtype=torch.long)
    cand = probs[node_index, torch.tensor(token_ids[1:], dtype=torch.long)].tolist() if n > 1 else []
    depth, best = [0] * n, 0
    for i in range(1, n):
        a = parents[i]
        if depth[a] >= 0 and cand[i - 1] > thresholds[a]:  # depth -1: a rejected parent
            depth[i] = depth[a] + 1
            if depth[i] > depth[best]:
                best = i
        else:
            depth[i] = -1  # rejected, and so is everything below it
    path = [best]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path.reverse()
    bonus = int(torch.multinomial(probs[best], 1, generator=generator))
    return path, [token_ids[i] for i in path[1:]] + [bonus]
