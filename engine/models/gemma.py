"""Gemma 2 and Gemma 3 (text) decoders over a ragged, packed batch and a paged KV cache.

What differs from the Llama block (engine/models/llama.py), following transformers' Gemma2 /
Gemma3 text models:

- the token embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype;
- RMSNorm scales by ``(1 + w)``: the converter stores ``1 + w`` (computed in float32), so the
  plain RMSNorm kernel applies it unchanged (engine/convert.py ``gemma_rank_weights``);
- "sandwich" norms: each sub-block's output is normed again before it joins the residual::

      x = x + post_attn_norm(attn(input_norm(x)))
      x = x + post_ffn_norm(mlp(pre_ffn_norm(x)))

- GeGLU MLP: ``gelu_tanh(gate) * up`` over the fused gate_up projection;
- attention scale ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps attention scores
  (``attn_logit_softcapping``) and both soft-cap the final logits (``final_logit_softcapping``);
- sliding-window ("sliding_attention") and global layers alternate (``layer_types``);
- Gemma 3 only: RMSNorm of q and k per head before rotary, and a rope base of its own for the
  sliding layers (``rope_local_theta``; HF's ``rope_local_base_freq``), while the global layers
  keep ``rope_theta`` and ``rope_scaling``.

Gemma 3's ``attn_logit_softcapping`` is not applied: transformers' Gemma 3 attention does not pass
it to the attention function, and its configs leave it null; the converter sets it to None.

Weights per rank (names = engine-directory names, see docs/INTERFACES.md): as the Llama block
(``qkv_proj`` rows [q_local | k_local | v_local], ``gate_up_proj`` rows [gate_local | up_local],
row-parallel ``o_proj`` and ``down_proj``), plus the replicated norms ``post_attn_norm``,
``pre_ffn_norm``, ``post_ffn_norm`` and (Gemma 3) ``q_norm``/``k_norm`` of size head_dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import (Linear, Norm, RowParallelLinear, VocabParallelEmbedding, qkv_heads,
                                  vocab_parallel_logits)
from engine.models.prompt_embeds import PromptEmbeds, splice_prompt_embeds
from kernels.activation import gelu_tanh_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.rmsnorm import rms_norm
from kernels.rope_attention import rope_paged_attention
from kernels.rotary import build_cos_sin_cache


class GemmaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device):
        super().__init__()
        self.layer_index = layer_index
        self.eps = config.norm_eps
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.sliding_window = config.layer_window(layer_index)  # None: a global layer
        self.logit_softcap = config.attn_logit_softcapping
        self.gelu_approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden, inter_local = config.hidden_size, config.intermediate_size // tp_size
        norm = {"bias": False, "dtype": dtype, "device": device}
        self.input_norm = Norm(hidden, **norm)
        self.qkv_proj = Linear(hidden, q_size + 2 * kv_size, bias=False, dtype=dtype, device=device)
        if config.architecture == "Gemma3ForCausalLM":
            self.q_norm = Norm(config.head_dim, **norm)
            self.k_norm = Norm(config.head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.o_proj = RowParallelLinear(q_size, hidden, bias=False, tp_group=tp_group, dtype=dtype, device=device)
        self.post_attn_norm = Norm(hidden, **norm)
        self.pre_ffn_norm = Norm(hidden, **norm)
        self.gate_up_proj = Linear(hidden, 2 * inter_local, bias=False, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(inter_local, hidden, bias=False, tp_group=tp_group, dtype=dtype, device=device)
        self.post_ffn_norm = Norm(hidden, **norm)

    def attention(self, x, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = qkv_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim,
                            self.q_norm, self.k_norm, self.eps)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        out = rope_paged_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, self.scale,
                                   sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * inter_local): [gate | up]
        if self.gelu_approximate == "tanh":  # gelu_pytorch_tanh: every Gemma 2/3 checkpoint
            return self.down_proj(gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate) * up)

    def forward(self, x, residual, positions, cos_sin_caches, kv_cache, meta):
        """x: the previous layer's normed output (the embeddings on the first layer, residual None);
        residual: the running sum of the residual stream. Returns both, updated, with the add of x
        into the residual left to the next norm (fused there)."""
        h, residual = rms_norm(x, self.input_norm.weight, self.eps, residual)
        cos_sin_cache = cos_sin_caches[0 if self.sliding_window is None else 1]
        h = self.attention(h, positions, cos_sin_cache, kv_cache, meta)
        h = rms_norm(h, self.post_attn_norm.weight, self.eps)[0]
        h, residual = rms_norm(h, self.pre_ffn_norm.weight, self.eps, residual)
        h = self.mlp(h)
        return rms_norm(h, self.post_ffn_norm.weight, self.eps)[0], residual


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text model for one tensor-parallel rank."""

    supports_prompt_tables = True  # forward() takes prompt_embeds (Gemma 3's image rows)

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        vocab_local = config.vocab_size // tp_size
        self.embed_tokens = VocabParallelEmbedding(
            vocab_local, config.hidden_size, tp_rank=tp_rank, tp_group=tp_group, dtype=dtype, device=device
        )
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype; so does this.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
        self.layers = nn.ModuleList(
            GemmaLayer(config, i, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device)
            for i in range(config.num_layers)
        )
        self.norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, vocab_local, bias=False, dtype=dtype, device=device)
        self.max_positions = max_positions or config.max_position_embeddings
        # Gemma 3: each run of prompt-table rows (an image) attends to itself in both directions during
        # prefill, as transformers' token_type_ids mask (engine/executor/image_spans.py)
        self.bidirectional_prompt_tables = config.architecture == "Gemma3ForCausalLM"
        # (global table, sliding-layer table): the same tensor unless rope_local_theta is set.
        self.cos_sin_caches: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_buffers(self, device: torch.device) -> None:
        """Build the rotary tables on ``device``; once, before any forward (CUDA-graph capture must
        never see an allocation here)."""
        c = self.config
        global_table = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling, device)
        local_table = global_table
        if c.rope_local_theta is not None:
            local_table = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_local_theta, None, device)
        self.cos_sin_caches = (global_table, local_table)

    def _rotary_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_sin_caches is None or self.cos_sin_caches[0].device != device:
            self.init_buffers(device)
        return self.cos_sin_caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden).
        ``prompt_embeds``: table rows (image features) in place of some tokens' embeddings, not scaled
        (transformers scatters them after the scaled lookup)."""
        cos_sin_caches = self._rotary_tables(input_ids.device)
        x, residual = splice_prompt_embeds(self.embed_tokens(input_ids) * self.embed_scale, prompt_embeds), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cos_sin_caches, kv_cache, attn_meta)
        return rms_norm(x, self.norm.weight, self.config.norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, hidden) rows to score -> float32 logits (n, vocab), soft-capped when configured."""
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, weight, self.tp_group)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
