"""Llama-family decoder over a ragged, packed batch and a paged KV cache.

One file covers every checkpoint with the Llama block (pre-norm RMSNorm, rotary attention with
GQA, SwiGLU MLP): Llama 2/3 (rope scalings ``llama3``, ``linear``, ``yarn``, ``dynamic``),
Mistral (sliding window on every layer), Qwen2 (bias on q/k/v; sliding window on the layers its
config lists), SmolLM2 (tied embeddings), Qwen3 (RMSNorm over each q and k head before rope),
Phi-3/Phi-4 (checkpoints with fused qkv and gate_up, LongRoPE, partial rotary) and SmolLM3
(some layers without rope).

Batch layout: ``input_ids`` and ``positions`` are (num_tokens,) with the new tokens of every
scheduled sequence back to back (prefill chunks and single decode tokens mixed, no padding);
``attn_meta`` says which rows belong to which sequence and where their K/V go in the pool.

Weights per rank (names = engine-directory names, see docs/INTERFACES.md): q/k/v fused into
``qkv_proj`` with rows [q_local | k_local | v_local], gate/up fused into ``gate_up_proj`` with
rows [gate_local | up_local]; ``o_proj`` and ``down_proj`` are row-parallel; Qwen3 adds
``q_norm``/``k_norm`` (head_dim,). With partial rotary, each q/k head's dims are stored in
``kernels.rotary.partial_rotary_order`` (engine.convert reorders them), so the rope tables and
kernels handle whole heads.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.prompt_embeds import PromptEmbeds, splice_prompt_embeds
from engine.models.layers import (Linear, Norm, RowParallelLinear, VocabParallelEmbedding, qkv_heads, rms_norm_into,
                                  vocab_parallel_logits)
from kernels.attention_metadata import AttentionMetadata
from kernels.attention import paged_attention, write_kv_cache
from kernels.fp8 import ScaledProduct, apply_scales
from kernels.rmsnorm import rms_norm
from kernels._triton import use_triton
from kernels.rope_attention import rope_paged_attention
from kernels.triton_attention import fuses_new_kv
from kernels.rotary import build_cos_sin_cache

if TYPE_CHECKING:
    from kernels.lora import LoraBatch

# "1": at decode on CUDA the attention kernel applies Qwen3's per-head q/k norms before its rotary
# (kernels/triton_attention.py qk_norm): kernels/rmsnorm.py qk_rms_norm's launch a layer less. "0" (the default): that
# launch, then the attention kernel (H200, Qwen3-30B-A3B batch 1, 2026-11-30: no change; the attention kernel gained
# 0.75 us a call, the norm's launch was 1.44 on the critical path; 2026-12-01: 2.834 against 2.876 ms alone, then
# 2.896 against 2.882 with the normed router, both within the spread).
QK_NORM_IN_ATTENTION_ENV = "TRITONLLM_QK_NORM_IN_ATTENTION"
QK_NORM_IN_ATTENTION_DEFAULT = "0"


def qk_norm_in_attention() -> bool:
    """$TRITONLLM_QK_NORM_IN_ATTENTION (read per call: benchmarks flip it between runs)."""
    return os.environ.get(QK_NORM_IN_ATTENTION_ENV, QK_NORM_IN_ATTENTION_DEFAULT).strip() == "1"


class LlamaLayer(nn.Module):
    """One decoder block: attention (GQA, rope, optional per-head q/k RMSNorm) then the MLP.

    Subclasses swap the MLP (a mixture of experts, say) by overriding ``_init_mlp`` and ``mlp``;
    the attention half, Qwen3's q/k norms included, stays as it is.
    """

    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device,
                 quantization: str | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.eps = config.norm_eps
        self.input_norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        self._init_attention(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                             quantization=quantization)
        self.post_attn_norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        self._init_mlp(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                       quantization=quantization)

    def _init_attention(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_window(self.layer_index)  # None: attends to the whole context
        self.use_rope = self.layer_index not in config.layers_without_rope  # SmolLM3's NoPE layers: False
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        quant = {"dtype": dtype, "device": device, "quantization": quantization}
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias, **quant)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=False, tp_group=tp_group, **quant)
        if config.qk_norm:  # Qwen3: (head_dim,) weights shared by every head, replicated over ranks
            self.q_norm = Norm(config.head_dim, bias=False, dtype=dtype, device=device)
            self.k_norm = Norm(config.head_dim, bias=False, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None

    def _init_mlp(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        inter_local = config.intermediate_size // tp_size
        quant = {"dtype": dtype, "device": device, "quantization": quantization}
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter_local, bias=False, **quant)
        self.down_proj = RowParallelLinear(inter_local, config.hidden_size, bias=False, tp_group=tp_group, **quant)

    def attention(self, x, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x, meta.lora)
        # Qwen3's q/k norms inside the decode attention kernel (before its rotary) where that kernel runs:
        # kernels/rmsnorm.py qk_rms_norm's launch less (kernels/triton_attention.py qk_norm).
        fold = (self.q_norm is not None and self.use_rope and qk_norm_in_attention() and use_triton(qkv)
                and meta.is_decode_only and fuses_new_kv(self.head_dim))  # (rope_attention's fused case)
        q, k, v = qkv_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                            *((None, None, 0.0) if fold else (self.q_norm, self.k_norm, self.eps)))
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        if self.use_rope:
            # Rotary, KV write and attention: one kernel at decode on CUDA (kernels/rope_attention.py).
            out = rope_paged_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, self.scale,
                                       sliding_window=self.sliding_window,
                                       qk_norm=(self.q_norm.weight, self.k_norm.weight, self.eps) if fold else None)
        else:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window)
        # Read only by forward's post-attention norm, which applies deferred FP8 scales itself
        # (kernels/fp8.py ScaledProduct) when it quantizes for an FP8 gate_up_proj.
        defer = getattr(self, "gate_up_proj", None) is not None and self.gate_up_proj.is_fp8
        return self.o_proj(out.reshape(out.shape[0], -1), meta.lora, defer_scales=defer)

    def mlp(self, h: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor | ScaledProduct:
        """``lora``: the forward's adapter rows (engine/lora/pool.py); down_proj then takes its
        input unquantized (its adapter reads it in the model dtype). The output may be a
        ScaledProduct: only the next layer's input norm or the model's final norm reads it."""
        quantize = self.down_proj.is_fp8 and (lora is None or self.down_proj.lora is None)
        return self.down_proj(self.gate_up_proj.gated(h, quantize_output=quantize, lora=lora), lora,
                              defer_scales=True)

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, meta):
        """x, residual: (num_tokens, hidden); residual None on the first layer. Returns both, updated.
        With FP8 layers on the W8A8 path, the norms hand qkv_proj and gate_up_proj their input
        already quantized (engine.models.layers.rms_norm_into); layers without a ``gate_up_proj``
        (sparse MoE) get the post-attention norm's output as it is."""
        h, residual = rms_norm_into(self.qkv_proj, x, self.input_norm.weight, self.eps, residual)
        h = self.attention(h, positions, cos_sin_cache, kv_cache, meta)
        # A sparse MoE layer keeps its experts' weights in self.moe: it has no gate_up_proj.
        h, residual = rms_norm_into(getattr(self, "gate_up_proj", None), h, self.post_attn_norm.weight, self.eps,
                                    residual)
        return self.mlp(h, meta.lora), residual


class LlamaForCausalLM(nn.Module):
    """The Llama-family model for one tensor-parallel rank. ``layer_class`` builds each block."""

    layer_class = LlamaLayer
    # Steps with prompt tokens may replay CUDA graphs (engine/executor/prefill_graphs.py): checked
    # against the eager forward in tests/engine/test_cuda_graphs.py.
    supports_prefill_graphs = True
    # Adapters on the attention and dense MLP projections (engine/lora/pool.py attaches them).
    supports_lora = True
    # forward() takes prompt_embeds (prompt-embedding tables, image features).
    supports_prompt_tables = True
    # forward() takes rotary: M-RoPE requests' rotary positions (engine/executor/mrope_rotary.py).
    supports_mrope = True

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization: str | None = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        vocab_local = config.vocab_size // tp_size
        self.embed_tokens = VocabParallelEmbedding(
            vocab_local, config.hidden_size, tp_rank=tp_rank, tp_group=tp_group, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            self.layer_class(config, i, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                       quantization=quantization)
            for i in range(config.num_layers)
        )
        self.norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, vocab_local, bias=False, dtype=dtype, device=device)
        self.max_positions = max_positions or config.max_position_embeddings
        self.cos_sin_cache: torch.Tensor | None = None  # built lazily on the weights' device

    def init_buffers(self, device: torch.device) -> None:
        """Build non-weight tensors (the rotary table) on ``device``; once, before any forward
        (CUDA-graph capture must never see an allocation here)."""
        c = self.config
        self.cos_sin_cache = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling, device,
                                                 rotary_dim=c.rotary_dim)

    def _rotary_table(self, device: torch.device) -> torch.Tensor:
        if self.cos_sin_cache is None or self.cos_sin_cache.device != device:
            self.init_buffers(device)
        return self.cos_sin_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden).
        ``prompt_embeds``: prompt-table rows that replace some tokens' embeddings (image features).
        ``rotary``: (positions (num_tokens,), table (rows, head_dim)) that rotary reads instead of
        ``positions`` and the model's table (M-RoPE); the KV slots are attn_meta's either way."""
        cos_sin_cache = self._rotary_table(input_ids.device)
        if rotary is not None:
            positions, cos_sin_cache = rotary
        x, residual = splice_prompt_embeds(self.embed_tokens(input_ids), prompt_embeds), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, attn_meta)
        return rms_norm(apply_scales(x), self.norm.weight, self.config.norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, hidden) rows to score -> float32 logits (n, vocab)."""
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.tp_group)
