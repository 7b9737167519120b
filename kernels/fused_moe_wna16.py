"""Mixture-of-experts MLPs with weight-only integer experts (W4A16, W8A16): the stacked experts of
one projection in the layout the grouped kernels read, and the fused-MoE entry that takes them.

Storage per projection (the engine directory's tensors; the scheme of kernels/wna16.py applied to
each expert): ``weight`` uint8 (E, N, stored K) — 4-bit codes two a byte along K (column 2j low
nibble), 8-bit one a byte; ``scale`` (E, N, K // G) float32; ``zero`` (E, N, K // G) uint8, with
expert e's weight[n, k] ~= (code - zero[e, n, k // G]) * scale[e, n, k // G].

gate_up is (E, 2I, H) with rows [gate_e | up_e], down (E, H, I), as for model-dtype experts
(kernels/fused_moe.py). On CPU the reference dequantizes the experts once (``dense``) and runs
kernels/fused_moe.py's reference on them: the dequantized model's MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.fused_moe import moe_forward
from kernels.wna16 import dequantize, unpack_codes


@dataclass
class WNA16Experts:
    """One projection's quantized experts, prepared at load (``prepare_wna16_experts``).

    ``dense``: the dequantized experts (E, N, K) in the activations' dtype (reference path).
    ``kernel``: the CUDA kernels' layout, by name; empty where the reference path runs."""

    num_experts: int
    out_features: int
    in_features: int
    bits: int
    group_size: int
    dtype: torch.dtype
    dense: torch.Tensor | None = None
    kernel: dict[str, torch.Tensor] = field(default_factory=dict)


def prepare_wna16_experts(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          dtype: torch.dtype) -> WNA16Experts:
    """Stored experts of one projection (module docstring) -> WNA16Experts for activations of ``dtype``."""
    experts, n, groups = scale.shape
    k = unpack_codes(weight[:1, :1], bits).shape[-1]
    return WNA16Experts(num_experts=experts, out_features=n, in_features=k, bits=bits, group_size=k // groups,
                        dtype=dtype, dense=dequantize(weight, scale, zero, bits, dtype))


def moe_forward_wna16(x: torch.Tensor, router_logits: torch.Tensor, gate_up: WNA16Experts, down: WNA16Experts,
                      top_k: int, renormalize: bool) -> torch.Tensor:
    """kernels.fused_moe.moe_forward with quantized experts: x (T, H) -> (T, H) in x's dtype."""
    return moe_forward(x, router_logits, gate_up.dense, down.dense, top_k, renormalize)
