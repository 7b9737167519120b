"""Fused residual-add + RMSNorm: the norm every Llama-family layer runs twice.

``rms_norm(x, weight, eps, residual)`` returns ``(out, new_residual)`` where
``new_residual = x + residual`` (or ``x`` when ``residual`` is None) and
``out = new_residual / rms(new_residual) * weight``. The statistics are taken in fp32 and
the normalized value is cast back to the input dtype before the weight multiply, as
Hugging Face's LlamaRMSNorm does, so fp32 results match it bit-for-bit in spirit (1e-6).

Shapes: x, residual, out, new_residual: (num_tokens, hidden); weight: (hidden,).

On CUDA one Triton program per row reads x (+ residual) once, writes the new residual and the
normalized row: one pass over the activations instead of the reference's five.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, tl, triton, use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype), x


@jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the activation dtype before the statistics, as the reference's ``x + residual``.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm_ref``; rows must be contiguous in the hidden dimension."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, residual_out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
