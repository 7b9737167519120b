"""Weight-only integer linear layers (W4A16, W8A16): the storage format, its plain-torch
reference, and the entry points the model calls.

Scheme (what an engine built with ``--quantization int4_wo/int4_awq/int8_wo``, or from an AWQ,
GPTQ or compressed-tensors checkpoint, holds):

    weight[n, k] ~= (code[n, k] - zero[n, g]) * scale[n, g],    g = k // group_size

- ``code`` unsigned ``bits``-bit integers in [0, 2**bits); ``zero`` the same range (symmetric
  schemes store 2**(bits - 1), so the codes are signed values offset by half the range);
- ``group_size`` divides K; per-channel quantization is ``group_size == K`` (one group per row);
- ``scale`` (N, K // group_size) float32 (checkpoints store float16 or bfloat16 scales; float32
  holds either exactly), ``zero`` (N, K // group_size) uint8.

Storage of the codes (the engine directory's ``<linear>.weight``):
- 8 bits: uint8 (N, K), one code a byte;
- 4 bits: uint8 (N, K // 2), codes of columns 2j and 2j + 1 in the low and high nibble of byte j.
  Row-major along K, so a tensor-parallel split of K (row-parallel layers) is a split of bytes,
  and one of N (column-parallel) a split of rows; either keeps whole groups when the group count
  divides by the ranks (engine.build checks).

Activations stay in the model dtype (float16/bfloat16); products accumulate in float32.

``prepare_wna16`` turns a layer's stored tensors into a ``WNA16Weight``, once at load: the layout
the kernels read. On CPU (and as the oracle of the kernel tests) the layout is the dequantized
weight in the activations' dtype, so the CPU path multiplies exactly the "dequantized model".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (4, 8)


# ---- storage --------------------------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes (..., K) integers in [0, 16) -> uint8 (..., K // 2): column 2j low nibble, 2j + 1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit codes need an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., K // 2) -> codes uint8 (..., K), the inverse of ``pack_int4``."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., K) -> the stored weight of ``bits`` (see the module docstring)."""
    return pack_int4(codes) if bits == 4 else codes.to(torch.uint8)


def unpack_codes(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored weight -> codes uint8 (..., K)."""
    return unpack_int4(weight) if bits == 4 else weight


def stored_columns(in_features: int, bits: int) -> int:
    """Columns of the stored weight for ``in_features`` codes a row."""
    return in_features // 2 if bits == 4 else in_features


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored weight (..., N, stored K), scale and zero (..., N, K // G) -> the weight (..., N, K) in
    ``dtype``, computed in float32 ((code - zero) * scale) and rounded once."""
    codes = unpack_codes(weight, bits).float()
    group_size = codes.shape[-1] // scale.shape[-1]
    values = (codes - zero.float().repeat_interleave(group_size, dim=-1)) * \
        scale.float().repeat_interleave(group_size, dim=-1)
    return values.to(dtype)


def quantize(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of a float weight (..., N, K) -> (stored weight, scale, zero).

    Asymmetric: each group's [min, max] (widened to include 0) maps onto [0, 2**bits - 1]:
    scale = (max - min) / (2**bits - 1), zero = round(-min / scale). Symmetric: zero = 2**(bits-1)
    and scale = max|w| / (2**(bits-1) - 1), so +-max|w| are codes 1 and 2**bits - 1 (the most
    negative code stays unused, as in TensorRT-LLM's and GPTQ's symmetric modes).
    """
    *lead, n, k = weight.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit weights are not supported; supported: {SUPPORTED_BITS}")
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input columns")
    groups = weight.float().reshape(*lead, n, k // group_size, group_size)
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = groups.abs().amax(dim=-1) / (half - 1)
        scale = scale.clamp_(min=1e-10)
        zero = torch.full_like(scale, half)
    else:
        low = groups.amin(dim=-1).clamp(max=0.0)
        high = groups.amax(dim=-1).clamp(min=0.0)
        scale = ((high - low) / top).clamp_(min=1e-10)
        zero = (-low / scale).round_().clamp_(0, top)
    codes = (groups / scale[..., None] + zero[..., None]).round_().clamp_(0, top)
    codes = codes.reshape(*lead, n, k).to(torch.uint8)
    return pack_codes(codes, bits), scale, zero.to(torch.uint8)


# ---- the layer's product -------------------------------------------------------------------

@dataclass
class WNA16Weight:
    """One linear layer's quantized weight in the layout its kernels read (``prepare_wna16``).

    ``out_features``/``in_features``: N and K; ``bits``/``group_size``: the scheme. ``dense``: the
    dequantized weight (N, K) in the activations' dtype, for the reference path (CPU). ``kernel``:
    the tensors of the CUDA kernels' layout, by name; empty where the reference path runs.
    """

    out_features: int
    in_features: int
    bits: int
    group_size: int
    dtype: torch.dtype
    dense: torch.Tensor | None = None
    kernel: dict[str, torch.Tensor] = field(default_factory=dict)
    variant: dict = field(default_factory=dict)  # chosen at load per row count (kernel timings)


def prepare_wna16(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  dtype: torch.dtype) -> WNA16Weight:
    """A layer's stored weight, scale and zero (module docstring) -> its WNA16Weight for
    activations of ``dtype``."""
    n, groups = scale.shape
    k = unpack_codes(weight[:1], bits).shape[-1]
    return WNA16Weight(out_features=n, in_features=k, bits=bits, group_size=k // groups, dtype=dtype,
                       dense=dequantize(weight, scale, zero, bits, dtype))


def wna16_linear_ref(x: torch.Tensor, weight: WNA16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ the dequantized weight.T (+ bias), in x's dtype: the dequantized model's product."""
    return F.linear(x, weight.dense, bias)


def wna16_linear(x: torch.Tensor, weight: WNA16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) in the model dtype @ the quantized weight (N, K).T (+ bias) -> (M, N) in x's dtype."""
    return wna16_linear_ref(x, weight, bias)
