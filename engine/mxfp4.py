"""MXFP4 checkpoint tensors (gpt-oss's experts), widened exactly at build.

A checkpoint with ``quantization_config.quant_method == "mxfp4"`` stores each quantized parameter
``<name>`` (transformers' ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``) as two tensors:

- ``<name>_blocks`` uint8 (..., rows, G, 16): two FP4 E2M1 codes a byte, the low nibble first
  (value 2j is byte j's low nibble, 2j + 1 its high one), so a row holds G * 32 values;
- ``<name>_scales`` uint8 (..., rows, G): one E8M0 exponent per 32 values, value = code * 2^(s - 127).

FP4 E2M1 codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same negated (bit 3 is the
sign). The rows are the parameter's output features: ``gate_up_proj_blocks`` (E, 2I, H/32, 16)
widens to (E, 2I, H), ``down_proj_blocks`` (E, H, I/32, 16) to (E, H, I), and transformers' own
parameters are those transposed, (E, in, out) (transformers/integrations/mxfp4.py,
``convert_moe_packed_tensors``).

Every MXFP4 value is a code of at most two significant bits times a power of two between 2^-127
and 2^127, so bfloat16 (float32's exponent range, subnormals down to 2^-133) holds it exactly when
it is below 2^128: ``mxfp4_getter`` serves each quantized parameter in bfloat16, in transformers'
layout, and the conversion (engine/convert.py) treats it like an unquantized checkpoint's. Values
of 2^128 and more (exponents 253-254 with large codes), exponent 255 (NaN in the OCP MX format)
and shapes that do not pair up are refused, naming the tensor.
"""
from __future__ import annotations

import copy

import torch

from engine.config import ConfigError
from engine.convert import CheckpointError, TensorGetter

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES_PER_SCALE = 32
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
_ROWS_PER_CHUNK = 1 << 18  # 32-value rows widened at once: bounds the int64 byte indices to 32 MB


def is_mxfp4_checkpoint(hf_config) -> bool:
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return False
    method = (quant if isinstance(quant, dict) else quant.to_dict()).get("quant_method")
    return str(getattr(method, "value", method)).lower() == "mxfp4"


def _byte_pairs() -> torch.Tensor:
    """(256, 2) float32: the two values of every byte, low nibble first."""
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([values[codes & 0xF], values[codes >> 4]], dim=1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """blocks uint8 (..., G, 16), scales uint8 (..., G) -> bfloat16 (..., G * 32), exactly (module
    docstring). ``name``: the parameter's name, for the errors."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 tensor {name}: _blocks and _scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != VALUES_PER_SCALE // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 tensor {name}: _blocks {tuple(blocks.shape)} must be _scales' shape "
                              f"{tuple(scales.shape)} plus a last dim of {VALUES_PER_SCALE // 2} bytes")
    if bool((scales == 255).any()):
        raise CheckpointError(f"MXFP4 tensor {name}: _scales holds 255, which is NaN in the E8M0 format")
    byte_rows = blocks.reshape(-1, VALUES_PER_SCALE // 2)
    # 2^(s - 127) as float32 bits (E8M0's bias is float32's): exponent field s for s >= 1, the
    # subnormal 2^-127 for s = 0.
    exponents = scales.reshape(-1, 1).to(torch.int32)
    factors = torch.where(exponents > 0, exponents << 23, torch.full_like(exponents, 1 << 22)).view(torch.float32)
    pairs = _byte_pairs()
    out = torch.empty(byte_rows.shape[0], VALUES_PER_SCALE, dtype=torch.bfloat16)
    for start in range(0, byte_rows.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        values = pairs[byte_rows[rows].long()].flatten(1)  # (chunk, 32): byte j's low, high nibble at 2j, 2j + 1
        out[rows] = values * factors[rows]
        if bool(out[rows].isinf().any()):
            raise CheckpointError(f"MXFP4 tensor {name}: a value reaches 2^128, beyond bfloat16's range (_scales "
                                  f"up to {int(scales.max())})")
    return out.view(*blocks.shape[:-2], blocks.shape[-2] * VALUES_PER_SCALE)


def mxfp4_getter(get: TensorGetter) -> TensorGetter:
    """``get`` that also serves every MXFP4 parameter ``<name>`` from ``<name>_blocks`` and
    ``<name>_scales``, widened to bfloat16 in transformers' layout (..., in, out): the transpose of
    the widened rows, as a view."""
    def get_widened(name: str) -> torch.Tensor:
        try:
            return get(name)
        except CheckpointError as missing:
            try:
                blocks = get(name + "_blocks")
            except CheckpointError:
                raise missing from None
        rows = dequantize_mxfp4(blocks, get(name + "_scales"), name)  # a _scales missing: its CheckpointError
        return rows.transpose(-1, -2)

    return get_widened


def widen_mxfp4_checkpoint(hf_config, get: TensorGetter, architecture: str):
    """(a copy of ``hf_config`` without its quantization_config, the widening getter) for an MXFP4
    checkpoint: what it becomes is an unquantized checkpoint of bfloat16 experts."""
    if architecture not in MXFP4_ARCHITECTURES:
        raise ConfigError(f"MXFP4 checkpoints are supported for {', '.join(MXFP4_ARCHITECTURES)}, not {architecture}")
    plain = copy.deepcopy(hf_config)
    plain.quantization_config = None
    return plain, mxfp4_getter(get)
