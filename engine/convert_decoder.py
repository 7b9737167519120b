"""Hugging Face checkpoints of the configurable-decoder families (engine/models/decoder.py) ->
ModelConfig block options and engine weights.

Each family is two things here: a config mapping (which block options its checkpoints use) and a
``_Layout``: where its tensors live and how its q/k/v come (separate, fused [q | k | v], fused per
head [q_h | k_h | v_h], or Falcon's per-KV-group [q.. | k | v]). ``decoder_rank_weights`` turns any
layout into the engine names, splitting q/k/v into their parts and sharding them by heads exactly
as engine/convert.py's Llama conversion does, so every rank's ``qkv_proj`` is [q_r | k_r | v_r].

Rotary dims: with partial rotary (GPT-NeoX, GPT-J, GLM-4) each q/k head is reordered as
kernels.rotary.partial_rotary_order says; with interleaved pairs (GPT-J, GLM-4) the rotary dims are
first de-interleaved (even dims, then odd), which maps pair (2i, 2i + 1) onto the kernels' pair
(i, i + rotary_dim / 2). q.k is unchanged by any reorder applied to both q and k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.config import ConfigError, ModelConfig
from engine.hf_checkpoint import TensorGetter, first_present, read_rope, shard, sliding_window_fields
from kernels.rotary import partial_rotary_order


# ---- config ---------------------------------------------------------------------------------

def _rope_fields(c, default_theta: float = 10000.0) -> dict:
    theta, scaling, partial = read_rope(c)  # the shared rope reader (v4 and v5 layouts)
    return {"rope_theta": theta or default_theta, "rope_scaling": scaling, "partial_rotary_factor": partial}


def _shape(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, eps: float, positions: int,
           tie: bool, head_dim: int | None = None) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim or hidden // heads, intermediate_size=inter, norm_eps=float(eps),
                max_position_embeddings=positions, tie_word_embeddings=bool(tie))


_LAYERNORM = {"norm_kind": "layernorm", "norm_bias": True, "mlp_gated": False}


def _gpt_neox(c) -> ModelConfig:
    bias = bool(getattr(c, "attention_bias", True))
    return ModelConfig(
        architecture="GPTNeoXForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_attention_heads,
                 c.intermediate_size, c.layer_norm_eps, c.max_position_embeddings,
                 getattr(c, "tie_word_embeddings", False)),
        **_rope_fields(c), **_LAYERNORM, hidden_act=c.hidden_act, qkv_bias=bias, attention_out_bias=bias,
        mlp_bias=True, residual="parallel_two_norms" if c.use_parallel_residual else "sequential",
    ).validate()


def _falcon(c) -> ModelConfig:
    if getattr(c, "alibi", False):
        raise ConfigError("FalconForCausalLM with alibi=True (Falcon-RW) is not supported; allowed: rotary Falcon "
                          "(alibi=False)")
    new_arch = bool(c.new_decoder_architecture)
    kv_heads = c.num_kv_heads if (new_arch or not c.multi_query) else 1
    if new_arch:
        two_norms = (getattr(c, "num_ln_in_parallel_attn", None) or 2) == 2
        residual = "parallel_two_norms" if two_norms else "parallel"
    else:
        residual = "parallel" if c.parallel_attn else "sequential"
    return ModelConfig(
        architecture="FalconForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, kv_heads,
                 getattr(c, "ffn_hidden_size", None) or 4 * c.hidden_size, c.layer_norm_epsilon,
                 c.max_position_embeddings, getattr(c, "tie_word_embeddings", True)),
        **_rope_fields(c), **_LAYERNORM, hidden_act=getattr(c, "activation", "gelu"), qkv_bias=bool(c.bias),
        attention_out_bias=bool(c.bias), mlp_bias=bool(c.bias), residual=residual,
    ).validate()


def _gptj(c) -> ModelConfig:
    head_dim = c.n_embd // c.n_head
    rotary_dim = c.rotary_dim or head_dim
    return ModelConfig(
        architecture="GPTJForCausalLM",
        **_shape(c.vocab_size, c.n_embd, c.n_layer, c.n_head, c.n_head, c.n_inner or 4 * c.n_embd,
                 c.layer_norm_epsilon, c.n_positions, getattr(c, "tie_word_embeddings", False)),
        rope_theta=10000.0, partial_rotary_factor=rotary_dim / head_dim, rotary_interleaved=True, **_LAYERNORM,
        hidden_act=c.activation_function, mlp_bias=True, residual="parallel", lm_head_bias=True,
    ).validate()


def _opt(c) -> ModelConfig:
    if not getattr(c, "layer_norm_elementwise_affine", True):
        raise ConfigError("OPTForCausalLM with layer_norm_elementwise_affine=False is not supported")
    bias = bool(getattr(c, "enable_bias", True))
    pre_norm = bool(c.do_layer_norm_before)
    projected = c.word_embed_proj_dim if c.word_embed_proj_dim != c.hidden_size else None
    return ModelConfig(
        architecture="OPTForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_attention_heads,
                 c.ffn_dim, 1e-5, c.max_position_embeddings, getattr(c, "tie_word_embeddings", True)),
        **_LAYERNORM, positions="learned", learned_position_offset=2, hidden_act=c.activation_function,
        qkv_bias=bias, attention_out_bias=bias, mlp_bias=bias, residual="sequential" if pre_norm else "post_norm",
        word_embed_proj_dim=projected,
        final_norm=pre_norm and not getattr(c, "_remove_final_layer_norm", False),
    ).validate()


def _starcoder2(c) -> ModelConfig:
    bias = bool(getattr(c, "use_bias", True))
    return ModelConfig(
        architecture="Starcoder2ForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                 c.num_key_value_heads or c.num_attention_heads, c.intermediate_size, c.norm_epsilon,
                 c.max_position_embeddings, getattr(c, "tie_word_embeddings", True)),
        **_rope_fields(c), **_LAYERNORM, hidden_act=c.hidden_act, qkv_bias=bias, attention_out_bias=bias,
        mlp_bias=bias, **sliding_window_fields(c),
    ).validate()


def _glm4(c) -> ModelConfig:
    return ModelConfig(
        architecture="Glm4ForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                 c.num_key_value_heads or c.num_attention_heads, c.intermediate_size, c.rms_norm_eps,
                 c.max_position_embeddings, getattr(c, "tie_word_embeddings", False),
                 head_dim=getattr(c, "head_dim", None)),
        **_rope_fields(c), rotary_interleaved=True, hidden_act=c.hidden_act, qkv_bias=bool(c.attention_bias),
        post_sublayer_norms=True,
    ).validate()


def _bloom(c) -> ModelConfig:
    if getattr(c, "apply_residual_connection_post_layernorm", False):
        raise ConfigError("BloomForCausalLM with apply_residual_connection_post_layernorm=True is not supported")
    # ALiBi has no position table: 2048 (BLOOM's training length) bounds the default max_seq_len only.
    positions = getattr(c, "seq_length", None) or 2048
    return ModelConfig(
        architecture="BloomForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.n_layer, c.n_head, c.n_head, 4 * c.hidden_size,
                 c.layer_norm_epsilon, positions, getattr(c, "tie_word_embeddings", True)),
        **_LAYERNORM, positions="alibi", alibi_slopes="bloom", hidden_act="gelu_pytorch_tanh", qkv_bias=True,
        attention_out_bias=True, mlp_bias=True, embedding_norm=True,
    ).validate()


def _mpt(c) -> ModelConfig:
    attn = c.attn_config
    get = (lambda name, default=None: attn.get(name, default)) if isinstance(attn, dict) else (
        lambda name, default=None: getattr(attn, name, default))
    for flag in ("qk_ln", "prefix_lm", "attn_uses_sequence_id"):
        if get(flag, False):
            raise ConfigError(f"MptForCausalLM with attn_config.{flag}=True is not supported")
    if not get("alibi", True):
        raise ConfigError("MptForCausalLM without ALiBi (attn_config.alibi=False) is not supported: it would have "
                          "no positions")
    if get("softmax_scale") is not None:
        raise ConfigError("MptForCausalLM with attn_config.softmax_scale set is not supported; allowed: null "
                          "(1 / sqrt(head_dim))")
    if not getattr(c, "no_bias", True):
        raise ConfigError("MptForCausalLM with no_bias=False is not supported")
    return ModelConfig(
        architecture="MptForCausalLM",
        **_shape(c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_heads, c.expansion_ratio * c.d_model,
                 c.layer_norm_epsilon, c.max_seq_len, getattr(c, "tie_word_embeddings", True)),
        norm_kind="layernorm", norm_bias=False, mlp_gated=False, positions="alibi", alibi_slopes="mpt",
        alibi_bias_max=float(get("alibi_bias_max", 8)), hidden_act="gelu", clip_qkv=get("clip_qkv"),
    ).validate()


# Baichuan 2's vocabulary: its checkpoints (and only they, among Baichuan's) have a NormHead lm_head.
BAICHUAN2_VOCAB_SIZE = 125696


def _baichuan(c) -> ModelConfig:
    """Baichuan 2 (remote code, no transformers class): the Llama block with q/k/v fused as
    ``W_pack`` ([q | k | v]) and, for Baichuan 2's vocabulary, a NormHead lm_head (rows normalised to
    unit length at load; engine.convert stores them normalised). 7B is rotary; 13B names no
    max_position_embeddings (only model_max_length) and uses ALiBi, with BLOOM's slopes (its
    ``_get_interleave`` is the same series)."""
    rotary = getattr(c, "max_position_embeddings", None) is not None
    positions = c.max_position_embeddings if rotary else getattr(c, "model_max_length", None) or 4096
    position_fields = {"rope_theta": 10000.0} if rotary else {"positions": "alibi", "alibi_slopes": "bloom"}
    return ModelConfig(
        architecture="BaichuanForCausalLM",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_attention_heads,
                 c.intermediate_size, c.rms_norm_eps, positions, getattr(c, "tie_word_embeddings", False)),
        **position_fields, hidden_act=getattr(c, "hidden_act", "silu"),
    ).validate()


def _qwen1(c) -> ModelConfig:
    """Qwen (v1, remote code): the Llama block with a fused, biased ``c_attn`` ([q | k | v]), an MLP
    of w2 (gate) and w1 (up) each intermediate_size / 2 wide. Its logn attention scaling and dynamic
    NTK apply only past ``seq_length``, which therefore bounds the engine's positions."""
    for flag in ("use_logn_attn", "use_dynamic_ntk"):
        if getattr(c, flag, False) and getattr(c, "seq_length", None) is None:
            raise ConfigError(f"QWenLMHeadModel with {flag} needs seq_length (the length past which it applies)")
    positions = min(c.max_position_embeddings, getattr(c, "seq_length", None) or c.max_position_embeddings)
    if getattr(c, "rotary_pct", 1.0) != 1.0:
        raise ConfigError(f"QWenLMHeadModel with rotary_pct {c.rotary_pct} is not supported; allowed: 1.0")
    return ModelConfig(
        architecture="QWenLMHeadModel",
        **_shape(c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_attention_heads,
                 c.intermediate_size // 2, c.layer_norm_epsilon, positions, getattr(c, "tie_word_embeddings", False),
                 head_dim=getattr(c, "kv_channels", None)),
        rope_theta=float(getattr(c, "rotary_emb_base", 10000.0)), hidden_act="silu", qkv_bias=True,
        attention_out_bias=not getattr(c, "no_bias", True), mlp_bias=not getattr(c, "no_bias", True),
    ).validate()


_CONFIGS = {"GPTNeoXForCausalLM": _gpt_neox, "FalconForCausalLM": _falcon, "GPTJForCausalLM": _gptj,
            "OPTForCausalLM": _opt, "Starcoder2ForCausalLM": _starcoder2, "Glm4ForCausalLM": _glm4,
            "BloomForCausalLM": _bloom, "MptForCausalLM": _mpt, "BaichuanForCausalLM": _baichuan,
            "QWenLMHeadModel": _qwen1}
MODEL_TYPES = {"gpt_neox": "GPTNeoXForCausalLM", "falcon": "FalconForCausalLM", "gptj": "GPTJForCausalLM",
               "opt": "OPTForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "glm4": "Glm4ForCausalLM",
               "bloom": "BloomForCausalLM", "mpt": "MptForCausalLM", "baichuan": "BaichuanForCausalLM",
               "qwen": "QWenLMHeadModel"}


# Remote-code checkpoints: transformers has no config class for them (AutoConfig wants their code).
REMOTE_CODE_ARCHITECTURES = ("BaichuanForCausalLM", "QWenLMHeadModel")


def remote_code_config(config_path: str):
    """A transformers PretrainedConfig holding every field of a remote-code checkpoint's config.json
    (read as data, its code never run), or None when the file names no architecture converted here."""
    import json

    import transformers

    with open(config_path) as f:
        data = json.load(f)
    if not set(data.get("architectures") or []) & set(REMOTE_CODE_ARCHITECTURES):
        return None
    data.pop("auto_map", None)
    return transformers.PretrainedConfig(**data)


def decoder_config_from_hf(hf_config, architecture: str) -> ModelConfig:
    return _CONFIGS[architecture](hf_config)


# ---- weights --------------------------------------------------------------------------------

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _per_head(t: torch.Tensor, heads: int, head_dim: int) -> QKV:
    """Rows laid out head by head as [q_h | k_h | v_h] (GPT-NeoX, BLOOM)."""
    parts = t.unflatten(0, (heads, 3, head_dim))
    return tuple(parts[:, j].flatten(0, 1) for j in range(3))


def _per_kv_group(t: torch.Tensor, kv_heads: int, group: int, head_dim: int) -> QKV:
    """Falcon: per KV head, [its group's q heads | k | v]."""
    parts = t.unflatten(0, (kv_heads, group + 2, head_dim))
    return parts[:, :group].flatten(0, 2), parts[:, group].flatten(0, 1), parts[:, group + 1].flatten(0, 1)


def _concatenated(t: torch.Tensor, cfg: ModelConfig) -> QKV:
    """[q | k | v] (MPT)."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return tuple(t.split([q_rows, kv_rows, kv_rows], dim=0))


@dataclass(frozen=True)
class _Layout:
    """Where a family's tensors live: engine part -> HF name prefix ({i}: the layer), and its q/k/v."""

    names: dict[str, str]
    qkv: Callable[[TensorGetter, int, str], QKV]  # (get, layer, "weight" | "bias") -> full q, k, v
    # Baichuan 2's NormHead: the lm_head's rows are normalised to unit L2 norm before use.
    normalized_lm_head: bool = False


def _fused_qkv_reader(name: str, split: Callable[[torch.Tensor], QKV]):
    return lambda get, i, kind: split(get(f"{name.format(i=i)}.{kind}"))


def _separate_qkv_reader(prefix: str, suffix: str = "_proj"):
    return lambda get, i, kind: tuple(get(f"{prefix.format(i=i)}{p}{suffix}.{kind}") for p in "qkv")


def _layout(cfg: ModelConfig) -> _Layout:
    a, heads, kv, hd = cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if a == "GPTNeoXForCausalLM":
        layer = "gpt_neox.layers.{i}."
        return _Layout({"embed_tokens": "gpt_neox.embed_in", "input_norm": layer + "input_layernorm",
                        "o_proj": layer + "attention.dense", "post_attn_norm": layer + "post_attention_layernorm",
                        "up_proj": layer + "mlp.dense_h_to_4h", "down_proj": layer + "mlp.dense_4h_to_h",
                        "norm": "gpt_neox.final_layer_norm",
                        "lm_head": "embed_out|lm_head"},  # embed_out on disk; transformers 5 renames it
                       _fused_qkv_reader(layer + "attention.query_key_value", lambda t: _per_head(t, heads, hd)))
    if a == "FalconForCausalLM":
        layer = "transformer.h.{i}."
        two_norms = cfg.residual == "parallel_two_norms"
        names = {"embed_tokens": "transformer.word_embeddings",
                 "input_norm": layer + ("ln_attn" if two_norms else "input_layernorm"),
                 "post_attn_norm": layer + ("ln_mlp" if two_norms else "post_attention_layernorm"),
                 "o_proj": layer + "self_attention.dense", "up_proj": layer + "mlp.dense_h_to_4h",
                 "down_proj": layer + "mlp.dense_4h_to_h", "norm": "transformer.ln_f", "lm_head": "lm_head"}
        # Every Falcon layout is per KV group: multi-query (Falcon-7B) is one group of all q heads,
        # the old architecture without MQA one group per head ([q_h | k_h | v_h]).
        split = lambda t: _per_kv_group(t, kv, heads // kv, hd)  # noqa: E731
        return _Layout(names, _fused_qkv_reader(layer + "self_attention.query_key_value", split))
    if a == "GPTJForCausalLM":
        layer = "transformer.h.{i}."
        return _Layout({"embed_tokens": "transformer.wte", "input_norm": layer + "ln_1",
                        "o_proj": layer + "attn.out_proj", "up_proj": layer + "mlp.fc_in",
                        "down_proj": layer + "mlp.fc_out", "norm": "transformer.ln_f", "lm_head": "lm_head"},
                       _separate_qkv_reader(layer + "attn."))
    if a == "OPTForCausalLM":
        layer = "model.decoder.layers.{i}."
        return _Layout({"embed_tokens": "model.decoder.embed_tokens", "embed_positions": "model.decoder.embed_positions",
                        "project_in": "model.decoder.project_in", "project_out": "model.decoder.project_out",
                        "input_norm": layer + "self_attn_layer_norm", "o_proj": layer + "self_attn.out_proj",
                        "post_attn_norm": layer + "final_layer_norm", "up_proj": layer + "fc1",
                        "down_proj": layer + "fc2", "norm": "model.decoder.final_layer_norm", "lm_head": "lm_head"},
                       _separate_qkv_reader(layer + "self_attn."))
    if a == "Starcoder2ForCausalLM":
        layer = "model.layers.{i}."
        return _Layout({"embed_tokens": "model.embed_tokens", "input_norm": layer + "input_layernorm",
                        "o_proj": layer + "self_attn.o_proj", "post_attn_norm": layer + "post_attention_layernorm",
                        "up_proj": layer + "mlp.c_fc", "down_proj": layer + "mlp.c_proj", "norm": "model.norm",
                        "lm_head": "lm_head"},
                       _separate_qkv_reader(layer + "self_attn."))
    if a == "Glm4ForCausalLM":
        layer = "model.layers.{i}."
        return _Layout({"embed_tokens": "model.embed_tokens", "input_norm": layer + "input_layernorm",
                        "o_proj": layer + "self_attn.o_proj", "attn_out_norm": layer + "post_self_attn_layernorm",
                        "post_attn_norm": layer + "post_attention_layernorm", "up_proj": layer + "mlp.gate_up_proj",
                        "down_proj": layer + "mlp.down_proj", "mlp_out_norm": layer + "post_mlp_layernorm",
                        "norm": "model.norm", "lm_head": "lm_head"},
                       _separate_qkv_reader(layer + "self_attn."))
    if a == "BloomForCausalLM":
        layer = "transformer.h.{i}."
        return _Layout({"embed_tokens": "transformer.word_embeddings", "embed_norm": "transformer.word_embeddings_layernorm",
                        "input_norm": layer + "input_layernorm", "o_proj": layer + "self_attention.dense",
                        "post_attn_norm": layer + "post_attention_layernorm", "up_proj": layer + "mlp.dense_h_to_4h",
                        "down_proj": layer + "mlp.dense_4h_to_h", "norm": "transformer.ln_f", "lm_head": "lm_head"},
                       _fused_qkv_reader(layer + "self_attention.query_key_value", lambda t: _per_head(t, heads, hd)))
    if a == "MptForCausalLM":
        layer = "transformer.blocks.{i}."
        return _Layout({"embed_tokens": "transformer.wte", "input_norm": layer + "norm_1",
                        "o_proj": layer + "attn.out_proj", "post_attn_norm": layer + "norm_2",
                        "up_proj": layer + "ffn.up_proj", "down_proj": layer + "ffn.down_proj",
                        "norm": "transformer.norm_f", "lm_head": "lm_head"},
                       _fused_qkv_reader(layer + "attn.Wqkv", lambda t: _concatenated(t, cfg)))
    if a == "BaichuanForCausalLM":
        layer = "model.layers.{i}."
        return _Layout({"embed_tokens": "model.embed_tokens", "input_norm": layer + "input_layernorm",
                        "o_proj": layer + "self_attn.o_proj", "post_attn_norm": layer + "post_attention_layernorm",
                        "gate_proj": layer + "mlp.gate_proj", "up_proj": layer + "mlp.up_proj",
                        "down_proj": layer + "mlp.down_proj", "norm": "model.norm", "lm_head": "lm_head"},
                       _fused_qkv_reader(layer + "self_attn.W_pack", lambda t: _concatenated(t, cfg)),
                       normalized_lm_head=cfg.vocab_size == BAICHUAN2_VOCAB_SIZE)
    if a == "QWenLMHeadModel":
        layer = "transformer.h.{i}."
        return _Layout({"embed_tokens": "transformer.wte", "input_norm": layer + "ln_1",
                        "o_proj": layer + "attn.c_proj", "post_attn_norm": layer + "ln_2",
                        "gate_proj": layer + "mlp.w2", "up_proj": layer + "mlp.w1",
                        "down_proj": layer + "mlp.c_proj", "norm": "transformer.ln_f", "lm_head": "lm_head"},
                       _fused_qkv_reader(layer + "attn.c_attn", lambda t: _concatenated(t, cfg)))
    raise ConfigError(f"{a} is not a configurable-decoder family")


def rotary_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The checkpoint dim of each engine dim of a q/k head, or None when no reorder is needed."""
    if cfg.positions != "rope" or (cfg.rotary_dim == cfg.head_dim and not cfg.rotary_interleaved):
        return None
    order = partial_rotary_order(cfg.head_dim, cfg.rotary_dim)
    if cfg.rotary_interleaved:
        r = cfg.rotary_dim
        deinterleaved = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, cfg.head_dim)])
        order = deinterleaved[order]
    return order


def _reorder(t: torch.Tensor, order: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    return t if order is None else t.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def decoder_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank of a configurable-decoder checkpoint."""
    layout, order = _layout(cfg), rotary_order(cfg)
    names = layout.names

    def get_any(alternatives: str) -> torch.Tensor:
        """The first present of 'a|b' names (a CheckpointError naming the first when none is)."""
        return first_present(get, *alternatives.split("|"))

    def norm(engine: str, hf: str):
        yield f"{engine}.weight", get(f"{hf}.weight")
        if cfg.norm_bias:
            yield f"{engine}.bias", get(f"{hf}.bias")

    yield "embed_tokens.weight", shard(get(names["embed_tokens"] + ".weight"), 0, rank, tp_size)
    if cfg.positions == "learned":
        yield "embed_positions.weight", get(names["embed_positions"] + ".weight")
    if cfg.embedding_norm:
        yield from norm("embed_norm", names["embed_norm"])
    if cfg.word_embed_proj_dim is not None:
        for part in ("project_in", "project_out"):
            yield f"{part}.weight", get(names[part] + ".weight")
    for i in range(cfg.num_layers):
        out = f"layers.{i}."
        hf = {part: name.format(i=i) for part, name in names.items()}
        yield from norm(out + "input_norm", hf["input_norm"])
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = layout.qkv(get, i, kind)
            q, k = _reorder(q, order, cfg.head_dim), _reorder(k, order, cfg.head_dim)
            yield out + f"qkv_proj.{kind}", torch.cat([shard(t, 0, rank, tp_size) for t in (q, k, v)])
        yield out + "o_proj.weight", shard(get(hf["o_proj"] + ".weight"), 1, rank, tp_size)
        if cfg.attention_out_bias:
            yield out + "o_proj.bias", get(hf["o_proj"] + ".bias")
        if cfg.residual != "parallel":
            yield from norm(out + "post_attn_norm", hf["post_attn_norm"])
        if cfg.post_sublayer_norms:
            yield from norm(out + "attn_out_norm", hf["attn_out_norm"])
            yield from norm(out + "mlp_out_norm", hf["mlp_out_norm"])
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            up = get(f"{hf['up_proj']}.{kind}")
            if "gate_proj" in hf:  # gate and up as separate tensors: this rank's [gate_r | up_r]
                up = torch.cat([shard(get(f"{hf['gate_proj']}.{kind}"), 0, rank, tp_size), shard(up, 0, rank, tp_size)])
            elif cfg.mlp_gated:  # [gate | up] -> this rank's [gate_r | up_r]
                up = torch.cat([shard(part, 0, rank, tp_size) for part in up.chunk(2, dim=0)])
            else:
                up = shard(up, 0, rank, tp_size)
            yield out + f"up_proj.{kind}", up
        yield out + "down_proj.weight", shard(get(hf["down_proj"] + ".weight"), 1, rank, tp_size)
        if cfg.mlp_bias:
            yield out + "down_proj.bias", get(hf["down_proj"] + ".bias")
    if cfg.final_norm:
        yield from norm("norm", names["norm"])
    if not cfg.tie_word_embeddings:
        lm_head = get_any("|".join(n + ".weight" for n in names["lm_head"].split("|")))
        if layout.normalized_lm_head:  # in float32, as the checkpoint's NormHead does before its cast
            lm_head = torch.nn.functional.normalize(lm_head.float(), dim=1)
        yield "lm_head.weight", shard(lm_head, 0, rank, tp_size)
        if cfg.lm_head_bias:
            yield "lm_head.bias", shard(get(names["lm_head"] + ".bias"), 0, rank, tp_size)
