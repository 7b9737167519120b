"""Gated activation of the Llama MLP: ``silu(gate) * up`` over the fused gate_up projection.

x: (num_tokens, 2 * intermediate) laid out as [gate | up] -> (num_tokens, intermediate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)
