"""Token trees inside the in-flight executor's steps: what the runner, the packing and the verify
step need beyond chains (engine/executor/speculative/tree.py says what a tree is). Outside the
speculative package, which imports the runner: the runner imports this.

A sequence verifying a tree carries ``seq.draft_parents`` beside ``seq.draft_token_ids``: draft i's
parent is draft ``draft_parents[i]``, or the root (its last known token) when -1. Its chunk is
packed like a chain's (known tokens, then the drafts), but

- ``ForwardBatch.tree_parents[i]``: each new token's parent within the chunk (-1: none), so the
  runner rotates a draft at root position + depth and masks attention to its ancestors
  (``tree_positions``, ``tree_mask``), while the KV slots stay consecutive (``slot_positions``);
- verification walks the tree (tree.py ``accept_greedy_tree``); the path's KV is compacted into
  consecutive positions before the next step (tree_step.py ``compact_path_kv``).
"""
from __future__ import annotations

import numpy as np
import torch


def ancestor_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """(n, n) bool: [i, j] iff node j is node i or one of its ancestors (parents[i] < i, -1: none)."""
    return torch.from_numpy(_ancestor_rows(parents))


def _ancestor_rows(parents) -> np.ndarray:
    """ancestor_mask in numpy: every tree step builds it on the host, a row per token, and a numpy
    row operation costs ~1 us where a torch one costs ~5-10 (65 tokens: ~0.5 ms of the step before)."""
    mask = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def chunk_parents(num_new: int, draft_parents: list[int]) -> list[int]:
    """A chunk of ``num_new`` tokens ending in len(draft_parents) drafts -> each token's parent in
    the chunk: the known tokens form a chain ending in the root, the drafts hang below it."""
    k = len(draft_parents)
    root = num_new - k - 1
    return [j - 1 for j in range(root + 1)] + [root if p < 0 else root + 1 + p for p in draft_parents]


def tree_positions(start: int, parents: list[int]) -> list[int]:
    """Rotary positions of a chunk starting at ``start``: parent's + 1 (a chain: start, start + 1, ...)."""
    positions = []
    for j, p in enumerate(parents):
        positions.append(start if p < 0 else positions[p] + 1)
    return positions


def slot_positions(positions: list[int], seq_lens_q: list[int], context_lens: list[int],
                   tree_parents: list[list[int] | None]) -> list[int]:
    """Where each new token's KV goes: its rotary position, except in a tree, whose tokens take
    consecutive slots after the prefix (context_len - q_len + j)."""
    out, offset = [], 0
    for n, context_len, parents in zip(seq_lens_q, context_lens, tree_parents):
        out += positions[offset:offset + n] if parents is None else range(context_len - n, context_len)
        offset += n
    return out


def tree_mask(seq_lens_q: list[int], tree_parents: list[list[int] | None]) -> torch.Tensor:
    """(num_tokens, max q_len) bool, AttentionMetadata.tree_mask: causal rows for plain chunks."""
    width = max(seq_lens_q)
    mask = np.zeros((sum(seq_lens_q), width), dtype=bool)
    offset = 0
    for n, parents in zip(seq_lens_q, tree_parents):
        if parents is None:  # a plain chunk: causal
            mask[offset:offset + n, :n] = np.tri(n, dtype=bool)
        else:
            mask[offset:offset + n, :n] = _ancestor_rows(parents)
        offset += n
    return torch.from_numpy(mask)
