"""Fused residual-add + RMSNorm: the norm every Llama-family layer runs twice.

``rms_norm(x, weight, eps, residual)`` returns ``(out, new_residual)`` where
``new_residual = x + residual`` (or ``x`` when ``residual`` is None) and
``out = new_residual / rms(new_residual) * weight``. The statistics are taken in fp32 and
the normalized value is cast back to the input dtype before the weight multiply, as
Hugging Face's LlamaRMSNorm does, so fp32 results match it bit-for-bit in spirit (1e-6).

Shapes: x, residual, out, new_residual: (num_tokens, hidden); weight: (hidden,).

x may also be (num_tokens, parts, hidden): rows to sum first (in fp32, rounded once to x's dtype,
as ``x.sum(dim=1)`` does), such as the K weighted expert rows of a mixture-of-experts layer
(kernels/fused_moe.py ``sum_experts=False``): the norm after the layer sums them in its own pass, so
the sum costs no launch and no (num_tokens, hidden) round trip through memory of its own.

On CUDA one Triton program per row reads x (+ residual) once, writes the new residual and the
normalized row: one pass over the activations instead of the reference's five.

``qk_rms_norm`` is the per-head norm of q and k (Qwen3, Gemma 3: a (head_dim,) weight each) read
straight from the fused qkv output: one launch for both, where normalizing the q and k column views
took a copy of each first and a launch each (four kernels a layer at every step).
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.int8_rows import int8_row_scale, to_int8


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 3:
        x = x.sum(dim=1)
    if residual is not None:
        x = x + residual
    hidden = x.float() if shift is None else (x.float() + shift).to(x.dtype).float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype), x


@jit
def _rms_normalized(x, n, eps, AXIS: tl.constexpr):
    """x / rms(x) over AXIS (n elements; masked ones loaded as 0) in float32, rounded to x's dtype
    as the reference rounds before the weight multiplies it, and returned in float32."""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, AXIS, keep_dims=True) / n + eps)
    return (xf * inv_rms).to(x.dtype).to(tl.float32)


@jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, x_row_scale_ptr, x_col_scale_ptr,
    stride_x, stride_xp, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    QUANTIZE: tl.constexpr, SCALED_X: tl.constexpr, INT8: tl.constexpr = False, shift_ptr=None,
    SHIFT: tl.constexpr = False,
):
    """NUM_PARTS > 1: row ``row`` of x is the sum of NUM_PARTS rows stride_xp apart (module
    docstring). QUANTIZE: out is float8_e4m3fn and the normalized row, rounded to x's dtype, is
    quantized per row as kernels/fp8.py's quantize_rows does (kernels/e4m3_rows.py); with INT8, out is
    int8 codes as kernels/int8_sq.py's quantize_rows_int8 makes them (kernels/int8_rows.py). SCALED_X: x is
    an unscaled FP8 product (kernels/fp8.py ScaledProduct), scaled by its row's and columns' scales
    and rounded to x's dtype first (what the row-wise product would have stored)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    if NUM_PARTS > 1:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(NUM_PARTS):
            total += tl.load(x_ptr + row * stride_x + part * stride_xp + cols, mask=mask, other=0.0).to(tl.float32)
        x = total.to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED_X:
        # In kernels/fp8.py apply_scales' order, (x * row) * column, so the two agree bit for bit.
        x = (x.to(tl.float32) * tl.load(x_row_scale_ptr + row)
             * tl.load(x_col_scale_ptr + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        # Rounded to the activation dtype before the statistics, as the reference's ``x + residual``.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL or NUM_PARTS > 1 or SCALED_X:
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    if SHIFT:  # the row normalized is x + shift, rounded to x's dtype (x itself is the residual returned)
        x = (x.to(tl.float32) + tl.load(shift_ptr + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    normed = _rms_normalized(x, hidden, eps, 0)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        y = (weight * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
        if INT8:
            scale = int8_row_scale(tl.max(tl.abs(y), 0))
            tl.store(scale_ptr + row, scale)
            tl.store(out_ptr + row * stride_o + cols, to_int8(y, scale), mask=mask)
        else:
            scale = e4m3_row_scale(tl.max(tl.abs(y), 0))
            tl.store(scale_ptr + row, scale)
            tl.store(out_ptr + row * stride_o + cols, to_e4m3(y, scale), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm_ref``; rows must be contiguous in the hidden dimension."""
    out, _, residual_out = _launch_rms_norm(x, weight, eps, residual, quantize=False, shift=shift)
    return out, residual_out


def rms_norm_quantized_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    x_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` whose output row is quantized to E4M3 per row in the same pass (the input of an
    FP8 product): returns (out (num_tokens, hidden) float8_e4m3fn, scale (num_tokens,) float32,
    new_residual); out * scale equals kernels.fp8.quantize_rows of rms_norm's output exactly.
    ``x_scales`` = (row_scale (num_tokens,), col_scale (hidden,)) float32: x (2-D) is an unscaled FP8
    product standing for x[i, j] * row_scale[i] * col_scale[j] (kernels/fp8.py ScaledProduct)."""
    return _launch_rms_norm(x, weight, eps, residual, quantize=True, x_scales=x_scales)


def rms_norm_quantized_int8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` whose output row is quantized to int8 per row in the same pass (the input of a
    SmoothQuant W8A8 product, kernels/int8_sq.py): returns (codes (num_tokens, hidden) int8, scale
    (num_tokens,) float32, new_residual), equal to kernels.int8_sq.quantize_rows_int8 of rms_norm's output."""
    return _launch_rms_norm(x, weight, eps, residual, quantize=True, int8=True)


def _launch_rms_norm(x, weight, eps, residual, *, quantize: bool, x_scales=None, int8: bool = False, shift=None):
    num_tokens, hidden = x.shape[0], x.shape[-1]
    parts = x.shape[1] if x.dim() == 3 else 1  # (num_tokens, parts, hidden): rows summed first
    assert x.stride(-1) == 1 and (residual is None or residual.stride(1) == 1)
    out_dtype = (torch.int8 if int8 else torch.float8_e4m3fn) if quantize else x.dtype
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=x.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device) if quantize else out
    # x itself is the new residual only when nothing is added to it, summed into it or scaled.
    residual_out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device) \
        if residual is not None or parts > 1 or x_scales is not None else x
    if num_tokens == 0:
        return out, scale, residual_out
    block = triton.next_power_of_2(hidden)
    weight, = dense(weight)  # read at w_ptr + column
    row_scale, col_scale = x_scales if x_scales is not None else (weight, weight)
    assert x_scales is None or (parts == 1 and row_scale.is_contiguous() and col_scale.is_contiguous()
                                and row_scale.numel() == num_tokens and col_scale.numel() == hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, residual_out, scale, row_scale, col_scale,
        x.stride(0), x.stride(1) if parts > 1 else 0, residual.stride(0) if residual is not None else 0,
        out.stride(0), residual_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, NUM_PARTS=parts,
        BLOCK=block, QUANTIZE=quantize, SCALED_X=x_scales is not None, INT8=int8,
        **({"shift_ptr": shift, "SHIFT": True} if shift is not None else {}),
        num_warps=min(16, max(1, block // 512)), **pdl_options(x),
    )
    return out, scale, residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``shift`` (hidden,) float32: the row normalized is (x [+ residual]) + shift, rounded to x's dtype; the
    residual returned is without it (a vision tower whose products add into the stream without their biases keeps
    the biases' sum here: engine/vision/qwen2_5_vl.py)."""
    if shift is not None:
        assert shift.dtype == torch.float32 and shift.shape == (x.shape[-1],) and shift.is_contiguous()
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, shift)
    return rms_norm_ref(x, weight, eps, residual, shift)


# ----------------------------------------------------------------------------------------------
# Per-head q/k norms (Qwen3, Gemma 3) straight from the fused qkv output
# ----------------------------------------------------------------------------------------------


def qk_rms_norm_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), rows [q | k | v] -> q (num_tokens,
    num_heads, head_dim) and k (num_tokens, num_kv_heads, head_dim), each head RMS-normalized over
    head_dim and scaled by its weight (head_dim,), as rms_norm_ref does a row."""
    tokens, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = rms_norm_ref(qkv[:, :q_size].reshape(-1, head_dim), q_weight, eps)[0]
    k = rms_norm_ref(qkv[:, q_size:q_size + kv_size].reshape(-1, head_dim), k_weight, eps)[0]
    return q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)


@jit
def _qk_rms_norm_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, out_ptr, stride_qkv, stride_out, eps,
                        NUM_HEADS: tl.constexpr, NUM_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        ROWS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, PDL: tl.constexpr):
    """One program per token: its NUM_ROWS = q heads + k heads (adjacent in the qkv row) as a
    (ROWS_PAD, DIM_PAD) tile, each row normalized with the q or the k weight."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, ROWS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (rows < NUM_ROWS)[:, None] & (dims < HEAD_DIM)[None, :]
    offsets = rows[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(qkv_ptr + token * stride_qkv + offsets, mask=mask, other=0.0)
    normed = _rms_normalized(x, HEAD_DIM, eps, 1)
    is_q = (rows < NUM_HEADS)[:, None]
    q_w = tl.load(q_weight_ptr + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
    k_w = tl.load(k_weight_ptr + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
    weight = tl.where(is_q, q_w[None, :], k_w[None, :])
    tl.store(out_ptr + token * stride_out + offsets, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def qk_rms_norm_triton(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_rms_norm_ref`` in one launch, reading the q and k columns of qkv in place (no copies of
    the column views first): q and k come back as views of one (num_tokens, heads + kv_heads,
    head_dim) buffer, last dim contiguous."""
    assert qkv.stride(1) == 1 and q_weight.is_contiguous() and k_weight.is_contiguous()
    tokens, num_rows = qkv.shape[0], num_heads + num_kv_heads
    out = torch.empty(tokens, num_rows, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        rows_pad, dim_pad = triton.next_power_of_2(num_rows), triton.next_power_of_2(head_dim)
        _qk_rms_norm_kernel[(tokens,)](
            qkv, q_weight, k_weight, out, qkv.stride(0), out.stride(0), eps,
            NUM_HEADS=num_heads, NUM_ROWS=num_rows, HEAD_DIM=head_dim, ROWS_PAD=rows_pad, DIM_PAD=dim_pad,
            num_warps=min(8, max(1, rows_pad * dim_pad // 1024)), **pdl_options(qkv),
        )
    return out[:, :num_heads], out[:, num_heads:]


def qk_rms_norm(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(qkv):
        return qk_rms_norm_triton(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps)
    return qk_rms_norm_ref(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps)
