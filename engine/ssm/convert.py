"""Hugging Face hybrid checkpoints -> ModelConfig (with its ``ssm`` spec) and engine weights.

Bamba (``BambaForCausalLM``; IBM's Bamba-9B and the Granite 4.0 hybrids saved in Bamba's layout):
each decoder layer is a Mamba-2 layer or rope attention (partial rotary 0.5, layers in
``attn_layer_indices``), then a gated SiLU MLP: two engine blocks per layer.
Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``): Bamba's layer (the MLP is the "shared" one,
``input_linear`` already [gate | up]), rope or no positions, and its scalars (embedding, residual and
attention multipliers, logits scaling). With routed experts (H-Tiny, H-Small: num_local_experts > 0)
the layer's second block is "moe": the experts (softmax over the top-k logits = renormalised top-k)
beside the shared MLP, both split by width over tensor-parallel ranks.
Falcon-H1 (``FalconH1ForCausalLM``): every layer a Mamba-2 layer and attention side by side on one
norm, then a gated MLP; its muP multipliers are folded into the weights (in float32, before the cast):
the mup vector and ssm_in into in_proj's rows, ssm_out into out_proj, attention_in into q/k/v, key into
k, attention_out into o_proj, the MLP's into gate and down, lm_head's into the lm_head (tied: the
engine divides the logits); the embedding multiplier stays a scalar of the model.
Pure Mamba-2 (``Mamba2ForCausalLM``): one block per layer, every one Mamba-2, named as Nemotron-H's.
Nemotron-H (``NemotronHForCausalLM``; tensors under ``backbone.`` as NVIDIA ships them, or
``model.``): each layer is one block, Mamba-2, attention without
positions, a relu^2 MLP, or an MoE layer (Nemotron-3 Nano: relu^2 experts with sigmoid group-limited
routing beside a relu^2 shared MLP; latent-projected experts refused by name), in the order of
``hybrid_override_pattern`` / ``layers_block_type``. The SSM state is kept in float32
(``mamba_ssm_cache_dtype``), prompt chunks clamp dt at ``time_step_min`` as transformers does.

Pure Mamba-1 (``MambaForCausalLM``; state-spaces/mamba-*-hf, tensors under ``backbone.``): every
layer one Mamba-1 block (engine/ssm/mamba1.py), tied lm_head as the checkpoints ship it.
Jamba (``JambaForCausalLM``): each layer a Mamba-1 layer with RMSNorms on dt, B and C, or attention
without positions (every ``attn_layer_period`` layers from ``attn_layer_offset``), then a gated SiLU
MLP or, every ``expert_layer_period`` layers from ``expert_layer_offset``, ``num_experts`` routed
experts (top ``num_experts_per_tok`` of the router's softmax, weights not renormalised): two engine
blocks per layer. Experts read from either layout (per expert on disk, stacked in memory).

Weights: q/k/v fused into ``qkv_proj`` (with partial rotary each q/k head's dims reordered, as
for the Llama family), gate/up fused into ``up_proj``, the conv's (C, 1, K) weight stored (C, K).
Tensor parallelism: each rank's file holds its vocab rows of the embedding and lm_head, its heads
of q/k/v (o_proj's matching input columns), its intermediate columns of the MLP, and its heads and
B/C groups of each Mamba-2 layer (engine/ssm/mamba_shard.py); norms are whole on every rank. Mamba-1
layers (Mamba, Jamba) take one rank (engine/config.py refuses more).
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.config import ConfigError, ModelConfig
from engine.hf_checkpoint import TensorGetter, has_tensor, read_rope, shard, stacked_experts
from engine.ssm.mamba_shard import MambaShard, mamba_shard, shard_conv, shard_head_channels, shard_in_proj
from kernels.rotary import partial_rotary_order

MODEL_TYPES = {"bamba": "BambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
               "granitemoehybrid": "GraniteMoeHybridForCausalLM", "mamba2": "Mamba2ForCausalLM",
               "falcon_h1": "FalconH1ForCausalLM", "jamba": "JambaForCausalLM", "mamba": "MambaForCausalLM"}


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def hybrid_config_from_hf(c, architecture: str) -> ModelConfig:
    from engine.ssm.spec import SsmSpec

    if architecture == "GraniteMoeHybridForCausalLM":
        return _granite_config(c)
    if architecture == "Mamba2ForCausalLM":
        return _mamba2_config(c)
    if architecture == "FalconH1ForCausalLM":
        return _falcon_h1_config(c)
    if architecture == "MambaForCausalLM":
        return _mamba1_config(c)
    if architecture == "JambaForCausalLM":
        return _jamba_config(c)
    if architecture == "BambaForCausalLM":
        _refuse(not getattr(c, "attention_bias", False) and not getattr(c, "mlp_bias", False),
                "BambaForCausalLM with attention_bias/mlp_bias is not supported")
        _refuse(c.hidden_act == "silu", f"BambaForCausalLM needs hidden_act 'silu', got {c.hidden_act!r}")
        kinds = list(c.layers_block_type)
        blocks = [b for kind in kinds for b in ("mamba" if kind == "linear_attention" else "attention", "mlp")]
        spec = SsmSpec(blocks=blocks, **_mamba_fields(c), mlp_act="silu", attention_rope=True)
        theta, scaling, partial = read_rope(c)
        extra = {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}
        eps, head_dim = c.rms_norm_eps, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    else:
        kinds = list(c.layers_block_type)
        moe = "moe" in kinds
        _refuse(not moe or getattr(c, "moe_latent_size", None) is None,
                f"NemotronHForCausalLM with moe_latent_size {getattr(c, 'moe_latent_size', None)} (experts on a "
                "latent projection) is not supported; its MoE layers without one (Nemotron-3 Nano) are")
        _refuse(not getattr(c, "mlp_bias", False) and not getattr(c, "attention_bias", False),
                "NemotronHForCausalLM with mlp_bias/attention_bias is not supported")
        _refuse(c.mlp_hidden_act == "relu2" and c.mamba_hidden_act == "silu",
                f"NemotronHForCausalLM needs mlp_hidden_act 'relu2' and mamba_hidden_act 'silu', got "
                f"{c.mlp_hidden_act!r} and {c.mamba_hidden_act!r}")
        by_kind = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
        spec = SsmSpec(blocks=[by_kind[k] for k in kinds], num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim,
                       d_state=c.ssm_state_size, n_groups=c.n_groups, d_conv=c.conv_kernel,
                       conv_bias=bool(c.use_conv_bias), proj_bias=bool(c.use_bias),
                       dt_limit=[float(c.time_step_min), None], mlp_act="relu2", attention_rope=False,
                       state_dtype=getattr(c, "mamba_ssm_cache_dtype", None) or None,
                       moe_shared_size=c.moe_shared_expert_intermediate_size if moe else 0)
        # MoE layers (transformers' NemotronHTopkRouter): sigmoid scores, + e_score_correction_bias for the
        # choice only, the best topk_group of n_group groups (by their top-2 sum), top-k, renormalised
        # (norm_topk_prob), times routed_scaling_factor; relu^2 experts beside a relu^2 shared MLP.
        extra = dict(num_experts=c.n_routed_experts, num_experts_per_tok=c.num_experts_per_tok,
                    moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
                    n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=float(c.routed_scaling_factor),
                    topk_method="noaux_tc") if moe else {}
        eps, head_dim = c.layer_norm_epsilon, c.head_dim
    spec.validate()
    return ModelConfig(
        architecture=architecture, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, norm_eps=float(eps), max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)), hidden_act="silu",
        ssm=spec.to_dict(), **extra,  # rope (Bamba) or the experts (Nemotron-H MoE)
    ).validate()


def _mamba_fields(c) -> dict:
    """The Mamba-2 shape as Bamba and Granite 4.0 name it (mamba_*)."""
    low, high = tuple(c.time_step_limit or (0.0, float("inf")))
    return dict(num_heads=c.mamba_n_heads, head_dim=c.mamba_d_head, d_state=c.mamba_d_state, n_groups=c.mamba_n_groups,
                d_conv=c.mamba_d_conv, conv_bias=bool(c.mamba_conv_bias), proj_bias=bool(c.mamba_proj_bias),
                dt_limit=[float(low), None if high == float("inf") else high])


def _granite_config(c) -> ModelConfig:
    """Granite 4.0 hybrids: Bamba's two blocks per layer (mixer, then the gated "shared" MLP of width
    shared_intermediate_size, with num_local_experts routed experts of width intermediate_size beside
    it when there are any), rope or no positions (position_embedding_type), and muP scalars."""
    from engine.ssm.spec import SsmSpec

    arch = "GraniteMoeHybridForCausalLM"
    moe = bool(c.num_local_experts or 0)
    _refuse(not getattr(c, "attention_bias", False), f"{arch} with attention_bias is not supported")
    _refuse(c.hidden_act == "silu", f"{arch} needs hidden_act 'silu', got {c.hidden_act!r}")
    _refuse(c.position_embedding_type in (None, "rope", "nope"),
            f"{arch}: position_embedding_type {c.position_embedding_type!r} is not supported; allowed: rope, nope")
    rope = c.position_embedding_type == "rope"
    blocks = [b for kind in c.layers_block_type
              for b in ("mamba" if kind == "linear_attention" else "attention", "moe" if moe else "mlp")]
    spec = SsmSpec(blocks=blocks, **_mamba_fields(c), mlp_act="silu", attention_rope=rope,
                   embedding_multiplier=float(c.embedding_multiplier), residual_multiplier=float(c.residual_multiplier),
                   attention_scale=float(c.attention_multiplier), logits_scaling=float(c.logits_scaling),
                   moe_shared_size=c.shared_intermediate_size if moe else 0).validate()
    # Routing (transformers' GraniteMoeHybridTopKRouter): softmax over the top-k logits, i.e. the
    # full softmax's top-k weights renormalised to sum to 1 (norm_topk_prob); no scaling factor.
    experts = dict(num_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.intermediate_size, norm_topk_prob=True) if moe else {}
    theta, scaling, partial = read_rope(c) if rope else (10000.0, None, 1.0)
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.shared_intermediate_size,
        norm_eps=float(c.rms_norm_eps), max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings), hidden_act="silu", ssm=spec.to_dict(), rope_theta=theta,
        rope_scaling=scaling, partial_rotary_factor=partial, **experts,
    ).validate()


def _mamba2_config(c) -> ModelConfig:
    """Pure Mamba-2 (state-spaces/mamba2-*, Codestral Mamba): every block a Mamba-2 layer, no attention
    and no MLP."""
    from engine.ssm.spec import SsmSpec

    arch = "Mamba2ForCausalLM"
    _refuse(c.hidden_act == "silu", f"{arch} needs hidden_act 'silu', got {c.hidden_act!r}")
    _refuse(c.num_heads * c.head_dim == int(c.expand * c.hidden_size),
            f"{arch}: num_heads x head_dim ({c.num_heads} x {c.head_dim}) must equal expand x hidden_size "
            f"({c.expand} x {c.hidden_size})")
    low, high = tuple(c.time_step_limit or (0.0, float("inf")))
    spec = SsmSpec(blocks=["mamba"] * c.num_hidden_layers, num_heads=c.num_heads, head_dim=c.head_dim,
                   d_state=c.state_size, n_groups=c.n_groups, d_conv=c.conv_kernel, conv_bias=bool(c.use_conv_bias),
                   proj_bias=bool(c.use_bias), dt_limit=[float(low), None if high == float("inf") else high]).validate()
    return _pure_mamba_config(c, arch, spec)


def _pure_mamba_config(c, arch: str, spec) -> ModelConfig:
    """A model of Mamba layers only (Mamba-2 or Mamba-1): the attention fields of ModelConfig are
    placeholders (one KV head of 2 values: the runner's KV pool has one tiny layer nobody reads);
    intermediate_size is unused."""
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=c.hidden_size,
        norm_eps=float(c.layer_norm_epsilon), max_position_embeddings=1 << 20,
        tie_word_embeddings=bool(c.tie_word_embeddings), hidden_act="silu", ssm=spec.to_dict(),
    ).validate()


def _mamba1_fields(*, inner: int, d_state: int, d_conv: int, dt_rank: int, conv_bias, proj_bias) -> dict:
    """A Mamba-1 layer in SsmSpec's terms (engine/ssm/spec.py): a head per channel, B/C shared."""
    return dict(num_heads=inner, head_dim=1, n_groups=1, d_state=d_state, d_conv=d_conv, conv_bias=bool(conv_bias),
                proj_bias=bool(proj_bias), mamba_version=1, dt_rank=int(dt_rank), gated_norm="gate_only")


def _mamba1_config(c) -> ModelConfig:
    """Pure Mamba-1: every block a Mamba-1 layer. (residual_in_fp32: transformers keeps the residual stream in float32 between
    blocks; the engine keeps it in the model dtype, as every family here does.)"""
    from engine.ssm.spec import SsmSpec

    arch = "MambaForCausalLM"
    _refuse(c.hidden_act == "silu", f"{arch} needs hidden_act 'silu', got {c.hidden_act!r}")
    spec = SsmSpec(blocks=["mamba"] * c.num_hidden_layers,
                   **_mamba1_fields(inner=c.intermediate_size, d_state=c.state_size, d_conv=c.conv_kernel,
                                    dt_rank=c.time_step_rank, conv_bias=c.use_conv_bias,
                                    proj_bias=c.use_bias)).validate()
    return _pure_mamba_config(c, arch, spec)


def _jamba_config(c) -> ModelConfig:
    """Jamba: two blocks per layer, the mixer (Mamba-1 with dt/B/C norms, or attention without
    positions) then the MLP (dense, or routed experts where layers_num_experts says so)."""
    from engine.ssm.spec import SsmSpec

    arch = "JambaForCausalLM"
    _refuse(c.hidden_act == "silu", f"{arch} needs hidden_act 'silu', got {c.hidden_act!r}")
    experts = list(c.layers_num_experts)
    blocks = [b for kind, e in zip(c.layers_block_type, experts) for b in (kind, "moe" if e > 1 else "mlp")]
    moe = "moe" in blocks
    spec = SsmSpec(blocks=blocks, **_mamba1_fields(inner=c.mamba_expand * c.hidden_size, d_state=c.mamba_d_state,
                                                   d_conv=c.mamba_d_conv, dt_rank=c.mamba_dt_rank,
                                                   conv_bias=c.mamba_conv_bias, proj_bias=c.mamba_proj_bias),
                   dt_norms=True, mlp_act="silu", attention_rope=False).validate()
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size, norm_eps=float(c.rms_norm_eps),
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=bool(c.tie_word_embeddings),
        hidden_act="silu", ssm=spec.to_dict(), num_experts=c.num_experts if moe else 0,
        num_experts_per_tok=c.num_experts_per_tok if moe else 0, moe_intermediate_size=c.intermediate_size if moe else 0,
        norm_topk_prob=False,
    ).validate()


def _falcon_h1_config(c) -> ModelConfig:
    """Falcon-H1: every layer a Mamba-2 layer and attention side by side ("parallel"), then a gated
    SiLU MLP. Its muP multipliers are folded into the weights at build (falcon_h1_multipliers), except
    the embedding's (the table may be tied to the lm_head) and, with tied embeddings, the lm_head's."""
    from engine.ssm.spec import SsmSpec

    arch = "FalconH1ForCausalLM"
    _refuse(not getattr(c, "attention_bias", False) and not getattr(c, "mlp_bias", False),
            f"{arch} with attention_bias/mlp_bias is not supported")
    _refuse(bool(c.mamba_proj_bias) == bool(c.projectors_bias),
            f"{arch} with mamba_proj_bias {c.mamba_proj_bias} and projectors_bias {c.projectors_bias} (a bias on "
            "only one of the Mamba projections) is not supported")
    _refuse(c.hidden_act == "silu", f"{arch} needs hidden_act 'silu', got {c.hidden_act!r}")
    inner = c.mamba_d_ssm if c.mamba_d_ssm is not None else int(c.mamba_expand * c.hidden_size)
    _refuse(c.mamba_n_heads * c.mamba_d_head == inner,
            f"{arch}: mamba_n_heads x mamba_d_head ({c.mamba_n_heads} x {c.mamba_d_head}) must equal the Mamba "
            f"width ({inner})")
    fields = _mamba_fields(c)
    fields["proj_bias"] = bool(c.mamba_proj_bias)
    gated = "gate_only" if not c.mamba_rms_norm else ("norm_before_gate" if c.mamba_norm_before_gate else
                                                       "norm_after_gate")
    tied = bool(c.tie_word_embeddings)
    spec = SsmSpec(blocks=["parallel", "mlp"] * c.num_hidden_layers, **fields, mlp_act="silu", attention_rope=True,
                   embedding_multiplier=float(c.embedding_multiplier), gated_norm=gated,
                   logits_scaling=1.0 / float(c.lm_head_multiplier) if tied else 1.0,
                   folded_multipliers=falcon_h1_multipliers(c)).validate()
    theta, scaling, partial = read_rope(c)
    return ModelConfig(
        architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size, norm_eps=float(c.rms_norm_eps),
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=tied, hidden_act="silu",
        ssm=spec.to_dict(), rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
    ).validate()


def falcon_h1_multipliers(c) -> dict:
    return {"ssm_in": float(c.ssm_in_multiplier), "ssm_out": float(c.ssm_out_multiplier),
            "ssm": [float(v) for v in (c.ssm_multipliers or [1.0] * 5)],
            "attention_in": float(c.attention_in_multiplier), "key": float(c.key_multiplier),
            "attention_out": float(c.attention_out_multiplier),
            "mlp": [float(v) for v in (c.mlp_multipliers or [1.0, 1.0])], "lm_head": float(c.lm_head_multiplier)}


def _hf_blocks(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(engine block kind, the checkpoint's prefix of that block's norm and mixer) per block:
    prefixes name norm and mixer as "<norm>|<mixer>"."""
    blocks = cfg.ssm["blocks"]
    if cfg.architecture == "JambaForCausalLM":
        out = []
        for i in range(cfg.num_layers):
            layer = f"model.layers.{i}."
            out.append((blocks[2 * i], f"{layer}input_layernorm|{layer}{'mamba' if blocks[2 * i] == 'mamba' else 'self_attn'}."))
            out.append((blocks[2 * i + 1], f"{layer}pre_ff_layernorm|{layer}feed_forward."))
        return out
    if cfg.architecture == "FalconH1ForCausalLM":
        return [b for i in range(cfg.num_layers) for b in (
            ("parallel", f"model.layers.{i}.input_layernorm|model.layers.{i}."),
            ("mlp", f"model.layers.{i}.pre_ff_layernorm|model.layers.{i}.feed_forward."))]
    if cfg.architecture in ("BambaForCausalLM", "GraniteMoeHybridForCausalLM"):
        bamba = cfg.architecture == "BambaForCausalLM"
        out = []
        for i in range(cfg.num_layers):
            layer = f"model.layers.{i}."
            mixer = "mamba" if blocks[2 * i] == "mamba" else "self_attn"
            out.append((blocks[2 * i], f"{layer}input_layernorm|{layer}{mixer}."))
            out.append((blocks[2 * i + 1], f"{layer}pre_ff_layernorm|{layer}feed_forward." if bamba else
                        f"{layer}post_attention_layernorm|{layer}"))
        return out
    return [(kind, f"model.layers.{i}.norm|model.layers.{i}.mixer.") for i, kind in enumerate(blocks)]


def hybrid_rank_weights(get: TensorGetter, cfg: ModelConfig, rank: int, tp_size: int
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    from engine.ssm.spec import SsmSpec

    whole = SsmSpec.from_dict(cfg.ssm)
    part = mamba_shard(whole, rank, tp_size)

    def split(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return shard(t, dim, rank, tp_size)

    # (Mamba-2 and Mamba-1 name them alike)
    nemotron = cfg.architecture in ("NemotronHForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM")
    if nemotron and not has_tensor(get, "model.embeddings.weight"):
        # NVIDIA's checkpoints (and transformers' save_pretrained) name Nemotron-H's stack "backbone";
        # transformers' in-memory state dict names it "model".
        stored = get
        get = lambda name: stored("backbone." + name[len("model."):] if name.startswith("model.") else name)  # noqa: E731
    yield "embed_tokens.weight", split(get("model.embeddings.weight" if nemotron else "model.embed_tokens.weight"))
    yield "norm.weight", get({"BambaForCausalLM": "model.final_layernorm.weight", "NemotronHForCausalLM": "model.norm_f.weight",
                              "GraniteMoeHybridForCausalLM": "model.norm.weight", "Mamba2ForCausalLM": "model.norm_f.weight",
                              "FalconH1ForCausalLM": "model.final_layernorm.weight", "MambaForCausalLM": "model.norm_f.weight",
                              "JambaForCausalLM": "model.final_layernorm.weight"}[cfg.architecture])
    if not cfg.tie_word_embeddings:  # (Falcon-H1's lm_head multiplier folded in; tied: logits_scaling)
        yield "lm_head.weight", split(_Multipliers.scale(get("lm_head.weight"), _Multipliers(cfg).lm_head))
    order = None if cfg.rotary_dim == cfg.head_dim else partial_rotary_order(cfg.head_dim, cfg.rotary_dim)

    def rotary(t: torch.Tensor) -> torch.Tensor:
        return t if order is None else t.unflatten(0, (-1, cfg.head_dim))[:, order].flatten(0, 1)

    mult = _Multipliers(cfg)
    for i, (kind, names) in enumerate(_hf_blocks(cfg)):
        norm, hf = names.split("|")
        out = f"blocks.{i}."
        yield out + "norm.weight", get(norm + ".weight")
        m = out + "mixer."
        if kind == "mamba" and cfg.ssm["mamba_version"] == 1:
            yield from _mamba1_weights(get, hf, m, cfg)
        elif kind == "mamba":
            yield from _mamba_weights(get, hf, m, cfg, mult, whole, part)
        elif kind == "moe" and cfg.architecture == "GraniteMoeHybridForCausalLM":
            yield from _granite_moe_weights(get, hf, m, split)
        elif kind == "moe" and cfg.architecture == "NemotronHForCausalLM":
            yield from _nemotron_h_moe_weights(get, hf, m, cfg.num_experts, split)
        elif kind == "moe":  # Jamba: engine/models/moe.py's names; the router stays in the model dtype
            yield m + "router.weight", get(hf + "router.weight")
            yield from _expert_weights(m, *stacked_experts(get, hf, cfg.num_experts, mlp=""), split)
        elif kind == "attention":
            yield from _attention_weights(get, hf, m, rotary, mult, split)
        elif kind == "parallel":  # Falcon-H1
            yield from _mamba_weights(get, hf + "mamba.", m + "mamba.", cfg, mult, whole, part)
            yield from _attention_weights(get, hf + "self_attn.", m + "attention.", rotary, mult, split)
        elif cfg.architecture == "GraniteMoeHybridForCausalLM":
            yield from _granite_shared_mlp(get, hf + "shared_mlp.", m, split)
        elif cfg.ssm["mlp_act"] == "silu":  # rows [gate_r | up_r]
            gate, down = mult.mlp
            yield m + "up_proj.weight", torch.cat([split(mult.scale(get(hf + "gate_proj.weight"), gate)),
                                                   split(get(hf + "up_proj.weight"))])
            yield m + "down_proj.weight", split(mult.scale(get(hf + "down_proj.weight"), down), 1)
        else:
            yield m + "up_proj.weight", split(get(hf + "up_proj.weight"))
            yield m + "down_proj.weight", split(get(hf + "down_proj.weight"), 1)


def _expert_weights(m: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, split):
    """Routed experts as engine/models/moe.py names them: gate/up (E, I, H), down (E, H, I) -> this
    rank's slice of every expert's width, gate_up_proj (E, 2 I_r, H) rows [gate_r | up_r] and
    down_proj (E, H, I_r)."""
    yield m + "gate_up_proj", torch.cat([split(gate, 1), split(up, 1)], dim=1)
    yield m + "down_proj", split(down, 2)


def _granite_shared_mlp(get: TensorGetter, hf: str, m: str, split):
    """Granite 4.0's shared MLP: input_linear rows [gate | up] -> this rank's [gate_r | up_r]."""
    gate, up = get(hf + "input_linear.weight").chunk(2)
    yield m + "up_proj.weight", torch.cat([split(gate), split(up)])
    yield m + "down_proj.weight", split(get(hf + "output_linear.weight"), 1)


def _granite_moe_weights(get: TensorGetter, hf: str, m: str, split):
    """Granite 4.0 H-Tiny / H-Small's MoE layer (engine/ssm/hybrid.py SharedMlpMoe): the router, the
    experts stacked as the checkpoints store them (``block_sparse_moe.input_linear.weight`` (E, 2I, H)
    rows [gate | up], ``output_linear.weight`` (E, H, I); transformers 5's in-memory state dict names
    them ``experts.gate_up_proj`` / ``experts.down_proj`` and the router ``router.weight``), and the
    shared MLP."""
    moe = hf + "block_sparse_moe."
    on_disk = has_tensor(get, moe + "input_linear.weight")
    yield m + "experts.router.weight", get(moe + ("router.layer.weight" if on_disk else "router.weight"))
    gate, up = get(moe + ("input_linear.weight" if on_disk else "experts.gate_up_proj")).chunk(2, dim=1)
    down = get(moe + ("output_linear.weight" if on_disk else "experts.down_proj"))
    yield from _expert_weights(m + "experts.", gate, up, down, split)
    yield from _granite_shared_mlp(get, hf + "shared_mlp.", m + "shared.", split)


def _nemotron_h_moe_weights(get: TensorGetter, hf: str, m: str, num_experts: int, split):
    """A Nemotron-H MoE layer (engine/ssm/hybrid.py SharedMlpMoe over relu^2 experts): the float32 router
    ``gate.weight`` and ``gate.e_score_correction_bias``; the experts' up rows (no gate) per expert as
    checkpoints ship them (``experts.{j}.up_proj.weight``) or stacked as transformers 5 holds them
    (``experts.up_proj`` (E, I, H)), split by width; the shared MLP ``shared_experts``."""
    yield m + "experts.router.weight", get(hf + "gate.weight").float()
    yield m + "experts.score_bias", get(hf + "gate.e_score_correction_bias").float()
    if has_tensor(get, hf + "experts.up_proj"):
        up, down = get(hf + "experts.up_proj"), get(hf + "experts.down_proj")
    else:
        up, down = (torch.stack([get(hf + f"experts.{j}.{name}_proj.weight") for j in range(num_experts)])
                    for name in ("up", "down"))
    yield m + "experts.gate_up_proj", split(up, 1)
    yield m + "experts.down_proj", split(down, 2)
    yield m + "shared.up_proj.weight", split(get(hf + "shared_experts.up_proj.weight"))
    yield m + "shared.down_proj.weight", split(get(hf + "shared_experts.down_proj.weight"), 1)


class _Multipliers:
    """Falcon-H1's muP multipliers (SsmSpec.folded_multipliers), folded into the weights they
    follow or precede: all 1 for the other families (then nothing is touched)."""

    def __init__(self, cfg: ModelConfig):
        m = cfg.ssm.get("folded_multipliers") or {}
        self.ssm_in, self.ssm_out = m.get("ssm_in", 1.0), m.get("ssm_out", 1.0)
        self.ssm = m.get("ssm", [1.0] * 5)  # in_proj rows: z, x, B, C, dt
        self.attention_in, self.key, self.attention_out = m.get("attention_in", 1.0), m.get("key", 1.0), \
            m.get("attention_out", 1.0)
        self.mlp, self.lm_head = m.get("mlp", [1.0, 1.0]), m.get("lm_head", 1.0)

    @staticmethod
    def scale(t: torch.Tensor, factor) -> torch.Tensor:
        """t times a number, or times a per-row vector; in float32 (the iterator casts after)."""
        if isinstance(factor, torch.Tensor):
            return t.float() * factor.view(-1, *([1] * (t.dim() - 1)))
        return t if factor == 1.0 else t.float() * factor

    def in_proj_rows(self, spec: dict) -> torch.Tensor | None:
        """Falcon-H1's mup vector: a factor per in_proj output row (sections z, x, B, C, dt)."""
        if self.ssm == [1.0] * 5 and self.ssm_in == 1.0:
            return None
        inner, bc = spec["num_heads"] * spec["head_dim"], spec["n_groups"] * spec["d_state"]
        sizes = [inner, inner, bc, bc, spec["num_heads"]]
        return torch.cat([torch.full((n,), float(f)) for n, f in zip(sizes, self.ssm)])


def _mamba_weights(get: TensorGetter, hf: str, m: str, cfg: ModelConfig, mult: _Multipliers, whole, part: MambaShard):
    """One Mamba-2 layer's tensors for rank ``part.rank``: multipliers folded into the whole
    tensors first, then split by heads and groups (engine/ssm/mamba_shard.py)."""
    rows = mult.in_proj_rows(cfg.ssm)
    in_rows = None if rows is None else rows * mult.ssm_in  # the input's multiplier, folded with the rows'
    in_proj = get(hf + "in_proj.weight") if in_rows is None else mult.scale(get(hf + "in_proj.weight"), in_rows)
    yield m + "in_proj.weight", shard_in_proj(in_proj, whole, part)
    yield m + "conv_weight", shard_conv(get(hf + "conv1d.weight").squeeze(1), whole, part)
    for name in ("dt_bias", "A_log", "D"):
        yield m + name, shard_head_channels(get(hf + name), part)
    if cfg.ssm["gated_norm"] != "gate_only":
        yield m + "gate_norm.weight", shard_head_channels(get(hf + "norm.weight"), part)
    yield m + "out_proj.weight", shard_head_channels(mult.scale(get(hf + "out_proj.weight"), mult.ssm_out), part, 1)
    if cfg.ssm["conv_bias"]:
        yield m + "conv_bias", shard_conv(get(hf + "conv1d.bias"), whole, part)
    if cfg.ssm["proj_bias"]:
        bias = get(hf + "in_proj.bias") if rows is None else mult.scale(get(hf + "in_proj.bias"), rows)
        yield m + "in_proj.bias", shard_in_proj(bias, whole, part)
        yield m + "out_proj.bias", mult.scale(get(hf + "out_proj.bias"), mult.ssm_out)  # whole: added after the reduce


def _mamba1_weights(get: TensorGetter, hf: str, m: str, cfg: ModelConfig):
    yield m + "in_proj.weight", get(hf + "in_proj.weight")
    yield m + "conv_weight", get(hf + "conv1d.weight").squeeze(1)
    yield m + "x_proj.weight", get(hf + "x_proj.weight")
    yield m + "dt_proj.weight", get(hf + "dt_proj.weight")
    yield m + "dt_bias", get(hf + "dt_proj.bias")
    for name in ("A_log", "D"):
        yield m + name, get(hf + name)
    yield m + "out_proj.weight", get(hf + "out_proj.weight")
    if cfg.ssm["dt_norms"]:  # Jamba
        for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"), ("c_norm", "c_layernorm")):
            yield m + f"{ours}.weight", get(hf + f"{theirs}.weight")
    if cfg.ssm["conv_bias"]:
        yield m + "conv_bias", get(hf + "conv1d.bias")
    if cfg.ssm["proj_bias"]:
        yield m + "in_proj.bias", get(hf + "in_proj.bias")
        yield m + "out_proj.bias", get(hf + "out_proj.bias")


def _attention_weights(get: TensorGetter, hf: str, m: str, rotary, mult: _Multipliers, split):
    """q/k/v fused as [q_r | k_r | v_r] of this rank's heads; o_proj's matching input columns."""
    q, k, v = (mult.scale(get(hf + f"{p}_proj.weight"), mult.attention_in) for p in "qkv")
    yield m + "qkv_proj.weight", torch.cat([split(rotary(q)), split(rotary(mult.scale(k, mult.key))), split(v)])
    yield m + "o_proj.weight", split(mult.scale(get(hf + "o_proj.weight"), mult.attention_out), 1)
