"""Mllama's cross-attention over the paged cross-KV pool, with a per-token mask over the vision tokens.

A request with images holds L = images x max_num_tiles x patches vision tokens (padded tiles included) of
K/V per cross layer in its cross blocks. Which of them a text token attends to is its cross-attention mask
row (``CrossMask``): transformers' processor lets a token see the tiles (the real ones) of the image(s)
whose <|image|> it follows (up to the next image, consecutive images together), and generated tokens use
the last prompt row; the anchor's tensorrt_llm takes the same mask as ``cross_attention_mask``
(prompt + output rows, L columns). A row that allows nothing attends to all L tokens and its MLP branch
is zeroed (``full_row``), as transformers computes it.

One step (``MllamaCrossStep``): the rows of the sequences with images, each sequence's queries padded to
the step's longest (R, Qmax), its K/V gathered from its block table (R, Lmax), and the (R, Qmax, Lmax)
boolean mask; one fused attention per cross layer (torch SDPA: plain torch on CPU and CUDA; eager, no
CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.planless_attention import planless_sdpa


@dataclass
class CrossMask:
    """A request's cross-attention mask, stored once per distinct row: ``rows`` (U, L) bool, ``index`` (P,)
    the row of each position; positions past P take the last one (generated tokens, as transformers)."""

    rows: np.ndarray
    index: np.ndarray

    @classmethod
    def from_dense(cls, mask) -> "CrossMask":
        """(positions, L) bool/int -> CrossMask."""
        dense = np.asarray(mask).astype(bool)
        rows, index = np.unique(dense, axis=0, return_inverse=True)
        return cls(rows, index.reshape(-1).astype(np.int64))

    @property
    def length(self) -> int:
        return self.rows.shape[1]

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        return self.rows[self.index[np.minimum(positions, len(self.index) - 1)]]


@dataclass
class MllamaCrossStep:
    """The cross-attention inputs of one step (module docstring); all on the device."""

    rows: torch.Tensor  # (M,) int64 token rows of the step whose sequence has images
    tables: torch.Tensor  # (R, blocks) int64 each such sequence's cross blocks (0-padded)
    query_index: torch.Tensor  # (R, Qmax) int64 each sequence's rows among the M (0-padded)
    valid: torch.Tensor  # (R, Qmax) bool: a real query
    mask: torch.Tensor  # (R, Qmax, Lmax) bool: key allowed
    full_row: torch.Tensor  # (M, 1) 0 where the token's mask row allowed nothing, else 1
    max_length: int  # Lmax


def cross_step(seq_lens_q: list[int], positions: list[int], crosses: list, tokens_per_block: int,
               device) -> MllamaCrossStep | None:
    """The step's cross inputs: ``crosses[i]`` = (block table, L, CrossMask) of scheduled sequence i, or None
    when its request has no images. None when no sequence of the step has images."""
    if all(c is None for c in crosses):
        return None
    starts = np.cumsum([0, *seq_lens_q]).tolist()
    chosen = [(i, c) for i, c in enumerate(crosses) if c is not None]
    width = max(-(-c[1] // tokens_per_block) for _, c in chosen)
    longest_q, longest = max(seq_lens_q[i] for i, _ in chosen), max(c[1] for _, c in chosen)
    R = len(chosen)
    tables = np.zeros((R, width), np.int64)
    query_index = np.zeros((R, longest_q), np.int64)
    valid = np.zeros((R, longest_q), bool)
    mask = np.zeros((R, longest_q, longest), bool)
    rows, full_row = [], []
    pos = np.asarray(positions, np.int64)
    for r, (i, (table, length, cross_mask)) in enumerate(chosen):
        n = seq_lens_q[i]
        tables[r, :len(table)] = table
        query_index[r, :n] = np.arange(len(rows), len(rows) + n)
        valid[r, :n] = True
        allowed = cross_mask.rows_at(pos[starts[i]:starts[i] + n])[:, :length]
        seen = allowed.any(axis=1)
        allowed[~seen] = True  # a row that allows nothing attends to every vision token (its MLP is zeroed)
        mask[r, :n, :length] = allowed
        mask[r, n:, :length] = True  # padding queries: any finite row
        rows += range(starts[i], starts[i] + n)
        full_row += seen.tolist()
    as_tensor = lambda a, dtype=None: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return MllamaCrossStep(rows=as_tensor(np.asarray(rows, np.int64)), tables=as_tensor(tables),
                           query_index=as_tensor(query_index), valid=as_tensor(valid), mask=as_tensor(mask),
                           full_row=as_tensor(np.asarray(full_row, np.float32).reshape(-1, 1)), max_length=longest)


def cross_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: MllamaCrossStep,
                    scale: float) -> torch.Tensor:
    """q (M, heads, head_dim) of the step's image rows; k_cache/v_cache (blocks, tokens_per_block, kv_heads,
    head_dim) one cross layer's planes -> (M, heads, head_dim)."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    k = k_cache[step.tables].flatten(1, 2)[:, :step.max_length]  # (R, Lmax, kv_heads, head_dim)
    v = v_cache[step.tables].flatten(1, 2)[:, :step.max_length]
    if heads != kv_heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=2), v.repeat_interleave(heads // kv_heads, dim=2)
    queries = q[step.query_index]  # (R, Qmax, heads, head_dim)
    out = planless_sdpa(queries.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                        attn_mask=step.mask[:, None], scale=scale)  # (a new shape each step: no cuDNN plans)
    return out.transpose(1, 2)[step.valid]  # rows in step order: sequence by sequence, token by token
