"""A model cut down to one pipeline stage, and that stage's forward.

Supported: the families whose model runs LlamaForCausalLM's forward (Llama, Mistral, Qwen2/3,
Phi-3, SmolLM2/3, the MoE families Mixtral / Qwen3-MoE, gpt-oss): their blocks take and return
``(x, residual)`` and nothing outside the blocks reads a layer index. Other families are refused by
name at build and at load (``check_pipeline_supported``).

What crosses from stage to stage is the residual stream as the blocks hand it on: ``x`` (the last
block's MLP output, any deferred FP8 scales applied) and ``residual``, stacked as one tensor
(2, num_tokens, hidden) in the model dtype. Sending both, not their sum, keeps every stage's
arithmetic exactly that of the unsplit model: the next block's fused add + norm sees the same
operands.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models import get_model_class
from engine.models.layers import apply_scales
from engine.models.llama import LlamaForCausalLM
from engine.pipeline.layout import Stage
from kernels.attention_metadata import AttentionMetadata
from kernels.rmsnorm import rms_norm


def check_pipeline_supported(model: ModelConfig) -> None:
    """ConfigError naming the architecture when its model cannot be split into stages."""
    model_class = get_model_class(model.architecture)
    if not (issubclass(model_class, LlamaForCausalLM) and model_class.forward is LlamaForCausalLM.forward):
        raise ConfigError(f"pipeline parallelism (pp_size > 1) is not supported for {model.architecture}; it is for "
                          "the Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2/3), Mixtral, "
                          "Qwen3-MoE and gpt-oss; use tp_size instead")


def trim_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Keep ``stage``'s layers (renumbered from 0: they index this stage's KV pool), the embedding
    on the first stage (and on the last when the LM head is tied to it), the final norm and LM head
    on the last. Runs on the meta-device model, before any weight is loaded. Features whose
    stage-split form is not built are switched off on the instance (the executor then refuses them
    by name): prompt tables, LoRA, graphed steps with prompt tokens."""
    layers = list(model.layers)[stage.start:stage.end]
    for local, layer in enumerate(layers):
        layer.layer_index = local  # was global; read only to index the KV pool from here on
    model.layers = nn.ModuleList(layers)
    tied = model.config.tie_word_embeddings
    if not (stage.is_first or (stage.is_last and tied)):
        del model.embed_tokens
    if not stage.is_last:
        del model.norm
        if hasattr(model, "lm_head"):
            del model.lm_head
    model.stage = stage
    model.supports_prompt_tables = False
    model.supports_lora = False
    model.supports_prefill_graphs = False
    return model


def stage_forward(model: nn.Module, stage: Stage, input_ids: torch.Tensor | None, carried: torch.Tensor | None,
                  positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One stage's share of LlamaForCausalLM.forward.

    First stage: ``input_ids`` (num_tokens,) are embedded. Later stages: ``carried`` (2, num_tokens,
    hidden) is the previous stage's (x, residual). Returns the last stage's final-normed hidden
    states (num_tokens, hidden), else the (2, num_tokens, hidden) stream for the next stage."""
    cos_sin_cache = model._rotary_table(positions.device)
    if stage.is_first:
        x, residual = model.embed_tokens(input_ids), None
    else:
        x, residual = carried[0], carried[1]
    for layer in model.layers:
        x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, meta)
    if stage.is_last:
        return rms_norm(apply_scales(x), model.norm.weight, model.config.norm_eps, residual)[0]
    return torch.stack((apply_scales(x), residual))
