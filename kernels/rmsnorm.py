"""Fused residual-add + RMSNorm: the norm every Llama-family layer runs twice.

``rms_norm(x, weight, eps, residual)`` returns ``(out, new_residual)`` where
``new_residual = x + residual`` (or ``x`` when ``residual`` is None) and
``out = new_residual / rms(new_residual) * weight``. The statistics are taken in fp32 and
the normalized value is cast back to the input dtype before the weight multiply, as
Hugging Face's LlamaRMSNorm does, so fp32 results match it bit-for-bit in spirit (1e-6).

Shapes: x, residual, out, new_residual: (num_tokens, hidden); weight: (hidden,).
"""
from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype), x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_ref(x, weight, eps, residual)
