"""The proposer of a speculative mode, made by name: the one place that knows every implementation.

It sits beside the implementations, not in proposer.py, which they import (the interface,
``draft_room``, ``ProposerConfigError``): there it made an import cycle.
"""
from __future__ import annotations

from engine.executor.speculative.draft_model import DraftModelProposer
from engine.executor.speculative.ngram import NgramProposer
from engine.executor.speculative.proposer import DraftProposer


def make_proposer(mode: str, *, max_matching_ngram_size: int = 3, draft_engine_dir: str | None = None,
                  target_engine_dir: str | None = None, target_runner=None, enable_reuse: bool = True,
                  kv_cache_dtype: str | None = None) -> DraftProposer:
    """The proposer of ``mode``. "draft_model" loads and checks the draft engine now (ProposerConfigError
    names the field) against the target's directory and runner; its pool comes with ``start``."""
    if mode == "ngram":
        return NgramProposer(max_matching_ngram_size)
    if mode == "draft_model":
        return DraftModelProposer(draft_engine_dir, target_engine_dir=target_engine_dir, target_runner=target_runner,
                                  enable_reuse=enable_reuse, kv_cache_dtype=kv_cache_dtype)
    raise ValueError(f"speculative mode {mode!r} has no proposer in the executor; allowed: ngram, draft_model")
