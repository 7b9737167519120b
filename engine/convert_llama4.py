"""Llama 4 checkpoints (Llama4ForCausalLM, and the text model of Llama4ForConditionalGeneration) ->
ModelConfig and engine weights (engine/models/llama4.py).

Config: ``layers_without_rope`` from ``no_rope_layers`` (1 = rope), ``attention_chunk_size`` (the
rope layers' chunks; transformers' ``layer_types`` say the same), ``qk_l2_norm`` from
``use_qk_norm``, the NoPE layers' temperature (``floor_scale``, ``attn_scale``) when
``attn_temperature_tuning``, MoE layers every ``interleave_moe_layer_step`` (``decoder_sparse_step``)
with experts and the shared expert of width ``intermediate_size`` and dense layers of width
``intermediate_size_mlp``.

Weights, per rank: q/k/v fused as the Llama family's, each head's dims de-interleaved (Llama 4's
rope rotates pairs (2i, 2i + 1); q and k of every layer are permuted alike, which leaves q . k, the
weightless per-head norm and the NoPE layers unchanged); experts as the checkpoint holds them,
``gate_up_proj`` (E, hidden, 2I) [gate | up] and ``down_proj`` (E, I, hidden), transposed to the
engine's (E, 2I_r, hidden) and (E, hidden, I_r), or per expert (``experts.{e}.gate_proj.weight`` ...:
compressed-tensors FP8 checkpoints, whose codes and per-row scales engine/fp8_checkpoint.py carries
through this same conversion) stacked; the shared expert fused and split like a dense MLP.
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.config import ModelConfig
from engine.convert_deepseek import deinterleaved_rope_rows, gate_up_down
from engine.hf_checkpoint import TensorGetter, decoder_shape, has_tensor, read_rope, shard


def llama4_config_from_hf(c, architecture: str) -> ModelConfig:
    theta, scaling, _ = read_rope(c)
    flags = getattr(c, "no_rope_layers", None) or [1] * c.num_hidden_layers
    tuning = bool(getattr(c, "attn_temperature_tuning", False))
    return ModelConfig(
        architecture=architecture,
        **{**decoder_shape(c, tie_word_embeddings_default=False), "intermediate_size": c.intermediate_size_mlp},
        rope_theta=theta,
        rope_scaling=scaling,
        hidden_act=c.hidden_act,
        rotary_interleaved=True,
        layers_without_rope=[i for i, use_rope in enumerate(flags) if not use_rope],
        num_experts=c.num_local_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size,
        decoder_sparse_step=getattr(c, "interleave_moe_layer_step", 1) or 1,
        n_shared_experts=1,
        attention_chunk_size=getattr(c, "attention_chunk_size", None),
        qk_l2_norm=bool(getattr(c, "use_qk_norm", False)),
        nope_floor_scale=float(c.floor_scale) if tuning else None,
        nope_attn_scale=float(c.attn_scale) if tuning else None,
    ).validate()


def llama4_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank (module docstring)."""
    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    for i in range(cfg.num_layers):
        hf, out = f"model.layers.{i}.", f"layers.{i}."
        yield out + "input_norm.weight", get(hf + "input_layernorm.weight")
        q, k, v = (get(hf + f"self_attn.{p}_proj.weight") for p in "qkv")
        q, k = (deinterleaved_rope_rows(t, cfg.head_dim, cfg.head_dim, True) for t in (q, k))
        yield out + "qkv_proj.weight", torch.cat([shard(t, 0, rank, tp_size) for t in (q, k, v)], dim=0)
        yield out + "o_proj.weight", shard(get(hf + "self_attn.o_proj.weight"), 1, rank, tp_size)
        yield out + "post_attn_norm.weight", get(hf + "post_attention_layernorm.weight")
        ff = hf + "feed_forward."
        if not cfg.is_moe_layer(i):
            yield from gate_up_down(get, ff, out, rank, tp_size)
            continue
        yield out + "moe.router.weight", get(ff + "router.weight")
        # Each block of experts read as it is yielded and held by no local here while the build quantizes and
        # writes it (Scout's on one rank: 2.7 GB and 1.3 GB in bf16).
        yield out + "moe.gate_up_proj", _experts_gate_up(get, ff, cfg.num_experts, rank, tp_size)
        yield out + "moe.down_proj", shard(_experts_down(get, ff, cfg.num_experts), 2, rank, tp_size)
        yield from gate_up_down(get, ff + "shared_expert.", out + "moe.shared_", rank, tp_size)
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)


def _experts_gate_up(get: TensorGetter, ff: str, num_experts: int, rank: int, tp_size: int) -> torch.Tensor:
    """This rank's [gate_r | up_r] (E, 2 * I_r, hidden) of one MoE layer, from either layout (_per_expert)."""
    if _per_expert(get, ff):
        gate, up = (torch.stack([get(ff + f"experts.{e}.{p}_proj.weight") for e in range(num_experts)])
                    for p in ("gate", "up"))
    else:
        gate, up = get(ff + "experts.gate_up_proj").transpose(1, 2).chunk(2, dim=1)
    return torch.cat([shard(gate, 1, rank, tp_size), shard(up, 1, rank, tp_size)], dim=1)


def _experts_down(get: TensorGetter, ff: str, num_experts: int) -> torch.Tensor:
    """down (E, hidden, I) of one MoE layer, from either layout (_per_expert)."""
    if _per_expert(get, ff):
        return torch.stack([get(ff + f"experts.{e}.down_proj.weight") for e in range(num_experts)])
    return get(ff + "experts.down_proj").transpose(1, 2)


def _per_expert(get: TensorGetter, ff: str) -> bool:
    """Whether the layer's experts come as per-expert Linears ``experts.{e}.gate_proj.weight`` (I, hidden) ...
    (the compressed-tensors FP8 checkpoints, Meta's Maverick FP8 among them, whose quantizer sees each expert as
    Linears: transformers' SequentialLlama4TextExperts), else stacked: ``experts.gate_up_proj`` (E, hidden, 2I)
    [gate | up] and ``experts.down_proj`` (E, I, hidden). The per-expert names are probed first:
    engine/fp8_checkpoint.py's stand-in getters answer for ``.weight`` names only as the checkpoint does."""
    return has_tensor(get, ff + "experts.0.gate_proj.weight")
