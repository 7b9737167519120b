"""A model cut down to one pipeline stage, and that stage's forward.

Supported: the families whose model runs LlamaForCausalLM's forward (Llama, Mistral, Qwen2/3,
Phi-3, SmolLM2/3, the MoE families Mixtral / Qwen3-MoE, gpt-oss, Llama 4): their blocks take and return
``(x, residual)`` and nothing outside the blocks reads a layer index. A block reads its index at
construction (SmolLM3's and Llama 4's NoPE layers, windows, dense or MoE MLP), on the meta-device model
before trim_to_stage renumbers it, and at run time only to index the KV pool: each admitted family's
pp 2 engine gives pp 1's logits on a split whose stage 1 starts on a layer unlike layer 0
(tests/engine/test_pipeline_parallel.py, pipeline_ranks.PP_MORE_LAYERS). Other families are refused by
name at build and at load (``check_pipeline_supported``).

What crosses from stage to stage is the residual stream as the blocks hand it on: ``x`` (the last
block's MLP output, any deferred FP8 scales applied) and ``residual``, stacked as one tensor
(num_tokens, 2, hidden) in the model dtype. Sending both, not their sum, keeps every stage's
arithmetic exactly that of the unsplit model: the next block's fused add + norm sees the same
operands. Tokens lead the layout so that the first n rows of a bucket-sized buffer are one
contiguous span: a decode graph's static input takes a step's n rows as received, and the
rows a graph computes for its sequences are a contiguous prefix of its output (StageStep).
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


def pipeline_admits(architecture: str) -> bool:
    """Whether ``architecture``'s model runs LlamaForCausalLM's forward, the one stage_forward splits."""
    model_class = get_model_class(architecture)
    return issubclass(model_class, LlamaForCausalLM) and model_class.forward is LlamaForCausalLM.forward


def check_pipeline_supported(model: ModelConfig) -> None:
    """ConfigError naming the architecture when its model cannot be split into stages."""
    if not pipeline_admits(model.architecture):
        raise ConfigError(f"pipeline parallelism (pp_size > 1) is not supported for {model.architecture}; it is for "
                          "the Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2/3), Mixtral, "
                          "Qwen3-MoE, gpt-oss and Llama 4; use tp_size instead")


def trim_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Keep ``stage``'s layers (renumbered from 0: they index this stage's KV pool), the embedding
    on the first stage (and on the last when the LM head is tied to it), the final norm and LM head
    on the last. Runs on the meta-device model, before any weight is loaded. Features whose
    stage-split form is not built are switched off on the instance (the executor then refuses them
    by name): prompt tables, LoRA."""
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
    return model


def stage_forward(model: nn.Module, stage: Stage, input_ids: torch.Tensor | None, carried: torch.Tensor | None,
                  positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One stage's share of LlamaForCausalLM.forward.

    First stage: ``input_ids`` (num_tokens,) are embedded. Later stages: ``carried`` (num_tokens, 2,
    hidden) is the previous stage's (x, residual). Returns the last stage's final-normed hidden
    states (num_tokens, hidden), else the (num_tokens, 2, hidden) stream for the next stage."""
    cos_sin_cache = model._rotary_table(positions.device)
    if stage.is_first:
        x, residual = model.embed_tokens(input_ids), None
    else:  # contiguous copies: the blocks' kernels take rows of stride hidden
        x, residual = carried[:, 0].contiguous(), carried[:, 1].contiguous()
    for layer in model.layers:
        x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, meta)
    if stage.is_last:
        return rms_norm(apply_scales(x), model.norm.weight, model.config.norm_eps, residual)[0]
    x = apply_scales(x)
    if x.dim() == 3:  # unsummed expert rows (T, parts, hidden) that the next stage's first norm cannot see as such
        x = x.sum(dim=1)
    return torch.stack((x, residual), dim=1)


class StageStep(nn.Module):
    """A stage's forward as the decode and prefill graphs capture it (engine/executor/cuda_graphs.py,
    prefill_graphs.py): ``(input_ids, positions, kv_cache, meta) -> hidden`` like a whole model's. A
    later stage's input stream is the static buffer ``carried`` (max_rows, 2, hidden): a step
    receives its n rows into ``carried[:n]`` before the replay, and a graph of bucket b reads
    ``carried[:b]`` (rows past n are padding: stale but finite, their outputs unread). The first
    stage embeds ``input_ids``; the ids of later stages are unread. Holds no weights of its own
    (``model`` is the runner's)."""

    def __init__(self, model: nn.Module, stage: Stage, *, max_rows: int, dtype: torch.dtype, device):
        super().__init__()
        self.model, self.stage = model, stage
        self.carried = None if stage.is_first else torch.zeros(max_rows, 2, model.config.hidden_size, dtype=dtype,
                                                               device=device)

    def forward(self, input_ids, positions, kv_cache, meta):
        carried = None if self.carried is None else self.carried[:positions.shape[0]]
        return stage_forward(self.model, self.stage, input_ids, carried, positions, kv_cache, meta)
