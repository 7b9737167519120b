"""Llama 4 text (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration: Scout,
Maverick), following transformers' Llama4TextModel: the Llama block with

- attention: GQA over the fused qkv_proj; rope layers rotate q and k, then (``qk_l2_norm``) divide
  each head by its RMS (no weight), and attend within chunks of ``attention_chunk_size`` positions
  (kernels/chunked_attention.py); NoPE layers (``layers_without_rope``, every fourth in Scout) attend
  to the whole context, their q scaled by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
  (attention temperature tuning); at decode either is one kernel (kernels/llama4_attention.py);
- MLP: dense SwiGLU layers of width intermediate_size_mlp and, every ``decoder_sparse_step``
  layers, a MoE block: the router's top-k logits through a sigmoid scale each chosen expert's
  *input* (x * s, not the output: the experts are nonlinear), the routed experts' outputs summed,
  plus a shared expert every token goes through::

      s_k, e_k = sigmoid(top-k of x @ router.T), their ids
      out      = shared(x) + sum_k expert_{e_k}(s_k x)

  The fused expert kernels (kernels/fused_moe.py) run it as T * K rows x * s_k each routed to one
  expert with weight 1. With $TRITONLLM_LLAMA4_STACK_SHARED=1 (off by default), where the shared expert has a
  routed expert's shape and storage (Scout, Maverick), decode steps whose 2T rows the experts' GEMV pair takes
  (kernels/moe_gemv.py) run it as expert E beside the routed ones: rows [x * s; x], ids [e; E]
  (kernels/llama4_router.py, which also holds the post-attention norm), the rows of id E reading the shared
  expert's own Linear weights where they lie (kernels/moe_gemv.py SharedExpert: no copy), the two outputs left
  unsummed for the next norm.

Tensor parallelism: as the Llama block (heads) and engine/models/moe.py (experts sliced along
their width); the shared expert's down projection is a partial sum that joins the routed part in
the layer's one all-reduce. Weights per rank beyond the Llama block's (engine-directory names):
``moe.router.weight`` (E, hidden), ``moe.gate_up_proj`` (E, 2 I_r, hidden), ``moe.down_proj``
(E, hidden, I_r), ``moe.shared_gate_up_proj.weight``, ``moe.shared_down_proj.weight``. q and k heads
are stored with their dims de-interleaved (engine/convert_llama4.py).

FP8 (``quantization`` "fp8" or "fp8_block", engine/models/moe.py's schemes): the attention and dense
MLP linears and the shared expert are FP8 Linears (engine/models/layers.py), the routed experts FP8
stacks with ``moe.gate_up_proj_scale`` (E, 2 I_r) / ``moe.down_proj_scale`` (E, hidden) per channel, or
per 128 x 128 block (E, ceil(2 I_r / 128), ceil(hidden / 128)) / (E, ceil(hidden / 128), ceil(I_r / 128)),
run by kernels/fused_moe_fp8.py; the router stays in the model dtype (its top-1 choice is discrete: a
rounding there would send tokens to other experts; FP8 checkpoints leave it unquantized too). The sigmoid
score scales each routed row before the experts quantize it, as in the model dtype. Decode steps of the token counts the
runner's load-time choice marked (decode_experts, kernels/moe_gemv_choice.py) take kernels/moe_gemv.py's
two GEMV launches instead of the grouped kernels, in either dtype.

Integer weight-only (``quantization`` a WeightOnlyScheme: ``int4_wo`` / ``int8_wo`` round-to-nearest at build, or
AWQ / GPTQ / compressed-tensors pack-quantized checkpoints as shipped): the attention and dense MLP linears and the
shared expert are integer Linears (kernels/wna16.py), the routed experts integer stacks as engine/models/moe.py
holds them (``moe.gate_up_proj`` uint8 (E, 2 I_r, stored hidden) with ``_scale`` float32 / ``_zero`` uint8
(E, 2 I_r, groups of hidden); ``moe.down_proj`` likewise over I_r), run by kernels/fused_moe_wna16.py's grouped
kernels on the same T * K input-scaled rows with weight 1 (the dequantized experts through kernels/fused_moe.py
on CPU), and, 4-bit, kernels/moe_gemv.py's GEMV pair at the decode row counts the load-time choice marked; the
router and the lm_head stay in the model dtype, and so do the Linears an integer checkpoint left unquantized
(``WeightOnlyScheme.float_linears``: llm-compressor's Llama 4 W4A16 recipe leaves the attention in bf16).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.config import FP8_QUANTIZATIONS, ConfigError, ModelConfig, WeightOnlyScheme
from engine.models.layers import Linear, qkv_heads, rms_norm_into, tp_all_reduce
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeLayer, declare_expert_stacks, gemv_experts_of, prepare_integer_experts
from kernels._triton import use_triton
from kernels.attention_metadata import AttentionMetadata
from kernels.fp8 import FP8_DTYPE, QuantizedRows
from kernels.fused_moe import fused_moe, warm_up_token_counts
from kernels.fused_moe_fp8 import fused_moe_fp8
from kernels.fused_moe_wna16 import WNA16Experts, fused_moe_wna16_triton, gemv_quantization
from kernels.llama4_attention import nope_attention, rope_chunked_attention
from kernels.llama4_router import (ROUTE_ROWS, Top1Routing, reserve_route_workspace, route_top1_fits,
                                   route_top1_triton)
from kernels.moe_gemv import GemvExperts, SharedExpert, gemv_tiles, moe_gemv_triton


# "0": Llama 4's MoE layers route as the unfused torch path at every batch (the post-attention norm, the router
# Linear, topk, sigmoid, the scaling; the shared expert through its Linears and added), not in the one launch of
# kernels/llama4_router.py with the shared expert as the experts' second row. An A/B switch, read at every call (a
# CUDA graph keeps what its capture saw).
ONE_LAUNCH_ROUTING_ENV = "TRITONLLM_LLAMA4_ONE_LAUNCH_ROUTING"
# "1": Llama 4's shared expert rides as the experts' extra row at the GEMV pair's decode counts
# (Llama4Experts.share_expert_rows); default "0": it runs through its own Linears at every batch. Read once at load
# (init_buffers). Off until an H200 has timed it (benchmarks/next_gpu_runs.md), and FP8 rounds differently: the
# shared expert's rows are W8A16 in the GEMV pair, W8A8 (per-token E4M3 activations) in its Linears (the tiny FP8
# model: 2.2% relative RMS between the two, tests/engine/test_llama4_fp8.py); model-dtype experts agree to 1e-5.
# The rows of id E read the shared expert's Linear weights in place (kernels/moe_gemv.py SharedExpert): an earlier
# form torch.cat'ed it onto the expert stacks at load, and on an H200 Scout's FP8 load ran out of memory (call 7,
# 2026-12-01: 110 GiB allocated and 28 GiB reserved but unallocated, each layer's freed E stack a fragment).
# Why the GEMV pair alone takes it: each of its programs streams one expert's rows, so choosing the shared expert's
# base is a scalar select a program; the grouped kernels' tiles span rows of one expert of the sorted stacks, and
# rows past the GEMV counts (T > 4) keep the separate shared expert, as before.
STACK_SHARED_ENV = "TRITONLLM_LLAMA4_STACK_SHARED"


class Llama4Experts(nn.Module):
    """Router, routed experts (input-scaled) and the shared expert of one MoE layer, for one rank.
    ``fp8``: None (the model dtype), "fp8" or "fp8_block"; or ``weight_only``: integer experts and shared
    expert (module docstring)."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, fp8: str | None = None,
                 weight_only: WeightOnlyScheme | None = None):
        super().__init__()
        assert fp8 is None or weight_only is None
        self.weight_only = weight_only  # prepare_weights() (engine/models/layers.py) finds integer modules by this
        self.experts: tuple[WNA16Experts, WNA16Experts] | None = None  # prepare_weights(): (gate_up, down)
        hidden, experts = config.hidden_size, config.num_experts
        inter_local = config.moe_intermediate_size // tp_size
        self.top_k = config.num_experts_per_tok
        self.tp_group = tp_group
        self.dtype = dtype
        self.router = Linear(hidden, experts, bias=False, dtype=dtype, device=device)  # model dtype in every scheme
        declare_expert_stacks(self, experts, 2 * inter_local, hidden, inter_local, dtype=dtype, device=device,
                              fp8=fp8, weight_only=weight_only)  # SparseMoeBlock's stacks
        shared_local = config.n_shared_experts * config.moe_intermediate_size // tp_size
        quantization = fp8 or weight_only
        self.shared_gate_up_proj = Linear(hidden, 2 * shared_local, bias=False, dtype=dtype, device=device,
                                          quantization=quantization)
        self.shared_down_proj = Linear(shared_local, hidden, bias=False, dtype=dtype, device=device,
                                       quantization=quantization)  # partial sum
        self.shared_slot: int | None = None  # share_expert_rows(): the id E the shared expert's rows carry

    def share_expert_rows(self) -> None:
        """Once after loading: where the shared expert has a routed expert's shape and storage (Scout and Maverick:
        one shared expert of the routed width; model-dtype or FP8 experts with its Linears in the same scheme and
        layout), decode steps of the GEMV pair's row counts run it as expert E, a second row of the experts'
        launches (forward_normed), instead of its own two products, their activation quantizations and the add.
        Nothing is copied or moved: the rows of id E read its Linears' weights (shared_expert). A no-op otherwise."""
        if self.weight_only is None and not any(getattr(linear, "int8", False) for linear in
                                                (self.shared_gate_up_proj, self.shared_down_proj)):
            fp8 = self.gate_up_proj.dtype == FP8_DTYPE
            stacks = (self.gate_up_proj, self.down_proj) + ((self.gate_up_proj_scale, self.down_proj_scale) if fp8
                                                            else (None, None))
            shared = self.shared_expert()
            same_blocks = not fp8 or all(linear.block_scales == (self.gate_up_proj_scale.dim() == 3)
                                         for linear in (self.shared_gate_up_proj, self.shared_down_proj))
            if same_blocks and shared.suits(*stacks[:2], *stacks[2:]):
                self.shared_slot = self.gate_up_proj.shape[0]

    def shared_expert(self) -> SharedExpert:
        """The shared expert's Linears as kernels/moe_gemv.py's extra expert (their weights, FP8: their scales)."""
        fp8 = self.gate_up_proj.dtype == FP8_DTYPE
        gate_up, down = self.shared_gate_up_proj, self.shared_down_proj
        scales = (gate_up.weight_scale, down.weight_scale) if fp8 else (None, None)
        return SharedExpert(gate_up.weight, down.weight, *scales)

    def shares_expert_rows(self, num_tokens: int) -> bool:
        """Whether a one-launch routing of ``num_tokens`` (routes_in_one_launch) puts the shared expert's rows
        beside the routed ones: shared (share_expert_rows) and its 2T rows at a count the GEMV pair takes."""
        return self.shared_slot is not None and gemv_tiles(self.gate_up_proj, 2 * num_tokens) is not None

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """Integer experts -> kernels/fused_moe_wna16.py's layout (engine/models/moe.py prepare_integer_experts);
        a no-op for model-dtype and FP8 experts."""
        prepare_integer_experts(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), all-reduced over ranks. Top-1 decode steps on CUDA route in one launch
        (kernels/llama4_router.py), which also quantizes x for a per-channel FP8 shared expert; with the shared
        expert's rows beside the routed ones (shares_expert_rows) they return (T, 2, hidden) unsummed on one rank
        (_experts_and_shared)."""
        if self.routes_in_one_launch(x.shape[0]) and x.stride(1) == 1:
            shared_rows = self.shares_expert_rows(x.shape[0])
            return self._experts_and_shared(self._route(x, None, shared_rows), shared_rows)
        num_tokens, hidden = x.shape
        top_logits, ids = self.router(x).topk(self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # (T, K), transformers' rounding
        routed_in = (x[:, None, :] * scores[..., None]).reshape(-1, hidden)  # (T * K, hidden): row t*K + k
        routed = self.routed_experts(routed_in, ids.reshape(-1, 1).to(torch.int32))
        # top-1: the rows are the tokens' outputs (no sum over one expert)
        out = routed if self.top_k == 1 else routed.view(num_tokens, self.top_k, hidden).sum(dim=1)
        return self._plus_shared(out, x)

    def routes_in_one_launch(self, num_tokens: int) -> bool:
        """Whether kernels/llama4_router.py routes a batch of ``num_tokens``: top-1 on CUDA, at most ROUTE_ROWS, a
        router the launch fits (route_top1_fits: Scout's, not Maverick's 128 experts)."""
        return (self.top_k == 1 and use_triton(self.router.weight) and num_tokens <= ROUTE_ROWS
                and route_top1_fits(self.router.out_features, self.router.in_features)
                and os.environ.get(ONE_LAUNCH_ROUTING_ENV, "1").strip() != "0")

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward of rms_norm(x + residual), the new residual) with the post-attention norm inside the routing
        launch; only where routes_in_one_launch(T). The output may be (T, 2, hidden) unsummed (forward's)."""
        shared_rows = self.shares_expert_rows(x.shape[0])
        routing = self._route(x, (residual, norm_weight, eps), shared_rows)
        return self._experts_and_shared(routing, shared_rows), routing.residual

    def _route(self, x: torch.Tensor, norm: tuple | None, shared_rows: bool) -> Top1Routing:
        """kernels/llama4_router.py's one launch: the shared expert's rows beside the routed ones where
        ``shared_rows`` (shares_expert_rows of the batch), else its input quantized for per-channel FP8 Linears."""
        if shared_rows:
            return route_top1_triton(x, self.router.weight, norm=norm, shared_slot=self.shared_slot)
        quantize = self.shared_gate_up_proj.takes_quantized_rows(x)
        return route_top1_triton(x, self.router.weight, quantize=quantize, norm=norm)

    def _experts_and_shared(self, routing: Top1Routing, shared_rows: bool) -> torch.Tensor:
        """The routed rows through their experts, plus the shared expert of the routing's shared input: with its
        rows beside them (``shared_rows``: _route gave them), both in the experts' launches, returned unsummed on
        one rank ((T, 2, hidden), a view of the (2T, hidden) rows: the next residual-add norm sums the two in its
        own pass, as SparseMoeBlock's unsummed experts)."""
        out = self.routed_experts(routing.rows, routing.ids, routing.weights, shared_rows=shared_rows)
        if not shared_rows:
            return self._plus_shared(out, routing.shared_input)
        both = out.view(2, -1, out.shape[1]).transpose(0, 1)  # (T, [routed, shared], hidden)
        return both if self.tp_group is None else tp_all_reduce(both.sum(dim=1), self.tp_group)

    def _plus_shared(self, routed: torch.Tensor, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """routed (T, hidden) + the shared expert of x, all-reduced over ranks."""
        values = x.values if isinstance(x, QuantizedRows) else x
        quantize = self.shared_down_proj.takes_quantized_rows(values)  # SiLU-and-mul quantizes for an FP8 down
        out = routed + self.shared_down_proj(self.shared_gate_up_proj.gated(x, quantize_output=quantize))
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)

    def routed_experts(self, rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor | None = None, *,
                       shared_rows: bool = False) -> torch.Tensor:
        """rows (R, hidden), each for the one expert of ids (R, 1) with weight 1 (``ones`` (R, 1) float32, or made
        here) -> (R, hidden): the GEMV pair at the row counts the load-time choice marked on gate_up (decode
        steps), else the grouped kernels; unsummed (``sum_experts=False``: a row's one expert needs no sum).
        ``shared_rows``: ids may be E, the shared expert (shares_expert_rows: the GEMV pair's counts alone)."""
        if ones is None:
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        if self.weight_only is not None:
            return self._integer_experts(rows, ids, ones).reshape(rows.shape[0], -1)
        fp8 = self.gate_up_proj.dtype == FP8_DTYPE
        scales = dict(gate_up_scale=self.gate_up_proj_scale, down_scale=self.down_proj_scale) if fp8 else {}
        if use_triton(rows) and (tiles := gemv_tiles(self.gate_up_proj, rows.shape[0])) is not None:
            shared = self.shared_expert() if shared_rows else None
            out = moe_gemv_triton(rows, self.gate_up_proj, self.down_proj, top_k=1, topk_weights=ones, topk_ids=ids,
                                  tiles=tiles, sum_experts=False, shared_expert=shared, **scales)
        elif shared_rows:
            raise AssertionError("the shared expert's rows take the GEMV pair alone (shares_expert_rows)")
        elif fp8:
            out = fused_moe_fp8(rows, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                self.down_proj_scale, ones, ids, sum_experts=False)
        else:
            out = fused_moe(rows, self.gate_up_proj, self.down_proj, ones, ids, sum_experts=False)
        return out.reshape(rows.shape[0], -1)

    def _integer_experts(self, rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        """routed_experts for integer experts: the dequantized experts through kernels/fused_moe.py's reference
        where the kernels' layout is absent (CPU), else (4 bits, decode row counts the load-time choice marked)
        the GEMV pair or kernels/fused_moe_wna16.py's grouped kernels, with the routing given."""
        self.prepare_weights()
        gate_up, down = self.experts
        if not (use_triton(rows) and gate_up.kernel):
            return fused_moe(rows, gate_up.dense, down.dense, ones, ids, sum_experts=False)
        if gate_up.bits == 4 and (tiles := gemv_tiles(gate_up.kernel["weight"], rows.shape[0])) is not None:
            return moe_gemv_triton(rows, gate_up.kernel["weight"], down.kernel["weight"], top_k=1, topk_weights=ones,
                                   topk_ids=ids, tiles=tiles, sum_experts=False, **gemv_quantization(gate_up, down))
        return fused_moe_wna16_triton(rows, gate_up, down, ones, ids)

    def gemv_experts(self) -> GemvExperts | None:
        """These experts as the runner's decode choice times them (engine/models/moe.py gemv_experts_of): one
        expert a row, the rows being the T * K input-scaled copies routed_experts receives."""
        return gemv_experts_of(self, 1)


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
        fp8 = quantization if quantization in FP8_QUANTIZATIONS else None
        weight_only = quantization if isinstance(quantization, WeightOnlyScheme) else None
        self.moe = Llama4Experts(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device, fp8=fp8,
                                 weight_only=weight_only)

    def attention(self, x, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        # Between the qkv product and o_proj: one kernel at decode on CUDA (kernels/llama4_attention.py).
        q, k, v = qkv_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        if self.use_rope:
            out = rope_chunked_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, self.scale,
                                         self.chunk_size, self.eps if self.l2_norm else None)
        else:
            out = nope_attention(q, k, v, positions, k_cache, v_cache, meta, self.scale, self.temperature)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, meta):
        """MoeLayer's, except that a MoE layer whose routing takes one launch (Llama4Experts.routes_in_one_launch:
        top-1 decode steps on CUDA) runs its post-attention norm inside that launch."""
        if not isinstance(self.moe, Llama4Experts) or not self.moe.routes_in_one_launch(positions.shape[0]):
            return super().forward(x, residual, positions, cos_sin_cache, kv_cache, meta)
        h, residual = rms_norm_into(self.qkv_proj, x, self.input_norm.weight, self.eps, residual)
        h = self.attention(h, positions, cos_sin_cache, kv_cache, meta)
        return self.moe.forward_normed(h, residual, self.post_attn_norm.weight, self.eps)


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama 4 text for one tensor-parallel rank; weights in the model dtype, or ``quantization`` "fp8" /
    "fp8_block" or an integer WeightOnlyScheme (module docstring)."""

    layer_class = Llama4Layer
    supports_prefill_graphs = False  # not checked against eager in a mixed-step graph yet
    supports_lora = False  # the attention above takes no adapter rows

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization=None):
        takes = quantization is None or quantization in FP8_QUANTIZATIONS or isinstance(quantization, WeightOnlyScheme)
        if not takes:
            raise ConfigError(f"quantization {quantization!r} is not supported for {config.architecture}; allowed: "
                              f"{', '.join(FP8_QUANTIZATIONS)} (FP8 linears and experts), an integer weight-only "
                              "scheme (int4_wo, int8_wo, or an AWQ / GPTQ / compressed-tensors checkpoint's), both "
                              "with the router in the model dtype, or none")
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                         max_positions=max_positions, quantization=quantization)
        if isinstance(quantization, WeightOnlyScheme):
            for name in quantization.float_linears:  # Linears an integer checkpoint left unquantized: in ``dtype``
                path, _, _ = name.rpartition(".")
                owner, _, attribute = path.rpartition(".")
                integer = self.get_submodule(path)
                setattr(self.get_submodule(owner), attribute,
                        Linear(integer.in_features, integer.out_features, bias=integer.bias is not None, dtype=dtype,
                               device=device))

    def init_buffers(self, device: torch.device) -> None:
        """LlamaForCausalLM's, the one routing launch's workspace, and (with $TRITONLLM_LLAMA4_STACK_SHARED=1) each
        MoE layer's shared expert as its experts' extra row (once, after loading: share_expert_rows; no copy)."""
        super().init_buffers(device)
        share = os.environ.get(STACK_SHARED_ENV, "0").strip() == "1"
        for layer in self.layers:
            if share and isinstance(layer.moe, Llama4Experts) and layer.moe.shared_slot is None:
                layer.moe.share_expert_rows()
        if torch.device(device).type != "cuda":
            return
        routers = {layer.moe.router.out_features for layer in self.layers
                   if isinstance(layer.moe, Llama4Experts) and layer.moe.routes_in_one_launch(1)}
        for num_experts in routers:  # the one-launch routing's workspace, before any graph captures it
            reserve_route_workspace(device, num_experts)

    @torch.inference_mode()
    def warm_up_kernels(self, max_tokens: int = 8192) -> None:
        """Compile the routed experts' kernels (kernels/fused_moe.py or fused_moe_fp8.py: alignment, block sizes,
        the sorted-rows grouped GEMMs) for every variant a forward of at most ``max_tokens`` tokens may pick, so
        the first long prefill does not compile them in a request's time (the runner's warm-up calls this on
        CUDA), as MoeForCausalLM.warm_up_kernels does: the first MoE layer's experts on zero rows spread over the
        experts, one expert a row as forward routes them, without the all-reduce (ranks may warm up apart)."""
        moe = next((layer.moe for layer in self.layers if isinstance(layer.moe, Llama4Experts)), None)
        if moe is None:
            return
        experts, hidden = moe.router.out_features, moe.router.in_features
        for rows in warm_up_token_counts(experts, 1, max_tokens * moe.top_k):
            ids = (torch.arange(rows, device=moe.router.weight.device) % experts).to(torch.int32)[:, None]
            moe.routed_experts(torch.zeros(rows, hidden, dtype=moe.dtype, device=ids.device), ids)

    def decode_experts(self) -> list[GemvExperts]:
        """Each MoE layer's routed experts for the runner's load-time choice (engine/executor/runner.py,
        kernels/moe_decode_tiles.py): per decode row count, the grouped path or kernels/moe_gemv.py's GEMV pair."""
        found = [layer.moe.gemv_experts() for layer in self.layers if isinstance(layer.moe, Llama4Experts)]
        return [experts for experts in found if experts is not None]
