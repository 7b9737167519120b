"""Checkpoints that are already FP8: their scheme from config.json, and their exact E4M3 values and
scales carried into the engine.

Layouts read (the ones most FP8 checkpoints on the Hugging Face Hub use):

- compressed-tensors (llm-compressor's output, e.g. ``*-FP8-dynamic``): ``quantization_config`` has
  ``quant_method: compressed-tensors`` and ``config_groups`` whose ``weights`` are
  ``{type: float, num_bits: 8, strategy: channel | tensor}``. Every quantized Linear stores
  ``weight`` float8_e4m3fn (out, in) and ``weight_scale`` (out, 1) per channel or (1,) / () per
  tensor (float32 or the model dtype), plus ``input_scale`` when its activations are static.
  Modules named in ``ignore`` (usually ``lm_head``) stay in the model dtype.
- per-tensor FP8 (``quant_method: fp8`` without ``weight_block_size``: AutoFP8 and transformers'
  FP8 config): a scalar ``weight_scale`` per Linear, and ``input_scale`` for static activations.

The engine's scheme is E4M3 per output channel (kernels/fp8.py). Both layouts map onto it without
rounding anything again: the source's scale becomes the scale of each of the weight's rows, rows
keep their scale through fusing (q/k/v, gate/up) and tensor-parallel splits, and the E4M3 values are
recovered exactly (``kernels.fp8.quantize_weight`` with the given scales). Static activation scales
are not used: the engine quantizes activations per token at run time, which is at least as exact.
Block-wise FP8 (``weight_block_size``), integer and other schemes are refused by name.
"""
from __future__ import annotations

import torch

from engine.config import ConfigError, ModelConfig
from engine.convert import CheckpointError, TensorGetter, rank_weights

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "weight_scale"


def fp8_checkpoint_strategy(hf_config) -> str | None:
    """"channel" or "tensor" for an FP8 checkpoint, None for an unquantized one; any other
    quantization is a ConfigError naming it and what is supported."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    method = getattr(method, "value", method)  # transformers may hold an enum
    if method == "gguf":  # transformers dequantized the GGUF file on load: float weights reach us
        return None
    if method == "fp8":
        if quant.get("weight_block_size"):
            raise ConfigError(f"block-wise FP8 checkpoints (weight_block_size {quant['weight_block_size']}) are not "
                              "supported; supported: FP8 per tensor or per channel (compressed-tensors)")
        return "tensor"
    if method == "compressed-tensors":
        return _compressed_tensors_strategy(quant)
    raise ConfigError(f"checkpoint quantization {method!r} is not supported; supported: unquantized checkpoints, "
                      "FP8 compressed-tensors (per channel or per tensor) and per-tensor FP8 (quant_method fp8)")


def _compressed_tensors_strategy(quant: dict) -> str:
    strategies = set()
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError(f"compressed-tensors group {name!r} quantizes weights as {weights.get('type')} "
                              f"{weights.get('num_bits')}-bit; supported: float 8-bit (FP8 E4M3)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ConfigError(f"compressed-tensors group {name!r} has weight strategy {weights.get('strategy')!r}; "
                              "supported: channel, tensor")
        strategies.add(weights["strategy"])
    if not strategies:
        raise ConfigError("compressed-tensors quantization_config has no config_groups with weights")
    return "channel" if "channel" in strategies else "tensor"


def _row_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight_scale ((rows, 1), (rows,), (1,) or ()) as one float32 scale per row (rows,)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows)
    if scale.numel() != rows:
        raise CheckpointError(f"{name} has {scale.numel()} values for a weight of {rows} rows; expected 1 or {rows}")
    return scale.float().reshape(rows)


def _scale_of(get: TensorGetter, weight_name: str) -> torch.Tensor | None:
    """The ``weight_scale`` beside ``<module>.weight``, or None when the module is not quantized."""
    try:
        return get(weight_name[: -len("weight")] + SCALE_SUFFIX)
    except CheckpointError:
        return None


def dequantizing_getter(get: TensorGetter) -> TensorGetter:
    """A getter that returns every FP8 weight dequantized to float32 (values x their row's scale),
    so the ordinary conversion fuses, splits and casts it like any other weight."""
    def dequantized(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        scale = _scale_of(get, name) if name.endswith(".weight") else None
        if scale is None:
            raise CheckpointError(f"{name} is stored as {tensor.dtype} but the checkpoint has no "
                                  f"{name[: -len('weight')] + SCALE_SUFFIX} for it")
        rows = _row_scales(scale, tensor.shape[0], name[: -len("weight")] + SCALE_SUFFIX)
        return tensor.float() * rows[:, None]

    return dequantized


def rank_row_scales(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """Engine weight name -> the source's per-row scales (rows,) for this rank, for every engine
    weight all of whose parts are FP8 in the checkpoint.

    The scales follow their rows through the family's own conversion: each quantized weight is stood
    in for by its row scales widened to (out, tp_size), a shape that every fuse (cat along rows),
    column split (rows) and row split (columns, leaving (out, 1)) handles as it handles the weight.
    Column 0 of the result is the per-row scale. Unquantized parts stand in as NaN, so an engine
    weight fused from a quantized and an unquantized part gets no source scale (quantized afresh).
    """
    def widened_scales(name: str) -> torch.Tensor:
        if name.endswith(".weight"):
            weight = get(name)
            scale = _scale_of(get, name) if weight.dtype in FP8_DTYPES else None
            rows = weight.shape[0] if weight.dim() == 2 else 1
            column = _row_scales(scale, rows, name) if scale is not None else torch.full((rows,), float("nan"))
            return column[:, None].expand(rows, tp_size)
        return torch.full((tp_size, tp_size), float("nan"))  # biases, norms: never a linear weight's part

    stand_ins = rank_weights(widened_scales, cfg, rank, tp_size, torch.float32)
    return {name: t[:, 0].contiguous() for name, t in stand_ins.items()
            if t.dim() == 2 and not torch.isnan(t[:, 0]).any()}

