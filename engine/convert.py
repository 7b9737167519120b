"""Checkpoint conversion: Hugging Face weights -> fused, sharded, cast engine weights.

Sources: a Hugging Face directory (``config.json`` + ``*.safetensors``) or a GGUF file, which
transformers dequantizes to float32 on load. Per rank, the output holds exactly the tensors
the engine model declares (names in docs/INTERFACES.md):

- q/k/v are fused to ``qkv_proj`` with rows [q_r | k_r | v_r], each split by heads, so every
  rank's slice is itself a fused projection;
- gate/up are fused to ``gate_up_proj`` with rows [gate_r | up_r];
- o_proj / down_proj (and GPT-2's c_proj's) are split along their input columns;
- embeddings and lm_head are split by vocab rows;
- Gemma's (1 + w) RMSNorm weights are stored as ``1 + w`` (added in float32 before the cast), so
  the engine's plain RMSNorm applies them.
- Phi-3's fused qkv_proj/gate_up_proj are split back into their parts first (unfused_phi3_getter),
  so they shard like the rest; Qwen3's q_norm/k_norm are replicated;
- with partial rotary, q/k head dims are reordered (kernels.rotary.partial_rotary_order);
- gpt-oss's experts come as transformers holds them, (E, in, out) with gate and up interleaved
  columns (gate 0, up 0, gate 1, ...): they are transposed to the engine's (E, out, in) and split
  into [gate_r | up_r] rows per rank, their biases likewise (gpt_oss_rank_weights); MXFP4 experts
  are kept as their codes and scales (rows de-interleaved and split the same way, down's input
  columns split on 32-value groups) or widened first (engine/mxfp4.py).
"""
from __future__ import annotations

import os
from typing import Iterator, Mapping

import torch

from engine.config import (DECODER_ARCHITECTURES, GEMMA_ARCHITECTURES, HYBRID_ARCHITECTURES, LLAMA4_ARCHITECTURES,
                           MLA_ARCHITECTURES, MOE_ARCHITECTURES, ConfigError, ModelConfig, check_tp_divides,
                           keeps_float32)
from engine.convert_decoder import MODEL_TYPES, decoder_config_from_hf, decoder_rank_weights
from engine.ssm.convert import MODEL_TYPES as HYBRID_MODEL_TYPES, hybrid_config_from_hf, hybrid_rank_weights
from engine.convert_deepseek import deepseek_config_from_hf, deepseek_rank_weights
from engine.convert_llama4 import llama4_config_from_hf, llama4_rank_weights
from engine.hf_checkpoint import (CheckpointError, TensorGetter, first_present, has_tensor, read_rope, shard,
                                  sliding_window_fields, stacked_experts, decoder_shape)
from engine.models import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError
from engine.safetensors_stream import SafetensorsFormatError, SafetensorsReader
from kernels.moe_epilogue import SWIGLU_ALPHA
from kernels.rotary import partial_rotary_order

# ---- config ---------------------------------------------------------------------------------

# Multimodal checkpoints whose language model the engine serves on its own (text in, text out;
# the vision tower and projector are not converted): architecture -> the text model's.
MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                          "Llama4ForConditionalGeneration": "Llama4ForCausalLM"}

# Remote-code checkpoints (their modeling files ship in the directory) that have no converter:
# architecture -> what the converter would have to read, named so users know what is missing.
UNCONVERTED_REMOTE_CODE = {
    "BaiChuanForCausalLM": "Baichuan (v1) 7B (remote code) has no converter; Baichuan 2 7B (BaichuanForCausalLM) has",
}


def model_config_from_hf(hf_config) -> ModelConfig:
    """Map a transformers config object (v4 or v5 layout) to a validated ModelConfig."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else _architecture_from_model_type(hf_config)
    if architecture in MULTIMODAL_TEXT_MODELS:
        hf_config, architecture = hf_config.text_config, MULTIMODAL_TEXT_MODELS[architecture]
    if architecture in UNCONVERTED_REMOTE_CODE:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}: {UNCONVERTED_REMOTE_CODE[architecture]}"
        )
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if architecture in DECODER_ARCHITECTURES:
        return decoder_config_from_hf(hf_config, architecture)
    if architecture in HYBRID_ARCHITECTURES:
        return hybrid_config_from_hf(hf_config, architecture)
    if architecture in MLA_ARCHITECTURES:
        return deepseek_config_from_hf(hf_config, architecture)
    if architecture in LLAMA4_ARCHITECTURES:
        return llama4_config_from_hf(hf_config, architecture)
    if architecture == "GPT2LMHeadModel":
        return _gpt2_config(hf_config)
    if architecture in GEMMA_ARCHITECTURES:
        return _gemma_config(hf_config, architecture)
    if architecture == "GptOssForCausalLM":
        return _gpt_oss_config(hf_config)
    if architecture in MOE_ARCHITECTURES:
        return _moe_config(hf_config, architecture)
    return _llama_family_config(hf_config, architecture)


def _architecture_from_model_type(hf_config) -> str:
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
               "smollm3": "SmolLM3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "gemma3": "Gemma3ForConditionalGeneration", "mixtral": "MixtralForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "llama4_text": "Llama4ForCausalLM", "llama4": "Llama4ForConditionalGeneration"}
    by_type.update(MODEL_TYPES)
    by_type.update(HYBRID_MODEL_TYPES)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in by_type:
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return by_type[model_type]


# Llama-block architectures and what each adds to the block (the weights differ only for Phi-3,
# whose q/k/v and gate/up come fused: see unfused_phi3_getter).
_QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM",)
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _llama_family_config(c, architecture: str, **moe_fields) -> ModelConfig:
    if getattr(c, "mlp_bias", False) or (architecture not in _QKV_BIAS_ARCHITECTURES and getattr(c, "attention_bias", False)):
        raise ConfigError(f"{architecture} with attention_bias/mlp_bias is not supported")
    theta, scaling, partial_rotary_factor = read_rope(c)
    return ModelConfig(
        architecture=architecture,
        **decoder_shape(c, tie_word_embeddings_default=False),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=architecture in _QKV_BIAS_ARCHITECTURES,
        hidden_act=c.hidden_act,
        qk_norm=architecture in _QK_NORM_ARCHITECTURES,
        partial_rotary_factor=partial_rotary_factor,
        layers_without_rope=_layers_without_rope(c),
        # Qwen3-VL's language model: set on its text config by engine/vision/qwen3_vl.text_config
        deepstack_layers=getattr(c, "deepstack_layers", 0),
        **sliding_window_fields(c),
        **moe_fields,
    ).validate()


def _gemma_config(c, architecture: str) -> ModelConfig:
    if getattr(c, "attention_bias", False):
        raise ConfigError(f"{architecture} with attention_bias is not supported")
    if getattr(c, "use_bidirectional_attention", False):
        raise ConfigError(f"{architecture} with use_bidirectional_attention is not supported (decoders only)")
    local_theta = None
    if architecture == "Gemma3ForCausalLM":  # rope_parameters per layer type (transformers 5)
        by_type = dict(getattr(c, "rope_parameters", None) or {})
        if "full_attention" in by_type:
            global_params, local_params = by_type["full_attention"], by_type.get("sliding_attention") or {}
            scaling = dict(global_params)
            theta = float(scaling.pop("rope_theta", 1_000_000.0))
            if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            if local_params.get("rope_type", "default") != "default":
                raise ConfigError(f"{architecture}: rope scaling of the sliding layers "
                                  f"({local_params['rope_type']!r}) is not supported; allowed: default")
            local_theta = float(local_params.get("rope_theta", 10000.0))
        else:  # transformers 4 layout
            theta, scaling, _ = read_rope(c)
            local_theta = float(getattr(c, "rope_local_base_freq", 10000.0))
    else:
        theta, scaling, _ = read_rope(c)
    return ModelConfig(
        architecture=architecture,
        **decoder_shape(c, tie_word_embeddings_default=True),
        rope_theta=theta,
        rope_scaling=scaling,
        hidden_act=getattr(c, "hidden_activation", None) or c.hidden_act,
        query_pre_attn_scalar=float(c.query_pre_attn_scalar),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping (engine/models/gemma.py)
        attn_logit_softcapping=(getattr(c, "attn_logit_softcapping", None) if architecture == "Gemma2ForCausalLM"
                                else None),
        final_logit_softcapping=getattr(c, "final_logit_softcapping", None),
        rope_local_theta=local_theta,
        **sliding_window_fields(c),
    ).validate()


def _layers_without_rope(c) -> list[int]:
    """SmolLM3's ``no_rope_layers`` holds one flag per layer, 1 = rope, 0 = none (NoPE)."""
    flags = getattr(c, "no_rope_layers", None)
    return [] if flags is None else [i for i, use_rope in enumerate(flags) if not use_rope]


def _moe_config(c, architecture: str) -> ModelConfig:
    """The Llama-family fields plus the experts'. Mixtral: every layer sparse, experts of width
    intermediate_size, top-k weights always renormalised. Qwen3-MoE: experts of width
    moe_intermediate_size, dense layers (mlp_only_layers, decoder_sparse_step) of width
    intermediate_size, renormalised only with norm_topk_prob."""
    if architecture == "MixtralForCausalLM":
        experts = dict(num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
                       moe_intermediate_size=c.intermediate_size, norm_topk_prob=True)
    else:
        experts = dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                       moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
                       decoder_sparse_step=c.decoder_sparse_step or 1,
                       mlp_only_layers=sorted(getattr(c, "mlp_only_layers", None) or []))
    return _llama_family_config(c, architecture, **experts)


def _gpt_oss_config(c) -> ModelConfig:
    """gpt-oss: every layer sparse (experts of width intermediate_size, top-k of the router's
    logits softmaxed over the chosen: softmax then top-k then renormalise is the same), q/k/v and
    o_proj biases, attention sinks, sliding and full layers alternating (layer_types), yarn."""
    alpha = getattr(c, "swiglu_alpha", SWIGLU_ALPHA)
    if alpha != SWIGLU_ALPHA:
        raise ConfigError(f"GptOssForCausalLM with swiglu_alpha {alpha} is not supported; the experts' kernels "
                          f"use gpt-oss's {SWIGLU_ALPHA}")
    if not getattr(c, "attention_bias", True):
        raise ConfigError("GptOssForCausalLM without attention_bias is not supported")
    theta, scaling, _ = read_rope(c)
    return ModelConfig(
        architecture="GptOssForCausalLM",
        **decoder_shape(c, tie_word_embeddings_default=False),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=True,
        hidden_act=c.hidden_act,
        num_experts=c.num_local_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size,
        norm_topk_prob=True,
        swiglu_limit=float(c.swiglu_limit),
        **sliding_window_fields(c),
    ).validate()


def _gpt2_config(c) -> ModelConfig:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(c, flag, False):
            raise ConfigError(f"GPT-2 checkpoints with {flag}=True are not supported")
    if not getattr(c, "scale_attn_weights", True):
        raise ConfigError("GPT-2 checkpoints with scale_attn_weights=False are not supported")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        intermediate_size=c.n_inner or 4 * c.n_embd,
        norm_eps=float(c.layer_norm_epsilon),
        max_position_embeddings=c.n_positions,
        tie_word_embeddings=True,
        qkv_bias=True,
        hidden_act=c.activation_function,
    ).validate()


# ---- weights --------------------------------------------------------------------------------

def unfused_phi3_getter(get: TensorGetter, cfg: ModelConfig) -> TensorGetter:
    """Serve Phi-3's fused ``qkv_proj`` (rows [q | k | v]) and ``gate_up_proj`` (rows [gate | up])
    under the Llama names (``q_proj``, ..., ``up_proj``), so the Llama conversion shards them
    per rank like any other checkpoint. The last fused tensor read is kept for its siblings."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    last: dict[str, torch.Tensor] = {}

    def get_unfused(name: str) -> torch.Tensor:
        prefix, part, suffix = name.rsplit(".", 2) if name.count(".") >= 2 else (name, "", "")
        if part not in parts:
            return get(name)
        fused_name, index = parts[part]
        fused_name = f"{prefix}.{fused_name}.{suffix}"
        if fused_name not in last:
            last.clear()
            last[fused_name] = get(fused_name)
        fused = last[fused_name]
        sizes = [q_rows, kv_rows, kv_rows] if fused_name.endswith(f"qkv_proj.{suffix}") else [fused.shape[0] // 2] * 2
        return fused.split(sizes, dim=0)[index]

    return get_unfused


def rotary_dim_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The engine's order of each q/k head's dims (kernels.rotary.partial_rotary_order) when rope
    rotates only part of a head; None when it rotates all of it (no reorder)."""
    return None if cfg.rotary_dim == cfg.head_dim else partial_rotary_order(cfg.head_dim, cfg.rotary_dim)


def reorder_rotary_dims(t: torch.Tensor, order: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Reorder the dims of every head of a q/k weight (heads * head_dim, ...) or bias/norm weight."""
    if order is None:
        return t
    return t.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def llama_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of a Llama-family checkpoint, layer by layer.

    Partial rotary (``rotary_dim < head_dim``): the dims of each q and k head (and of q/k norms)
    are stored in the order of ``kernels.rotary.partial_rotary_order``, which lets the full-head
    rotary kernels rotate exactly the checkpoint's rotary dims; q.k is unchanged by the reorder.
    """
    if cfg.architecture == "Phi3ForCausalLM":
        get = unfused_phi3_getter(get, cfg)
    order = rotary_dim_order(cfg)
    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        rope_order = None if i in cfg.layers_without_rope else order
        yield f"layers.{i}.input_norm.weight", get(hf + "input_layernorm.weight")
        yield f"layers.{i}.qkv_proj.weight", _fused_qkv(get, hf, "weight", rope_order, cfg, rank, tp_size)
        if cfg.qkv_bias:
            yield f"layers.{i}.qkv_proj.bias", _fused_qkv(get, hf, "bias", rope_order, cfg, rank, tp_size)
        if cfg.qk_norm:
            for p in "qk":
                yield f"layers.{i}.{p}_norm.weight", reorder_rotary_dims(get(hf + f"self_attn.{p}_norm.weight"),
                                                                   rope_order, cfg.head_dim)
        yield f"layers.{i}.o_proj.weight", shard(get(hf + "self_attn.o_proj.weight"), 1, rank, tp_size)
        yield f"layers.{i}.post_attn_norm.weight", get(hf + "post_attention_layernorm.weight")
        gate_up = [shard(get(hf + f"mlp.{p}_proj.weight"), 0, rank, tp_size) for p in ("gate", "up")]
        yield f"layers.{i}.gate_up_proj.weight", torch.cat(gate_up, dim=0)
        yield f"layers.{i}.down_proj.weight", shard(get(hf + "mlp.down_proj.weight"), 1, rank, tp_size)
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)


def gemma_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of Gemma 2/3: the Llama fusion and sharding, the
    extra norms, and every norm weight w stored as 1 + w (float32 add, cast later)."""
    def norm(name: str) -> torch.Tensor:
        return get(name).float() + 1.0

    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "pre_ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}
    if cfg.architecture == "Gemma3ForCausalLM":
        norms.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        for engine_name, hf_name in norms.items():
            yield f"layers.{i}.{engine_name}.weight", norm(hf + hf_name + ".weight")
        qkv = [shard(get(hf + f"self_attn.{p}_proj.weight"), 0, rank, tp_size) for p in "qkv"]
        yield f"layers.{i}.qkv_proj.weight", torch.cat(qkv, dim=0)
        yield f"layers.{i}.o_proj.weight", shard(get(hf + "self_attn.o_proj.weight"), 1, rank, tp_size)
        gate_up = [shard(get(hf + f"mlp.{p}_proj.weight"), 0, rank, tp_size) for p in ("gate", "up")]
        yield f"layers.{i}.gate_up_proj.weight", torch.cat(gate_up, dim=0)
        yield f"layers.{i}.down_proj.weight", shard(get(hf + "mlp.down_proj.weight"), 1, rank, tp_size)
    yield "norm.weight", norm("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)
def _fused_qkv(get: TensorGetter, hf: str, kind: str, order, cfg: ModelConfig, rank: int, tp_size: int) -> torch.Tensor:
    """This rank's [q_r | k_r | v_r] rows of a layer's q/k/v ``kind`` ("weight" or "bias")."""
    q, k, v = (get(hf + f"self_attn.{p}_proj.{kind}") for p in "qkv")
    q, k = reorder_rotary_dims(q, order, cfg.head_dim), reorder_rotary_dims(k, order, cfg.head_dim)
    return torch.cat([shard(t, 0, rank, tp_size) for t in (q, k, v)], dim=0)


def moe_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of a Mixtral / Qwen3-MoE checkpoint: the Llama
    family's tensors, with each sparse layer's MLP as its router (replicated) and its experts
    stacked and sliced along their width (engine/models/moe.py says why). Neither family has
    partial rotary or q/k/v biases (ModelConfig.validate refuses them for these architectures)."""
    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        yield f"layers.{i}.input_norm.weight", get(hf + "input_layernorm.weight")
        yield f"layers.{i}.qkv_proj.weight", _fused_qkv(get, hf, "weight", None, cfg, rank, tp_size)
        if cfg.qk_norm:  # Qwen3-MoE
            for p in "qk":
                yield f"layers.{i}.{p}_norm.weight", get(hf + f"self_attn.{p}_norm.weight")
        yield f"layers.{i}.o_proj.weight", shard(get(hf + "self_attn.o_proj.weight"), 1, rank, tp_size)
        yield f"layers.{i}.post_attn_norm.weight", get(hf + "post_attention_layernorm.weight")
        if not cfg.is_moe_layer(i):
            gate_up = [shard(get(hf + f"mlp.{p}_proj.weight"), 0, rank, tp_size) for p in ("gate", "up")]
            yield f"layers.{i}.gate_up_proj.weight", torch.cat(gate_up, dim=0)
            yield f"layers.{i}.down_proj.weight", shard(get(hf + "mlp.down_proj.weight"), 1, rank, tp_size)
            continue
        yield f"layers.{i}.moe.router.weight", first_present(get, hf + "mlp.gate.weight",
                                                             hf + "block_sparse_moe.gate.weight")
        gate, up, down = stacked_experts(get, hf, cfg.num_experts)
        yield f"layers.{i}.moe.gate_up_proj", torch.cat([shard(gate, 1, rank, tp_size),
                                                          shard(up, 1, rank, tp_size)], dim=1)
        yield f"layers.{i}.moe.down_proj", shard(down, 2, rank, tp_size)
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)


def gpt_oss_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of gpt-oss (engine/models/gpt_oss.py): the Llama
    attention with biases on q/k/v and o_proj and each rank's heads' sinks; every layer's router
    (with its bias) replicated, its experts transposed from transformers' (E, in, out), gate and up
    de-interleaved and sliced along their width like moe_rank_weights', gate_up_bias likewise, and
    down_bias replicated (the model adds it on rank 0 only)."""
    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    for i in range(cfg.num_layers):
        hf, out = f"model.layers.{i}.", f"layers.{i}."
        yield out + "input_norm.weight", get(hf + "input_layernorm.weight")
        for kind in ("weight", "bias"):
            yield out + f"qkv_proj.{kind}", _fused_qkv(get, hf, kind, None, cfg, rank, tp_size)
        yield out + "sinks", shard(get(hf + "self_attn.sinks"), 0, rank, tp_size)
        yield out + "o_proj.weight", shard(get(hf + "self_attn.o_proj.weight"), 1, rank, tp_size)
        yield out + "o_proj.bias", get(hf + "self_attn.o_proj.bias")
        yield out + "post_attn_norm.weight", get(hf + "post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            yield out + f"moe.router.{kind}", get(hf + f"mlp.router.{kind}")
        experts = hf + "mlp.experts."
        if cfg.expert_quantization == "mxfp4":
            yield from _mxfp4_experts(get, experts, out, rank, tp_size)
        else:
            gate_up = get(experts + "gate_up_proj").transpose(1, 2)  # (E, 2I, H), rows gate 0, up 0, gate 1, ...
            yield out + "moe.gate_up_proj", _gate_up_rows(gate_up, rank, tp_size)
            yield out + "moe.down_proj", shard(get(experts + "down_proj").transpose(1, 2), 2, rank, tp_size)
        bias = get(experts + "gate_up_proj_bias")  # (E, 2I), gate and up alternating
        yield out + "moe.gate_up_bias", _gate_up_rows(bias, rank, tp_size)
        yield out + "moe.down_bias", get(experts + "down_proj_bias")
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)


def _mxfp4_experts(get: TensorGetter, experts: str, out: str, rank: int, tp_size: int):
    """A layer's MXFP4 experts for one rank, kept (engine/mxfp4.py serves ``_blocks`` as codes
    (E, rows, K/2) and ``_scales`` (E, rows, K/32), rows = output features): gate_up's rows
    de-interleaved into [gate_r | up_r], down's input columns split, bytes and scales alike (the
    split falls on a 32-value group: keep_mxfp4_checkpoint checked)."""
    for name in ("gate_up_proj", "down_proj"):
        codes, scales = get(experts + name + "_blocks"), get(experts + name + "_scales")
        if name == "gate_up_proj":
            codes, scales = _gate_up_rows(codes, rank, tp_size), _gate_up_rows(scales, rank, tp_size)
        else:
            codes, scales = shard(codes, 2, rank, tp_size), shard(scales, 2, rank, tp_size)
        yield out + f"moe.{name}", codes
        yield out + f"moe.{name}_scale", scales


def _gate_up_rows(interleaved: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """(E, 2I, ...) with gate and up alternating along dim 1 -> this rank's (E, 2 * I_r, ...) [gate_r | up_r]."""
    gate, up = interleaved[:, 0::2], interleaved[:, 1::2]
    return torch.cat([shard(gate, 1, rank, tp_size), shard(up, 1, rank, tp_size)], dim=1)


def gpt2_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of GPT-2; HF Conv1D weights are (in, out), so transposed."""
    hidden = cfg.hidden_size
    yield "wte.weight", shard(get("transformer.wte.weight"), 0, rank, tp_size)
    yield "wpe.weight", get("transformer.wpe.weight")
    for i in range(cfg.num_layers):
        hf, out = f"transformer.h.{i}.", f"layers.{i}."
        for norm in ("ln_1", "ln_2"):
            yield out + f"{norm}.weight", get(hf + f"{norm}.weight")
            yield out + f"{norm}.bias", get(hf + f"{norm}.bias")
        qkv_w = get(hf + "attn.c_attn.weight").t().split(hidden, dim=0)
        qkv_b = get(hf + "attn.c_attn.bias").split(hidden, dim=0)
        yield out + "qkv_proj.weight", torch.cat([shard(w, 0, rank, tp_size) for w in qkv_w])
        yield out + "qkv_proj.bias", torch.cat([shard(b, 0, rank, tp_size) for b in qkv_b])
        yield out + "o_proj.weight", shard(get(hf + "attn.c_proj.weight").t(), 1, rank, tp_size)
        yield out + "o_proj.bias", get(hf + "attn.c_proj.bias")
        yield out + "fc_in.weight", shard(get(hf + "mlp.c_fc.weight").t(), 0, rank, tp_size)
        yield out + "fc_in.bias", shard(get(hf + "mlp.c_fc.bias"), 0, rank, tp_size)
        yield out + "fc_out.weight", shard(get(hf + "mlp.c_proj.weight").t(), 1, rank, tp_size)
        yield out + "fc_out.bias", get(hf + "mlp.c_proj.bias")
    yield "ln_f.weight", get("transformer.ln_f.weight")
    yield "ln_f.bias", get("transformer.ln_f.bias")


def iter_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every engine tensor of ``rank``: fused, sharded, cast to ``dtype`` (floating-point
    tensors: kept MXFP4 codes and exponents stay uint8), contiguous."""
    check_tp_divides(cfg, tp_size)
    convert = gpt2_rank_weights if cfg.architecture == "GPT2LMHeadModel" else llama_rank_weights
    if cfg.architecture in GEMMA_ARCHITECTURES:
        convert = gemma_rank_weights
    if cfg.architecture in MOE_ARCHITECTURES:
        convert = gpt_oss_rank_weights if cfg.architecture == "GptOssForCausalLM" else moe_rank_weights
    if cfg.architecture in DECODER_ARCHITECTURES:
        convert = decoder_rank_weights
    if cfg.architecture in HYBRID_ARCHITECTURES:
        convert = hybrid_rank_weights
    if cfg.architecture in MLA_ARCHITECTURES:
        convert = deepseek_rank_weights
    if cfg.architecture in LLAMA4_ARCHITECTURES:
        convert = llama4_rank_weights
    for name, tensor in convert(get, cfg, rank, tp_size):
        cast = torch.float32 if keeps_float32(cfg.architecture, name) else dtype
        # One copy at most, straight into the contiguous layout (a transposed view cast, then made contiguous,
        # would be copied twice: Scout's experts' down block is one).
        # (``to`` with the dtype unchanged returns the view as it is, hence ``contiguous`` after it.)
        converted = (tensor.to(cast, memory_format=torch.contiguous_format) if tensor.is_floating_point()
                     else tensor).contiguous()
        del tensor  # the tensor before the cast is not held while the caller uses the cast one
        yield name, converted
        del converted  # nor the cast one while the next tensor converts


def rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return dict(iter_rank_weights(get, cfg, rank, tp_size, dtype))


def language_model_getter(hf_config, get: TensorGetter) -> TensorGetter:
    """For a multimodal checkpoint (MULTIMODAL_TEXT_MODELS), a getter that finds the language
    model's tensors under the text-model names (``model.layers.0...``, ``lm_head.weight``):
    transformers 5 saves them as ``model.language_model.*``, transformers 4 as
    ``language_model.model.*`` / ``language_model.lm_head.*``. Other checkpoints: ``get`` itself."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else getattr(hf_config, "model_type", None)
    if architecture not in MULTIMODAL_TEXT_MODELS and architecture not in ("gemma3", "llama4"):
        return get

    def get_text(name: str) -> torch.Tensor:
        rest = name.removeprefix("model.")
        candidates = ([f"model.language_model.{rest}", f"language_model.model.{rest}"] if name.startswith("model.")
                      else [name, f"language_model.{name}"])
        for candidate in candidates[:-1]:
            try:
                return get(candidate)
            except CheckpointError:
                continue
        return get(candidates[-1])  # its CheckpointError names the last layout tried

    return get_text


def getter_from_state_dict(state_dict: Mapping[str, torch.Tensor], source: str) -> TensorGetter:
    """A TensorGetter over an in-memory state dict; a missing tensor is a CheckpointError."""
    # Some checkpoints (GGUF-loaded, or saved from a bare base model) lack the "model." prefix.
    def get(name: str) -> torch.Tensor:
        for candidate in (name, name.removeprefix("model.").removeprefix("transformer.")):
            if candidate in state_dict:
                return state_dict[candidate]
        raise CheckpointError(f"checkpoint {source!r} lacks the tensor {name!r}")

    return get


class _SafetensorsIndex(Mapping):
    """Read-only name -> tensor view over several safetensors files; each tensor is read on access into
    memory of its own (engine/safetensors_stream.py: a mapped file would keep every tensor read resident), so a
    conversion holds only the tensors it still uses. A file the reader does not take (a dtype it does not
    know) is read through safetensors' ``safe_open``, which says what is wrong with a corrupt one."""

    def __init__(self, paths: list[str]):
        from safetensors import SafetensorError, safe_open

        self._handles = {}
        for path in paths:
            try:
                handle = SafetensorsReader(path)
            except (SafetensorsFormatError, OSError):
                try:
                    handle = safe_open(path, framework="pt")
                except (SafetensorError, OSError) as err:
                    raise CheckpointError(f"cannot read {path} (corrupt or truncated safetensors file): {err}") from None
            self._handles.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def getter_from_safetensors_dir(checkpoint_dir: str) -> TensorGetter:
    """A lazy TensorGetter over every ``*.safetensors`` file of a HF directory (sharded or not)."""
    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(
            f"checkpoint directory {checkpoint_dir!r} holds no *.safetensors files; "
            "allowed inputs: a HF directory with config.json + safetensors weights, or a .gguf file"
        )
    index = _SafetensorsIndex([os.path.join(checkpoint_dir, f) for f in files])
    return getter_from_state_dict(index, checkpoint_dir)
