"""Zero-padding a vision tower's MLP width to a multiple of 128 at load (CUDA), so its products
take the GPU's fast tensor-core tilings.

Why: Qwen2.5-VL's tower has MLPs of width 3,420 (= 128 x 26.7). On an H200 cuBLAS runs its three
products of that width in sm80 CUTLASS kernels at ~240 TFLOPS, against ~770 for the tower's qkv
product of width 3,840 in sm90 kernels: 114 of the 158 ms that 32 images at 448 x 448 take
(benchmarks/results/engine.md, "Vision-language models"). Padded to 3,456 they are ordinary shapes.

Exactness: the widening products (gate and up, or fc1) get zero output rows and zero bias, so the
new hidden columns are act(0) [* 0]; the narrowing product (down, fc2) gets zero input columns. Every
activation the towers use (SiLU, GELU, GELU-tanh, quick GELU) maps 0 to 0, so the new columns hold
zeros and add exact zeros to the down product's sums: the rows equal the unpadded tower's (bitwise on
the CPU, tests/engine/test_qwen2_vl_parts.py; to cuBLAS's summation order on a GPU).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.vision.clip import ACTIVATIONS

WIDTH_MULTIPLE = 128


def padded_width(width: int, multiple: int = WIDTH_MULTIPLE) -> int:
    return -(-width // multiple) * multiple


@torch.no_grad()
def pad_linear_pair(widening: list[nn.Linear], narrowing: nn.Linear, multiple: int = WIDTH_MULTIPLE) -> int:
    """Pad the hidden width between ``widening`` (each (parts * width, dim): one product, or a fused
    [gate | up] of two, each part padded at its end) and ``narrowing`` ((dim, width)) with zeros to a
    multiple of ``multiple``, in place -> the new width."""
    width = narrowing.in_features
    new = padded_width(width, multiple)
    if new == width:
        return width

    def padded(values: torch.Tensor) -> torch.Tensor:  # (parts * width[, dim]) -> (parts * new[, dim])
        parts = values.view(-1, width, *values.shape[1:])
        return torch.cat([parts, parts.new_zeros(parts.shape[0], new - width, *parts.shape[2:])], dim=1).flatten(0, 1)

    for linear in widening:
        linear.weight = nn.Parameter(padded(linear.weight), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(padded(linear.bias), requires_grad=False)
        linear.out_features = linear.weight.shape[0]
    weight = narrowing.weight
    narrowing.weight = nn.Parameter(torch.cat([weight, weight.new_zeros(weight.shape[0], new - width)], dim=1),
                                    requires_grad=False)
    narrowing.in_features = new
    return new


def pad_mlp_widths(encoder: nn.Module, multiple: int = WIDTH_MULTIPLE) -> None:
    """Every block of ``encoder`` with an MLP through one of engine/vision/clip.py's ACTIVATIONS (all
    map 0 to 0), SwiGLU (gate_proj, up_proj -> down_proj, or Qwen2.5-VL's fused gate_up -> down_proj) or
    plain (fc1 -> fc2), padded as pad_linear_pair. (Mergers and projectors apply their GELU outside a
    block: left as they are.)"""
    for block in encoder.modules():
        if not any(getattr(block, "act", None) is act for act in ACTIVATIONS.values()):
            continue
        if all(isinstance(getattr(block, name, None), nn.Linear) for name in ("gate_up", "down_proj")):
            pad_linear_pair([block.gate_up], block.down_proj, multiple)
        elif all(isinstance(getattr(block, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
            pad_linear_pair([block.gate_proj, block.up_proj], block.down_proj, multiple)
        elif all(isinstance(getattr(block, name, None), nn.Linear) for name in ("fc1", "fc2")):
            pad_linear_pair([block.fc1], block.fc2, multiple)
