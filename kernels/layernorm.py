"""LayerNorm (with or without a bias) with the residual adds of the layer before it, in one pass.

The LayerNorm families (BLOOM, Falcon, GPT-NeoX, GPT-J, OPT, StarCoder2, MPT) add up to two
sub-block outputs to the residual stream before the next norm: ``x + attn`` (sequential),
``x + attn + mlp`` (parallel residual). Unfused, a batch-1 decode layer ran two adds and one or two
norms as separate kernels, each a launch on the step's critical path and a round trip of the row.

``layer_norm(x, weight, bias, eps, adds=(), second=None)`` returns ``(out, stream, out2)``:

- ``stream = x + adds[0] + adds[1]``, each add rounded to x's dtype in that order (as the
  reference's ``x + attn + mlp`` is), or ``x`` itself when there is nothing to add;
- ``out = layer_norm(stream) * weight + bias`` (``bias`` None: none), the statistics in float32
  (mean, then the mean of squared deviations) and the result rounded once, as torch's
  F.layer_norm does for half-precision inputs;
- ``out2``: the same row through a second (weight, bias) when ``second`` is given, else None
  (GPT-NeoX's and Falcon-40B's two norms of one stream, parallel_two_norms), with no second read.

Shapes: x and each add (num_tokens, hidden), rows contiguous; weight, bias (hidden,); outputs
(num_tokens, hidden) in x's dtype. On CUDA one Triton program per row; elsewhere the reference.

``layer_norm_quantized_triton``: ``out`` (one norm) quantized per row to E4M3 in the same pass, for a norm
whose output only FP8 products read (kernels/fp8.py ``layer_norm_quantized``: an FP8 Whisper decoder step),
the values kernels.fp8.quantize_rows gives on ``out`` (kernels/e4m3_rows.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3

Affine = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias or None), each (hidden,)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   adds: tuple[torch.Tensor, ...] = (), second: Affine | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    stream = x
    for term in adds:
        stream = stream + term
    width = (stream.shape[-1],)
    out2 = F.layer_norm(stream, width, second[0], second[1], eps) if second is not None else None
    return F.layer_norm(stream, width, weight, bias, eps), stream, out2


@jit
def _layer_norm_kernel(
    x_ptr, add0_ptr, add1_ptr, w_ptr, b_ptr, w2_ptr, b2_ptr, out_ptr, out2_ptr, stream_ptr, scale_ptr,
    stride_x, stride_a0, stride_a1, stride_o, stride_o2, stride_s, hidden, eps,
    NUM_ADDS: tl.constexpr, HAS_BIAS: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
):
    """One program per row: the adds (each rounded to x's dtype), the stream stored when anything
    was added, then one or two affine LayerNorms of it (float32 statistics, one rounding each).
    QUANTIZE (one norm): out is float8_e4m3fn, the normed row rounded to x's dtype then quantized
    per row (its scale at scale_ptr + row)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if NUM_ADDS >= 1:
        x = (x.to(tl.float32) + tl.load(add0_ptr + row * stride_a0 + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
    if NUM_ADDS >= 2:
        x = (x.to(tl.float32) + tl.load(add1_ptr + row * stride_a1 + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
    if NUM_ADDS >= 1:
        tl.store(stream_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / hidden
    centered = tl.where(mask, xf - mean, 0.0)
    normed = centered * tl.rsqrt(tl.sum(centered * centered, 0) / hidden + eps)
    y = normed * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = e4m3_row_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, to_e4m3(y, scale), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    if SECOND:
        y2 = normed * tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y2 += tl.load(b2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out2_ptr + row * stride_o2 + cols, y2.to(out2_ptr.dtype.element_ty), mask=mask)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                      adds: tuple[torch.Tensor, ...] = (), second: Affine | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as ``layer_norm_ref`` (module docstring), in one launch. With ``second`` both
    norms have a bias or neither has."""
    num_tokens, hidden = x.shape
    assert len(adds) <= 2 and x.stride(1) == 1 and all(t.stride(1) == 1 and t.shape == x.shape for t in adds)
    assert second is None or (second[1] is None) == (bias is None)
    out = torch.empty_like(x)
    out2 = torch.empty_like(x) if second is not None else None
    stream, add0, add1 = _stream_and_adds(x, adds)
    if num_tokens == 0:
        return out, stream, out2
    block = triton.next_power_of_2(hidden)
    w2, b2 = second if second is not None else (weight, bias)
    weight, bias, w2, b2 = dense(weight, bias, w2, b2)  # read at ptr + column
    _layer_norm_kernel[(num_tokens,)](
        x, add0, add1, weight, bias if bias is not None else weight, w2, b2 if b2 is not None else weight,
        out, out2 if out2 is not None else out, stream, out,
        x.stride(0), add0.stride(0), add1.stride(0), out.stride(0), out.stride(0), stream.stride(0), hidden, eps,
        NUM_ADDS=len(adds), HAS_BIAS=bias is not None, SECOND=second is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **pdl_options(x),
    )
    return out, stream, out2


def _stream_and_adds(x: torch.Tensor, adds: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The kernel's residual-stream output (x itself when nothing is added) and its two add operands (unread
    ones alias the last given, or x)."""
    add0 = adds[0] if adds else x
    return (torch.empty_like(x) if adds else x), add0, (adds[1] if len(adds) > 1 else add0)


def layer_norm_quantized_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                adds: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_norm_triton`` (one norm) with its output quantized per row to E4M3 in the same launch:
    (values (num_tokens, hidden) float8_e4m3fn, scale (num_tokens,) float32, stream); values * scale is
    kernels.fp8.quantize_rows of layer_norm_triton's ``out`` exactly."""
    num_tokens, hidden = x.shape
    assert len(adds) <= 2 and x.stride(1) == 1 and all(t.stride(1) == 1 and t.shape == x.shape for t in adds)
    values = torch.empty(num_tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    stream, add0, add1 = _stream_and_adds(x, adds)
    if num_tokens == 0:
        return values, scale, stream
    block = triton.next_power_of_2(hidden)
    weight, bias = dense(weight, bias)
    _layer_norm_kernel[(num_tokens,)](
        x, add0, add1, weight, bias if bias is not None else weight, weight, weight, values, values, stream, scale,
        x.stride(0), add0.stride(0), add1.stride(0), values.stride(0), values.stride(0), stream.stride(0), hidden, eps,
        NUM_ADDS=len(adds), HAS_BIAS=bias is not None, SECOND=False, BLOCK=block, QUANTIZE=True,
        num_warps=min(16, max(1, block // 512)), **pdl_options(x),
    )
    return values, scale, stream


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               adds: tuple[torch.Tensor, ...] = (), second: Affine | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps, adds, second)
    return layer_norm_ref(x, weight, bias, eps, adds, second)
