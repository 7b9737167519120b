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
- block-wise FP8 (``quant_method: fp8`` with ``weight_block_size: [128, 128]``, ``fmt: e4m3``,
  ``activation_scheme: dynamic``: DeepSeek-V3, Qwen3-*-FP8): every quantized Linear (every expert's
  too) stores ``weight`` float8_e4m3fn (N, K) and ``weight_scale_inv`` float32 (ceil(N / 128),
  ceil(K / 128)); the real weight is weight x the scale of its block (transformers'
  integrations/finegrained_fp8.py: the inverse of the scale it was divided by). Modules the
  checkpoint leaves unquantized (``modules_to_not_convert``: the lm_head, Qwen3-MoE's routers) hold
  plain weights.

Per-channel and per-tensor checkpoints map onto the engine's per-output-channel scheme
(kernels/fp8.py) without rounding anything again: the source's scale becomes the scale of each of
the weight's rows, rows keep their scale through fusing (q/k/v, gate/up) and tensor-parallel
splits, and the E4M3 values are recovered exactly (``kernels.fp8.quantize_weight`` with the given
scales). Block-wise checkpoints build ``fp8_block`` engines (kernels/fp8_block.py) that hold their
codes and block scales exactly: ``rank_block_scales`` follows every block through the family's
conversion and refuses, by name, a fuse or split that would cut one. Static activation scales are
not used: the engine quantizes activations per token at run time, which is at least as exact.
compressed-tensors W8A8 INT8 (int8 weights per channel, int8 activations per token, dynamic,
symmetric; ``format: int-quantized``: ``weight`` int8 (out, in), ``weight_scale`` (out, 1)) is read
the same way as per-channel FP8 and builds an ``int8_sq`` engine (kernels/int8_sq.py) holding the
checkpoint's codes and scales; its smoothing is already folded into the weights. Integer
weight-only schemes are engine/weight_only/checkpoint_formats.py's; other schemes are refused by name.
"""
from __future__ import annotations

import math

import torch

from engine.config import ConfigError, ModelConfig
from engine.convert import CheckpointError, TensorGetter, iter_rank_weights
from kernels.fp8_block import BLOCK, blocks, dequantize_blocks

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALED_DTYPES = FP8_DTYPES + (torch.int8,)  # weights stored as codes x a per-row scale (int8: W8A8 INT8)
SCALE_SUFFIX = "weight_scale"
BLOCK_SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv; stacked experts: <name>_scale_inv


def fp8_checkpoint_strategy(hf_config) -> str | None:
    """"channel", "tensor" or "block" (128 x 128) for an FP8 checkpoint, "int8" for a W8A8 INT8 one,
    None for an unquantized one; any other quantization is a ConfigError naming it and what is supported."""
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
            _check_block_scheme(quant)
            return "block"
        return "tensor"
    if method == "compressed-tensors":
        return _compressed_tensors_strategy(quant)
    raise ConfigError(f"checkpoint quantization {method!r} is not supported; supported: unquantized checkpoints, "
                      "FP8 compressed-tensors (per channel or per tensor) and per-tensor FP8 (quant_method fp8)")


def _check_block_scheme(quant: dict) -> None:
    """The block-wise FP8 scheme the kernels run: 128 x 128 E4M3 blocks, dynamic activations."""
    block = list(quant["weight_block_size"])
    if block != [BLOCK, BLOCK]:
        raise ConfigError(f"block-wise FP8 checkpoints with weight_block_size {block} are not supported; "
                          f"supported: [{BLOCK}, {BLOCK}]")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"block-wise FP8 checkpoints in fmt {quant['fmt']!r} are not supported; supported: e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"block-wise FP8 checkpoints with activation_scheme {quant['activation_scheme']!r} are not "
                          "supported; supported: dynamic (activations quantized per token and 128-column group)")


def _compressed_tensors_strategy(quant: dict) -> str:
    from engine.weight_only.checkpoint_formats import is_ct_w8a8_int

    groups = quant.get("config_groups") or {}
    if groups and all(is_ct_w8a8_int(group) for group in groups.values()):
        return "int8"
    strategies = set()
    for name, group in groups.items():
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


def dequantizing_getter(get: TensorGetter, strategy: str = "channel") -> TensorGetter:
    """A getter that returns every FP8 weight dequantized to float32 (values x their row's scale, or
    their block's for a "block" checkpoint), so the ordinary conversion fuses, splits and casts it
    like any other weight."""
    def dequantized(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor.dtype not in SCALED_DTYPES:
            return tensor
        if strategy == "block":
            return dequantize_blocks(tensor, block_scale_of(get, name, tensor))
        scale = _scale_of(get, name) if name.endswith(".weight") else None
        if scale is None:
            raise CheckpointError(f"{name} is stored as {tensor.dtype} but the checkpoint has no "
                                  f"{name[: -len('weight')] + SCALE_SUFFIX} for it")
        rows = _row_scales(scale, tensor.shape[0], name[: -len("weight")] + SCALE_SUFFIX)
        return tensor.float() * rows[:, None]

    return dequantized


def rank_row_scales(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """rank_source_rows' scales alone."""
    return rank_source_rows(get, cfg, rank, tp_size)[0]


def rank_source_rows(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int
                     ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(scales, unquantized): engine weight name -> the source's per-row scales (rows,) for this rank, for
    every engine weight all of whose parts are FP8 in the checkpoint; and the names of the engine tensors
    none of whose parts is (the modules the checkpoint left in its float dtype, e.g. those its compressed-tensors
    ``ignore`` names; norms and biases among them, which no caller quantizes).

    The scales follow their rows through the family's own conversion: each quantized weight is stood
    in for by its row scales widened to (out, tp_size), a shape that every fuse (cat along rows),
    column split (rows) and row split (columns, leaving (out, 1)) handles as it handles the weight.
    Column 0 of the result is the per-row scale. Unquantized parts stand in as NaN, so an engine
    weight fused from a quantized and an unquantized part gets no source scale (quantized afresh).
    """
    def widened_scales(name: str) -> torch.Tensor:
        if name.endswith(".weight"):
            weight = get(name)
            scale = _scale_of(get, name) if weight.dtype in SCALED_DTYPES else None
            rows = weight.shape[0] if weight.dim() == 2 else 1
            column = _row_scales(scale, rows, name) if scale is not None else torch.full((rows,), float("nan"))
            return column[:, None].expand(rows, tp_size)
        return torch.full((tp_size, tp_size), float("nan"))  # biases, norms: never a linear weight's part

    scales, unquantized = {}, set()
    for name, t in iter_rank_weights(widened_scales, cfg, rank, tp_size, torch.float32):  # one stand-in at a time
        if t.dim() >= 2 and not torch.isnan(t[..., 0]).any():  # 3-D: stacked experts (E, rows)
            scales[name] = t[..., 0].contiguous()
        if torch.isnan(t).all():
            unquantized.add(name)
    return scales, unquantized


# ---- block-wise checkpoints ------------------------------------------------------------------

def block_scale_of(get: TensorGetter, name: str, weight: torch.Tensor) -> torch.Tensor:
    """The float32 block scales (..., ceil(N / 128), ceil(K / 128)) of the FP8 weight ``name``; a
    CheckpointError naming both tensors when they are missing or shaped for other blocks."""
    scale_name = name + BLOCK_SCALE_SUFFIX
    try:
        scale = get(scale_name)
    except CheckpointError:
        raise CheckpointError(f"{name} is stored as {weight.dtype} but the checkpoint has no {scale_name} for it "
                              "(block-wise FP8 needs one scale per 128 x 128 block)") from None
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], blocks(rows), blocks(cols))
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"{scale_name} has shape {tuple(scale.shape)} for the weight {name} of shape "
                              f"{tuple(weight.shape)}; allowed: {expected}, one scale per 128 x 128 block")
    return scale.float()


class _BlockIds:
    """Every block of the checkpoint's FP8 weights under a number of its own (exact in float64), and
    the block's scale under that number: conversion moves the numbers as it moves the weights."""

    def __init__(self):
        self.names: list[str] = []
        self.starts: list[int] = [0]
        self.scales: list[torch.Tensor] = []

    def add(self, name: str, scale: torch.Tensor) -> torch.Tensor:
        self.names.append(name)
        self.scales.append(scale.reshape(-1))
        start = self.starts[-1]
        self.starts.append(start + scale.numel())
        return torch.arange(start, start + scale.numel(), dtype=torch.float64).view(scale.shape)

    def name_of(self, block_id: float) -> str:
        index = next(i for i, end in enumerate(self.starts[1:]) if block_id < end)
        return self.names[index]

    def scale_of(self, block_ids: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.scales)[block_ids.long()]


def _column_step(columns: int, tp_size: int) -> int:
    """Columns per stand-in column: a divisor of 128 that every tensor-parallel split of ``columns``
    respects (a split falls between stand-in columns, and none straddles a block)."""
    return math.gcd(BLOCK, columns // tp_size if columns % tp_size == 0 else columns)


def rank_block_scales(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int,
                      shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor | None]:
    """Engine weight name -> its 128 x 128 block scales on this rank, for every weight of ``shapes``
    (engine name -> the shape on one rank): the checkpoint's own, for an engine weight all of whose
    parts are block-FP8 in the checkpoint; None for one the checkpoint left unquantized, wholly or in
    part (the engine keeps it in the model dtype).

    The blocks follow the family's own conversion: each FP8 weight (..., N, K) is stood in for by its
    block numbers (_BlockIds) widened to one per row and per ``_column_step`` columns, a shape that
    every fuse (rows), column split (rows) and row split (columns) handles as it handles the weight;
    unquantized parts stand in as NaN. An engine block is carried when all its numbers agree: its
    values then share one scale of the checkpoint. When they do not, a fuse or split cut a block,
    and the CheckpointError names the engine tensor, the checkpoint tensor and what is allowed.
    """
    ids = _BlockIds()

    def stand_in(name: str) -> torch.Tensor:
        tensor = get(name)
        if tensor.dim() < 2:
            return torch.full(tensor.shape, float("nan"), dtype=torch.float64)
        rows, cols = tensor.shape[-2:]
        step = _column_step(cols, tp_size)
        if tensor.dtype not in FP8_DTYPES:
            return torch.full((*tensor.shape[:-1], cols // step), float("nan"), dtype=torch.float64)
        numbers = ids.add(name, block_scale_of(get, name, tensor))
        numbers = numbers.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
        return numbers.repeat_interleave(BLOCK // step, dim=-1)[..., :cols // step]

    # One stand-in at a time (float64, a number per row and per _column_step columns: 1/32 of the bf16 weight's
    # bytes, too many to hold for a whole rank of DeepSeek-V3); only each weight's block scales are kept.
    out = {}
    for name, numbers in iter_rank_weights(stand_in, cfg, rank, tp_size, torch.float64):
        if name in shapes:
            out[name] = _engine_block_scales(name, numbers, shapes[name], ids, rank, tp_size)
    return {name: out[name] for name in shapes}


def _engine_block_scales(name: str, numbers: torch.Tensor, shape: tuple[int, ...], ids: _BlockIds, rank: int,
                         tp_size: int) -> torch.Tensor | None:
    """The scales of engine weight ``name`` (numbers: its stand-in) per 128 x 128 block, or None."""
    if torch.isnan(numbers).any():
        return None
    rows, cols = shape[-2:]
    per_block = BLOCK * numbers.shape[-1] // cols  # stand-in columns per 128 weight columns
    row_index = torch.arange(blocks(rows) * BLOCK).clamp_(max=rows - 1)  # the edge block repeats its last row
    col_index = torch.arange(blocks(cols) * per_block).clamp_(max=numbers.shape[-1] - 1)
    tiles = numbers[..., row_index, :][..., col_index].unflatten(-1, (blocks(cols), per_block))
    tiles = tiles.unflatten(-3, (blocks(rows), BLOCK))  # (..., row blocks, 128, column blocks, per_block)
    low, high = tiles.amin(dim=(-3, -1)), tiles.amax(dim=(-3, -1))
    if not torch.equal(low, high):
        first = (low != high).nonzero()[0].tolist()
        where = f"rank {rank} of tp_size {tp_size}" if tp_size > 1 else "one rank"
        raise CheckpointError(
            f"{name} ({where}) would put values of two 128 x 128 blocks of {ids.name_of(low[tuple(first)].item())} "
            f"in its block {tuple(first[-2:])}, and one scale cannot serve both; allowed: fused parts (q/k/v, gate/up) "
            "and tensor-parallel splits that cut the checkpoint's weights at multiples of 128 rows and columns "
            "(a tp_size whose per-rank widths are multiples of 128)")
    return ids.scale_of(low)

