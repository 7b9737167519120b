"""The host-side adapter every format loads into: the projections it may target (``MODULES``),
their full-model shapes, the ``LoraAdapter`` dataclass and ``LoraError``.

Shapes follow the base weights (out_features, in_features): an adapter adds ``b @ a`` to a
projection's weight, so ``y = x W^T + (x a^T) b^T`` with a (rank, in) and b (out, rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig

MODULES = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter may target


class LoraError(ValueError):
    """A bad adapter; the message names the file/tensor/field, the value and what is allowed."""


@dataclass
class LoraAdapter:
    """One adapter on the host (CPU tensors), scale already folded into B.

    weights[(layer_index, module)] = (a, b): a (rank, in_features), b (out_features, rank), float32
    or the stored dtype, for module in MODULES; in/out features of the FULL (unsharded) model.
    Fused sources (Phi-3's qkv_proj, TRT-LLM's attn_qkv) give q/k/v entries sharing one ``a``
    whose ``b`` are row blocks (views) of the fused B.
    """

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    source: str  # e.g. "PEFT adapter /path" or "lora_task_id 3"

    @property
    def rank(self) -> int:
        """The largest rank over the adapter's modules (0 for an empty adapter)."""
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Host bytes held: an ``a`` shared by fused slices counts once."""
        seen: dict[int, int] = {}
        for a, b in self.weights.values():
            seen[id(a)] = a.nbytes
            seen[id(b)] = b.nbytes
        return sum(seen.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of ``module`` in the full (unsharded) model. The MLP modules
    are those of a dense layer (width ``intermediate_size``)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q": (hidden, q_size), "k": (hidden, kv_size), "v": (hidden, kv_size), "o": (q_size, hidden),
              "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    if module not in shapes:
        raise LoraError(f"unknown LoRA module {module!r}; allowed: {', '.join(MODULES)}")
    return shapes[module]


def check_rank(rank: int, max_rank: int, what: str, context: str = "") -> None:
    """Refuse a rank outside [1, max_rank]; ``what`` names the module or field, ``context`` (if
    any) the input and row it came from, as a prefix."""
    prefix = f"{context}: " if context else ""
    if rank < 1:
        raise LoraError(f"{prefix}rank {rank} of {what} must be at least 1")
    if rank > max_rank:
        raise LoraError(f"{prefix}rank {rank} of {what} exceeds max_lora_rank {max_rank}")
