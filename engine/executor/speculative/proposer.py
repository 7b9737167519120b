"""Where per-step drafts come from: the ``DraftProposer`` interface the executor calls before each
schedule, and the room a sequence has for drafts.

A proposer sees the sequences about to decode, with every token on the host (the executor runs
synchronously while one is configured), and returns up to ``max_draft_len`` tokens per sequence to
verify in the next step. It keeps whatever per-sequence state it likes (an n-gram index; a draft
model's KV blocks) and drops it in ``release`` when the sequence ends. The executor knows nothing
else about it: a draft-model proposer with its own ModelRunner and KV pool fits the same two calls.
"""
from __future__ import annotations

from typing import Protocol

from engine.executor.request import Sequence
from engine.executor.runner import ModelRunner


class ProposerConfigError(ValueError):
    """A proposer cannot run with its settings (the message names the field); refused at executor start."""


class DraftProposer(Protocol):
    def propose(self, seqs: list[Sequence], max_draft_len: int) -> list[list[int]]:
        """Drafts for each of ``seqs`` (same order), each at most ``draft_room(seq, max_draft_len)`` long."""

    def release(self, seq: Sequence) -> None:
        """``seq`` ended (finished, cancelled, failed): forget it."""


def draft_room(seq: Sequence, max_draft_len: int) -> int:
    """How many drafts ``seq`` may verify next step: a step that keeps all k drafts emits k + 1
    tokens, which must stay within prompt + max_tokens (itself within max_seq_len)."""
    return max(0, min(max_draft_len, seq.max_total_tokens - len(seq.token_ids) - 1))


def refuse_unless_one_rank_without_state(runner, mode: str, has_state: bool) -> None:
    """ProposerConfigError unless ``runner`` is one rank's ModelRunner of a model without recurrent
    state: tree verification moves KV per path, and a Mamba state cannot follow a tree."""
    if not isinstance(runner, ModelRunner) or runner.build_config.tp_size > 1 or runner.build_config.pp_size > 1:
        raise ProposerConfigError(f"decoding_mode {mode} runs on one rank (tp_size 1, pp_size 1) in this release")
    if has_state:
        raise ProposerConfigError(f"decoding_mode {mode}: models with recurrent state (Mamba layers) cannot verify "
                                  "token trees")
