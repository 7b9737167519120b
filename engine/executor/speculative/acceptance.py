"""Which draft tokens a verify step keeps: plain functions of probabilities, no executor state.

Each function gets the target's distributions at the k + 1 verified positions and the k drafts,
and returns the tokens to emit: the accepted drafts, then one token of the target's own (the
correction at the first rejection, or the bonus token after the last draft when all are
accepted), so a verify step always emits between 1 and k + 1 tokens.

    positions:      t    t+1   ...  t+k          (t: the sequence's last known token)
    target probs:   p0   p1    ...  pk            (k + 1, vocab)
    drafts:         d0   d1    ...                 d_j is proposed for position t + 1 + j,
                                                   judged by p_j (the target's next-token law there)

Rules:
- ``accept_greedy``: d_j is kept iff it is the target's argmax at j; the emitted ids are exactly
  what plain greedy decoding would produce.
- ``accept_by_rejection`` (Leviathan et al. / Chen et al. speculative sampling): d_j is kept with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the
  normalized residual max(0, p_j - q_j). The emitted tokens then follow the target's law exactly,
  whatever the draft law q. Without draft logits q_j is the point mass on d_j (a deterministic
  proposer: n-gram lookup, or client drafts without logits): kept with probability p_j(d_j), else
  drawn from p_j with d_j removed. So is a draft whose q_j(d_j) is 0 (it cannot have been drawn
  from q_j, e.g. a draft model that sampled with other settings): min(1, p/0) would keep it always.
- ``accept_by_threshold`` (the reference's "typical acceptance" with draft_acceptance_threshold):
  d_j is kept iff p_j(d_j) >= threshold, else the token is drawn from p_j. Cheaper to reason
  about than rejection sampling but not distribution-preserving: it favours likely drafts.
"""
from __future__ import annotations

import torch


def accept_greedy(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """target_ids: the target's argmax at the k + 1 positions -> the tokens plain greedy emits."""
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return target_ids[:num_accepted + 1]


def accept_by_rejection(target_probs: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
                        generator: torch.Generator) -> list[int]:
    """target_probs (k + 1, vocab), draft_probs (k, vocab) or None (point masses on the drafts),
    both on the CPU, rows summing to 1 -> the emitted tokens."""
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    for j, draft in enumerate(draft_ids):
        p = float(target_probs[j, draft])
        q = 0.0 if draft_probs is None else float(draft_probs[j, draft])
        point_mass = not q > 0  # no law, or one that rules the draft out (it was not drawn from it)
        if uniforms[j] * (1.0 if point_mass else q) < p:  # u < p / q, without dividing
            continue
        if point_mass:
            residual = target_probs[j].clone()
            residual[draft] = 0
        else:
            residual = (target_probs[j] - draft_probs[j]).clamp_(min=0)
        return list(draft_ids[:j]) + [_draw(residual, target_probs[j], generator)]
    return list(draft_ids) + [_draw(target_probs[k], target_probs[k], generator)]


def accept_by_threshold(target_probs: torch.Tensor, draft_ids: list[int], threshold: float,
                        generator: torch.Generator) -> list[int]:
    """target_probs (k + 1, vocab) on the CPU -> the emitted tokens (see the module docstring)."""
    for j, draft in enumerate(draft_ids):
        if float(target_probs[j, draft]) < threshold:
            return list(draft_ids[:j]) + [_draw(target_probs[j], target_probs[j], generator)]
    return list(draft_ids) + [_draw(target_probs[len(draft_ids)], target_probs[len(draft_ids)], generator)]


def _draw(weights: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``weights`` (vocab,) normalized; from ``fallback`` when they are all 0
    (a residual is empty only when p == q up to rounding: then p itself is the right law)."""
    if not float(weights.sum()) > 0:
        weights = fallback
    return int(torch.multinomial(weights.double(), 1, generator=generator))


def accept_tree_by_rejection(parents: list[int], token_ids: list[int], probs: torch.Tensor,
                             generator: torch.Generator) -> tuple[list[int], list[int]]:
    """A token tree of fixed drafts (point masses, chosen before this step's draws), verified so
    that the emitted tokens follow the target's law exactly (multi-draft rejection sampling:
    SpecInfer; the lookahead paper's sampling verification). parents/token_ids: node 0 the root
    (parents[0] == -1, parents[i] < i); probs (nodes, vocab) on the CPU: the law after each node.

    At node a with law p, its children are tried in order: child token x is accepted with
    probability p(x); on rejection p becomes p with x removed, renormalised (the residual
    max(p - delta_x, 0)), and the next child is tried. An accepted child continues the walk with its
    own law; when none is accepted, one token is drawn from the residual. Each step of the walk thus
    emits a token distributed as p (by induction over the children), and what follows an accepted
    child is distributed as the target's law there. -> (path of node indices from the root, tokens)."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    path, emitted = [0], []
    while True:
        p = probs[path[-1]].double().clone()
        accepted = None
        for child in children.get(path[-1], ()):
            x = token_ids[child]
            if p[x] <= 0:  # ruled out by the target, or a sibling with the same token was rejected
                continue
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[x]):
                accepted = child
                break
            p[x] = 0
            p /= p.sum()
        if accepted is None:
            emitted.append(int(torch.multinomial(p, 1, generator=generator)))
            return path, emitted
        path.append(accepted)
        emitted.append(token_ids[accepted])
