"""What converting any Hugging Face checkpoint needs, whatever the family (engine/convert.py for the
Llama-block, Gemma, MoE, gpt-oss and GPT-2 families, engine/convert_decoder.py for the configurable
decoders): the tensor getter and its error, reading tensors that go by more than one name, the
tensor-parallel split, and the config fields every family reads the same way (rope, sliding window).
"""
from __future__ import annotations

from typing import Callable

import torch

TensorGetter = Callable[[str], torch.Tensor]  # HF tensor name -> tensor (any dtype, on CPU)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or unreadable; the message names the file."""


# ---- config ---------------------------------------------------------------------------------

def sliding_window_fields(hf_config) -> dict:
    """``sliding_window`` and ``layer_types`` of a ModelConfig, as transformers applies them:
    Mistral (and Mixtral, Phi-3) window every layer when ``sliding_window`` is set; configs with a
    ``use_sliding_window`` flag (Qwen2, Qwen3, SmolLM3) only when it is true, on the layers their
    ``layer_types`` lists (Qwen: from ``max_window_layers`` on); Gemma alternates."""
    window = getattr(hf_config, "sliding_window", None)
    if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
        window = None
    if not window:
        return {"sliding_window": None, "layer_types": None}
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and all(t == "sliding_attention" for t in layer_types):
        layer_types = None  # None: every layer
    return {"sliding_window": int(window), "layer_types": list(layer_types) if layer_types is not None else None}


def read_rope(hf_config) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial_rotary_factor) from transformers 5's ``rope_parameters`` or 4's
    ``rope_theta``/``rope_scaling``/``partial_rotary_factor``.

    The scaling dict is completed with what its frequencies depend on outside it (so the engine
    needs no HF config): ``original_max_position_embeddings`` for yarn/longrope/llama3 (Phi-3 keeps
    it beside the dict, and that value wins as in transformers), ``max_position_embeddings`` for
    dynamic, longrope and yarn (their default factor and attention factor come from it). Phi-3's
    older names "su" and "yarn" for LongRoPE become "longrope".
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    partial = params.pop("partial_rotary_factor", None) or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    scaling = dict(params or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None, float(partial)
    if getattr(hf_config, "model_type", "") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        scaling["original_max_position_embeddings"] = (
            original or scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
    if rope_type in ("dynamic", "yarn", "longrope"):
        scaling["max_position_embeddings"] = hf_config.max_position_embeddings
    return float(theta), scaling, float(partial)


def decoder_shape(c, *, tie_word_embeddings_default: bool) -> dict:
    """The fields every Hugging Face decoder config names alike (Llama family, Gemma, DeepSeek, Llama 4): sizes,
    heads (GQA when num_key_value_heads is set), RMSNorm eps and learned/rope position limit."""
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        norm_eps=float(c.rms_norm_eps),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", tie_word_embeddings_default)),
    )


# ---- weights --------------------------------------------------------------------------------

def shard(t: torch.Tensor, dim: int, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s 1/tp_size of ``t`` along ``dim`` (engine/lora/pool.py splits adapters so too)."""
    return t.chunk(tp_size, dim=dim)[rank]


def has_tensor(get: TensorGetter, name: str) -> bool:
    try:
        get(name)
    except CheckpointError:
        return False
    return True


def first_present(get: TensorGetter, *names: str) -> torch.Tensor:
    """The first of ``names`` the checkpoint holds; a CheckpointError naming the first when none.
    Each name is read once (has_tensor then get would read the found tensor twice)."""
    first_error = None
    for name in names:
        try:
            return get(name)
        except CheckpointError as error:
            first_error = first_error or error
    raise first_error


# Per-expert tensor names of the checkpoints on disk, (gate, up, down) under a layer's prefix.
_EXPERT_NAMES = ("block_sparse_moe.experts.{}.w1.weight", "block_sparse_moe.experts.{}.w3.weight",
                 "block_sparse_moe.experts.{}.w2.weight")  # Mixtral
_EXPERT_NAMES_MLP = ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight",
                     "mlp.experts.{}.down_proj.weight")  # Qwen3-MoE


def stacked_experts(get: TensorGetter, hf_layer: str, num_experts: int, mlp: str = "mlp.") -> tuple[torch.Tensor, ...]:
    """(gate (E, I, H), up (E, I, H), down (E, H, I)) of one layer, from either layout: the
    per-expert tensors of a checkpoint on disk, or transformers 5's in-memory stacked
    ``mlp.experts.gate_up_proj`` (E, 2I, H) = [gate | up] and ``mlp.experts.down_proj``.
    ``mlp``: the prefix of the experts after ``hf_layer`` (Jamba: "", its ``hf_layer`` ending in
    ``feed_forward.``; its per-expert names are Qwen3-MoE's)."""
    try:
        gate_up = get(hf_layer + mlp + "experts.gate_up_proj")
    except CheckpointError:
        pass
    else:
        gate, up = gate_up.chunk(2, dim=1)
        return gate, up, get(hf_layer + mlp + "experts.down_proj")
    if mlp != "mlp.":
        names = tuple(mlp + name[len("mlp."):] for name in _EXPERT_NAMES_MLP)
        return tuple(torch.stack([get(hf_layer + name.format(e)) for e in range(num_experts)]) for name in names)
    names = _EXPERT_NAMES_MLP if has_tensor(get, hf_layer + _EXPERT_NAMES_MLP[0].format(0)) else _EXPERT_NAMES
    return tuple(torch.stack([get(hf_layer + name.format(e)) for e in range(num_experts)]) for name in names)
