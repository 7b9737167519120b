"""Gated activations over the fused gate_up projection: ``silu(gate) * up`` (the Llama MLP) and
``gelu_tanh(gate) * up`` (GeGLU, Gemma's MLP).

x: (num_tokens, 2 * intermediate) laid out as [gate | up] -> (num_tokens, intermediate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import jit, tl, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the activation dtype first, as the reference's F.silu(gate) * up does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    num_tokens, width = x.shape
    inter = width // 2
    assert x.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(num_tokens, -(-inter // block))](x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, as transformers' Gemma MLP (gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with tanh(z) = 2 sigmoid(2z) - 1; the gelu
    # rounded to the activation dtype first, as the reference's F.gelu(gate) * up does.
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    num_tokens, width = x.shape
    inter = width // 2
    assert x.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    _gelu_tanh_and_mul_kernel[(num_tokens, -(-inter // block))](x, out, x.stride(0), out.stride(0), inter,
                                                               BLOCK=block, num_warps=4)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """One pass over the gate_up output on CUDA (the reference takes three)."""
    if use_triton(x):
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
