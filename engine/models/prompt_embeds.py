"""Prompt-table rows spliced into a packed batch's token embeddings (the model side of
engine/executor/prompt_table.py): a model whose forward takes ``prompt_embeds`` calls
``splice_prompt_embeds`` right after its embedding lookup.

Two forms of the same rows: indexed (eager steps: ``token_indices`` names the n tokens, ``embeddings``
holds their n rows) and dense (CUDA-graph steps, engine/executor/table_graphs.py: ``mask`` (num_tokens,)
bool marks the tokens, ``embeddings`` has a row per token of the step, read only where the mask is
set, so the graph's static buffers hold any step's rows). Both give bitwise the same embeddings: each
selected row is the table's row cast to the model dtype, every other row the token's embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptEmbeds:
    """What one step splices in: ``token_indices`` (n,) rows of the packed batch whose embedding
    is replaced by ``embeddings`` (n, hidden), in order. Built by ``gather_prompt_embeds``.
    Dense form: ``token_indices`` None, ``mask`` (num_tokens,) bool, ``embeddings`` (num_tokens, hidden)."""

    token_indices: list[int] | None
    embeddings: torch.Tensor
    mask: torch.Tensor | None = None


def splice_prompt_embeds(x: torch.Tensor, prompt_embeds: PromptEmbeds | None) -> torch.Tensor:
    """x: (num_tokens, hidden) token embeddings of the packed batch -> the same with the table rows
    in place (a model's forward calls this right after its embedding lookup)."""
    if prompt_embeds is None:
        return x
    if prompt_embeds.mask is not None:
        return torch.where(prompt_embeds.mask[:, None], prompt_embeds.embeddings.to(x.dtype), x)
    index = torch.tensor(prompt_embeds.token_indices, dtype=torch.int64, device=x.device)
    return x.index_copy(0, index, prompt_embeds.embeddings.to(device=x.device, dtype=x.dtype))


def add_prompt_rows(x: torch.Tensor, prompt_embeds: PromptEmbeds, rows: torch.Tensor,
                    index: torch.Tensor | None = None) -> torch.Tensor:
    """x plus ``rows`` at the table's tokens (rows in either form of ``prompt_embeds``; ``index``: the
    indexed form's token_indices on x's device, made once per forward). Other rows of x are unchanged
    (x + 0 in the dense form)."""
    rows = rows.to(device=x.device, dtype=x.dtype)
    if prompt_embeds.mask is not None:
        return x + torch.where(prompt_embeds.mask[:, None], rows, 0)
    return x.index_add(0, index, rows)


def embeddable_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids with fake ids (>= vocab_size) replaced by 0, so the embedding lookup stays in
    range; their rows are overwritten by splice_prompt_embeds."""
    return input_ids.masked_fill(input_ids >= vocab_size, 0)
