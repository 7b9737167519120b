"""SmoothQuant W8A8 INT8 linear layers: int8 weights per output channel, int8 activations per token.

Scheme (what ``--quantization int8_sq`` holds and runs; the smoothing itself is a float-to-float
transform of the model before quantization, engine/weight_only/smoothquant.py):

- weight (N, K) int8 with ``weight_scale`` (N,) float32: row n of the real weight is
  ``weight[n] * weight_scale[n]``, ``weight_scale[n] = max|W[n]| / 127`` (symmetric, code -128 unused);
- activations x (M, K) quantized per token at run time the same way: scale (M,) = max|x[m]| / 127,
  codes round(x / scale) (round half away from zero, the same in the kernel and the reference);
- y = (x_q @ w_q.T) * s_x[:, None] * s_w[None, :] (+ bias): the integer product is exact (int32
  accumulation), the scales are applied once in float32, the result rounded once to x's dtype.

Paths: on CUDA, ``quantize_rows_int8_triton`` (one program per row) and ``torch._int_mm`` (cuBLASLt
int8 tensor cores, int32 accumulation; rows padded to at least 17, the smallest it takes); elsewhere
``int8_linear_ref`` in plain torch, also the oracle of the tests. Both compute the same integers,
so they differ only where float32 rounds the scaling differently (none observed; the tests allow
one output rounding).
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton

INT8_MAX = 127.0
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values quantize to 0 anyway)
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (codes (R, C) int8, scale (R,) float32), x ~= codes * scale[:, None] (plain torch)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / INT8_MAX).clamp_(min=MIN_SCALE)
    codes = _round_half_away(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_weight_int8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight (N, K) -> (int8 codes (N, K), per-output-channel scale (N,) float32). ``scale``
    (N,): these row scales instead of max|row| / 127, for a weight that was int8 codes x them already
    (a W8A8 checkpoint, dequantized for conversion): its codes come back exactly."""
    if scale is None:
        return quantize_rows_int8(weight)
    scale = scale.float()
    codes = _round_half_away(weight.float() / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


@jit
def _quantize_rows_int8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
    """One program per row: its absolute maximum, then every value / (max / 127) rounded half away
    from zero (``quantize_rows_int8``'s arithmetic: float32 division, then floor(|v| + 0.5))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    pdl_prologue(PDL)
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, 0) / 127.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale + tl.zeros([BLOCK], dtype=tl.float32))  # IEEE division, as torch
        r = tl.where(v < 0, -tl.floor(-v + 0.5), tl.floor(v + 0.5))
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + k0 + cols, r.to(tl.int8), mask=k0 + cols < K)


def quantize_rows_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_int8`` in one launch (x (R, C) with unit column stride)."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    codes = torch.empty(rows, cols, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), 4096)
        _quantize_rows_int8_kernel[(rows,)](x, codes, scale, cols, x.stride(0), codes.stride(0), BLOCK=block,
                                            num_warps=min(16, max(4, block // 512)), **pdl_options(x))
    return codes, scale


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 INT8 scheme in plain torch: x (..., K) quantized per token, the integer product in
    float64 (exact: |sum| < 127^2 K < 2^53), scaled in float32, rounded once to x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_rows_int8(rows)
    exact = (codes.double() @ weight.double().T).float()
    out = exact * scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) in the model dtype @ the int8 weight (N, K) with per-channel scales (+ bias) ->
    (..., N) in x's dtype: the Triton row quantizer and ``torch._int_mm`` on CUDA, the reference
    elsewhere (and where cuBLASLt's int8 shape rules, K and N multiples of 8, do not hold)."""
    n, k = weight.shape
    if not use_triton(x) or k % 8 or n % 8:
        return int8_linear_ref(x, weight, weight_scale, bias)
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    codes, scale = quantize_rows_int8_triton(rows)
    m = codes.shape[0]
    if m < INT_MM_MIN_ROWS:
        codes = torch.cat([codes, codes.new_zeros(INT_MM_MIN_ROWS - m, k)])
    exact = torch._int_mm(codes, weight.t())[:m]
    out = exact.float() * scale[:, None] * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
