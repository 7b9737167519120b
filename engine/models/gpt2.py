"""GPT-2 over a ragged, packed batch and a paged KV cache.

Pre-norm LayerNorm blocks with learned absolute positions (``wpe``), MHA (no GQA, no rope),
a GELU MLP and an lm_head tied to ``wte``. Hugging Face stores GPT-2 projections as Conv1D,
(in, out); the engine stores them as (out, in) like every other linear, fused and sharded:

``wte.weight`` (vocab/tp rows), ``wpe.weight`` (replicated), ``layers.{i}.ln_1.{weight,bias}``,
``layers.{i}.qkv_proj.{weight,bias}`` (rows [q_local | k_local | v_local]),
``layers.{i}.o_proj.{weight,bias}`` (row-parallel; bias replicated), ``layers.{i}.ln_2.*``,
``layers.{i}.fc_in.{weight,bias}`` (column-parallel), ``layers.{i}.fc_out.{weight,bias}``
(row-parallel), ``ln_f.{weight,bias}``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import Linear, Norm, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_logits
from engine.models.tables import uninitialized_table
from kernels.attention_metadata import AttentionMetadata
from kernels.attention import paged_attention, write_kv_cache

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def _layer_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, eps)


class GPT2Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device):
        super().__init__()
        self.layer_index = layer_index
        self.eps = config.norm_eps
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.scale = config.head_dim**-0.5
        self.act = _ACTIVATIONS[config.hidden_act]
        hidden, local = config.hidden_size, self.num_heads * self.head_dim
        inter_local = config.intermediate_size // tp_size
        kw = dict(dtype=dtype, device=device)
        self.ln_1 = Norm(hidden, bias=True, **kw)
        self.qkv_proj = Linear(hidden, 3 * local, bias=True, **kw)
        self.o_proj = RowParallelLinear(local, hidden, bias=True, tp_group=tp_group, **kw)
        self.ln_2 = Norm(hidden, bias=True, **kw)
        self.fc_in = Linear(hidden, inter_local, bias=True, **kw)
        self.fc_out = RowParallelLinear(inter_local, hidden, bias=True, tp_group=tp_group, **kw)

    def attention(self, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q.contiguous(), k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def forward(self, x, kv_cache, meta):
        x = x + self.attention(_layer_norm(x, self.ln_1, self.eps), kv_cache, meta)
        return x + self.fc_out(self.act(self.fc_in(_layer_norm(x, self.ln_2, self.eps))))


class GPT2LMHeadModel(nn.Module):
    """GPT-2 for one tensor-parallel rank; logits come from the tied ``wte``."""

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        kw = dict(dtype=dtype, device=device)
        self.wte = VocabParallelEmbedding(
            config.vocab_size // tp_size, config.hidden_size, tp_rank=tp_rank, tp_group=tp_group, **kw
        )
        self.wpe = uninitialized_table(config.max_position_embeddings, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            GPT2Layer(config, i, tp_size=tp_size, tp_group=tp_group, **kw) for i in range(config.num_layers)
        )
        self.ln_f = Norm(config.hidden_size, bias=True, **kw)

    def init_buffers(self, device: torch.device) -> None:
        """GPT-2 has no non-weight tensors (learned positions are weights)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden)."""
        x = self.wte(input_ids) + self.wpe(positions)
        for layer in self.layers:
            x = layer(x, kv_cache, attn_meta)
        return _layer_norm(x, self.ln_f, self.config.norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, hidden) rows to score -> float32 logits (n, vocab)."""
        return vocab_parallel_logits(hidden, self.wte.weight, self.tp_group)
