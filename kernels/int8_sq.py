"""SmoothQuant W8A8 INT8 linear layers: int8 weights per output channel, int8 activations per token.

Scheme (what ``--quantization int8_sq`` holds and runs; the smoothing itself is a float-to-float
transform of the model before quantization, engine/weight_only/smoothquant.py):

- weight (N, K) int8 with ``weight_scale`` (N,) float32: row n of the real weight is
  ``weight[n] * weight_scale[n]``, ``weight_scale[n] = max|W[n]| / 127`` (symmetric, code -128 unused);
- activations x (M, K) quantized per token at run time the same way: scale (M,) = max|x[m]| / 127,
  codes round(x / scale) (round half away from zero, the same in the kernel and the reference);
- y = (x_q @ w_q.T) * s_x[:, None] * s_w[None, :] (+ bias): the integer product is exact (int32
  accumulation), the scales are applied once in float32, the result rounded once to x's dtype.

Paths: on CUDA the rows are quantized by ``quantize_rows_int8_triton`` (one program per row), or
already by the RMSNorm before the layer (``rms_norm_quantized_int8``: QuantizedRows, as FP8's norms
hand over; engine/models/layers.py rms_norm_into, for qkv_proj and gate_up_proj), then
- at most ``MAX_SKINNY_ROWS`` rows (decode): kernels/linear.py's skinny kernel with int8 x and weight
  tiles in int8 tensor-core dots (int32 sums, exact), both scales in its epilogue (``int8_skinny_linear``;
  the gated [gate | up] product with its SiLU-and-mul in the same kernel, ``int8_gated_linear``). Before
  it, a decode step padded its rows to 17 for ``torch._int_mm``: a 17-row GEMM per linear at batch 1;
- more rows: kernels/int8_gemm.py's Triton GEMM (int8 tensor-core dots, int32 sums, the same epilogue, the
  gated form with its SiLU-and-mul). Before it (and with TRITONLLM_INT8_GEMM=0) ``torch._int_mm`` (cuBLASLt,
  int32 (M, N) out, where its shape rules, K and N multiples of 8, hold) then the scaling in torch (``_scaled``:
  several passes over the (M, N) sums) and a separate silu_and_mul: on an H200 (2026-11-30) a batch-512 decode
  step took 23.7 ms against bf16's 17.7;
elsewhere ``int8_linear_ref`` in plain torch, also the oracle of the tests. All compute the same
integers and scale them in the same order, (sum * s_x[m]) * s_w[n] in float32, so they differ only
where a bias add is fused into a multiply-add (the tests allow one output rounding).
"""
from __future__ import annotations

import torch

from kernels._triton import use_triton
from kernels.activation import silu_and_mul
from kernels.fp8 import QuantizedRows, choose_skinny_tilings, fastest_tiling, launch_row_quantizer
from kernels.int8_gemm import int8_gemm, int8_gemm_enabled
from kernels.linear import MAX_SKINNY_ROWS, skinny_linear_triton, variant_options
from kernels.rmsnorm import rms_norm_quantized_int8_triton, rms_norm_ref

INT8_MAX = 127.0
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values quantize to 0 anyway)
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows
# (block_n, block_k, num_warps, num_stages[, split_k[, swap_ab[, waves]]]) of the skinny kernel for int8 weights
# until a weight is timed at load (choose_int8_skinny_variants, which sets INT8_VARIANT_ATTR on it): an int8 tile
# has the bytes of an FP8 one, so FP8's default tiling (kernels/fp8.py FP8_SKINNY_DEFAULT).
INT8_SKINNY_DEFAULT = (16, 512, 4, 4)
INT8_VARIANT_ATTR = "_int8_skinny_variant"
# The tilings the load-time choice times (also benchmarks/quantization/int8_skinny_bench.py's): the default and, from
# FP8's candidates (same bytes a tile), longer K tiles, swapped 64-wide tiles (the weight tile as a warpgroup
# MMA's first operand), split-K, and one balanced tiling of the bf16 set. Eight, not FP8's 27: each is two
# compiles (plain, gated) at an int8 engine's first load. Not yet timed on a GPU (2026-11-30).
INT8_SKINNY_VARIANTS = ((16, 512, 4, 4), (32, 512, 4, 4), (16, 1024, 4, 4), (64, 256, 4, 5, 1, 1),
                        (64, 512, 4, 3, 2, 1), (16, 512, 4, 4, 2), (32, 256, 4, 8, 4), (64, 128, 4, 4, 1, 1, 1))


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (codes (R, C) int8, scale (R,) float32), x ~= codes * scale[:, None] (plain torch)."""
    x = x.float()
    peak = x.abs().amax(dim=-1)
    # Divided by a tensor of 127s, not the number: on CUDA torch turns ``tensor / number`` into a multiply by
    # the number's reciprocal, an ulp off the IEEE quotient that the CPU and the Triton kernels compute.
    scale = (peak / torch.full_like(peak, INT8_MAX)).clamp_(min=MIN_SCALE)
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


def quantize_rows_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_int8`` in one launch (x (R, C) with unit column stride) of kernels/fp8.py's row quantizer
    in its int8 form (kernels/int8_rows.py's arithmetic). Rows up to QUANTIZE_ONE_PASS_MAX wide are read once: on
    an H200 (2026-11-30) the two-pass kernel (4,096-wide tiles) took ~25 us for down_proj's 512 x 14,336 input,
    half the int8 product's own 51.7 us."""
    return launch_row_quantizer(x, torch.int8, two_pass_block=4096)


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 INT8 scheme in plain torch: x (..., K) quantized per token, the integer product in
    float64 (exact: |sum| < 127^2 K < 2^53), scaled in float32, rounded once to x's dtype."""
    rows = QuantizedRows(*quantize_rows_int8(x.reshape(-1, x.shape[-1])), x.dtype)
    return _rows_product_ref(rows, weight, weight_scale, bias).reshape(*x.shape[:-1], weight.shape[0])


def _rows_product_ref(rows: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear_ref's product of rows quantized already: (M, N) in rows.dtype."""
    return _scaled(rows.values.double() @ weight.double().T, rows, weight_scale, bias)


def _scaled(exact: torch.Tensor, rows: QuantizedRows, weight_scale: torch.Tensor, bias: torch.Tensor | None
            ) -> torch.Tensor:
    """The integer sums (M, N) (exact in any dtype) -> (sum * s_x[m]) * s_w[n] (+ bias) in float32, rounded
    once to rows' dtype: the one scaling of the reference and the torch._int_mm path (the skinny kernel's
    epilogue keeps the same order)."""
    out = exact.float() * rows.scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(rows.dtype)


def as_int8_rows(x: torch.Tensor | QuantizedRows) -> QuantizedRows:
    """x (..., K) quantized per row as (M, K) int8 codes (itself when it is QuantizedRows already): the
    Triton row quantizer on CUDA, else the reference (the two agree bit for bit)."""
    if isinstance(x, QuantizedRows):
        return x
    rows = _packed_rows(x)
    quantize = quantize_rows_int8_triton if use_triton(rows) else quantize_rows_int8
    return QuantizedRows(*quantize(rows), x.dtype)


def rms_norm_quantized_int8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """kernels.rmsnorm.rms_norm with its output quantized per row to int8 (QuantizedRows, new_residual):
    on CUDA in the norm's own kernel (no quantize launch of its own before qkv_proj and gate_up_proj)."""
    if use_triton(x):
        values, scale, residual = rms_norm_quantized_int8_triton(x, weight, eps, residual)
        return QuantizedRows(values, scale, x.dtype), residual
    out, residual = rms_norm_ref(x, weight, eps, residual)
    return as_int8_rows(out), residual


def int8_skinny_linear(rows: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, gated: bool = False,
                       variant: tuple | None = None) -> torch.Tensor:
    """rows (M, K), M <= MAX_SKINNY_ROWS, unit column stride, quantized per token by the Triton row
    quantizer (unless they are QuantizedRows already), then one skinny kernel: int8 dots with int32 sums,
    (sum * s_x) * s_w, bias, rounded once to rows' dtype: (M, N). ``gated``: weight (2N, K) = [gate | up]
    and the result silu(gate product) * (up product), each product rounded first as ``silu_and_mul`` of
    ``int8_linear`` rounds (no bias). ``variant``: the tiling (default: the weight's, else
    INT8_SKINNY_DEFAULT). Triton's: CUDA, or CPU under TRITON_INTERPRET=1 (the tests)."""
    if not isinstance(rows, QuantizedRows):
        rows = QuantizedRows(*quantize_rows_int8_triton(rows), rows.dtype)
    variant = variant or getattr(weight, INT8_VARIANT_ATTR, INT8_SKINNY_DEFAULT)
    return skinny_linear_triton(rows.values, weight, bias, weight_scale=weight_scale, x_scale=rows.scale,
                                out_dtype=rows.dtype, gated=gated, **variant_options(variant))


def _packed_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _leading_shape(x: torch.Tensor | QuantizedRows) -> tuple[int, ...]:
    return tuple(x.values.shape[:-1]) if isinstance(x, QuantizedRows) else tuple(x.shape[:-1])


def int8_gated_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor
                      ) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for an int8 gate_up weight (2 * inter, hidden) = [gate | up]
    with per-channel scales: on CUDA one kernel with the SiLU-and-mul in its epilogue (the skinny kernel for
    decode rows, kernels/int8_gemm.py's GEMM past them), else ``int8_linear`` then ``silu_and_mul``. x may be
    QuantizedRows (from rms_norm_quantized_int8)."""
    values = x.values if isinstance(x, QuantizedRows) else x
    if use_triton(values) and values.numel() // values.shape[-1] <= MAX_SKINNY_ROWS:
        out = int8_skinny_linear(x if isinstance(x, QuantizedRows) else _packed_rows(x), weight, weight_scale,
                                 gated=True)
        return out.reshape(*_leading_shape(x), weight.shape[0] // 2)
    if use_triton(values) and int8_gemm_enabled():
        rows = as_int8_rows(x)
        out = int8_gemm(rows.values, rows.scale, weight, weight_scale, out_dtype=rows.dtype, gated=True)
        return out.reshape(*_leading_shape(x), weight.shape[0] // 2)
    both = int8_linear(x, weight, weight_scale)  # (..., 2 * inter); silu_and_mul takes rows
    return silu_and_mul(both.reshape(-1, both.shape[-1])).reshape(*both.shape[:-1], -1)


def int8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) in the model dtype, or QuantizedRows (rms_norm_quantized_int8's), @ the int8 weight (N, K)
    with per-channel scales (+ bias) -> (..., N) in x's dtype: on CUDA the Triton row quantizer (unless x is
    QuantizedRows), then the skinny int8 kernel for decode rows, else kernels/int8_gemm.py's GEMM with the
    scaling fused (with TRITONLLM_INT8_GEMM=0: ``torch._int_mm`` and the scaling in torch, or the reference
    where cuBLASLt's int8 shape rules, K and N multiples of 8, do not hold); the reference elsewhere."""
    n, k = weight.shape
    shape = (*_leading_shape(x), n)
    if not isinstance(x, QuantizedRows) and not use_triton(x):
        return int8_linear_ref(x, weight, weight_scale, bias)
    rows = as_int8_rows(x)
    m = rows.values.shape[0]
    if use_triton(rows.values) and m <= MAX_SKINNY_ROWS:
        return int8_skinny_linear(rows, weight, weight_scale, bias).reshape(shape)
    if use_triton(rows.values) and int8_gemm_enabled():
        return int8_gemm(rows.values, rows.scale, weight, weight_scale, bias, out_dtype=rows.dtype).reshape(shape)
    if not use_triton(rows.values) or k % 8 or n % 8:
        return _rows_product_ref(rows, weight, weight_scale, bias).reshape(shape)
    return _scaled(torch._int_mm(rows.values, weight.t()), rows, weight_scale, bias).reshape(shape)


@torch.inference_mode()
def choose_int8_skinny_variants(weights: list[torch.Tensor], gated: list[torch.Tensor] = (),
                                rows: tuple[int, ...] = (1, 8)) -> dict[tuple, tuple]:
    """Per distinct int8 weight shape, the INT8_SKINNY_VARIANTS tiling with the least device time summed
    over ``rows`` (CUDA graphs over copies of the weight that defeat the L2 cache, the row quantizer
    included), set on each weight as INT8_VARIANT_ATTR (kernels/fp8.py choose_skinny_tilings, FP8's rule).
    ``gated`` weights ([gate | up], only run fused with the SiLU) are timed so, under ("gated", N, K).
    CUDA only; through the persistent choice cache (kernels/choice_cache.py)."""
    return choose_skinny_tilings("int8_skinny", weights, gated, rows, attr=INT8_VARIANT_ATTR,
                                 candidates=INT8_SKINNY_VARIANTS, sources=_int8_sources(),
                                 fastest=_fastest_int8_variant)


def _int8_sources() -> tuple[str, ...]:
    """The files whose kernels the int8 load-time choice times (kernels/choice_cache.py's key)."""
    from kernels import _triton, fp8, int8_rows, linear

    return (__file__, fp8.__file__, linear.__file__, _triton.__file__, int8_rows.__file__)


def _fastest_int8_variant(weight: torch.Tensor, gated: bool, rows: tuple[int, ...]) -> tuple:
    scale = torch.full((weight.shape[0],), 1e-3, dtype=torch.float32, device=weight.device)
    return fastest_tiling(
        weight, rows, INT8_SKINNY_VARIANTS,
        lambda m: torch.randn(m, weight.shape[1], dtype=torch.bfloat16, device=weight.device),
        lambda x, w, variant: int8_skinny_linear(x, w, scale, gated=gated, variant=variant))
