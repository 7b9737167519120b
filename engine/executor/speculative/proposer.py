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


def make_proposer(mode: str, *, max_matching_ngram_size: int = 3, draft_engine_dir: str | None = None,
                  target_engine_dir: str | None = None, target_runner=None, enable_reuse: bool = True,
                  kv_cache_dtype: str | None = None) -> DraftProposer:
    """The proposer of ``mode``. "draft_model" loads and checks the draft engine now (ProposerConfigError
    names the field) against the target's directory and runner; its pool comes with ``start``."""
    if mode == "ngram":
        from engine.executor.speculative.ngram import NgramProposer

        return NgramProposer(max_matching_ngram_size)
    if mode == "draft_model":
        from engine.executor.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(draft_engine_dir, target_engine_dir=target_engine_dir, target_runner=target_runner,
                                  enable_reuse=enable_reuse, kv_cache_dtype=kv_cache_dtype)
    raise ValueError(f"speculative mode {mode!r} has no proposer in the executor; allowed: ngram, draft_model")
