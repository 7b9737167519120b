"""Gated activations over the fused gate_up projection: ``silu(gate) * up`` (the Llama MLP) and
``gelu_tanh(gate) * up`` (GeGLU, Gemma's MLP).

x: (num_tokens, 2 * intermediate) laid out as [gate | up] -> (num_tokens, intermediate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import jit, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3

SILU_ONE_PASS_MAX = 16384  # widest row the fused SiLU quantizer keeps in registers (one read of the row)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


SILU, GELU_TANH = 0, 1  # the ACTIVATION constexpr of the gated kernels


@jit
def _activated_gate(gate, ACTIVATION: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """silu(gate) (ACTIVATION 0) or gelu_tanh(gate) (1) of a float32 tile, rounded to OUT_DTYPE as the
    references' F.silu(gate) / F.gelu(gate) are before their product with up; in float32."""
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))
    return act.to(OUT_DTYPE).to(tl.float32)


@jit
def _gated_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column tile): act(gate) * up of BLOCK columns of one [gate | up] row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = _activated_gate(gate, ACTIVATION, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated_and_mul_triton(x: torch.Tensor, activation: int) -> torch.Tensor:
    """x (num_tokens, 2 * inter) [gate | up] -> activation(gate) * up (num_tokens, inter), in one pass."""
    num_tokens, width = x.shape
    inter = width // 2
    assert x.stride(1) == 1
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    _gated_and_mul_kernel[(num_tokens, -(-inter // block))](x, out, x.stride(0), out.stride(0), inter,
                                                           ACTIVATION=activation, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_and_mul_triton(x, SILU)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


@jit
def _gated_and_mul_quantized_kernel(x_ptr, q_ptr, scale_ptr, row_scale_ptr, col_scale_ptr, stride_x, stride_q, inter,
                                    BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, SCALED: tl.constexpr,
                                    ACTIVATION: tl.constexpr):
    """One program per row: act(gate) * up (ACTIVATION: SILU or GELU_TANH) rounded to OUT_DTYPE (as
    _gated_and_mul_kernel stores it), its absolute maximum over the row, then the row quantized to E4M3
    (kernels/e4m3_rows.py).
    A row that fits one BLOCK is read once and kept in registers; a longer one is read twice (the
    second pass finds it in L2). SCALED: x is an unscaled FP8 product (kernels/fp8.py
    ScaledProduct); each value is first multiplied by its row's and column's scale and rounded to
    OUT_DTYPE, which is the product the row-wise path would have stored."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_scale = tl.load(row_scale_ptr + row) if SCALED else 1.0
    if BLOCK >= inter:
        y = _gated_mul_chunk(x_ptr + row * stride_x, cols, inter, OUT_DTYPE, row_scale, col_scale_ptr, SCALED,
                             ACTIVATION)
        scale = e4m3_row_scale(tl.max(tl.abs(y), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(y, scale), mask=cols < inter)
        return
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK):
        peak = tl.maximum(peak, tl.abs(_gated_mul_chunk(x_ptr + row * stride_x, k0 + cols, inter, OUT_DTYPE,
                                                        row_scale, col_scale_ptr, SCALED, ACTIVATION)))
    scale = e4m3_row_scale(tl.max(peak, 0))
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, inter, BLOCK):
        y = _gated_mul_chunk(x_ptr + row * stride_x, k0 + cols, inter, OUT_DTYPE, row_scale, col_scale_ptr, SCALED,
                             ACTIVATION)
        tl.store(q_ptr + row * stride_q + k0 + cols, to_e4m3(y, scale), mask=k0 + cols < inter)


@jit
def _gated_mul_chunk(row_ptr, cols, inter, OUT_DTYPE: tl.constexpr, row_scale, col_scale_ptr, SCALED: tl.constexpr,
                     ACTIVATION: tl.constexpr):
    """act(gate[cols]) * up[cols] of one [gate | up] row, rounded as _gated_and_mul_kernel rounds, in float32
    (SCALED: gate and up scaled first, see _gated_and_mul_quantized_kernel)."""
    mask = cols < inter
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        gate = (gate * row_scale * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)).to(OUT_DTYPE).to(tl.float32)
        up = (up * row_scale * tl.load(col_scale_ptr + inter + cols, mask=mask, other=0.0)).to(OUT_DTYPE).to(tl.float32)
    act = _activated_gate(gate, ACTIVATION, OUT_DTYPE)
    return (act * up).to(OUT_DTYPE).to(tl.float32)


def silu_and_mul_quantized_triton(x: torch.Tensor, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) quantized to E4M3 per row in the same kernel (the input of an FP8 down
    projection): (values (num_tokens, inter) float8_e4m3fn, scale (num_tokens,) float32), equal to
    kernels.fp8.quantize_rows(silu_and_mul(x)) exactly, without writing the activation itself.
    ``x_scales`` = (row_scale (num_tokens,), col_scale (2 * inter,)) float32: x is an unscaled FP8
    product whose value [i, j] stands for x[i, j] * row_scale[i] * col_scale[j] (kernels/fp8.py)."""
    return _gated_and_mul_quantized_triton(x, x_scales, SILU)


def gelu_tanh_and_mul_quantized_triton(x: torch.Tensor, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_quantized_triton for gelu_tanh(gate) * up (T5 v1.1's gated-GELU, Gemma's GeGLU): equal to
    kernels.fp8.quantize_rows(gelu_tanh_and_mul(x)) exactly."""
    return _gated_and_mul_quantized_triton(x, x_scales, GELU_TANH)


def _gated_and_mul_quantized_triton(x: torch.Tensor, x_scales, activation: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, width = x.shape
    inter = width // 2
    assert x.stride(1) == 1 and x.dtype in (torch.float16, torch.bfloat16)
    values = torch.empty(num_tokens, inter, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    # Rows up to 16,384 wide (Llama-8B's 14,336) in one tile of 16 warps: 32 gate and 32 up values a thread.
    block, num_warps = (triton.next_power_of_2(inter), 16) if inter <= SILU_ONE_PASS_MAX else (2048, 8)
    if num_tokens:
        row_scale, col_scale = x_scales if x_scales is not None else (scale, scale)
        assert x_scales is None or (row_scale.is_contiguous() and col_scale.is_contiguous()
                                    and col_scale.numel() == width and row_scale.numel() == num_tokens)
        _gated_and_mul_quantized_kernel[(num_tokens,)](
            x, values, scale, row_scale, col_scale, x.stride(0), values.stride(0), inter, BLOCK=block,
            OUT_DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, SCALED=x_scales is not None,
            ACTIVATION=activation, num_warps=num_warps)
    return values, scale


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, as transformers' Gemma MLP (gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated_and_mul_triton(x, GELU_TANH)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """One pass over the gate_up output on CUDA (the reference takes three)."""
    if use_triton(x):
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
