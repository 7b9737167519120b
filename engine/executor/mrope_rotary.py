"""M-RoPE requests (Qwen2-VL): the rotary position of a token is no longer its KV position.

A request's ``Mrope`` carries what the anchor's ``mrope_rotary_cos_sin`` and ``mrope_position_deltas``
carry: one rotary row per prompt token, (rows >= prompt length, head_dim) float32 in the engine's
table layout ([cos | sin] of the head_dim / 2 frequencies, kernels/rotary.py), and the delta that
places every later token: token i >= prompt length rotates as plain RoPE at position i + delta
(its three M-RoPE positions are equal there). Rows past the prompt are ignored (the anchor pads the
table to max_position_embeddings). engine/vision/mrope.py request_mrope computes both.

The KV position (slot mapping, causal mask) stays the token's index. Per step, ``step_rotary``
gives the rotary index of every packed token: a row of the engine's table (position + delta) or,
for prompt tokens, an extra row appended after the table for this step. Chunked prefill and
recompute after preemption read the same rows again: they are indexed by the token's place in its
sequence. A decode-only step with deltas replays its decode graph with the rotary positions in the
graph's positions buffer (the runner); a step with prompt tokens replays the prefill graphs' table
twin in a vision-language engine (engine/executor/table_graphs.py), else runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch where rows are read: requests.py's checks import this without it
    import torch


@dataclass
class Mrope:
    """``rotary_cos_sin``: (rows, head_dim) float (torch or numpy), row i for prompt token i;
    ``position_delta``: the rotary position of token i >= prompt length is i + position_delta."""

    rotary_cos_sin: Any
    position_delta: int = 0


@dataclass
class StepRotary:
    """One step's rotary override: ``indices`` (num_tokens,), for each packed token a row of the
    engine's table (>= 0) or, as -1 - k, row k of ``rows`` (n, head_dim) float32."""

    indices: list[int]
    rows: torch.Tensor | None

    def resolve(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotary positions (num_tokens,) int64 on the table's device, the step's table): the engine's
        (max_positions, head_dim) table with ``rows`` appended after it."""
        import torch

        index = torch.tensor(self.indices, dtype=torch.int64)
        if self.rows is None:
            return index.to(table.device), table
        index = torch.where(index < 0, table.shape[0] - 1 - index, index)
        return index.to(table.device), torch.cat([table, self.rows.to(device=table.device, dtype=table.dtype)])


def normalize_mrope(mrope: Mrope) -> Mrope:
    """A copy with the rows as a contiguous float32 CPU tensor and the delta as an int."""
    import torch

    if not isinstance(mrope, Mrope):
        raise TypeError(f"mrope must be an Mrope, got {type(mrope).__name__}")
    rows = mrope.rotary_cos_sin
    rows = torch.as_tensor(np.array(rows) if isinstance(rows, np.ndarray) else rows)
    return Mrope(rows.detach().float().cpu().contiguous(), int(mrope.position_delta))


def mrope_error(prompt_len: int, max_tokens: int, mrope: Mrope | None, width: int, max_seq_len: int) -> str | None:
    """Why ``mrope`` does not fit the request and the engine (naming the Triton inputs), or None.
    ``width``: the engine's rotary table width (head_dim); 0 when the model takes no M-RoPE."""
    if mrope is None:
        return None
    if not width:
        return ("mrope_rotary_cos_sin / mrope_position_deltas are not supported for this model's architecture "
                "(M-RoPE: Qwen2-VL's language model, one rank); send the request without them")
    shape = tuple(getattr(mrope.rotary_cos_sin, "shape", ()))
    if len(shape) != 2 or shape[1] != width or shape[0] < prompt_len:
        return (f"mrope_rotary_cos_sin has shape {shape}; send (rows, {width}) float32 rows, one per prompt token "
                f"(at least {prompt_len}: [cos | sin] of the head's {width // 2} frequencies)")
    delta = mrope.position_delta
    if prompt_len + delta < 0 or prompt_len + max_tokens + delta > max_seq_len:
        return (f"mrope_position_deltas {delta} puts generated tokens at rotary positions "
                f"{prompt_len + delta}..{prompt_len + max_tokens - 1 + delta}; allowed: 0..{max_seq_len - 1}")
    return None


def step_rotary(sequences: list[tuple[Mrope | None, int, list[int]]]) -> StepRotary | None:
    """``sequences``: per scheduled sequence in packing order, (its request's Mrope or None, its prompt
    length, the positions of its new tokens). None when every token rotates at its own position (no
    M-RoPE prompt token, every delta 0): the step then runs as any other."""
    indices, rows, shifted = [], [], False
    for mrope, prompt_len, positions in sequences:
        shifted = _add_rotary_indices(indices, rows, mrope, prompt_len, positions) or shifted
    return _step_rotary(indices, rows, shifted)


def step_rotary_of(scheduled, batch) -> StepRotary | None:
    """``step_rotary`` of a scheduler step: ``scheduled`` (its items, in the order the ForwardBatch packs
    them) and ``batch`` (their positions, seq_lens_q). Runs once per sequence per step: a decode token of an
    M-RoPE request (past its prompt) takes its index without a call."""
    indices, rows, shifted, offset, positions = [], [], False, 0, batch.positions
    for item, n in zip(scheduled, batch.seq_lens_q):
        seq = item.seq
        mrope = seq.state.request.mrope
        if n == 1 and mrope is not None and positions[offset] >= seq.num_prompt_tokens:
            indices.append(positions[offset] + mrope.position_delta)
            shifted = shifted or mrope.position_delta != 0
        else:
            shifted = _add_rotary_indices(indices, rows, mrope, seq.num_prompt_tokens,
                                          positions[offset:offset + n]) or shifted
        offset += n
    return _step_rotary(indices, rows, shifted)


def _add_rotary_indices(indices: list[int], rows: list, mrope: Mrope | None, prompt_len: int,
                        positions: list[int]) -> bool:
    """One sequence's part of ``step_rotary``: its tokens' indices onto ``indices`` (its prompt tokens' rows onto
    ``rows``, indexed -1 - k after the step's rows before them); True when it rotates away from its positions
    (a nonzero delta)."""
    if mrope is None:
        indices += positions
        return False
    delta = mrope.position_delta
    prompt = [p for p in positions if p < prompt_len]
    if prompt:  # a chunk's prompt tokens are consecutive and come first
        extra = sum(len(r) for r in rows)
        rows.append(mrope.rotary_cos_sin[prompt[0]:prompt[-1] + 1])
        indices += range(-1 - extra, -1 - extra - len(prompt), -1)
    indices += [p + delta for p in positions[len(prompt):]]
    return delta != 0


def _step_rotary(indices: list[int], rows: list, shifted: bool) -> StepRotary | None:
    """None when every token rotates at its own position (no prompt row, every delta 0)."""
    import torch

    if not rows and not shifted:
        return None
    return StepRotary(indices, torch.cat(rows) if rows else None)
