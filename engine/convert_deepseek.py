"""DeepSeek-V2/V3 checkpoints -> ModelConfig and engine weights (engine/models/deepseek.py).

Config: DeepSeek's names carried as they are (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
v_head_dim, n_shared_experts, n_group, topk_group, routed_scaling_factor, norm_topk_prob,
topk_method), with ``head_dim`` = qk_rope_head_dim (the rotary width), ``num_kv_heads`` =
num_heads, ``mlp_only_layers`` = the first ``first_k_dense_replace`` layers, and V3's routing named
``noaux_tc`` whatever its config says (transformers' DeepseekV3TopkRouter has no other).

Weights, per rank: q_b_proj / q_proj and kv_b_proj split by heads (rows), o_proj by its input
columns; q_a_proj, kv_a_proj_with_mqa and the norms replicated; experts stacked (E, ...) and split
along their width as engine/convert.py does Qwen3-MoE's (or, with moe_ep_size > 1, whole experts,
num_experts / moe_ep_size a rank); shared experts' gate/up fused and split
like a dense MLP's. The rope dims: DeepSeek rotates interleaved pairs (2i, 2i + 1) (V2 always, V3
when ``rope_interleave``); each q head's last P rows and kv_a_proj's last P rows are reordered into
the kernels' halves (all even dims, then all odd), a permutation of rows inside each head's rope
part, so block-FP8 scales still cover them (engine/fp8_checkpoint.py checks every block).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import torch

from engine.config import ModelConfig
from engine.hf_checkpoint import (CheckpointError, TensorGetter, decoder_shape, has_tensor, read_rope, shard,
                                  stacked_experts)


def deepseek_config_from_hf(c, architecture: str) -> ModelConfig:
    theta, scaling, _ = read_rope(c)
    v3 = architecture == "DeepseekV3ForCausalLM"
    return ModelConfig(
        architecture=architecture,
        **{**decoder_shape(c, tie_word_embeddings_default=False), "num_kv_heads": c.num_attention_heads,
           "head_dim": c.qk_rope_head_dim},
        rope_theta=theta,
        rope_scaling=scaling,
        hidden_act=c.hidden_act,
        rotary_interleaved=not v3 or bool(getattr(c, "rope_interleave", True)),
        num_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        norm_topk_prob=bool(c.norm_topk_prob),
        mlp_only_layers=list(range(min(c.first_k_dense_replace or 0, c.num_hidden_layers))),
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        v_head_dim=c.v_head_dim,
        n_shared_experts=c.n_shared_experts or 0,
        n_group=c.n_group or 1,
        topk_group=c.topk_group or 1,
        routed_scaling_factor=float(c.routed_scaling_factor),
        topk_method="noaux_tc" if v3 else (getattr(c, "topk_method", None) or "greedy"),
    ).validate()


def deinterleaved_rope_rows(t: torch.Tensor, rows_per_head: int, rope: int, interleaved: bool) -> torch.Tensor:
    """t (heads * rows_per_head, ...) whose last ``rope`` rows of each head rotate in pairs (2i, 2i + 1)
    -> the same rows with each head's rope part in the kernels' halves order."""
    if not interleaved:
        return t
    order = torch.arange(t.shape[0]).view(-1, rows_per_head)
    nope = rows_per_head - rope
    order[:, nope:] = order[:, nope:][:, torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])]
    return t[order.reshape(-1)]


def deepseek_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (engine name, tensor) for one rank (module docstring)."""
    yield "embed_tokens.weight", shard(get("model.embed_tokens.weight"), 0, rank, tp_size)
    for i in range(cfg.num_layers):
        yield from _layer_weights(get, cfg, i, f"model.layers.{i}.", f"layers.{i}.", rank, tp_size)
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", shard(get("lm_head.weight"), 0, rank, tp_size)
    if cfg.num_nextn_predict_layers:  # the MTP module: the checkpoint's layer num_layers (engine/models/deepseek.py)
        hf = f"model.layers.{cfg.num_layers}."
        for name in ("enorm", "hnorm", "eh_proj"):
            yield f"mtp.{name}.weight", get(hf + f"{name}.weight")
        yield "mtp.head_norm.weight", get(hf + "shared_head.norm.weight")
        yield from _layer_weights(get, cfg, cfg.num_layers, hf, "mtp.layer.", rank, tp_size)


def checkpoint_mtp_layers(cfg: ModelConfig, get: TensorGetter) -> ModelConfig:
    """``cfg`` with num_nextn_predict_layers 1 when the checkpoint holds an MTP module at layer
    num_layers (DeepSeek-V3 / R1 as shipped: enorm, hnorm, eh_proj, a decoder layer, shared_head),
    else 0: transformers drops it when it saves a model, whatever its config says. Only the first
    module is converted; drafts reuse it (engine/executor/speculative/mtp.py)."""
    try:
        get(f"model.layers.{cfg.num_layers}.eh_proj.weight")
    except CheckpointError:
        return replace(cfg, num_nextn_predict_layers=0)
    return replace(cfg, num_nextn_predict_layers=1)


def _layer_weights(get: TensorGetter, cfg: ModelConfig, i: int, hf: str, out: str, rank: int, tp_size: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Decoder layer ``i``'s tensors (checkpoint prefix ``hf``) under the engine prefix ``out``."""
    rope, head_rows = cfg.head_dim, cfg.qk_nope_head_dim + cfg.head_dim
    interleaved = cfg.rotary_interleaved
    attn = hf + "self_attn."
    yield out + "input_norm.weight", get(hf + "input_layernorm.weight")
    q_name = "q_b_proj" if cfg.q_lora_rank is not None else "q_proj"
    if cfg.q_lora_rank is not None:
        yield out + "attn.q_a_proj.weight", get(attn + "q_a_proj.weight")
        yield out + "attn.q_a_norm.weight", get(attn + "q_a_layernorm.weight")
    q = deinterleaved_rope_rows(get(attn + f"{q_name}.weight"), head_rows, rope, interleaved)
    yield out + f"attn.{q_name}.weight", shard(q, 0, rank, tp_size)
    kv_a = get(attn + "kv_a_proj_with_mqa.weight")
    yield out + "attn.kv_a_proj.weight", deinterleaved_rope_rows(kv_a, kv_a.shape[0], rope, interleaved)
    yield out + "attn.kv_a_norm.weight", get(attn + "kv_a_layernorm.weight")
    yield out + "attn.kv_b_proj.weight", shard(get(attn + "kv_b_proj.weight"), 0, rank, tp_size)
    yield out + "attn.o_proj.weight", shard(get(attn + "o_proj.weight"), 1, rank, tp_size)
    yield out + "post_attn_norm.weight", get(hf + "post_attention_layernorm.weight")
    if not cfg.is_moe_layer(i):
        yield from gate_up_down(get, hf + "mlp.", out + "mlp.", rank, tp_size)
        return
    yield out + "moe.router.weight", get(hf + "mlp.gate.weight")
    if cfg.topk_method == "noaux_tc":
        yield out + "moe.score_bias", get(hf + "mlp.gate.e_score_correction_bias")
    if has_tensor(get, hf + "mlp.experts.gate_up_proj"):  # transformers 5's in-memory stacks
        gate, up, down = stacked_experts(get, hf, cfg.num_experts)
        if cfg.moe_ep_size > 1:  # whole experts, this rank's num_experts / moe_ep_size of them
            gate, up, down = (shard(t, 0, rank, cfg.moe_ep_size) for t in (gate, up, down))
            yield out + "moe.gate_up_proj", torch.cat([gate, up], dim=1)
            yield out + "moe.down_proj", down
        else:
            yield out + "moe.gate_up_proj", torch.cat([shard(gate, 1, rank, tp_size), shard(up, 1, rank, tp_size)], dim=1)
            yield out + "moe.down_proj", shard(down, 2, rank, tp_size)
    else:  # a checkpoint's per-expert Linears: only this rank's part of each is read and stacked
        yield out + "moe.gate_up_proj", torch.cat([_rank_expert_stack(get, hf, cfg, p, rank, tp_size)
                                                   for p in ("gate", "up")], dim=1)
        yield out + "moe.down_proj", _rank_expert_stack(get, hf, cfg, "down", rank, tp_size)
    if cfg.n_shared_experts:
        yield from gate_up_down(get, hf + "mlp.shared_experts.", out + "moe.shared_", rank, tp_size)


def _rank_expert_stack(get: TensorGetter, hf: str, cfg: ModelConfig, proj: str, rank: int, tp_size: int
                       ) -> torch.Tensor:
    """This rank's stack of a layer's ``mlp.experts.{e}.{proj}_proj.weight``: with expert parallelism its
    num_experts / moe_ep_size whole experts, else every expert's 1/tp_size (gate/up rows, down's input columns):
    the stacks' slices the in-memory layout takes, read a rank's part at a time (DeepSeek-V3's 256 experts of a
    layer are 11 GB in FP8: a rank of 8 reads an eighth)."""
    names = [hf + f"mlp.experts.{e}.{proj}_proj.weight" for e in range(cfg.num_experts)]
    if cfg.moe_ep_size > 1:
        return torch.stack([get(name) for name in shard_list(names, rank, cfg.moe_ep_size)])
    return torch.stack([shard(get(name), 1 if proj == "down" else 0, rank, tp_size) for name in names])


def shard_list(items: list, rank: int, parts: int) -> list:
    """Rank ``rank``'s run of ``items`` split into ``parts`` as ``shard`` splits a tensor's dim (torch.chunk)."""
    step = -(-len(items) // parts)
    return items[rank * step:(rank + 1) * step]


def gate_up_down(get: TensorGetter, hf: str, out: str, rank: int, tp_size: int):
    """A SwiGLU MLP's [gate_r | up_r] rows and down's input columns for this rank."""
    gate_up = [shard(get(hf + f"{p}_proj.weight"), 0, rank, tp_size) for p in ("gate", "up")]
    yield out + "gate_up_proj.weight", torch.cat(gate_up, dim=0)
    yield out + "down_proj.weight", shard(get(hf + "down_proj.weight"), 1, rank, tp_size)
