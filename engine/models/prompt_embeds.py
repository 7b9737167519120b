"""Prompt-table rows spliced into a packed batch's token embeddings (the model side of
engine/executor/prompt_table.py): a model whose forward takes ``prompt_embeds`` calls
``splice_prompt_embeds`` right after its embedding lookup."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptEmbeds:
    """What one step splices in: ``token_indices`` (n,) rows of the packed batch whose embedding
    is replaced by ``embeddings`` (n, hidden), in order. Built by ``gather_prompt_embeds``."""

    token_indices: list[int]
    embeddings: torch.Tensor


def splice_prompt_embeds(x: torch.Tensor, prompt_embeds: PromptEmbeds | None) -> torch.Tensor:
    """x: (num_tokens, hidden) token embeddings of the packed batch -> the same with the table rows
    in place (a model's forward calls this right after its embedding lookup)."""
    if prompt_embeds is None:
        return x
    index = torch.tensor(prompt_embeds.token_indices, dtype=torch.int64, device=x.device)
    return x.index_copy(0, index, prompt_embeds.embeddings.to(device=x.device, dtype=x.dtype))


def embeddable_ids(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """input_ids with fake ids (>= vocab_size) replaced by 0, so the embedding lookup stays in
    range; their rows are overwritten by splice_prompt_embeds."""
    return input_ids.masked_fill(input_ids >= vocab_size, 0)
