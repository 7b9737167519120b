"""The executor's side of drafts: what a step does with them before and after the verify forward.

``attach_external_draft``: a request's own drafts (TensorRT-LLM's external draft tokens) ride with
each sequence's first sampling chunk. ``propose_drafts``: the per-step proposer's drafts for every
running sequence about to decode one token (``may_draft`` says which may); ``resolve_device_drafts``:
drafts a proposer left on the device come home once the verify step is launched. ``take_verified``: a
verified sequence rolls back to its accepted tokens (the KV of rejected positions forgotten, blocks
holding only rejected positions freed, a tree's accepted path queued for moving into place). The
executor (engine/executor/executor.py, finishing.py) calls these; the rules that accept drafts are in
verify.py and acceptance.py.
"""
from __future__ import annotations

import torch

from engine.executor.kv_cache import BlockManager
from engine.executor.request import Request, Sequence
from engine.executor.speculative.proposer import DraftProposer, draft_room
from engine.executor.speculative.tree_step import path_kv_moves
from engine.executor.speculative.verify import Verified


def has_external_drafts(request: Request) -> bool:
    return request.external_draft is not None and bool(request.external_draft.token_ids)


def may_draft(seq: Sequence) -> bool:
    """Per-step drafts are for plain decoding: not beams (refused with a proposer), grammars (the
    matcher would need to follow each draft), top log-probs or context logits."""
    output = seq.state.request.output
    return (seq.grammar is None and not seq.state.is_beam_search and not output.num_top_log_probs
            and not output.return_context_logits)


def attach_external_draft(seq: Sequence) -> None:
    """The request's own drafts ride with each sequence's first sampling chunk (the prompt's
    last), cut so that keeping them all stays within max_tokens."""
    if not has_external_drafts(seq.state.request):
        return
    draft = seq.state.request.external_draft
    room = draft_room(seq, len(draft.token_ids))
    seq.draft_token_ids = list(draft.token_ids[:room])
    seq.draft_logits = None if draft.logits is None else torch.as_tensor(draft.logits)[:room]
    seq.draft_acceptance_threshold = draft.acceptance_threshold


def propose_drafts(proposer: DraftProposer, running, max_draft_len: int, vocab_size: int) -> None:
    """Ask the proposer for drafts for every running sequence about to decode one token."""
    seqs = [seq for seq in running if seq.num_uncomputed_tokens == 1 and may_draft(seq)]
    if not seqs:
        return
    for seq, drafts in zip(seqs, proposer.propose(seqs, max_draft_len)):
        if seq.state.request.prompt_table is not None:  # an n-gram may copy a prompt's image placeholders
            drafts = drafts[:next((i for i, t in enumerate(drafts) if t >= vocab_size), len(drafts))]
        seq.draft_token_ids = drafts


def resolve_device_drafts(proposer: DraftProposer | None, drafted: list[tuple[Sequence, int, int]]) -> None:
    """Drafts the proposer left on the device (speculative/device_drafts.py) come home: each drafted
    sequence's placeholder ids become the drafted ids. After the verify step's launch, before verifying."""
    resolve = getattr(proposer, "resolve_drafts", None)
    if resolve is None:
        return
    for seq, _, _ in drafted:
        seq.draft_token_ids = resolve(seq.draft_token_ids)


def take_verified(item, verified: Verified, kv_moves: list, blocks: BlockManager, tokens_per_block: int) -> None:
    """Roll a drafted sequence back to its accepted tokens: they join token_ids (as unresolved
    tokens, until the executor's _resolve_verified checks stops on each), the KV of rejected
    positions is forgotten (num_computed_tokens stops after the last accepted draft; the target's
    own token has no KV yet), and blocks that held only rejected positions go back to the pool.
    A tree's accepted path: its KV moves into consecutive positions join ``kv_moves``, which the
    caller makes for the whole step before anything else reaches the device (a source in a
    block freed here is still read first). The request's perf counters count the drafts."""
    seq, state = item.seq, item.seq.state
    if verified.path is not None:
        kv_moves += path_kv_moves(seq.block_ids, len(seq.token_ids) - 1, verified.path, tokens_per_block)
    seq.num_computed_tokens = len(seq.token_ids) + verified.num_accepted
    seq.token_ids += verified.token_ids
    seq.num_unresolved_tokens += len(verified.token_ids)
    seq.draft_token_ids, seq.draft_logits, seq.draft_probs, seq.draft_acceptance_threshold = [], None, None, None
    seq.draft_parents = None
    surplus = seq.block_ids[blocks.blocks_for_tokens(len(seq.token_ids)):]
    if surplus:  # fresh, unregistered blocks of this step (nothing else is in flight: synchronous)
        del seq.block_ids[-len(surplus):]
        blocks.free(surplus)
    perf = state.perf
    perf.total_draft_tokens += verified.num_draft_tokens
    perf.total_accepted_draft_tokens += verified.num_accepted
    perf.acceptance_rate = perf.total_accepted_draft_tokens / max(1, perf.total_draft_tokens)
