"""Random weights for benchmark engines: a config-only engine directory runs without a checkpoint.

An engine directory whose ``config.json`` has ``extra.random_weights_seed`` (and no rank files)
gets its weights made on the device at load: the honest way to measure speed at a real shape
(Llama-3.1-8B: 16 GB) on a machine that cannot download it, and faster than reading it from
disk. Norm weights are 1; every other weight is N(0, 0.02), which keeps activations O(1)
through dozens of layers, so no NaN or overflow path is timed. Rank r draws from seed + r.
"""
from __future__ import annotations

import torch

from kernels.fp8 import quantize_weight


def has_random_weights(extra: dict) -> bool:
    return extra.get("random_weights_seed") is not None


@torch.no_grad()
def materialize_random_weights(model: torch.nn.Module, device: torch.device, seed: int) -> torch.nn.Module:
    """A model built on the meta device -> the same model on ``device`` with random weights."""
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(".weight_scale"):
            continue  # set with its FP8 weight
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if name.endswith(".weight") and getattr(owner, "weight_scale", None) is not None:
            # An FP8 linear layer: random weights in float32, quantized per output channel.
            full = torch.empty(param.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
            quantized, scale = quantize_weight(full)
            param.copy_(quantized)
            owner.weight_scale.copy_(scale)
        elif "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return model
