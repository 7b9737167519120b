"""Llama 3.2 Vision's (Mllama's) text model: Llama layers with gated cross-attention layers between them.

The layers at ``cross_attention_layers`` have no self-attention: each is
    h = x + tanh(attn_gate) * o(cross_attention(q_norm(q(norm(x))), the image's K/V)),
    out = h + tanh(mlp_gate) * full_row * mlp(norm(h))
over the vision states of the request's images (engine/vision/mllama.py), whose K (k_norm'd) and V every
cross layer projects once per request into the cross-KV pool (``cross_kv``, engine/encoder_decoder/
mllama_runner.py); ``full_row`` is 0 for a token whose cross-attention mask row allows no image token
(text before the first <|image|>), which then attends to all of its request's vision tokens, as in
transformers (its mask row becomes all zeros there). A token of a request without images skips the cross
layers (transformers runs none of them without images). The other layers are engine/models/llama.py's
LlamaLayer as they are, their paged self-attention KV numbered 0.. over the self-attention layers only.

Embeddings have vocab_size + 8 rows (the image token <|image|> is row vocab_size); the head scores the
text vocabulary, and the 8 extra ids get -inf logits (the engine's vocabulary is the embedding's).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.encoder_decoder.mllama_cross import MllamaCrossStep, cross_attention
from engine.models.layers import Linear, Norm, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_logits
from engine.models.llama import LlamaLayer
from kernels.rmsnorm import rms_norm
from kernels.rotary import build_cos_sin_cache

EXTRA_EMBEDDING_ROWS = 8  # transformers' MllamaTextModel: nn.Embedding(vocab_size + 8, hidden)


def _heads_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    """RMSNorm over each head of (rows, heads, head_dim)."""
    return rms_norm(x.reshape(-1, x.shape[-1]), norm.weight, eps)[0].view(x.shape)


class MllamaCrossLayer(LlamaLayer):
    """A gated cross-attention layer: the Llama block's MLP (its gate_up/down and norms), cross-attention
    projections instead of self-attention. ``layer_index`` is its index among the cross layers (its
    planes of the cross pool)."""

    def _init_attention(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        self.head_dim, self.num_heads, self.num_kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=False, dtype=dtype, device=device)
        self.kv_proj = Linear(config.hidden_size, 2 * kv_size, bias=False, dtype=dtype, device=device)  # [k | v]
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=False, tp_group=tp_group, dtype=dtype,
                                        device=device)
        self.q_norm = Norm(config.head_dim, bias=False, dtype=dtype, device=device)
        self.k_norm = Norm(config.head_dim, bias=False, dtype=dtype, device=device)
        self.attn_gate = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.mlp_gate = nn.Parameter(torch.empty(1, dtype=dtype, device=device))

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """(L, hidden) vision states -> (2, L, kv_heads, head_dim): k_norm(k) and v."""
        k, v = self.kv_proj(states).view(states.shape[0], 2, self.num_kv_heads, self.head_dim).unbind(1)
        return torch.stack([_heads_norm(k, self.k_norm, self.eps), v])

    def forward(self, x: torch.Tensor, pool: torch.Tensor, step: MllamaCrossStep) -> torch.Tensor:
        """x: (num_tokens, hidden) hidden states; only the rows of sequences with images change."""
        rows = x.index_select(0, step.rows)
        h = rms_norm(rows, self.input_norm.weight, self.eps)[0]
        q = _heads_norm(self.q_proj(h).view(h.shape[0], self.num_heads, self.head_dim), self.q_norm, self.eps)
        out = cross_attention(q, pool[self.layer_index, 0], pool[self.layer_index, 1], step, self.scale)
        rows = rows + self.attn_gate.tanh() * self.o_proj(out.reshape(out.shape[0], -1))
        mlp = self.mlp(rms_norm(rows, self.post_attn_norm.weight, self.eps)[0])
        rows = rows + self.mlp_gate.tanh() * (step.full_row.to(rows.dtype) * mlp)
        return x.index_copy(0, step.rows, rows)


class MllamaTextModel(nn.Module):
    """The model surface the runner drives (engine/models/__init__.py) plus the cross-attention step.
    ``config`` describes the self-attention stack (num_layers = the self-attention layers: the paged
    KV pool's), ``cross_layers`` the positions of the cross layers among ``num_layers_total``."""

    def __init__(self, config: ModelConfig, *, num_layers_total: int, cross_layers: list[int], text_vocab_size: int,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.text_vocab_size = text_vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank=0, tp_group=None,
                                                   dtype=dtype, device=device)
        layers, self_index, cross_index = [], 0, 0
        for i in range(num_layers_total):
            if i in cross_layers:
                layers.append(MllamaCrossLayer(config, cross_index, tp_size=1, tp_group=None, dtype=dtype,
                                               device=device))
                cross_index += 1
            else:
                layers.append(LlamaLayer(config, self_index, tp_size=1, tp_group=None, dtype=dtype, device=device))
                self_index += 1
        self.layers = nn.ModuleList(layers)
        self.cross_layers = [layer for layer in layers if isinstance(layer, MllamaCrossLayer)]
        self.cross_layer_indexes = sorted(cross_layers)
        self.norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        self.lm_head = Linear(config.hidden_size, text_vocab_size, bias=False, dtype=dtype, device=device)
        self.max_positions = max_positions or config.max_position_embeddings
        self.cos_sin_cache: torch.Tensor | None = None

    def init_buffers(self, device: torch.device) -> None:
        c = self.config
        self.cos_sin_cache = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling, device,
                                                 rotary_dim=c.rotary_dim)

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        """(L, hidden) vision states -> (cross layers, 2, L, kv_heads, head_dim)."""
        return torch.stack([layer.cross_kv(states) for layer in self.cross_layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_meta,
                *, cross_pool: torch.Tensor | None = None, cross: MllamaCrossStep | None = None) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden). ``cross``:
        the step's rows with images and their masks (None: no row has images; the cross layers are skipped)."""
        if self.cos_sin_cache is None or self.cos_sin_cache.device != input_ids.device:
            self.init_buffers(input_ids.device)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            if isinstance(layer, MllamaCrossLayer):
                if cross is not None:
                    x, residual = layer(x if residual is None else x + residual, cross_pool, cross), None
                continue
            x, residual = layer(x, residual, positions, self.cos_sin_cache, kv_cache, attn_meta)
        return rms_norm(x, self.norm.weight, self.config.norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) -> float32 logits (n, vocab_size + 8): the 8 ids past the text vocabulary at -inf."""
        logits = vocab_parallel_logits(hidden, self.lm_head.weight, None)
        extra = self.config.vocab_size - self.text_vocab_size
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
