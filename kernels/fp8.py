"""FP8 (E4M3) linear layers: weights per output channel, activations per token.

Scheme (what an engine built with ``--quantization fp8`` holds and runs):

- weight (N, K) float8_e4m3fn with ``weight_scale`` (N,) float32: row n of the real weight is
  ``weight[n].float() * weight_scale[n]``, where ``weight_scale[n] = max|W[n]| / 448`` (448 is
  E4M3's largest finite value), so every row uses the format's whole range;
- activations x (M, K) quantized per token at run time the same way (scale (M, 1) float32);
- y = (x_q * s_x) @ (w_q * s_w).T, accumulated in float32, returned in x's dtype.

E4M3 keeps 3 mantissa bits: a value's relative rounding error is at most 2^-4 (half a unit in
the last place), 6.25%, for values within the normal range (>= 2^-6 of the scale's 448).

Paths, chosen per call; on CUDA every one is W8A8, so a sequence is rounded the same way whatever
the size of its batch (the kernels differ only in their order of accumulation; the reference below
is the same scheme):
- CUDA, at most ``MAX_SKINNY_ROWS`` rows (decode): the skinny Triton kernel streams the FP8
  weight (half the bytes of bf16) into FP8 tensor-core dots with the quantized activations and
  applies both scales in its epilogue. Until 2026-11-25 these rows stayed in bf16 (W8A16) and the
  weight tiles were widened to bf16 for the dot. On an H100 the widening cost more than quantizing
  the rows: the decode products went from 31.3 to 25.6 us on average, and Llama-8B's batch-1
  decode from 210 to 243 tok/s. The norms and the SiLU quantize their output in the kernel that
  makes it; o_proj's input and the gated product's output take a quantize kernel of ~3.4 us each;
- CUDA, 17-128 rows where the engine's load chose it for the weight (kernels/wide_rows.py: tree
  verify steps): the same skinny kernel with the rows padded to 32, 64 or 128 in the dot;
- CUDA, more rows: ``torch._scaled_mm`` (cuBLASLt FP8 tensor cores) with per-token activation
  scales and per-channel weight scales (W8A8), with Hopper's fast FP8 accumulation (the tensor
  cores' own accumulator, not promoted to float32 after every K block): 8-20% faster on Llama-8B's
  shapes on an H100 (2026-11-25). It doubles the product's error against the exact product of the
  E4M3 values (relative RMS 3.3e-3 against 1.7e-3 at K = 14336), an order of magnitude below what
  rounding the inputs to E4M3 costs (~4%). ``TRITONLLM_FP8_FAST_ACCUM=0`` asks for the promoted accumulation;
- elsewhere: ``fp8_linear_ref``, the plain-torch reference of the W8A8 scheme (quantize x per
  token, dequantize both, matmul in float32), also the oracle of the kernel tests.

Deferred scales (``ScaledProduct``): cuBLASLt's kernels for row-wise scales are chosen apart from
its tensor-wise ones, and at some decode batch sizes they are much slower (H100, Llama-8B's shapes,
fast accumulation, 544 rows: o_proj 28.5 us against 17.7 tensor-wise, down_proj 78.8 against 46.4,
gate_up 123.6 against 112.1; at 512 or 1,024 rows the two are within a few percent). Where a caller
allows it (``defer_scales``) and a timing at engine load chose it for that row count
(``choose_fp8_scaling``), the product runs tensor-wise with unit scales and returns its unscaled
values with the two scale vectors; the kernel that reads the product next applies them (the
SiLU-and-quantize of the gated MLP, the residual-add RMSNorm after o_proj and down_proj). The
values are those of the row-wise path but for one more bf16 rounding (of the unscaled product).
bf16 models only: an unscaled product of E4M3 values overflows fp16 (448^2 * K).

Where the W8A8 path will run (``quantizes_activations``: on CUDA), the kernel that makes a product's input
may quantize it on the way out and hand over ``QuantizedRows`` instead: ``rms_norm_quantized``
(the norms before qkv and gate_up; ``layer_norm_quantized`` for LayerNorm stacks) and
``silu_and_mul_quantized`` / ``gelu_tanh_and_mul_quantized`` (the activation before down_proj). That
skips writing and re-reading the activations in the model dtype; the values are the same as
quantizing the unfused output.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kernels import choice_cache
from kernels._triton import HAVE_TRITON, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.activation import (gelu_tanh_and_mul, gelu_tanh_and_mul_quantized_triton, silu_and_mul,
                                silu_and_mul_quantized_triton)
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.int8_rows import int8_row_scale, to_int8
from kernels.layernorm import layer_norm_quantized_triton, layer_norm_ref
from kernels.linear import (MAX_SKINNY_ROWS, SKINNY_VARIANTS, activation_ref, graph_time_ms, skinny_linear_triton,
                            variant_options, wide_variant)
from kernels.rmsnorm import rms_norm_quantized_triton, rms_norm_ref

FP8_DTYPE = torch.float8_e4m3fn
FAST_ACCUM = os.environ.get("TRITONLLM_FP8_FAST_ACCUM", "1") != "0"  # see the module docstring
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values quantize to 0 anyway)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (x_q (R, C) float8_e4m3fn, scale (R,) float32) with x ~= x_q.float() * scale[:, None]."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    x_q = (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, scale


@jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr,
                          INT8: tl.constexpr):
    """One program per row: its absolute maximum, then every value divided by max / 448 into E4M3 (the same
    arithmetic as ``quantize_rows``: float32 division, clamp, round to nearest), or with INT8 by max / 127 into
    int8 codes rounded half away from zero (kernels/int8_rows.py: ``quantize_rows_int8``'s arithmetic). A row
    that fits one BLOCK is read once and kept in registers; a longer one is read twice."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    pdl_prologue(PDL)
    if BLOCK >= K:
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(x), 0), INT8)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + cols, _row_codes(x, scale, INT8), mask=cols < K)
        return
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = _row_scale(tl.max(peak, 0), INT8)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + cols, _row_codes(x, scale, INT8), mask=k0 + cols < K)


@jit
def _row_scale(peak, INT8: tl.constexpr):
    if INT8:
        scale = int8_row_scale(peak)
    else:
        scale = e4m3_row_scale(peak)
    return scale


@jit
def _row_codes(x, scale, INT8: tl.constexpr):
    if INT8:
        codes = to_int8(x, scale)
    else:
        codes = to_e4m3(x, scale)
    return codes


QUANTIZE_ONE_PASS_MAX = 16384  # widest row kept in registers: 32 values a thread at 16 warps


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in one kernel launch (x (R, C) with unit column stride). Rows up to
    QUANTIZE_ONE_PASS_MAX wide are read once: for one row of Llama-8B's 14,336 that is one round
    trip to memory instead of fourteen (two passes of 2,048-wide tiles), the whole cost of a
    kernel this small."""
    return launch_row_quantizer(x, FP8_DTYPE, two_pass_block=2048)


def launch_row_quantizer(x: torch.Tensor, code_dtype: torch.dtype, *, two_pass_block: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C), unit column stride -> (codes (R, C) of ``code_dtype``: E4M3, or int8 for kernels/int8_sq.py,
    scale (R,) float32) in one launch of _quantize_rows_kernel; rows wider than QUANTIZE_ONE_PASS_MAX in two
    passes of ``two_pass_block``-wide tiles."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and code_dtype in (FP8_DTYPE, torch.int8)
    codes = torch.empty(rows, cols, dtype=code_dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols) if cols <= QUANTIZE_ONE_PASS_MAX else two_pass_block
        _quantize_rows_kernel[(rows,)](x, codes, scale, cols, x.stride(0), codes.stride(0), BLOCK=block,
                                       INT8=code_dtype == torch.int8, num_warps=min(16, max(4, block // 512)),
                                       **pdl_options(x))
    return codes, scale


class QuantizedRows(NamedTuple):
    """Activations already quantized per token: values ~= rows of the model-dtype activations / scale."""

    values: torch.Tensor  # (M, K) float8_e4m3fn
    scale: torch.Tensor  # (M,) float32
    dtype: torch.dtype  # the activations' dtype, which the product returns


class ScaledProduct(NamedTuple):
    """An FP8 product whose scales are not applied yet (module docstring, "Deferred scales"): the
    product is ``values * row_scale[:, None] * col_scale[None, :]``, rounded to values.dtype."""

    values: torch.Tensor  # (M, N) bf16: the unscaled product of the E4M3 operands
    row_scale: torch.Tensor  # (M,) float32: the activations' per-token scales
    col_scale: torch.Tensor  # (N,) float32: the weight's per-channel scales


def apply_scales(x: torch.Tensor | ScaledProduct) -> torch.Tensor:
    """The product itself (x when it is a tensor already): for readers that take no ScaledProduct."""
    if not isinstance(x, ScaledProduct):
        return x
    return (x.values.float() * x.row_scale[:, None] * x.col_scale[None, :]).to(x.values.dtype)


def quantizes_activations(device: torch.device) -> bool:
    """Whether fp8_linear quantizes activations on ``device`` itself (W8A8 on the skinny kernel or
    cuBLASLt: CUDA with Triton, at every batch size), so that the kernel making its input may hand
    it QuantizedRows instead."""
    return HAVE_TRITON and device.type == "cuda"


def as_quantized_rows(x: torch.Tensor | QuantizedRows) -> QuantizedRows:
    """x quantized per row (itself when it already is): one Triton kernel for CUDA rows with unit
    column stride, else the reference (the two agree bit for bit)."""
    if isinstance(x, QuantizedRows):
        return x
    x_q, x_scale = quantize_rows_triton(x) if use_triton(x) and x.stride(1) == 1 else quantize_rows(x)
    return QuantizedRows(x_q, x_scale, x.dtype)


def rms_norm_quantized(x: torch.Tensor | ScaledProduct, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """kernels.rmsnorm.rms_norm with its output quantized per row: (QuantizedRows, new_residual).
    A ScaledProduct x has its scales applied in the same kernel."""
    scales = None
    if isinstance(x, ScaledProduct):
        x, scales = x.values, (x.row_scale, x.col_scale)
    if use_triton(x):
        values, scale, residual = rms_norm_quantized_triton(x, weight, eps, residual, x_scales=scales)
        return QuantizedRows(values, scale, x.dtype), residual
    if scales is not None:
        x = apply_scales(ScaledProduct(x, *scales))
    out, residual = rms_norm_ref(x, weight, eps, residual)
    return as_quantized_rows(out), residual


def layer_norm_quantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                         residual: torch.Tensor | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """kernels.layernorm.layer_norm of x + residual with its output quantized per row: (QuantizedRows,
    x + residual (x itself when residual is None)). CUDA: one kernel; elsewhere the reference then
    as_quantized_rows (the values quantize_rows gives on the plain output either way)."""
    adds = () if residual is None else (residual,)
    if use_triton(x):
        values, scale, stream = layer_norm_quantized_triton(x, weight, bias, eps, adds)
        return QuantizedRows(values, scale, x.dtype), stream
    out, stream, _ = layer_norm_ref(x, weight, bias, eps, adds)
    return as_quantized_rows(out), stream


def silu_and_mul_quantized(x: torch.Tensor | ScaledProduct) -> QuantizedRows:
    """kernels.activation.silu_and_mul with its output quantized per row; a ScaledProduct x has its
    scales applied in the same kernel."""
    return _gated_quantized(x, silu_and_mul_quantized_triton, silu_and_mul)


def gelu_tanh_and_mul_quantized(x: torch.Tensor | ScaledProduct) -> QuantizedRows:
    """kernels.activation.gelu_tanh_and_mul with its output quantized per row in the same kernel (T5 v1.1's
    gated-GELU before an FP8 down projection): the values quantize_rows gives on the unfused output. A
    ScaledProduct x has its scales applied in the same kernel."""
    return _gated_quantized(x, gelu_tanh_and_mul_quantized_triton, gelu_tanh_and_mul)


def _gated_quantized(x: torch.Tensor | ScaledProduct, fused, unfused) -> QuantizedRows:
    """A gated activation quantized per row: ``fused`` (its Triton kernel, the product's scales applied inside)
    on CUDA, else ``unfused`` then the row quantizer (the scales applied first)."""
    scales = None
    if isinstance(x, ScaledProduct):
        x, scales = x.values, (x.row_scale, x.col_scale)
    # The kernel reads 16-bit rows; a float32 model (T5 checkpoints ship float32) takes the unfused path.
    if use_triton(x) and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1:
        return QuantizedRows(*fused(x, x_scales=scales), x.dtype)
    if scales is not None:
        x = apply_scales(ScaledProduct(x, *scales))
    return as_quantized_rows(unfused(x))


def dequantize_rows(x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x_q.float() * scale.float()[:, None]).to(dtype)


def quantize_weight(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight (N, K) -> (float8 weight (N, K), per-output-channel scale (N,) float32).

    ``scale`` (N,): use these row scales instead of max|row| / 448, for a weight that was E4M3 with
    them already (an FP8 checkpoint, dequantized for conversion): its values come back exactly, since
    a float32 or bfloat16 rounding of value x scale is far inside half an E4M3 step (2^-4).
    """
    if scale is None:
        return quantize_rows(weight)
    scale = scale.float()
    return (weight.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_ref(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The W8A8 scheme in plain torch: x (M, K) quantized per token, then everything in float32."""
    if isinstance(x, QuantizedRows):
        return _dequantized_product(x, weight, weight_scale, bias, out_dtype)
    rows = QuantizedRows(*quantize_rows(x.reshape(-1, x.shape[-1])), x.dtype)
    return _dequantized_product(rows, weight, weight_scale, bias, out_dtype).reshape(*x.shape[:-1], weight.shape[0])


def _dequantized_product(x: QuantizedRows, weight, weight_scale, bias, out_dtype=None) -> torch.Tensor:
    out = dequantize_rows(x.values, x.scale) @ dequantize_rows(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def fp8_linear_scaled_mm(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The W8A8 scheme on cuBLASLt's FP8 tensor cores (``torch._scaled_mm``, row-wise scales)."""
    x = as_quantized_rows(x)
    out = torch._scaled_mm(x.values, weight.t(), scale_a=x.scale[:, None], scale_b=weight_scale[None, :],
                           out_dtype=out_dtype or x.dtype, use_fast_accum=FAST_ACCUM)
    return out if bias is None else out + bias


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, defer_scales: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor | ScaledProduct:
    """x (M, K) @ dequantized weight (N, K).T (+ bias), by the paths in the module docstring.
    QuantizedRows (from rms_norm_quantized / silu_and_mul_quantized) are multiplied as they are.
    ``defer_scales``: the caller's next kernel takes a ScaledProduct; one comes back where
    ``choose_fp8_scaling`` found the tensor-wise product faster for this row count.
    ``out_dtype``: the result's (default x's), e.g. float32 for logits: the accumulators as they are."""
    wide = _wide_variant(x, weight)
    if wide is not None:
        return _skinny_w8a8(as_quantized_rows(x), weight, weight_scale, bias, variant=wide, out_dtype=out_dtype)
    if defer_scales and bias is None and out_dtype is None and _defers_scales(x, weight):
        x = as_quantized_rows(x)
        unit = _UNIT_SCALES[x.values.device]
        values = torch._scaled_mm(x.values, weight.t(), scale_a=unit, scale_b=unit, out_dtype=x.dtype,
                                  use_fast_accum=FAST_ACCUM)
        return ScaledProduct(values, x.scale, weight_scale)
    if _takes_skinny_kernel(x):
        return _skinny_w8a8(as_quantized_rows(x), weight, weight_scale, bias, out_dtype=out_dtype)
    if (x.values if isinstance(x, QuantizedRows) else x).is_cuda:
        return fp8_linear_scaled_mm(x, weight, weight_scale, bias, out_dtype)
    return fp8_linear_ref(x, weight, weight_scale, bias, out_dtype)


def _takes_skinny_kernel(x: torch.Tensor | QuantizedRows) -> bool:
    """Decode-size rows on CUDA with unit column stride: the skinny W8A8 kernel's inputs."""
    values = x.values if isinstance(x, QuantizedRows) else x
    return values.shape[0] <= MAX_SKINNY_ROWS and values.stride(1) == 1 and use_triton(values)


def _wide_variant(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> tuple | None:
    """linear.wide_variant of x's rows: the tiling kernels/wide_rows.py chose at load for 17-128 rows."""
    return wide_variant(x.values if isinstance(x, QuantizedRows) else x, weight)


def _skinny_w8a8(x: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 *, gated: bool = False, variant: tuple | None = None, out_dtype: torch.dtype | None = None,
                 activation: str | None = None) -> torch.Tensor:
    variant = variant or getattr(weight, "_fp8_skinny_variant", FP8_SKINNY_DEFAULT)
    return skinny_linear_triton(x.values, weight, bias, weight_scale=weight_scale, x_scale=x.scale,
                                out_dtype=out_dtype or x.dtype,
                                gated=gated, activation=activation, **variant_options(variant))


def fp8_linear_activated(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(fp8_linear(x, weight, weight_scale, bias)), act one of kernels.linear.ACTIVATIONS (a non-gated MLP's
    up product: Whisper's fc1, T5 v1.0's wi): where the skinny kernel takes the rows (decode rows, or 17-128
    with a wide-row tiling chosen at load) the bias and the activation in its epilogue, one kernel instead of
    two; elsewhere the product then kernels.linear.activation_ref. The same rounding either way (the product
    rounded to the output dtype, the activation in float32 of it, rounded again)."""
    wide = _wide_variant(x, weight)
    if wide is not None or _takes_skinny_kernel(x):
        return _skinny_w8a8(as_quantized_rows(x), weight, weight_scale, bias, variant=wide, activation=activation)
    return activation_ref(fp8_linear(x, weight, weight_scale, bias), activation)


def fp8_gated_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                     *, quantize_output: bool = False) -> torch.Tensor | QuantizedRows:
    """silu(x @ gate.T) * (x @ up.T) for an FP8 gate_up weight (2 * inter, hidden) = [gate | up].
    ``quantize_output``: the result feeds an FP8 product, so return it as QuantizedRows where that
    product will take the W8A8 path."""
    wide = _wide_variant(x, weight)
    if wide is not None or _takes_skinny_kernel(x):
        # One skinny kernel for both products and the SiLU; its output is quantized apart when the
        # down projection wants it (a row's scale needs the whole row, which no one program sees).
        out = _skinny_w8a8(as_quantized_rows(x), weight, weight_scale, gated=True, variant=wide)
        return as_quantized_rows(out) if quantize_output else out
    product = fp8_linear(x, weight, weight_scale, defer_scales=quantize_output)
    # A ScaledProduct comes back only for quantize_output, and only the quantizing SiLU takes one.
    if isinstance(product, ScaledProduct) or (quantize_output and quantizes_activations(product.device)):
        return silu_and_mul_quantized(product)
    return silu_and_mul(product)


# (block_n, block_k, num_warps, num_stages[, split_k[, swap_ab]]) of the skinny kernel for FP8
# weights until a weight is timed at load (``choose_fp8_skinny_variants``): FP8 rows are half as
# many bytes, so longer K tiles.
FP8_SKINNY_DEFAULT = (16, 512, 4, 4)
# Tried at load beside the bf16 tilings: an FP8 tile carries half the bytes of a bf16 one, so
# longer K tiles, more warps and deeper pipelines keep as many bytes in flight. The swapped-operand
# tilings (64 weight rows as one warpgroup MMA's first operand) were the fastest for Llama-8B's
# qkv_proj and gated gate_up_proj at one row on an H100 (2026-11-25, a probe: 10.7 and 41.8 us
# against 11.7 and 45.5 for the best unswapped tilings).
FP8_EXTRA_VARIANTS = ((16, 1024, 4, 4), (32, 512, 4, 4), (16, 1024, 8, 3), (32, 1024, 8, 3), (64, 512, 8, 4),
                      (16, 2048, 8, 2), (32, 256, 4, 8), (16, 512, 8, 6),
                      (16, 512, 4, 4, 2), (32, 512, 4, 4, 2), (16, 512, 4, 4, 4), (32, 256, 4, 8, 4),
                      (16, 1024, 4, 4, 2), (64, 512, 8, 4, 2),
                      (64, 256, 4, 5, 1, 1), (64, 256, 4, 3, 1, 1), (64, 256, 4, 5, 2, 1), (64, 256, 4, 5, 4, 1),
                      (32, 512, 4, 4, 1, 1), (64, 512, 4, 3, 2, 1), (128, 256, 8, 3, 2, 1))


@torch.inference_mode()
def choose_fp8_skinny_variants(weights: list[torch.Tensor], gated: list[torch.Tensor] = (),
                               rows: tuple[int, ...] = (1, 8)) -> dict[tuple, tuple]:
    """Per distinct FP8 weight shape, the skinny tiling with the least device time summed over
    ``rows`` (from CUDA graphs, W8A8 on rows quantized per row), set on each weight as
    ``_fp8_skinny_variant``. ``gated`` weights ([gate | up], only ever run fused with the SiLU) are
    timed that way, under the key ("gated", N, K). CUDA only."""
    return choose_skinny_tilings("fp8_skinny", weights, gated, rows, attr="_fp8_skinny_variant",
                                 candidates=SKINNY_VARIANTS + FP8_EXTRA_VARIANTS, sources=_fp8_sources(),
                                 fastest=_fastest_fp8_variant)


def choose_skinny_tilings(family: str, weights: list[torch.Tensor], gated: list[torch.Tensor], rows: tuple[int, ...],
                          *, attr: str, candidates: tuple, sources: tuple[str, ...], fastest) -> dict[tuple, tuple]:
    """The load-time tiling choice of a quantized skinny product (FP8 here, int8 in kernels/int8_sq.py): per
    distinct weight shape (gated [gate | up] weights under ("gated", N, K)), ``fastest(weight, gated, rows)``'s
    tiling of ``candidates``, through the persistent choice cache (``family``; ``sources``: the files of the
    kernels it times), set on each weight as attribute ``attr``. Returns {key: tiling}."""
    chosen: dict[tuple, tuple] = {}
    for weight, is_gated in [(w, False) for w in weights] + [(w, True) for w in gated]:
        key = (("gated",) if is_gated else ()) + tuple(weight.shape)
        if key not in chosen:
            chosen[key], _ = choice_cache.choice(
                family, (key, tuple(rows)), weight.device, lambda: fastest(weight, is_gated, rows),
                sources=sources, candidates=candidates, valid=lambda variant: variant in candidates)
        setattr(weight, attr, chosen[key])
    return chosen


def fastest_tiling(weight: torch.Tensor, rows: tuple[int, ...], candidates: tuple, inputs, product) -> tuple:
    """The tiling of ``candidates`` with the least device time summed over ``rows``: for each row count m,
    ``product(inputs(m), weight_copy, tiling)`` timed from CUDA graphs over copies of ``weight`` that
    defeat the L2 cache (l2_defeating_copies), used in turn."""
    copies = l2_defeating_copies(weight)
    turn = iter(range(1 << 40))
    times = dict.fromkeys(candidates, 0.0)
    for m in rows:
        x = inputs(m)
        for variant in times:
            times[variant] += graph_time_ms(lambda: product(x, copies[next(turn) % len(copies)], variant))
    return min(times, key=times.get)


def _fp8_sources() -> tuple[str, ...]:
    """The files whose kernels the FP8 load-time choices time (kernels/choice_cache.py's key)."""
    from kernels import _triton, e4m3_rows, linear

    return (__file__, linear.__file__, _triton.__file__, e4m3_rows.__file__)


def _fastest_fp8_variant(weight: torch.Tensor, gated: bool, rows: tuple[int, ...]) -> tuple:
    n, k = weight.shape
    scale = torch.ones(n, dtype=torch.float32, device=weight.device)
    return fastest_tiling(
        weight, rows, SKINNY_VARIANTS + FP8_EXTRA_VARIANTS,
        lambda m: quantize_rows_triton(torch.randn(m, k, dtype=torch.bfloat16, device=weight.device)),
        lambda x, w, variant: skinny_linear_triton(x[0], w, weight_scale=scale, x_scale=x[1], out_dtype=torch.bfloat16,
                                                   gated=gated, **variant_options(variant)))


def l2_defeating_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it that, used in turn, together they exceed twice the L2
    cache: a decode step streams each weight from HBM, and an FP8 weight of 17-25 MB (Llama-8B's
    o_proj, qkv_proj) fits in an H100's 50 MB L2, so timing it alone would time L2 reads."""
    l2_bytes = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 50 << 20)
    count = min(8, max(1, -(-2 * l2_bytes // (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(count - 1)]


# Products that run tensor-wise with their scales deferred: (device index, rows, N, K) -> True, set at
# engine load by choose_fp8_scaling (a row count never timed keeps the row-wise path).
_DEFERRED_SCALING: set[tuple[int, int, int, int]] = set()
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}  # the tensor-wise path's scale 1.0, per device
# Deferral pays only where the tensor-wise product is this much faster: the reader's scaling costs a
# little too (a multiply per value in a kernel that reads the product anyway).
DEFER_MIN_GAIN = 0.97
# Calls in each timing's CUDA graph: ~40 decode buckets x 4 shapes x 2 ways are timed at every engine
# load. With graphs of 20 calls (graph_time_ms' default) an 8B FP8 engine loaded in 74-88 s on an H100
# against 42 s for the tree before (2026-11-26; that includes compiling the new attention variants, not
# measured apart). Five calls cut the timings' share by ~4x.
SCALING_TIMING_CALLS = 5


def _defers_scales(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    values = x.values if isinstance(x, QuantizedRows) else x
    if not values.is_cuda or x.dtype != torch.bfloat16:  # (a QuantizedRows' dtype: its activations')
        return False
    return (values.device.index, values.shape[0], *weight.shape) in _DEFERRED_SCALING


@torch.inference_mode()
def choose_fp8_scaling(weights: list[torch.Tensor], rows: list[int]) -> dict[tuple[int, int, int], bool]:
    """For each distinct FP8 weight shape (N, K) and row count of ``rows`` above MAX_SKINNY_ROWS,
    whether the tensor-wise product with deferred scales beats the row-wise one (device time from
    CUDA graphs, over copies of the weight that defeat the L2 cache); the winners are kept for
    fp8_linear's ``defer_scales``. Returns {(rows, N, K): deferred}. CUDA, bf16 activations only."""
    results: dict[tuple[int, int, int], bool] = {}
    if not weights:
        return results
    device = weights[0].device
    _UNIT_SCALES.setdefault(device, torch.ones((), dtype=torch.float32, device=device))
    unit = _UNIT_SCALES[device]
    shapes = {tuple(w.shape): w for w in weights}
    for (n, k), weight in shapes.items():
        copies = []  # made at the first timing (a shape whose every row count is cached needs none)
        col_scale = torch.ones(1, n, dtype=torch.float32, device=device)
        turn = iter(range(1 << 40))
        for m in sorted({r for r in rows if r > MAX_SKINNY_ROWS}):
            def time_both() -> dict:  # (called at once, in this iteration)
                copies[:] = copies or l2_defeating_copies(weight)
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16).to(FP8_DTYPE)
                row_scale = torch.ones(m, 1, dtype=torch.float32, device=device)
                row_wise = graph_time_ms(lambda: torch._scaled_mm(
                    x, copies[next(turn) % len(copies)].t(), scale_a=row_scale, scale_b=col_scale,
                    out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM), repeat=SCALING_TIMING_CALLS)
                tensor_wise = graph_time_ms(lambda: torch._scaled_mm(
                    x, copies[next(turn) % len(copies)].t(), scale_a=unit, scale_b=unit,
                    out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM), repeat=SCALING_TIMING_CALLS)
                return {"deferred": tensor_wise < DEFER_MIN_GAIN * row_wise, "row_wise_ms": row_wise,
                        "tensor_wise_ms": tensor_wise}

            timed, _ = choice_cache.choice("fp8_scaling", (m, n, k, FAST_ACCUM), device, time_both,
                                           sources=_fp8_sources(), candidates=(DEFER_MIN_GAIN, SCALING_TIMING_CALLS),
                                           valid=lambda r: isinstance(r["deferred"], bool))
            deferred = timed["deferred"]
            results[(m, n, k)] = deferred
            key = (device.index, m, n, k)
            if deferred:
                _DEFERRED_SCALING.add(key)
            else:
                _DEFERRED_SCALING.discard(key)
    return results
