"""Embedding tables made empty, for models whose weights are loaded over them.

Its own small module (torch only), so that a vision tower or an encoder-decoder stack takes it without importing
engine.models.layers' kernels (~0.16 CPU-s more of an encoder stub's start).
"""
from __future__ import annotations

import torch
from torch import nn


def uninitialized_table(rows: int, width: int, *, dtype: torch.dtype, device, frozen: bool = True) -> nn.Embedding:
    """An nn.Embedding left uninitialized like engine.models.layers._empty's parameters (the weights are loaded over it), frozen unless
    ``frozen`` is False: nn.Embedding's own normal_ init on the meta device, where engines and vision towers are
    made, imports torch._dynamo (~1.5-2 CPU-s of an engine process's or an encoder stub's start)."""
    return nn.Embedding.from_pretrained(torch.empty(rows, width, dtype=dtype, device=device), freeze=frozen)
