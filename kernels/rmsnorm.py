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

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3


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
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, QUANTIZE: tl.constexpr,
):
    """QUANTIZE: out is float8_e4m3fn and the normalized row, rounded to x's dtype, is quantized
    per row as kernels/fp8.py's quantize_rows does (kernels/e4m3_rows.py)."""
    pdl_prologue(PDL)
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
    if QUANTIZE:
        y = (weight * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = e4m3_row_scale(tl.max(tl.abs(y), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(y, scale), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm_ref``; rows must be contiguous in the hidden dimension."""
    out, _, residual_out = _launch_rms_norm(x, weight, eps, residual, quantize=False)
    return out, residual_out


def rms_norm_quantized_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` whose output row is quantized to E4M3 per row in the same pass (the input of an
    FP8 product): returns (out (num_tokens, hidden) float8_e4m3fn, scale (num_tokens,) float32,
    new_residual); out * scale equals kernels.fp8.quantize_rows of rms_norm's output exactly."""
    return _launch_rms_norm(x, weight, eps, residual, quantize=True)


def _launch_rms_norm(x, weight, eps, residual, *, quantize: bool):
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn if quantize else x.dtype)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device) if quantize else out
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return out, scale, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, residual_out, scale,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
        hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, QUANTIZE=quantize,
        num_warps=min(16, max(1, block // 512)), **pdl_options(x),
    )
    return out, scale, residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
