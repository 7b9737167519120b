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

Two ways to build it (``mxfp4_checkpoint``, engine/build.py ``--mxfp4_experts``):

- ``keep`` (the default): the engine holds the experts as they ship, ~4.25 bits a weight
  (kernels/fused_moe_mxfp4.py multiplies them). ``mxfp4_keeping_getter`` serves ``<name>_blocks``
  as codes (..., rows, K/2) and ``<name>_scales`` as they are, both checked; the conversion
  (engine/convert.py gpt_oss_rank_weights) de-interleaves gate/up rows into [gate_r | up_r] and
  splits down's input columns across ranks, bytes and scales alike: a split must fall on a
  32-value group (moe_intermediate_size / tp_size a multiple of 32), else the build is refused
  naming both numbers. The engine's ModelConfig says ``expert_quantization = "mxfp4"``.
- ``widen``: every MXFP4 value is a code of at most two significant bits times a power of two
  between 2^-127 and 2^127, so bfloat16 (float32's exponent range, subnormals down to 2^-133) holds
  it exactly when it is below 2^128: ``mxfp4_getter`` serves each quantized parameter in bfloat16,
  in transformers' layout, and the conversion treats it like an unquantized checkpoint's.

Values of 2^128 and more (exponents 253-254 with large codes; kept: exponents above 240, which
the kernels do not take), exponent 255 (NaN in the OCP MX format) and shapes that do not pair up
are refused, naming the tensor.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from engine.config import ConfigError, ModelConfig
from engine.convert import CheckpointError, TensorGetter
from kernels.fused_moe_mxfp4 import MAX_KERNEL_EXPONENT

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES_PER_SCALE = 32
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
MXFP4_EXPERTS = ("keep", "widen")  # engine/build.py --mxfp4_experts
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


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """CheckpointError naming parameter ``name`` unless blocks uint8 (..., G, 16) and scales uint8
    (..., G) pair up and no exponent is 255 (NaN)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 tensor {name}: _blocks and _scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != VALUES_PER_SCALE // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 tensor {name}: _blocks {tuple(blocks.shape)} must be _scales' shape "
                              f"{tuple(scales.shape)} plus a last dim of {VALUES_PER_SCALE // 2} bytes")
    if bool((scales == 255).any()):
        raise CheckpointError(f"MXFP4 tensor {name}: _scales holds 255, which is NaN in the E8M0 format")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """blocks uint8 (..., G, 16), scales uint8 (..., G) -> bfloat16 (..., G * 32), exactly (module
    docstring). ``name``: the parameter's name, for the errors."""
    check_mxfp4(blocks, scales, name)
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


def mxfp4_keeping_getter(get: TensorGetter) -> TensorGetter:
    """``get`` that serves every MXFP4 parameter's ``<name>_blocks`` as codes uint8 (..., rows, K/2)
    (the checkpoint's bytes: value 2j in byte j's low nibble) and its ``<name>_scales`` (..., rows,
    K/32), each checked with the other (check_mxfp4) and for exponents the kernels take."""
    def get_kept(name: str) -> torch.Tensor:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                param = name[:-len(suffix)]
                blocks, scales = get(param + "_blocks"), get(param + "_scales")
                check_mxfp4(blocks, scales, param)
                if bool((scales > MAX_KERNEL_EXPONENT).any()):
                    raise CheckpointError(f"MXFP4 tensor {param}: _scales up to {int(scales.max())}; MXFP4 experts "
                                          f"are kept with exponents up to {MAX_KERNEL_EXPONENT} (weights below 2^113):"
                                          " build with --mxfp4_experts widen")
                return blocks.flatten(-2) if suffix == "_blocks" else scales
        return get(name)

    return get_kept


def keep_mxfp4_checkpoint(hf_config, get: TensorGetter, model: ModelConfig, tp_size: int):
    """(a copy of ``hf_config`` without its quantization_config, the keeping getter, ``model`` with
    expert_quantization "mxfp4") for an MXFP4 checkpoint whose experts the engine keeps."""
    if model.architecture not in MXFP4_ARCHITECTURES:
        raise ConfigError(f"MXFP4 checkpoints are supported for {', '.join(MXFP4_ARCHITECTURES)}, not "
                          f"{model.architecture}")
    width = model.moe_intermediate_size // tp_size  # each rank's slice of every expert's width
    if width % VALUES_PER_SCALE:
        raise ConfigError(f"MXFP4 experts kept: tp_size {tp_size} splits the experts' width "
                          f"(moe_intermediate_size {model.moe_intermediate_size}) into slices of {width}, which "
                          f"cuts a scale group of {VALUES_PER_SCALE} values; use a tp_size that leaves a multiple of "
                          f"{VALUES_PER_SCALE} a rank, or --mxfp4_experts widen")
    plain = copy.deepcopy(hf_config)
    plain.quantization_config = None
    return plain, mxfp4_keeping_getter(get), dataclasses.replace(model, expert_quantization="mxfp4").validate()


def mxfp4_checkpoint(hf_config, get: TensorGetter, model: ModelConfig, tp_size: int, experts: str):
    """(hf_config, getter, model, description) of an MXFP4 checkpoint built with its experts kept
    or widened (``experts``, one of MXFP4_EXPERTS; module docstring)."""
    if experts not in MXFP4_EXPERTS:
        raise ConfigError(f"mxfp4_experts must be one of {', '.join(MXFP4_EXPERTS)}, got {experts!r}")
    if experts == "keep":
        return (*keep_mxfp4_checkpoint(hf_config, get, model, tp_size), "mxfp4 experts, kept")
    hf_config, get = widen_mxfp4_checkpoint(hf_config, get, model.architecture)
    return hf_config, get, model, "mxfp4 experts, widened at build"
