"""PEFT LoRA directories: ``adapter_config.json`` plus ``adapter_model.safetensors`` (or
``adapter_model.bin``), as ``PeftModel.save_pretrained`` writes them.

Tensor keys look like ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
(a: (r, in)) and ``...lora_B.weight`` (b: (out, r)). Each module's scale is PEFT's:
``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), r and alpha taken from ``rank_pattern`` /
``alpha_pattern`` when a pattern matches the module's path; it is folded into b, in float32.
Only the keys present count, so ``target_modules`` / ``layers_to_transform`` subsets load as they are.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora.host_adapter import MODULES, LoraAdapter, LoraError, check_rank, module_shape

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # the first present is read
# A Hugging Face projection -> the MODULES it covers; fused ones (Phi-3) stack their parts' B rows.
HF_MODULES = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
              "up_proj": ("up",), "down_proj": ("down",), "qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
_KEY = re.compile(r"(?P<path>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>\w+))\.lora_(?P<ab>[AB])\.weight")
_PEFT_PREFIX = "base_model.model."  # PeftModel's own prefix; rank/alpha patterns match the path after it
# Config fields that must be off (false/empty/None): each would change the model beyond a + b @ a
# on the projections above.
_MUST_BE_OFF = {
    "use_dora": "DoRA adapters are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D-style transposed weights) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "trainable_token_indices": "trainable_token_indices (embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not supported",
    "layer_replication": "layer_replication is not supported",
}


@dataclass
class PeftModule:
    """One LoRA pair of a PEFT file, scale folded: a (r, in), b (out, r), both float32."""

    layer: int
    name: str  # the HF projection, a key of HF_MODULES
    key: str  # the lora_A tensor's key, for messages
    a: torch.Tensor
    b: torch.Tensor


def read_peft_config(path: str, max_rank: int) -> dict:
    """adapter_config.json of ``path``, checked without reading a tensor: LoRA, none of the
    unsupported features, and r and every rank_pattern rank within ``max_rank``."""
    config = parse_peft_config(path)
    check_rank(config["r"], max_rank, f"{ADAPTER_CONFIG} field r in {path}")
    for pattern, rank in config["rank_pattern"].items():
        check_rank(rank, max_rank, f"{ADAPTER_CONFIG} rank_pattern[{pattern!r}] in {path}")
    return config


def load_peft_adapter(path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Load the PEFT adapter in directory ``path`` for a model of shape ``config``; fused
    projections become their parts, each sharing the fused ``a``. Every module's rank is r or a
    rank_pattern value (read_peft_modules checks the tensors against them), so read_peft_config's
    check is the rank check."""
    peft_config = read_peft_config(path, max_rank)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for m in read_peft_modules(path, peft_config):
        if m.layer >= config.num_layers:
            raise LoraError(f"tensor {m.key}: layer {m.layer} is out of range [0, {config.num_layers})")
        parts = HF_MODULES[m.name]
        in_features = module_shape(config, parts[0])[0]
        out_sizes = [module_shape(config, part)[1] for part in parts]
        _check_shape(m.key, m.a, (m.a.shape[0], in_features), "(rank, in_features)")
        _check_shape(m.key.replace(".lora_A.", ".lora_B."), m.b, (sum(out_sizes), m.a.shape[0]),
                     "(out_features, rank)")
        for part, b in zip(parts, m.b.split(out_sizes)):
            if (m.layer, part) in weights:
                raise LoraError(f"tensor {m.key}: module {part} of layer {m.layer} is already set by another tensor")
            weights[(m.layer, part)] = (m.a, b)
    return LoraAdapter(weights=weights, source=f"PEFT adapter {path}")


def read_peft_modules(path: str, config: dict) -> list[PeftModule]:
    """Every LoRA pair of the adapter in ``path`` (whose checked config is ``config``), scale
    folded into b, in the order of layers, then of MODULES. Shapes are checked against each other only."""
    file, tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        match = _match_key(key, file)
        slot, ab = (int(match["layer"]), match["name"]), match["ab"]
        if ab in pairs.setdefault(slot, {}):
            raise LoraError(f"{file}: tensors {pairs[slot][ab][0]} and {key} are both lora_{ab} of layer {slot[0]} "
                            f"{slot[1]}; one adapter holds one per projection")
        pairs[slot][ab] = (key, tensor)
        paths[slot] = match["path"]
    if not pairs:
        raise LoraError(f"{file} holds no LoRA tensors")

    def position(slot):  # layer, then the place of the projection's first module in MODULES
        return slot[0], MODULES.index(HF_MODULES[slot[1]][0])
    return [_module(slot, pairs[slot], paths[slot], config, file) for slot in sorted(pairs, key=position)]


def parse_peft_config(path: str) -> dict:
    """adapter_config.json of ``path``, checked for unsupported features but not for rank (see
    read_peft_config), with PEFT's defaults filled in for r, lora_alpha and the patterns."""
    if not os.path.isdir(path):
        raise LoraError(f"PEFT adapter directory {path} does not exist")
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise LoraError(f"{path} is not a PEFT adapter directory: {file} does not exist")
    try:
        with open(file) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoraError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file} must hold a JSON object, got {type(config).__name__}")
    _check_supported(config, file)
    return {**config, "r": config.get("r", 8), "lora_alpha": config.get("lora_alpha", 8),
            "rank_pattern": config.get("rank_pattern") or {}, "alpha_pattern": config.get("alpha_pattern") or {}}


def _check_supported(config: dict, file: str) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type {peft_type!r} is not supported; allowed: 'LORA'")
    for field, reason in _MUST_BE_OFF.items():
        if config.get(field):
            raise LoraError(f"{file}: {reason} ({field} = {config[field]!r})")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{file}: bias {config['bias']!r} is not supported (bias terms); allowed: 'none'")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for name in ("embed_tokens", "lm_head"):
        if any(name in target for target in targets):
            raise LoraError(f"{file}: target_modules {targets} includes {name}; LoRA on the embeddings or "
                            f"lm_head is not supported, only on {', '.join(HF_MODULES)}")
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoraError(f"{file}: {field} must be a positive number, got {value!r}")
    for field, kinds in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict):
            raise LoraError(f"{file}: {field} must be an object (module pattern -> value), got {patterns!r}")
        for pattern, value in patterns.items():
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                raise LoraError(f"{file}: {field}[{pattern!r}] must be a positive "
                                f"{'integer' if kinds is int else 'number'}, got {value!r}")


def _read_tensors(path: str) -> tuple[str, dict[str, torch.Tensor]]:
    """(file, tensors) of the first weight file present in ``path``."""
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            break
    else:
        raise LoraError(f"{path} has no adapter weights: neither {' nor '.join(WEIGHT_FILES)} exists")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file
            return file, load_file(file, device="cpu")
        return file, torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: name it, whatever the reader raised
        raise LoraError(f"cannot read adapter weights {file}: {err}") from None


def _match_key(key: str, file: str) -> re.Match:
    """The parsed key of a LoRA A/B weight on a decoder layer's projection; anything else is refused."""
    if "lora_embedding" in key:
        raise LoraError(f"tensor {key} in {file}: lora_embedding_* tensors (LoRA on the embeddings) are not supported")
    if "embed_tokens" in key or "lm_head" in key:
        raise LoraError(f"tensor {key} in {file}: embed_tokens / lm_head adapters are not supported")
    if ".lora_" in key and key.endswith(".bias"):
        raise LoraError(f"tensor {key} in {file}: LoRA bias tensors are not supported")
    match = _KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
    if match is None:
        raise LoraError(f"tensor {key} in {file} is not a lora_A/lora_B weight of a decoder layer's "
                        f"self_attn/mlp projection; supported modules: {', '.join(HF_MODULES)}")
    if match["name"] not in HF_MODULES:
        raise LoraError(f"tensor {key} in {file}: module {match['name']!r} is not supported; "
                        f"allowed: {', '.join(HF_MODULES)}")
    return match


def _module(slot: tuple[int, str], pair: dict, module_path: str, config: dict, file: str) -> PeftModule:
    layer, name = slot
    for ab, other in (("A", "B"), ("B", "A")):
        if ab not in pair:
            raise LoraError(f"{file}: layer {layer} {name} has a lora_{other}.weight but no lora_{ab}.weight")
    (key_a, a), (key_b, b) = pair["A"], pair["B"]
    rank = _pattern_value(config["rank_pattern"], module_path, config["r"])
    alpha = _pattern_value(config["alpha_pattern"], module_path, config["lora_alpha"])
    _check_shape(key_a, a, (rank, -1), "(r, in_features), r from the config")
    _check_shape(key_b, b, (-1, rank), "(out_features, r), r from the config")
    for key, t in ((key_a, a), (key_b, b)):
        # A float32 sum is inf or nan exactly when the tensor holds an inf or a nan (no adapter's
        # finite weights come near float32's range), at a sixth of torch.isfinite's cost on bf16.
        if not torch.isfinite(t.sum(dtype=torch.float32)):
            raise LoraError(f"tensor {key} in {file} holds non-finite values (inf or nan)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    # Kept in the stored dtype (float64 aside): the slots are in the model dtype anyway, and
    # torch scales a bf16/fp16 B through float32 with one rounding, as a float32 copy would get
    # when cast into the slot. Widening every tensor cost a third of a large adapter's parse.
    if a.dtype == torch.float64:
        a, b = a.float(), b.float()
    return PeftModule(layer, name, key_a, a, b * scale)


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern/alpha_pattern rule: the first pattern (a regex) that matches the end of
    the module path at a dot boundary wins, e.g. "q_proj" or "layers.0.self_attn.q_proj" match
    "model.layers.0.self_attn.q_proj"; no match gives ``default``."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_path):
            return value
    return default


def _check_shape(key: str, t: torch.Tensor, expected: tuple[int, int], meaning: str) -> None:
    """``expected`` -1: any size."""
    if t.dim() != 2 or any(e != -1 and s != e for s, e in zip(t.shape, expected)):
        shown = ", ".join("?" if e == -1 else str(e) for e in expected)
        raise LoraError(f"tensor {key} has shape {tuple(t.shape)}, expected ({shown}) {meaning}")
