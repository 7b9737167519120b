"""Qwen3-VL's language model: Qwen3 (or Qwen3-MoE) whose first decoder layers also take DeepStack rows.

An image's table rows are (1 + k) * hidden wide (engine/vision/qwen3_vl.py): [embedding | level 0 | ...
| level k-1]. The embedding part replaces the token embedding at the image's fake ids, as any prompt
table's row; level j is added to the hidden state at the same tokens right after decoder layer j
(transformers' Qwen3VLTextModel._deepstack_process). Tokens without table rows (text, every decode
step) see a plain Qwen3, so the engine's Llama path is used as it is and only ``forward`` differs.

The hidden state after a layer is ``x + residual`` (the next norm adds them, engine/models/llama.py);
a level is added to ``residual``, which the next layer's (or the final) norm sums in.
"""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeForCausalLM
from engine.models.prompt_embeds import PromptEmbeds, add_prompt_rows, splice_prompt_embeds
from kernels.attention_metadata import AttentionMetadata
from kernels.fp8 import apply_scales
from kernels.rmsnorm import rms_norm


def split_deepstack(prompt_embeds: PromptEmbeds | None, hidden: int, levels: int
                    ) -> tuple[PromptEmbeds | None, list[torch.Tensor]]:
    """A step's wide table rows (n, (1 + levels) * hidden) -> (the embedding part as PromptEmbeds,
    ``levels`` tensors (n, hidden)); no rows -> (None, [])."""
    if prompt_embeds is None:
        return None, []
    rows = prompt_embeds.embeddings
    if rows.shape[-1] != hidden * (1 + levels):
        raise ValueError(f"prompt-table rows of width {rows.shape[-1]}; this Qwen3-VL model takes "
                         f"{hidden} x (1 + {levels} DeepStack levels) = {hidden * (1 + levels)}")
    parts = rows.split(hidden, dim=-1)
    return PromptEmbeds(prompt_embeds.token_indices, parts[0], prompt_embeds.mask), list(parts[1:])


class DeepstackForward:
    """The forward of a Llama-family model whose layers 0..k-1 add the step's DeepStack rows."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward; ``prompt_embeds`` rows are (1 + deepstack_layers) * hidden wide."""
        c = self.config
        cos_sin_cache = self._rotary_table(input_ids.device)
        if rotary is not None:
            positions, cos_sin_cache = rotary
        embeds, levels = split_deepstack(prompt_embeds, c.hidden_size, c.deepstack_layers)
        x, residual = splice_prompt_embeds(self.embed_tokens(input_ids), embeds), None
        index = (None if embeds is None or embeds.mask is not None  # the dense form (CUDA graphs) needs none
                 else torch.tensor(embeds.token_indices, dtype=torch.int64, device=x.device))
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, attn_meta)
            if i < len(levels):
                residual = add_prompt_rows(residual, embeds, levels[i], index)
        return rms_norm(apply_scales(x), self.norm.weight, c.norm_eps, residual)[0]


class Qwen3VLForCausalLM(DeepstackForward, LlamaForCausalLM):
    """Qwen3-VL dense: Qwen3's layers and weights (engine/models/llama.py), DeepStack in forward."""


class Qwen3VLMoeForCausalLM(DeepstackForward, MoeForCausalLM):
    """Qwen3-VL-MoE: Qwen3-MoE's layers and weights (engine/models/moe.py), DeepStack in forward."""

