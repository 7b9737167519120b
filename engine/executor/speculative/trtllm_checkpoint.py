"""Speculative heads inside a TensorRT-LLM checkpoint (convert_checkpoint.py's output): a directory
with ``config.json`` and ``rank{r}.safetensors`` holding the target's weights and the heads'
(Medusa's ``medusa_heads.*``, ReDrafter's ``drafter.*``). Only the heads' tensors are read.
"""
from __future__ import annotations

import os

import torch
from safetensors import safe_open


def rank_tensors(path: str, config: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The ``prefix``-named tensors of the checkpoint's ``rank{r}.safetensors``, each concatenated
    along dim 0 over the ``mapping.tp_size`` ranks (the converters split every head tensor along its
    output dimension: linear weights and biases, lm heads by vocabulary). FileNotFoundError names
    the missing rank file."""
    tp = int((config.get("mapping") or {}).get("tp_size", 1))
    parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(tp):
        file = os.path.join(path, f"rank{rank}.safetensors")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path!r} has no rank{rank}.safetensors (a TensorRT-LLM checkpoint of tp_size "
                                    f"{tp} holds rank0..rank{tp - 1}.safetensors)")
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    parts.setdefault(key, []).append(f.get_tensor(key))
    return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
