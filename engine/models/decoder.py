"""The configurable decoder: GPT-NeoX, Falcon, GPT-J, OPT, StarCoder2, GLM-4, BLOOM and MPT.

These families differ from one another (and from Llama) in a handful of well-known choices, which
are ModelConfig's block options (engine/config.py), not copies of the model:

- ``norm_kind`` "layernorm" (``norm_bias``: with a bias) or "rmsnorm";
- ``positions``: "rope" (partial with ``partial_rotary_factor``; GPT-J's and GLM's interleaved
  pairs are reordered into the kernels' halves by engine.convert), "learned" (a table looked up at
  ``position + learned_position_offset``, OPT's 2) or "alibi" (per-head slopes, kernels/alibi.py,
  applied inside the paged attention kernels);
- ``residual``: "sequential", "parallel" (one norm feeds attention and MLP: GPT-J, Falcon-7B),
  "parallel_two_norms" (GPT-NeoX, Falcon's new decoder architecture) or "post_norm" (OPT-350m);
- ``post_sublayer_norms`` (GLM-4): each sub-block's output is normed before it joins the residual;
- biases: ``qkv_bias``, ``attention_out_bias``, ``mlp_bias``, ``lm_head_bias`` (GPT-J);
- the MLP: ``mlp_gated`` (SiLU(gate) * up, GLM-4) or act(fc_in(x)) with ``hidden_act``;
- ``embedding_norm`` (BLOOM), ``word_embed_proj_dim`` (OPT-350m: project_in / project_out),
  ``final_norm`` (OPT's post-norm models have none), ``clip_qkv`` (MPT).

Weights per rank (names = engine-directory names; engine.convert ``decoder_rank_weights`` maps each
family's checkpoint onto them): ``embed_tokens.weight`` (vocab/tp rows, width word_embed_proj_dim
or hidden), ``embed_positions.weight`` (learned; replicated), ``embed_norm.*``,
``project_in.weight`` / ``project_out.weight`` (replicated), per layer ``input_norm.*``,
``qkv_proj.*`` (rows [q_r | k_r | v_r]), ``o_proj.*`` (row-parallel), ``post_attn_norm.*`` (the
MLP's norm; under post_norm the norm after the MLP's add), ``attn_out_norm`` / ``mlp_out_norm``
(GLM-4), ``up_proj.*`` (column-parallel; [gate_r | up_r] rows when gated), ``down_proj.*``
(row-parallel); ``norm.*``, ``lm_head.*`` (vocab/tp rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import Linear, Norm, RowParallelLinear, VocabParallelEmbedding, qkv_heads, vocab_parallel_logits
from engine.models.prompt_embeds import PromptEmbeds, splice_prompt_embeds
from engine.models.tables import uninitialized_table
from kernels.activation import silu_and_mul
from kernels.alibi import alibi_slopes
from kernels.attention_metadata import AttentionMetadata
from kernels.layernorm import layer_norm
from kernels.rmsnorm import rms_norm
from kernels.rope_attention import append_paged_attention, rope_paged_attention
from kernels.rotary import build_cos_sin_cache

# hidden_act -> the kernels' activation (kernels/linear.py ACTIVATIONS), fused into the up projection's
# epilogue; SiLU (never a non-gated MLP's activation among the families) stays a torch op after it.
_KERNEL_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

Adds = tuple[torch.Tensor, ...]  # sub-block outputs still to be added to the residual stream, in order


def apply_norm(x: torch.Tensor, norm: Norm, kind: str, eps: float, adds: Adds = (), second: Norm | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The residual stream x (num_tokens, hidden) plus ``adds`` (each rounded in order, as the
    reference's ``x + attn + mlp``) through a LayerNorm (with or without bias) or an RMSNorm:
    (normed, the summed stream, the same stream through ``second`` or None). One kernel on CUDA
    for a LayerNorm (kernels/layernorm.py), adds and both norms included."""
    if kind == "layernorm":
        return layer_norm(x, norm.weight, norm.bias, eps, adds,
                          (second.weight, second.bias) if second is not None else None)
    for term in adds[:-1]:
        x = x + term
    out, stream = rms_norm(adds[-1], norm.weight, eps, residual=x) if adds else rms_norm(x, norm.weight, eps)
    return out, stream, rms_norm(stream, second.weight, eps)[0] if second is not None else None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device,
                 quantization=None):
        super().__init__()
        c = self.config = config
        self.layer_index = layer_index
        self.head_dim = c.head_dim
        self.num_heads = c.num_heads // tp_size
        self.num_kv_heads = c.num_kv_heads // tp_size
        self.scale = c.head_dim**-0.5
        self.sliding_window = c.layer_window(layer_index)
        self.activation = _KERNEL_ACTIVATIONS.get(c.hidden_act)  # None: silu, applied by torch
        hidden, inter_local = c.hidden_size, c.intermediate_size // tp_size
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        norm = {"bias": c.norm_bias, "dtype": dtype, "device": device}
        linear = {"dtype": dtype, "device": device, "quantization": quantization}
        self.input_norm = Norm(hidden, **norm)
        self.qkv_proj = Linear(hidden, q_size + 2 * kv_size, bias=c.qkv_bias, **linear)
        self.o_proj = RowParallelLinear(q_size, hidden, bias=c.attention_out_bias, tp_group=tp_group, **linear)
        if c.residual != "parallel":  # parallel: the input norm feeds the MLP too
            self.post_attn_norm = Norm(hidden, **norm)
        if c.post_sublayer_norms:
            self.attn_out_norm = Norm(hidden, **norm)
            self.mlp_out_norm = Norm(hidden, **norm)
        up_rows = 2 * inter_local if c.mlp_gated else inter_local
        self.up_proj = Linear(hidden, up_rows, bias=c.mlp_bias, **linear)
        self.down_proj = RowParallelLinear(inter_local, hidden, bias=c.mlp_bias, tp_group=tp_group, **linear)

    def _norm(self, x: torch.Tensor, norm: Norm, adds: Adds = (), second: Norm | None = None):
        return apply_norm(x, norm, self.config.norm_kind, self.config.norm_eps, adds, second)

    def attention(self, x, positions, position_table, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """position_table: the rotary cos/sin table (positions "rope"), this rank's ALiBi slopes
        (num_heads_local,) ("alibi"), or None (learned positions, already in x)."""
        qkv = self.qkv_proj(x)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(-self.config.clip_qkv, self.config.clip_qkv)
        q, k, v = qkv_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        if self.config.positions == "rope":
            out = rope_paged_attention(q, k, v, positions, position_table, k_cache, v_cache, meta, self.scale,
                                       sliding_window=self.sliding_window)
        else:  # ALiBi or learned positions: nothing to rotate
            out = append_paged_attention(q, k, v, k_cache, v_cache, meta, self.scale,
                                         sliding_window=self.sliding_window, alibi_slopes=position_table)
        out = self.o_proj(out.reshape(out.shape[0], -1))
        return self._norm(out, self.attn_out_norm)[0] if self.config.post_sublayer_norms else out

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.mlp_gated:
            up = silu_and_mul(self.up_proj(h))
        elif self.activation is None:
            up = F.silu(self.up_proj(h))
        else:  # bias and activation in the product's epilogue where the kernel was chosen at load
            up = self.up_proj.activated(h, self.activation)
        out = self.down_proj(up)
        return self._norm(out, self.mlp_out_norm)[0] if self.config.post_sublayer_norms else out

    def forward(self, x, adds: Adds, positions, position_table, kv_cache, meta) -> tuple[torch.Tensor, Adds]:
        """x: (num_tokens, hidden), the residual stream before ``adds`` (the previous block's
        sub-block outputs, not yet added) -> (the stream, this block's outputs still to add): the
        next norm adds them in its own kernel, so no residual add is a launch of its own."""
        residual = self.config.residual
        if residual == "post_norm":  # LN(x + attn), then LN(x + mlp): the stream is normed, nothing pending
            x = self._norm(x, self.input_norm, adds + (self.attention(x, positions, position_table, kv_cache, meta),))[0]
            return self._norm(x, self.post_attn_norm, (self.mlp(x),))[0], ()
        second = self.post_attn_norm if residual == "parallel_two_norms" else None
        h, x, h_mlp = self._norm(x, self.input_norm, adds, second)
        attn = self.attention(h, positions, position_table, kv_cache, meta)
        if residual == "parallel":
            return x, (attn, self.mlp(h))
        if residual == "parallel_two_norms":
            return x, (attn, self.mlp(h_mlp))
        h, x, _ = self._norm(x, self.post_attn_norm, (attn,))
        return x, (self.mlp(h),)


class DecoderForCausalLM(nn.Module):
    """One tensor-parallel rank of a configurable-decoder family (module docstring)."""

    supports_prefill_graphs = True  # steps with prompt tokens replay graphs too (tests/engine/test_cuda_graphs.py)
    supports_prompt_tables = True  # forward() takes prompt_embeds (image features: BLIP-2 over OPT)

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization=None):
        super().__init__()
        c = self.config = config
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        embed_dim = c.word_embed_proj_dim or c.hidden_size
        vocab_local = c.vocab_size // tp_size
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = VocabParallelEmbedding(vocab_local, embed_dim, tp_rank=tp_rank, tp_group=tp_group, **kw)
        if c.positions == "learned":
            table_rows = c.max_position_embeddings + c.learned_position_offset
            self.embed_positions = uninitialized_table(table_rows, c.hidden_size, **kw)
        if c.embedding_norm:
            self.embed_norm = Norm(c.hidden_size, bias=c.norm_bias, **kw)
        if c.word_embed_proj_dim is not None:
            self.project_in = Linear(embed_dim, c.hidden_size, bias=False, **kw)
            self.project_out = Linear(c.hidden_size, embed_dim, bias=False, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, tp_size=tp_size, tp_group=tp_group, quantization=quantization, **kw)
            for i in range(c.num_layers)
        )
        if c.final_norm:
            self.norm = Norm(c.hidden_size, bias=c.norm_bias, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(embed_dim, vocab_local, bias=c.lm_head_bias, **kw)
        self.max_positions = max_positions or c.max_position_embeddings
        self.position_table: torch.Tensor | None = None  # rotary table or ALiBi slopes, built by init_buffers

    def init_buffers(self, device: torch.device) -> None:
        """The rotary table (rope) or this rank's slice of the ALiBi slopes (alibi), on ``device``;
        once, before any forward (CUDA-graph capture must never see an allocation here)."""
        c = self.config
        if c.positions == "rope":
            self.position_table = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling,
                                                      device, rotary_dim=c.rotary_dim)
        elif c.positions == "alibi":
            heads_local = c.num_heads // self.tp_size
            slopes = alibi_slopes(c.num_heads, c.alibi_slopes, c.alibi_bias_max)
            self.position_table = slopes[self.tp_rank * heads_local:(self.tp_rank + 1) * heads_local].to(device)

    def activated_weights(self) -> dict[str, list[torch.Tensor]]:
        """The non-gated up projections' weights (model dtype) by kernel activation, for the runner's
        load-time choice of the fused bias + activation epilogue (kernels/linear.py)."""
        weights: dict[str, list[torch.Tensor]] = {}
        for layer in self.layers:
            up = layer.up_proj
            if layer.activation is not None and not self.config.mlp_gated and up.weight_scale is None \
                    and up.weight_only is None:
                weights.setdefault(layer.activation, []).append(up.weight)
        return weights

    def _position_table(self, device: torch.device) -> torch.Tensor | None:
        if self.config.positions == "learned":
            return None
        if self.position_table is None or self.position_table.device != device:
            self.init_buffers(device)
        return self.position_table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata, prompt_embeds: PromptEmbeds | None = None) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final hidden states (num_tokens, hidden), normed
        (when the family has a final norm) and projected out (OPT-350m). ``prompt_embeds``: table rows
        that replace some tokens' embeddings (before project_in and the learned positions, as
        transformers' inputs_embeds)."""
        c = self.config
        position_table = self._position_table(input_ids.device)
        x = splice_prompt_embeds(self.embed_tokens(input_ids), prompt_embeds)
        if c.word_embed_proj_dim is not None:
            x = self.project_in(x)
        if c.positions == "learned":
            x = x + self.embed_positions(positions + c.learned_position_offset)
        if c.embedding_norm:
            x = apply_norm(x, self.embed_norm, c.norm_kind, c.norm_eps)[0]
        adds: Adds = ()
        for layer in self.layers:
            x, adds = layer(x, adds, positions, position_table, kv_cache, attn_meta)
        if c.final_norm:
            x = apply_norm(x, self.norm, c.norm_kind, c.norm_eps, adds)[0]
        else:
            for term in adds:
                x = x + term
        if c.word_embed_proj_dim is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, embed width) rows to score -> float32 logits (n, vocab)."""
        if self.config.tie_word_embeddings:
            return vocab_parallel_logits(hidden, self.embed_tokens.weight, self.tp_group)
        return vocab_parallel_logits(hidden, self.lm_head.weight, self.tp_group, bias=self.lm_head.bias)
