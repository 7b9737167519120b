"""Llama 4 text (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration: Scout,
Maverick), following transformers' Llama4TextModel: the Llama block with

- attention: GQA over the fused qkv_proj; rope layers rotate q and k, then (``qk_l2_norm``) divide
  each head by its RMS (no weight), and attend within chunks of ``attention_chunk_size`` positions
  (kernels/chunked_attention.py); NoPE layers (``layers_without_rope``, every fourth in Scout) attend
  to the whole context, their q scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
  (attention temperature tuning);
- MLP: dense SwiGLU layers of width intermediate_size_mlp and, every ``decoder_sparse_step``
  layers, a MoE block: the router's top-k logits through a sigmoid scale each chosen expert's
  *input* (x * s, not the output: the experts are nonlinear), the routed experts' outputs summed,
  plus a shared expert every token goes through::

      s_k, e_k = sigmoid(top-k of x @ router.T), their ids
      out      = shared(x) + sum_k expert_{e_k}(s_k x)

  The fused expert kernels (kernels/fused_moe.py) run it as T * K rows x * s_k each routed to one
  expert with weight 1.

Tensor parallelism: as the Llama block (heads) and engine/models/moe.py (experts sliced along
their width); the shared expert's down projection is a partial sum that joins the routed part in
the layer's one all-reduce. Weights per rank beyond the Llama block's (engine-directory names):
``moe.router.weight`` (E, hidden), ``moe.gate_up_proj`` (E, 2 I_r, hidden), ``moe.down_proj``
(E, hidden, I_r), ``moe.shared_gate_up_proj.weight``, ``moe.shared_down_proj.weight``. q and k heads
are stored with their dims de-interleaved (engine/convert_llama4.py).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models.layers import Linear, qkv_heads, tp_all_reduce
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeLayer
from kernels.activation import silu_and_mul
from kernels.attention import paged_attention, write_kv_cache
from kernels.attention_metadata import AttentionMetadata
from kernels.chunked_attention import chunked_attention
from kernels.fused_moe import fused_moe
from kernels.rotary import apply_rotary


def _parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Llama4Experts(nn.Module):
    """Router, routed experts (input-scaled) and the shared expert of one MoE layer, for one rank."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        inter_local = config.moe_intermediate_size // tp_size
        self.top_k = config.num_experts_per_tok
        self.tp_group = tp_group
        self.router = Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        self.gate_up_proj = _parameter(experts, 2 * inter_local, hidden, dtype=dtype, device=device)
        self.down_proj = _parameter(experts, hidden, inter_local, dtype=dtype, device=device)
        shared_local = config.n_shared_experts * config.moe_intermediate_size // tp_size
        self.shared_gate_up_proj = Linear(hidden, 2 * shared_local, bias=False, dtype=dtype, device=device)
        self.shared_down_proj = Linear(shared_local, hidden, bias=False, dtype=dtype, device=device)  # partial sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), all-reduced over ranks."""
        num_tokens, hidden = x.shape
        top_logits, ids = self.router(x).topk(self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # (T, K), transformers' rounding
        routed_in = (x[:, None, :] * scores[..., None]).reshape(-1, hidden)  # (T * K, hidden): row t*K + k
        ones = torch.ones(routed_in.shape[0], 1, dtype=torch.float32, device=x.device)
        routed = fused_moe(routed_in, self.gate_up_proj, self.down_proj, ones, ids.reshape(-1, 1).to(torch.int32))
        out = routed.view(num_tokens, self.top_k, hidden).sum(dim=1)
        out = out + self.shared_down_proj(silu_and_mul(self.shared_gate_up_proj(x)))
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)


class Llama4Layer(MoeLayer):
    """MoeLayer (dense or sparse MLP by config.is_moe_layer) with Llama 4's attention and experts."""

    def _init_attention(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        super()._init_attention(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                                quantization=quantization)
        self.eps = config.norm_eps
        self.chunk_size = config.attention_chunk_size if self.use_rope else None
        self.l2_norm = config.qk_l2_norm and self.use_rope
        self.temperature = None  # (floor_scale, attn_scale) on NoPE layers with temperature tuning
        if not self.use_rope and config.nope_floor_scale is not None:
            self.temperature = (config.nope_floor_scale, config.nope_attn_scale)

    def _init_mlp(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        if not config.is_moe_layer(self.layer_index):
            super()._init_mlp(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                              quantization=quantization)
            return
        self.moe = Llama4Experts(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device)

    def _l2_normed(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def attention(self, x, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = qkv_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rotary(q.contiguous(), k.contiguous(), positions, cos_sin_cache)
            if self.l2_norm:
                q, k = self._l2_normed(q), self._l2_normed(k)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * factor[:, None, None]).to(q.dtype)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.chunk_size is not None:
            out = chunked_attention(q, k_cache, v_cache, meta, self.scale, self.chunk_size)
        else:
            out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(out.shape[0], -1))


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 text for one tensor-parallel rank; weights in the model dtype."""

    layer_class = Llama4Layer
    supports_prefill_graphs = False  # not checked against eager in a mixed-step graph yet
    supports_lora = False  # the attention above takes no adapter rows

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization=None):
        if quantization is not None:
            raise ConfigError(f"quantization {quantization!r} is not supported for {config.architecture} yet; "
                              "build it in the model dtype")
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                         max_positions=max_positions)
