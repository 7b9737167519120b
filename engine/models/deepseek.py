"""DeepSeek-V2 / V3 (and the models built like them: V2-Lite, R1, Moonlight, Kimi-K2): multi-head
latent attention over a latent KV pool, and shared + routed experts, following transformers'
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM.

Attention (MLA), per layer, H heads on this rank, R = kv_lora_rank, P = qk_rope_head_dim (=
config.head_dim), N = qk_nope_head_dim, V = v_head_dim::

    q            = q_b_proj(rmsnorm(q_a_proj(x)))   or  q_proj(x)         (T, H, N + P)
    [c | k_r]    = kv_a_proj(x);  c = rmsnorm(c)                          (T, R), (T, P)  replicated
    q_r, k_r     = rope(q_r), rope(k_r)       (yarn with DeepSeek's mscale: kernels/rotary.py)
    pool[slot]   = [c | k_r]                  one row a token a layer (kernels/mla_attention.py)
    q_lat        = q_nope @ W_UK_h            (T, H, R)   W_UK / W_UV: kv_b_proj's halves, absorbed
    out_lat      = softmax(scale (q_lat . c + q_r . k_r)) c          over the latent rows
    out          = o_proj(out_lat @ W_UV_h^T)                        (T, H * V) -> (T, hidden)

``scale`` = (N + P)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn (as transformers). The
absorbed form serves decode rows and short chunks; a sequence with at least ``expanded_min_tokens``
new tokens in an eager step attends in the expanded form instead (per-head K/V made from its cached
latents, kernels/mla_expanded.py: the same sums in another order, fewer multiply-adds from 171 new
tokens for V3's shape; $TRITONLLM_MLA_EXPANDED_TOKENS sets the threshold, 0 turns it off).

MLP: the first ``first_k_dense_replace`` layers (config.mlp_only_layers) are dense SwiGLU of width
intermediate_size; the others route each token to num_experts_per_tok of num_experts experts
(kernels/moe_grouped_routing.py: V2's softmax greedy / group-limited, V3's sigmoid with
e_score_correction_bias and group-limited top-k, norm_topk_prob, routed_scaling_factor) run by the
fused expert kernels (kernels/fused_moe.py, kernels/fused_moe_fp8.py), plus the shared experts: a
dense SwiGLU of width n_shared_experts * moe_intermediate_size that every token goes through.

Tensor parallelism: each rank holds H / tp heads (q_b_proj / q_proj and kv_b_proj rows, o_proj
columns), the replicated latent path (q_a_proj, kv_a_proj and their norms) and a replicated latent
pool; the experts and shared experts sliced along their width as Mixtral's (engine/models/moe.py),
or with expert parallelism (config.moe_ep_size == tp) num_experts / tp whole routed experts a rank,
each rank running the (token, expert) assignments routed to its own. The routed and shared partial
sums meet in the layer's one all-reduce.

Weights per rank of layer i (engine-directory names): ``input_norm.weight``, ``attn.q_a_proj``,
``attn.q_a_norm``, ``attn.q_b_proj`` (or ``attn.q_proj``), ``attn.kv_a_proj``, ``attn.kv_a_norm``,
``attn.kv_b_proj``, ``attn.o_proj``, ``post_attn_norm.weight``; dense ``mlp.gate_up_proj`` /
``mlp.down_proj``; sparse ``moe.router.weight`` (E, hidden), ``moe.score_bias`` (E,) (noaux_tc) (both float32),
``moe.gate_up_proj`` (E, 2 I_r, hidden), ``moe.down_proj`` (E, hidden, I_r),
``moe.shared_gate_up_proj`` / ``moe.shared_down_proj``. The rope dims of q heads and of k_r are
stored in the kernels' halves order (engine/convert_deepseek.py de-interleaves DeepSeek's pairs).
``fp8_block`` engines (DeepSeek's block-FP8 checkpoints as shipped, or bf16 ones quantized at
build) hold every projection and expert as E4M3 with 128 x 128 block scales; kv_b_proj is
dequantized once at load into the absorbed matrices.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models.layers import Linear, Norm, RowParallelLinear, VocabParallelEmbedding, tp_all_reduce, \
    vocab_parallel_logits
from kernels._triton import use_triton
from kernels.attention_metadata import AttentionMetadata
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_block import blocks, dequantize_blocks
from kernels.fused_moe import fused_moe, moe_forward
from kernels.fused_moe_fp8 import fused_moe_fp8, moe_forward_fp8
from kernels.head_matmul import head_matmul
from kernels.mla_attention import mla_attention_values
from kernels.mla_expanded import expanded_min_tokens, mla_expanded_prefill, split_long
from kernels.mla_latent_write import latent_rope_write, latent_rope_write_absorb
from kernels.moe_grouped_routing import route_grouped
from kernels.moe_router import MAX_TOKENS as ROUTER_MAX_TOKENS, norm_fuses, route_decode, route_decode_normed
from kernels.rmsnorm import rms_norm
from kernels.rotary import build_cos_sin_cache


EXPANDED_TOKENS_ENV = "TRITONLLM_MLA_EXPANDED_TOKENS"


def _parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def softmax_scale(config: ModelConfig) -> float:
    """(N + P)^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    factor = scaling.get("factor") or 1.0
    if config.rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def expanded_prefill_min_tokens(config: ModelConfig) -> int | None:
    """New tokens of a sequence's chunk from which its attention runs expanded: $TRITONLLM_MLA_EXPANDED_TOKENS
    when set (0: never), else where the expanded form needs fewer multiply-adds (171 for DeepSeek-V3)."""
    value = os.environ.get(EXPANDED_TOKENS_ENV)
    if value is not None:
        try:
            tokens = int(value)
        except ValueError:
            raise ConfigError(f"${EXPANDED_TOKENS_ENV} must be an integer >= 0 (0: never), got {value!r}") from None
        if tokens < 0:
            raise ConfigError(f"${EXPANDED_TOKENS_ENV} must be an integer >= 0 (0: never), got {value!r}")
        return tokens or None
    return expanded_min_tokens(config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim)


def graph_padding_rows(meta: AttentionMetadata) -> torch.Tensor | None:
    """(T, 1) bool, the rows of a prefill graph's step past its real tokens (slot -1), or None for
    other steps: eager ones have no padding (and host copies of their lengths, which a graph lacks),
    and decode graphs' few padding rows cost little. A verify step of 2-4 tokens fills a 16-token
    bucket; its padding rows are alike (token 0 at position 0, attention 0), so they would route to up
    to top_k experts of their own, weights the step would read only for them."""
    if meta.is_decode_only or meta.cu_seqlens_q_host is not None:
        return None
    return (meta.slot_mapping < 0)[:, None]


class MlaAttention(nn.Module):
    """Multi-head latent attention for one rank (module docstring)."""

    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device,
                 quantization):
        super().__init__()
        c = config
        self.layer_index = layer_index
        self.eps = c.norm_eps
        self.num_heads = c.num_heads // tp_size
        self.nope, self.rope, self.rank, self.v_dim = c.qk_nope_head_dim, c.head_dim, c.kv_lora_rank, c.v_head_dim
        self.scale = softmax_scale(c)
        # A sequence with this many new tokens or more in a step attends in the expanded form
        # (kernels/mla_expanded.py: cheaper from there by the multiply-add count); None: never.
        self.expanded_min_tokens = expanded_prefill_min_tokens(c)
        linear = {"dtype": dtype, "device": device, "quantization": quantization}
        q_width = self.num_heads * (self.nope + self.rope)
        if c.q_lora_rank is not None:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=False, **linear)
            self.q_a_norm = Norm(c.q_lora_rank, bias=False, dtype=dtype, device=device)
            self.q_b_proj = Linear(c.q_lora_rank, q_width, bias=False, **linear)
        else:
            self.q_proj = Linear(c.hidden_size, q_width, bias=False, **linear)
        self.kv_a_proj = Linear(c.hidden_size, self.rank + self.rope, bias=False, **linear)
        self.kv_a_norm = Norm(self.rank, bias=False, dtype=dtype, device=device)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False, **linear)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, c.hidden_size, bias=False, tp_group=tp_group,
                                        **linear)
        self.dtype = dtype
        self.quantization = quantization
        self.w_uk: torch.Tensor | None = None  # (H, N, R), absorbed into the query; made by init_buffers
        # init_buffers: q_a_proj (or q_proj) and kv_a_proj, which read the same x, as one product
        # (rows [first | kv_a]); q_rows: the first's rows. None: the two run apart.
        self.qkv_a_proj: Linear | None = None
        self.q_rows = 0
        self.w_uv: torch.Tensor | None = None  # (H, V, R), applied to the attention's latent output

    def init_buffers(self) -> None:
        """kv_b_proj's two halves per head, in the model dtype (dequantized once when FP8)."""
        weight = self.kv_b_proj.weight
        if weight.dtype == FP8_DTYPE:
            weight = dequantize_blocks(weight, self.kv_b_proj.weight_scale, self.dtype)
        per_head = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        self.w_uk = per_head[:, :self.nope].contiguous()
        self.w_uv = per_head[:, self.nope:].contiguous()
        self._merge_first_products()

    @torch.no_grad()
    def _merge_first_products(self) -> None:
        """q_a_proj (V3) or q_proj (V2-Lite) and kv_a_proj read the same normed x: stacked into one
        Linear (one launch and one weight stream a layer instead of two), which replaces both. Only
        where both hold the same kind of weight and block-FP8 scale blocks do not straddle the seam."""
        first = self.q_a_proj if hasattr(self, "q_a_proj") else getattr(self, "q_proj", None)
        kv = self.kv_a_proj
        if first is None or self.qkv_a_proj is not None or first.weight.dtype != kv.weight.dtype:
            return
        fp8 = first.weight.dtype == FP8_DTYPE
        if fp8 and (first.out_features % 128 or first.weight_scale.shape[1] != kv.weight_scale.shape[1]):
            return
        merged = Linear(first.in_features, first.out_features + kv.out_features, bias=False, dtype=self.dtype,
                        device="meta", quantization=self.quantization)
        merged.weight = nn.Parameter(torch.cat([first.weight, kv.weight]), requires_grad=False)
        if fp8:
            merged.weight_scale = nn.Parameter(torch.cat([first.weight_scale, kv.weight_scale]), requires_grad=False)
        elif merged.weight_scale is not None:  # (a block-FP8 engine's unquantized pair: scales unread)
            merged.weight_scale = nn.Parameter(torch.ones(1, device=first.weight.device), requires_grad=False)
        self.q_rows = first.out_features
        del self.kv_a_proj
        if hasattr(self, "q_a_proj"):
            del self.q_a_proj
        else:
            del self.q_proj
        self.qkv_a_proj = merged

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x (T, hidden) normed -> this rank's attention output (T, hidden), all-reduced."""
        if self.qkv_a_proj is not None:
            q, kv = self.qkv_a_proj(x).split([self.q_rows, self.rank + self.rope], dim=-1)
        else:
            q, kv = (self.q_a_proj(x) if hasattr(self, "q_a_proj") else self.q_proj(x)), self.kv_a_proj(x)
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(rms_norm(q, self.q_a_norm.weight, self.eps)[0])
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., :self.nope], q[..., self.nope:]  # strided views (no copies)
        cache = kv_cache[self.layer_index, 0, :, :, 0]  # (num_blocks, tokens_per_block, R + P)
        long, short_rows, short_meta = split_long(meta, self.expanded_min_tokens)
        if not long:
            # kv_a_norm of the latent, rope of q_rope (in place) and of k_r, [c | k_r] into the pool, and
            # W_UK's product into the query (kernels/head_matmul.py): one launch at decode sizes
            q_rope, q_latent = latent_rope_write_absorb(q_nope, self.w_uk, q_rope, kv, self.kv_a_norm.weight,
                                                        self.eps, positions, cos_sin_cache, cache, meta.slot_mapping)
            out = self._attend(q_latent, q_rope, cache, meta)
        else:  # long prefill chunks expanded per head, the rest absorbed (kernels/mla_expanded.py)
            q_rope = latent_rope_write(q_rope, kv, self.kv_a_norm.weight, self.eps, positions, cos_sin_cache, cache,
                                       meta.slot_mapping)
            out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
            for i, start, end, context_len in long:
                out[start:end] = mla_expanded_prefill(q_nope[start:end], q_rope[start:end], cache,
                                                      meta.block_tables[i], context_len, self.w_uk, self.w_uv,
                                                      self.scale)
            if short_rows is not None:
                out[short_rows] = self._attend(head_matmul(q_nope[short_rows], self.w_uk), q_rope[short_rows], cache,
                                               short_meta)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _attend(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q_latent (T, H, R) (W_UK absorbed), q_rope (T, H, P) -> (T, H, V): attention over the latents,
        then W_UV (at decode in the splits' combine launch)."""
        return mla_attention_values(q_latent, q_rope, cache, meta, self.scale, self.w_uv)


class DeepseekExperts(nn.Module):
    """Router, routed experts and shared experts of one sparse layer, for one rank (module docstring)."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization, tp_rank: int = 0):
        super().__init__()
        c = config
        hidden = c.hidden_size
        # Expert parallelism: this rank's whole experts [first_expert, first_expert + experts); else a
        # width slice of all of them.
        self.ep_size = c.moe_ep_size
        experts = c.num_experts // self.ep_size
        self.first_expert = tp_rank * experts if self.ep_size > 1 else 0
        inter_local = c.moe_intermediate_size // (1 if self.ep_size > 1 else tp_size)
        self.tp_group = tp_group
        self.top_k, self.method = c.num_experts_per_tok, c.topk_method
        self.routing = dict(n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                            scaling=c.routed_scaling_factor)
        # Routing runs in float32 whatever the model dtype (as transformers keeps gate.weight and
        # e_score_correction_bias): in bf16 a near tie between experts' scores could pick another expert.
        self.router = Linear(hidden, c.num_experts, bias=False, dtype=torch.float32, device=device)
        self.score_bias = (_parameter(c.num_experts, dtype=torch.float32, device=device)
                           if c.topk_method == "noaux_tc" else None)
        fp8 = quantization == "fp8_block"
        for name, (rows, cols) in {"gate_up_proj": (2 * inter_local, hidden), "down_proj": (hidden, inter_local)}.items():
            setattr(self, name, _parameter(experts, rows, cols, dtype=FP8_DTYPE if fp8 else dtype, device=device))
            if fp8:
                setattr(self, name + "_scale", _parameter(experts, blocks(rows), blocks(cols), dtype=torch.float32,
                                                          device=device))
        self.shared = None
        if c.n_shared_experts:
            shared_local = c.n_shared_experts * c.moe_intermediate_size // tp_size
            linear = {"dtype": dtype, "device": device, "quantization": quantization}
            # down is a plain (partial-sum) Linear: the layer's one all-reduce sums it with the routed part.
            self.shared_gate_up_proj = Linear(hidden, 2 * shared_local, bias=False, **linear)
            self.shared_down_proj = Linear(shared_local, hidden, bias=False, **linear)
            self.shared = True
        # init_buffers: (gate_up (E + S, 2 I_r, hidden), down (E + S, hidden, I_r)), the routed experts
        # followed by the S = n_shared_experts shared ones cut to the routed width, and for block-FP8
        # experts their block scales (gate_up_scale, down_scale) likewise; None: not appended.
        self.with_shared: tuple[torch.Tensor, ...] | None = None
        self.num_shared = c.n_shared_experts or 0

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Append the shared experts to the routed ones (once, after loading): a SwiGLU of width S * I is
        the sum of S SwiGLUs of width I (its intermediate columns cut in S runs), so decode batches run
        them as S more experts every token chooses with weight 1 (kernels/moe_router.py's shared slots)
        in the same two grouped GEMMs, not as two more GEMMs, an activation and an add. The routed
        parameters become views of the new tensors (no second copy); the shared Linears stay for
        longer steps. On one expert-parallel rank; block-FP8 experts where I is a whole number of
        128-wide scale blocks (DeepSeek's: V2-Lite 1408, V3 2048) and the shared experts are FP8 too."""
        if self.with_shared is not None or not self.shared or self.ep_size > 1:
            return
        num_experts, two_inter, hidden = self.gate_up_proj.shape
        inter, shared = two_inter // 2, self.num_shared
        shared_gate_up, shared_down = self.shared_gate_up_proj, self.shared_down_proj
        fp8 = self.gate_up_proj.dtype == FP8_DTYPE
        if (shared_gate_up.weight.dtype != self.gate_up_proj.dtype or shared_down.weight.dtype != self.down_proj.dtype
                or shared_down.weight.shape != (hidden, shared * inter) or (fp8 and inter % 128)):
            return
        # shared rows [gate (S * I) | up (S * I)] -> expert j: [gate run j | up run j]; down columns run j
        # (block scales alike, in 128-row / 128-column blocks: I / 128 of them a run)
        runs = inter // 128 if fp8 else inter
        tensors = [("gate_up_proj", shared_gate_up.weight.view(2, shared, inter, hidden).transpose(0, 1)),
                   ("down_proj", shared_down.weight.view(hidden, shared, inter).transpose(0, 1))]
        if fp8:
            gu_scale, d_scale = shared_gate_up.weight_scale, shared_down.weight_scale
            tensors += [("gate_up_proj_scale", gu_scale.view(2, shared, runs, gu_scale.shape[1]).transpose(0, 1)),
                        ("down_proj_scale", d_scale.view(d_scale.shape[0], shared, runs).transpose(0, 1))]
        merged = []
        for name, appended in tensors:
            routed = getattr(self, name)
            both = routed.new_empty(num_experts + shared, *routed.shape[1:])
            both[:num_experts] = routed
            both[num_experts:] = appended.reshape(shared, *routed.shape[1:])
            setattr(self, name, nn.Parameter(both[:num_experts], requires_grad=False))
            merged.append(both)
        self.with_shared = tuple(merged)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, hidden); padding (T, 1) bool: rows of no sequence (graph_padding_rows), routed as row 0.
        -> (T, hidden), or on one rank for a decode-sized batch with the shared experts appended
        (T, K + S, hidden): the expert rows unsummed, which the next rms_norm sums in its own pass."""
        if 1 <= x.shape[0] <= ROUTER_MAX_TOKENS and self.ep_size == 1:
            return self._decode(x, padding)
        logits = self.router(x.float())
        if padding is not None:  # no experts of their own: a verify step's bucket reads no more weights
            logits = torch.where(padding, logits[:1], logits)
        if self.method == "greedy" and self.ep_size == 1:
            out = self._greedy_experts(x, logits)
        else:
            weights, ids = route_grouped(logits, self.top_k, self.method, score_bias=self.score_bias, **self.routing)
            out = self._local_experts(x, weights, ids) if self.ep_size > 1 else self._experts(x, weights, ids)
        if self.shared:
            out = out + self.shared_down_proj(self.shared_gate_up_proj.gated(x))
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)

    def takes_norm(self, x: torch.Tensor) -> bool:
        """forward_normed serves this step: a decode-sized batch with the shared experts appended whose
        hidden rows fit the router launch's one product chunk (V2-Lite: 1-2 tokens)."""
        return self.with_shared is not None and self.ep_size == 1 and norm_fuses(x.shape[0], x.shape[1])

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output as forward's, the new residual) of the attention output x: the
        post-attention norm in the router's launch (kernels/moe_router.py route_decode_normed), then
        the grouped GEMMs. Only where takes_norm(x)."""
        weights, ids, x, residual = route_decode_normed(x, residual, norm_weight, eps, self.router.weight, self.top_k,
                                                        self.method, score_bias=self.score_bias,
                                                        num_shared=self.num_shared, padding=padding, **self.routing)
        return self._routed(x, weights, ids), residual

    def _decode(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """1..ROUTER_MAX_TOKENS tokens: the router product and the routing in one launch
        (kernels/moe_router.py), then the grouped GEMMs over the routed (and appended shared) experts."""
        shared = self.with_shared is not None
        weights, ids = route_decode(x, self.router.weight, self.top_k, self.method, score_bias=self.score_bias,
                                    num_shared=self.num_shared if shared else 0, padding=padding, **self.routing)
        return self._routed(x, weights, ids)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The decode path's experts for routed (weights, ids) (T, K [+ S]): unsummed rows on one rank."""
        shared = self.with_shared is not None
        if shared and len(self.with_shared) == 4:  # block-FP8
            gate_up, down, gate_up_scale, down_scale = self.with_shared
            out = fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, weights, ids,
                                sum_experts=self.tp_group is not None)
        elif shared:
            out = fused_moe(x, *self.with_shared, weights, ids, sum_experts=self.tp_group is not None)
        else:
            out = self._experts(x, weights, ids)
            if self.shared:
                out = out + self.shared_down_proj(self.shared_gate_up_proj.gated(x))
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)

    def _greedy_experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """V2 / V2-Lite's softmax greedy top-k is the Mixtral-style routing the expert kernels fold in:
        one token (batch-1 decode) routes inside the gate_up launch, more in one routing launch (five
        torch launches fewer a sparse layer than route_grouped; ~10% of V2-Lite's decode step)."""
        renormalize = self.routing["renormalize"]
        if self.gate_up_proj.dtype == FP8_DTYPE:
            out = moe_forward_fp8(x, logits, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                  self.down_proj_scale, self.top_k, renormalize)
        else:
            out = moe_forward(x, logits, self.gate_up_proj, self.down_proj, self.top_k, renormalize)
        scaling = self.routing["scaling"]
        return out if scaling == 1.0 else out * scaling

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), weights / ids (T, K) of this rank's experts -> (T, hidden)."""
        if self.gate_up_proj.dtype == FP8_DTYPE:
            return fused_moe_fp8(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale,
                                 weights, ids)
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the assignments (token, k) routed to this rank's experts, run as rows
        of one expert each (A, 1), summed back into their tokens; the other ranks add the rest in
        the all-reduce. (Every rank routes every token: attention TP leaves the activations replicated.)"""
        local = ids.long() - self.first_expert
        mine = (local >= 0) & (local < self.gate_up_proj.shape[0])
        token, slot = mine.nonzero(as_tuple=True)
        out = torch.zeros_like(x, dtype=torch.float32)
        if token.numel():
            rows = self._experts(x[token], weights[token, slot, None], local[token, slot, None].to(ids.dtype))
            out.index_add_(0, token, rows.float())
        return out.to(x.dtype)


class DenseMlp(nn.Module):
    """SwiGLU of width intermediate_size (the first_k_dense_replace layers), column/row parallel."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization):
        super().__init__()
        inter_local = config.intermediate_size // tp_size
        linear = {"dtype": dtype, "device": device, "quantization": quantization}
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter_local, bias=False, **linear)
        self.down_proj = RowParallelLinear(inter_local, config.hidden_size, bias=False, tp_group=tp_group, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x))


class DeepseekLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, *, tp_size: int, tp_group, dtype, device,
                 quantization, tp_rank: int = 0):
        super().__init__()
        kw = {"tp_size": tp_size, "tp_group": tp_group, "dtype": dtype, "device": device, "quantization": quantization}
        self.eps = config.norm_eps
        self.input_norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        self.attn = MlaAttention(config, layer_index, **kw)
        self.post_attn_norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        if config.is_moe_layer(layer_index):
            self.moe = DeepseekExperts(config, tp_rank=tp_rank, **kw)
        else:
            self.mlp = DenseMlp(config, **kw)

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, meta, padding=None):
        """(x, residual) -> (this block's output, the residual stream before it): the next norm adds them.
        padding: graph_padding_rows(meta)."""
        h, residual = rms_norm(x, self.input_norm.weight, self.eps, residual)
        h = self.attn(h, positions, cos_sin_cache, kv_cache, meta)
        if hasattr(self, "moe") and self.moe.takes_norm(h):  # the norm in the router's launch
            return self.moe.forward_normed(h, residual, self.post_attn_norm.weight, self.eps, padding)
        h, residual = rms_norm(h, self.post_attn_norm.weight, self.eps, residual)
        return (self.moe(h, padding) if hasattr(self, "moe") else self.mlp(h)), residual


class DeepseekMtp(nn.Module):
    """DeepSeek-V3's multi-token prediction module (the checkpoint's layer ``num_layers``), the draft
    source of decoding_mode mtp (engine/executor/speculative/mtp.py), as transformers' MtpLayer::

        x   = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])        (T, 2 hidden) -> (T, hidden)
        g   = head_norm(decoder layer(x))                           the layer: attention + MoE, as layer N's
        logits = lm_head(g)                                         a guess at t_{p+2}

    h_p is the target's final-normed hidden state at position p (or, for a chained draft, the g of
    the row before). Embedding and head are the target's (DeepSeek shares them; the checkpoint's
    copies are not read). The layer's attention runs over a latent pool of its own (one layer), so
    its ``attn.layer_index`` is 0; its experts and quantization are those of a sparse layer."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization, tp_rank: int = 0):
        super().__init__()
        self.eps = config.norm_eps
        hidden = config.hidden_size
        self.enorm = Norm(hidden, bias=False, dtype=dtype, device=device)
        self.hnorm = Norm(hidden, bias=False, dtype=dtype, device=device)
        # eh_proj and the head norm stay in the model dtype (DeepSeek ships eh_proj unquantized)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False, dtype=dtype, device=device)
        self.layer = DeepseekLayer(config, config.num_layers, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                   dtype=dtype, device=device, quantization=quantization)
        self.layer.attn.layer_index = 0
        self.head_norm = Norm(hidden, bias=False, dtype=dtype, device=device)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embeds, previous_hidden (T, hidden); positions (T,) rotary positions; kv_cache the MTP pool
        (1 layer) -> g (T, hidden), head-normed (what the next chained draft reads as its h)."""
        x = torch.cat([rms_norm(embeds, self.enorm.weight, self.eps)[0],
                       rms_norm(previous_hidden.to(embeds.dtype), self.hnorm.weight, self.eps)[0]], dim=-1)
        x, residual = self.layer(self.eh_proj(x), None, positions, cos_sin_cache, kv_cache, meta,
                                 graph_padding_rows(meta))
        return rms_norm(x, self.head_norm.weight, self.eps, residual)[0]


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2/V3 for one tensor-parallel rank. ``quantization``: None or "fp8_block"."""

    # Steps with prompt tokens or drafts replay the prefill graphs (engine/executor/prefill_graphs.py)
    # up to prefill_graph_max_tokens: eagerly, V2-Lite's 27 layers of ~40 launches cost ~43 ms of host
    # time a step on the H200 (an MTP verify step of 2-4 tokens was 10x a graphed decode step).
    supports_prefill_graphs = True

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization: str | None = None):
        super().__init__()
        if quantization not in (None, "fp8_block"):
            raise ConfigError(f"quantization {quantization!r} is not supported for {config.architecture}; allowed: "
                             "fp8_block (DeepSeek's block-FP8 checkpoints, or --quantization fp8_block) or none")
        if config.moe_ep_size not in (1, tp_size):
            raise ConfigError(f"moe_ep_size {config.moe_ep_size} must be 1 or tp_size ({tp_size})")
        self.config = config
        self.tp_group = tp_group
        vocab_local = config.vocab_size // tp_size
        self.embed_tokens = VocabParallelEmbedding(vocab_local, config.hidden_size, tp_rank=tp_rank, tp_group=tp_group,
                                                   dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DeepseekLayer(config, i, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                          quantization=quantization)
            for i in range(config.num_layers))
        self.norm = Norm(config.hidden_size, bias=False, dtype=dtype, device=device)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, vocab_local, bias=False, dtype=dtype, device=device)
        if config.num_nextn_predict_layers:  # held for decoding_mode mtp; the target's forward never runs it
            self.mtp = DeepseekMtp(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype,
                                   device=device, quantization=quantization)
        self.max_positions = max_positions or config.max_position_embeddings
        self.cos_sin_cache: torch.Tensor | None = None

    @property
    def prefill_graph_max_tokens(self) -> int | None:
        """The largest step the prefill graphs take (None: any): below the expanded form's threshold,
        so a graph (which has no host copies of the sequence lengths to choose by) runs the absorbed
        form exactly where an eager step would; longer steps stay eager and may expand a long chunk."""
        threshold = self.layers[0].attn.expanded_min_tokens
        return None if threshold is None else threshold - 1

    # The runner's KV pool (engine/executor/runner.py kv_pool_dims): one plane, one "head" of
    # kv_lora_rank + qk_rope_head_dim values, i.e. one latent row per token per layer.
    @property
    def kv_pool_dims(self) -> tuple[int, int, int]:
        return 1, 1, self.config.kv_lora_rank + self.config.head_dim

    def init_buffers(self, device: torch.device) -> None:
        """The rope table (qk_rope_head_dim wide, yarn's attention factor in it) and each layer's
        absorbed kv_b_proj halves; once, after loading."""
        c = self.config
        self.cos_sin_cache = build_cos_sin_cache(self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling, device)
        for layer in [*self.layers, *([self.mtp.layer] if hasattr(self, "mtp") else [])]:
            layer.attn.init_buffers()
            if hasattr(layer, "moe"):
                layer.moe.init_buffers()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> final-normed hidden states (num_tokens, hidden)."""
        if self.cos_sin_cache is None or self.cos_sin_cache.device != input_ids.device:
            self.init_buffers(input_ids.device)
        x, residual = self.embed_tokens(input_ids), None
        padding = graph_padding_rows(attn_meta)
        # The token map once for the layers' attention launches, not once a layer; all-decode steps need
        # none (the MLA kernel's DECODE form: token t is sequence t).
        if use_triton(input_ids) and not attn_meta.is_decode_only:
            attn_meta = dataclasses.replace(attn_meta, token_seq=attn_meta.token_sequences(input_ids.shape[0]))
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin_cache, kv_cache, attn_meta, padding)
        return rms_norm(x, self.norm.weight, self.config.norm_eps, residual)[0]

    def decode_experts(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(gate_up, down, assignments a token) of each sparse layer's experts in the model dtype, as its
        one-token decode step hands them to fused_moe (the shared experts appended where they are): the
        runner's load-time tile choice of those GEMMs (kernels/moe_decode_tiles.py) times and marks them.
        The MTP module's layer (decoding_mode mtp's drafts) is listed too."""
        found = []
        for layer in [*self.layers, *([self.mtp.layer] if hasattr(self, "mtp") else [])]:
            moe = getattr(layer, "moe", None)
            if moe is None or moe.ep_size > 1 or moe.gate_up_proj.dtype == FP8_DTYPE:
                continue
            if moe.with_shared is not None:
                found.append((moe.with_shared[0], moe.with_shared[1], moe.top_k + moe.num_shared))
            else:
                found.append((moe.gate_up_proj, moe.down_proj, moe.top_k))
        return found

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, hidden) rows to score -> float32 logits (n, vocab)."""
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.tp_group)
