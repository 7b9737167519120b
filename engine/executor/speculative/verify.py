"""A verify step's logits -> the tokens each drafted sequence emits (engine/executor/speculative/acceptance.py).

The target's law at each verified position is the one the sampler would draw from there, had
the drafts before it been accepted: bias, penalties and bans see the sequence's tokens plus
those drafts (``_Drafted``), then temperature, top-k and top-p. Greedy requests take the argmax
of the same processed logits, so their ids are plain decoding's.

Sampled requests draw from a torch.Generator seeded by the sequence's seed and its step: the
draws are reproducible for a seeded request, but they are not the Gumbel stream plain decoding
uses, so a seeded sampled request gives other (equally distributed) tokens with drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.executor.request import Sequence
from engine.executor.sampler import apply_top_k_top_p, build_sampling_metadata, process_logits, sampling_law
from engine.executor.speculative.acceptance import (accept_by_rejection, accept_by_threshold, accept_greedy,
                                                     accept_tree_by_rejection)
from engine.executor.speculative.tree import accept_greedy_tree
from engine.executor.speculative.typical import accept_typical_tree
from kernels.sampling import greedy_tokens


@dataclass
class Verified:
    """What one drafted sequence emits after a verify step."""

    token_ids: list[int]  # the accepted drafts, then one token of the target's own
    num_draft_tokens: int  # drafts that were verified
    log_probs: list[float] | None  # per emitted token, as the sampler reports them; None unless asked
    path: list[int] | None = None  # a tree's accepted nodes (0: the root), whose KV moves into place; None: a chain
    node_argmax: list[int] | None = None  # a greedy tree's: the target's choice at every node (lookahead.py reads it)

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


class _Drafted:
    """``seq`` as it would be with ``extra`` tokens accepted: what the sampling metadata reads.
    The token list is built only when read (penalties, bad words), not for every verify step."""

    def __init__(self, seq: Sequence, extra: list[int]):
        self.state, self.seed, self.grammar = seq.state, seq.seed, None
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_generated_tokens = seq.num_generated_tokens + len(extra)
        self._seq, self._extra = seq, extra

    @property
    def token_ids(self) -> list[int]:
        return self._seq.token_ids + self._extra

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def verify_batch(drafted: list[tuple[Sequence, list[int], int]], logits: torch.Tensor, vocab_size: int,
                 normalize_log_probs: bool = True) -> dict[int, Verified]:
    """Every drafted sequence of a step: (sequence, drafts, first logits row) -> seq_id -> Verified.
    logits (rows, vocab): the step's; sequence i's k + 1 rows start at its first row. Plain greedy
    sequences (nothing changes their logits) share one argmax and one copy to the host (their trees
    one, their chains another): a copy to the host waits for the step's forward, each a sync."""
    verified, plain, trees = {}, [], []
    for seq, draft_ids, first in drafted:
        if seq.draft_parents is not None:  # a token tree (tree_batch.py)
            parents = [-1] + [p + 1 for p in seq.draft_parents[:len(draft_ids)]]
            if not is_plain_greedy(seq):
                rows = logits[first:first + len(draft_ids) + 1]
                verified[seq.seq_id] = verify_tree(seq, parents, draft_ids, rows, vocab_size, normalize_log_probs)
                continue
            trees.append((seq, draft_ids, first, parents))
        elif is_plain_greedy(seq):
            plain.append((seq, draft_ids, first))
        else:
            verified[seq.seq_id] = verify_drafts(seq, draft_ids, logits[first:first + len(draft_ids) + 1],
                                                 vocab_size, normalize_log_probs)
    if trees:  # plain greedy trees: one argmax over the span of their rows, one copy to the host (not one a tree)
        low = min(first for _, _, first, _ in trees)
        # (kernels/sampling.py greedy_tokens: on CUDA a 128k-token row split over many programs, not
        # torch.argmax's one block a row: ~17 rows of 0.5 MB each at a fraction of the bandwidth)
        argmax = greedy_tokens(logits[low:max(first + len(d) + 1 for _, d, first, _ in trees)]).tolist()
        for seq, draft_ids, first, parents in trees:
            node_argmax = argmax[first - low:first - low + len(draft_ids) + 1]
            path, token_ids = accept_greedy_tree(parents, [-1] + list(draft_ids), node_argmax)
            verified[seq.seq_id] = Verified(token_ids, len(draft_ids), None, path, node_argmax)
    if plain:
        rows = [first + j for _, draft_ids, first in plain for j in range(len(draft_ids) + 1)]
        argmax = greedy_tokens(logits[torch.tensor(rows, device=logits.device)]).tolist()
        offset = 0
        for seq, draft_ids, _ in plain:
            k = len(draft_ids)
            verified[seq.seq_id] = Verified(accept_greedy(argmax[offset:offset + k + 1], draft_ids), k, None)
            offset += k + 1
    return verified


def is_plain_greedy(seq: Sequence) -> bool:
    """Greedy, and the sampler would take the raw argmax: no bias, penalty, ban or log-prob."""
    request = seq.state.request
    s = request.sampling
    return (s.is_greedy and request.embedding_bias is None and not request.bad_words
            and not (request.end_id is not None and s.min_tokens)
            and (s.repetition_penalty is None or s.repetition_penalty == 1.0)
            and not s.presence_penalty and not s.frequency_penalty and not request.output.return_log_probs)


def verify_drafts(seq: Sequence, draft_ids: list[int], logits: torch.Tensor, vocab_size: int,
                  normalize_log_probs: bool = True) -> Verified:
    """logits (k + 1, vocab): the target's at the sequence's last known token and at each of its
    k drafts. Draft logits and the acceptance threshold come from ``seq`` (external drafts)."""
    k = len(draft_ids)
    views = [_Drafted(seq, draft_ids[:j]) for j in range(k + 1)]
    md = build_sampling_metadata(views, vocab_size, logits.device, return_log_probs=False)
    processed = process_logits(logits, md)
    want_log_probs = seq.state.request.output.return_log_probs
    if md.all_greedy:
        token_ids = accept_greedy(processed.argmax(dim=-1).tolist(), draft_ids)
        scores = processed
    else:
        scores = processed / md.temperature.unsqueeze(1)  # a sampled row's temperature is > 0
        candidates = apply_top_k_top_p(scores, md.top_k, md.top_p) if md.needs_top_k_top_p else scores
        token_ids = _accept_sampled(seq, draft_ids, candidates.softmax(dim=-1).cpu(), md)
    log_probs = None
    if want_log_probs:
        if normalize_log_probs:
            scores = scores.log_softmax(dim=-1)
        rows = torch.arange(len(token_ids), device=scores.device)
        log_probs = scores[rows, torch.tensor(token_ids, device=scores.device)].tolist()
    return Verified(token_ids, k, log_probs)


def verify_tree(seq: Sequence, parents: list[int], draft_ids: list[int], logits: torch.Tensor, vocab_size: int,
                normalize_log_probs: bool = True) -> Verified:
    """A tree that is not plain greedy: parents (-1 for the root, node 0), logits (nodes, vocab).
    Each node's law sees the sequence plus its path's drafts (penalties, bans); greedy ones accept
    by argmax, sampled ones by Medusa's typical acceptance (speculative/typical.py), or, where the
    proposer set ``seq.draft_tree_keeps_law`` (lookahead), by multi-draft rejection sampling, which
    keeps the target's law (acceptance.py accept_tree_by_rejection)."""
    tokens = [-1] + list(draft_ids)
    paths = [[]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [tokens[i]])
    md = build_sampling_metadata([_Drafted(seq, p) for p in paths], vocab_size, logits.device, return_log_probs=False)
    scores = process_logits(logits, md)
    node_argmax = scores.argmax(dim=-1).tolist()  # (lookahead's Jacobi step is greedy whatever the request)
    if md.all_greedy:
        path, token_ids = accept_greedy_tree(parents, tokens, node_argmax)
    else:
        scores = scores / md.temperature.unsqueeze(1)  # a sampled row's temperature is > 0
        candidates = apply_top_k_top_p(scores, md.top_k, md.top_p) if md.needs_top_k_top_p else scores
        generator = torch.Generator().manual_seed((seq.seed * 1_000_003 + seq.num_generated_tokens) % (1 << 63))
        accept = accept_tree_by_rejection if getattr(seq, "draft_tree_keeps_law", False) else accept_typical_tree
        path, token_ids = accept(parents, tokens, candidates.softmax(dim=-1).cpu(), generator)
    log_probs = None
    if seq.state.request.output.return_log_probs:  # token j of the emitted ones is judged at path[j]
        if normalize_log_probs:
            scores = scores.log_softmax(dim=-1)
        log_probs = scores[torch.tensor(path, device=scores.device), torch.tensor(token_ids, device=scores.device)].tolist()
    return Verified(token_ids, len(draft_ids), log_probs, path, node_argmax)


def _accept_sampled(seq: Sequence, draft_ids: list[int], target_probs: torch.Tensor, md) -> list[int]:
    generator = torch.Generator().manual_seed((seq.seed * 1_000_003 + seq.num_generated_tokens) % (1 << 63))
    if seq.draft_probs is not None:  # a draft model drew them from this law (speculative/draft_model.py)
        return accept_by_rejection(target_probs, draft_ids, seq.draft_probs[:len(draft_ids)], generator)
    if seq.draft_logits is not None:
        return accept_by_rejection(target_probs, draft_ids, _draft_probs(seq.draft_logits[:len(draft_ids)], md),
                                   generator)
    if seq.draft_acceptance_threshold is not None:
        return accept_by_threshold(target_probs, draft_ids, seq.draft_acceptance_threshold, generator)
    return accept_by_rejection(target_probs, draft_ids, None, generator)  # drafts as point masses


def _draft_probs(draft_logits, md) -> torch.Tensor:
    """The draft's law at each draft position: its logits under the request's temperature, top-k
    and top-p (the draft model sampled with the request's settings), on the CPU."""
    logits = torch.as_tensor(draft_logits, dtype=torch.float32).cpu()
    k = logits.shape[0]
    limits = (md.top_k[:k].cpu(), md.top_p[:k].cpu()) if md.needs_top_k_top_p else (None, None)
    return sampling_law(logits, md.temperature[:k].cpu(), *limits)
