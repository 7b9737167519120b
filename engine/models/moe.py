"""Mixture-of-experts decoders: the Llama block with its MLP replaced by top-k routed experts.

Covers Mixtral (every layer sparse, top-k weights always renormalised) and, with Qwen3's
attention, Qwen3-MoE (``norm_topk_prob``; ``decoder_sparse_step`` / ``mlp_only_layers`` keep
some layers dense). Attention, norms, embeddings and the lm_head are exactly the Llama
family's (engine/models/llama.py); only the MLP of a sparse layer differs:

    router logits = x @ router.T                  (T, E), replicated on every rank
    topk_weights, topk_ids = top-k of softmax(logits) (renormalised when norm_topk_prob)
    out = sum over the K chosen experts e of  w * down_e(silu(gate_e x) * up_e x)   (kernels/fused_moe.py)

Tensor parallelism: every rank holds every expert, sliced along the expert width, exactly as a
dense MLP is sliced: gate_up_proj (E, 2 * I_r, H) with rows [gate_r | up_r] per expert and
down_proj (E, H, I_r), I_r = moe_intermediate_size / tp. Each rank computes the same routing
(the router is replicated and its input is identical after the previous all-reduce), runs its
slice of each chosen expert, and the partial sums meet in the layer's one all-reduce, as a
row-parallel down_proj's do. Chosen over expert parallelism (whole experts per rank, tokens
exchanged all-to-all) because it needs no new collective, balances the work across ranks
whatever the routing does, and at decode splits each active expert's bytes evenly over ranks;
it costs skinnier GEMMs per rank (Qwen3-30B-A3B at TP 8: 96 columns per expert slice).

Weights per rank of a sparse layer i (names = engine-directory names): ``layers.{i}.moe.router.weight``
(E, H), ``layers.{i}.moe.gate_up_proj`` (E, 2 * I_r, H), ``layers.{i}.moe.down_proj`` (E, H, I_r).
A dense layer keeps the Llama names (``gate_up_proj.weight``, ``down_proj.weight``).

Integer weight-only experts (kernels/fused_moe_wna16.py): ``gate_up_proj`` uint8 (E, 2 * I_r, stored H)
with ``gate_up_proj_scale`` float32 and ``gate_up_proj_zero`` uint8 (E, 2 * I_r, groups of H), and
``down_proj`` likewise over I_r. FP8 experts (kernels/fused_moe_fp8.py): ``gate_up_proj``
float8_e4m3fn (E, 2 * I_r, H) with ``gate_up_proj_scale`` float32 (E, 2 * I_r) per channel
(``fp8``) or (E, ceil(2 * I_r / 128), ceil(H / 128)) per 128 x 128 block (``fp8_block``), and
``down_proj`` (E, H, I_r) with ``down_proj_scale`` (E, H) or (E, ceil(H / 128), ceil(I_r / 128));
in an ``fp8_block`` engine, experts the checkpoint left unquantized keep the model dtype (ones as
their unread scales). The router stays in the model dtype.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.config import ModelConfig, WeightOnlyScheme
from engine.models.layers import Linear, LinearQuantization, rms_norm_into, tp_all_reduce
from engine.models.llama import LlamaForCausalLM, LlamaLayer
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_block import blocks
from kernels._triton import use_triton
from kernels.fused_moe import fused_moe, moe_forward, route_tokens, warm_up_token_counts
from kernels.fused_moe_fp8 import fused_moe_fp8, moe_forward_fp8
from kernels.fused_moe_wna16 import WNA16Experts, gemv_quantization, moe_forward_wna16, prepare_wna16_experts
from kernels.moe_decode import fused_decode_enabled
from kernels.moe_gemv import GemvExperts, gemv_tiles, moe_gemv_triton
from kernels.moe_grouped_routing import route_grouped
from kernels.moe_router import norm_fuses, route_decode_normed
from kernels.wna16 import stored_columns

# "1": a decode step's sparse layers (softmax top-k, SiLU experts in the model dtype or FP8, 1-2 tokens) run their
# post-attention norm, router product and routing in one launch (kernels/moe_router.py route_decode_normed, the
# DeepSeek path's), and the experts read the chosen ids: one launch a layer less (the norm's), and no top-k inside
# each program of the experts' gate_up launch. "0" (the default: no gain beyond the run-to-run spread on an H200,
# Qwen3-30B-A3B batch 1, 2026-12-01: graph 2.818 against 2.876 ms alone in one lease, but with the q/k norms in
# attention 2.896 against 2.882 for both off in the next; block-FP8 3.107 against 2.982): the norm, the router Linear,
# the routing in gate_up.
NORM_ROUTER_ENV = "TRITONLLM_MOE_NORM_ROUTER"
NORM_ROUTER_DEFAULT = "0"


def norm_router_enabled() -> bool:
    """TRITONLLM_MOE_NORM_ROUTER (read per call: benchmarks flip it between runs)."""
    return os.environ.get(NORM_ROUTER_ENV, NORM_ROUTER_DEFAULT).strip() == "1"


class SparseMoeBlock(nn.Module):
    """Router + every expert's slice for one tensor-parallel rank; output all-reduced over ranks."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device,
                 weight_only: WeightOnlyScheme | None = None, fp8: str | None = None, activation: str = "silu"):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        inter_local = config.moe_intermediate_size // tp_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.tp_group = tp_group
        self.dtype = dtype
        self.weight_only = weight_only
        self.experts: tuple[WNA16Experts, WNA16Experts] | None = None  # prepare_weights(): (gate_up, down)
        # Options of the hybrids (engine/ssm/hybrid.py), model-dtype experts only: activation "relu2"
        # (Nemotron-H: non-gated relu(up x)^2 experts, gate_up_proj holds I_r up rows), and topk_method
        # "noaux_tc" (Nemotron-H: sigmoid scores plus ``score_bias``, group-limited top-k, renormalised,
        # times routed_scaling_factor; kernels/moe_grouped_routing.py, the router in float32 as
        # transformers keeps it).
        self.activation = activation
        self.grouped = config.topk_method == "noaux_tc"
        if (activation != "silu" or self.grouped) and (weight_only is not None or fp8 is not None):
            raise ValueError(f"quantized experts take SiLU experts with softmax routing only, got activation "
                             f"{activation!r} and topk_method {config.topk_method!r}")
        self.router = Linear(hidden, experts, bias=False, dtype=torch.float32 if self.grouped else dtype, device=device)
        if self.grouped:
            self.score_bias = _parameter(experts, dtype=torch.float32, device=device)
            self.routing = dict(n_group=config.n_group, topk_group=config.topk_group, renormalize=config.norm_topk_prob,
                                scaling=config.routed_scaling_factor)
        up_rows = 2 * inter_local if activation != "relu2" else inter_local
        declare_expert_stacks(self, experts, up_rows, hidden, inter_local, dtype=dtype, device=device, fp8=fp8,
                              weight_only=weight_only)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """Integer experts -> the kernels' layout (kernels/fused_moe_wna16.py); the stored tensors
        are then released on CUDA. A no-op for model-dtype experts."""
        prepare_integer_experts(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (num_tokens, hidden) -> the routed experts' output (num_tokens, hidden); on one rank
        possibly (num_tokens, top_k, hidden), each token's weighted expert rows unsummed, which the
        next layer's (or the final) residual-add RMSNorm sums in its own pass (kernels/rmsnorm.py):
        one launch and one round trip of the layer's output less. With tensor parallelism the
        all-reduce takes the summed rows."""
        out = self.routed_experts(x, self.logits(x), sum_experts=self.tp_group is not None)
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)

    def takes_norm(self, num_tokens: int) -> bool:
        """forward_normed serves this step (norm_router_enabled): SiLU experts with softmax routing in the model
        dtype or FP8 on CUDA, a batch whose rows fit the router launch's one product chunk (norm_fuses: 1-2 tokens
        of Qwen3-30B-A3B's 2048), and not the opt-in one-launch experts (kernels/moe_decode.py)."""
        return (norm_router_enabled() and not self.grouped and self.activation == "silu" and self.weight_only is None
                and use_triton(self.router.weight) and norm_fuses(num_tokens, self.router.in_features)
                and not fused_decode_enabled())

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward's output, the new residual) of the attention output x: the post-attention norm, the router
        product (its logits rounded to the model dtype, as the router Linear returns them) and the top-k in one
        launch (kernels/moe_router.py route_decode_normed), then the experts for those ids. Only where
        takes_norm(T)."""
        weights, ids, h, residual = route_decode_normed(x, residual, norm_weight, eps, self.router.weight, self.top_k,
                                                        "greedy", renormalize=self.renormalize, round_logits=True)
        out = self.experts_for(h, weights, ids, sum_experts=self.tp_group is not None)
        return (out if self.tp_group is None else tp_all_reduce(out, self.tp_group)), residual

    def experts_for(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    sum_experts: bool = True) -> torch.Tensor:
        """The chosen experts' output for routing given (T, K) (model-dtype or FP8 SiLU experts): the GEMV pair at
        the token counts the load-time choice marked (kernels/moe_gemv.py), else the grouped kernels."""
        fp8 = self.gate_up_proj.dtype == FP8_DTYPE
        scales = dict(gate_up_scale=self.gate_up_proj_scale, down_scale=self.down_proj_scale) if fp8 else {}
        tiles = gemv_tiles(self.gate_up_proj, x.shape[0])
        if tiles is not None:
            return moe_gemv_triton(x, self.gate_up_proj, self.down_proj, top_k=self.top_k, topk_weights=weights,
                                   topk_ids=ids, tiles=tiles, sum_experts=sum_experts, **scales)
        if fp8:
            return fused_moe_fp8(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale,
                                 weights, ids, sum_experts=sum_experts)
        return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, sum_experts=sum_experts)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits (T, E) (float32 for grouped routing)."""
        return self.router(x.float() if self.grouped else x)

    def routed_experts(self, x: torch.Tensor, router_logits: torch.Tensor, sum_experts: bool = True) -> torch.Tensor:
        """This rank's partial sum of the chosen experts, before the all-reduce: the kernels of the
        experts' storage (model dtype, integer codes, or FP8 codes and scales). ``sum_experts=False``:
        kernels/fused_moe.py's fused_moe (the result may be (T, K, H))."""
        if self.grouped or self.activation != "silu":
            if self.grouped:
                weights, ids = route_grouped(router_logits, self.top_k, "noaux_tc", score_bias=self.score_bias,
                                             **self.routing)
            else:
                weights, ids = route_tokens(router_logits, self.top_k, self.renormalize)
            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, activation=self.activation,
                             sum_experts=sum_experts)
        if self.weight_only is not None:
            self.prepare_weights()
            return moe_forward_wna16(x, router_logits, *self.experts, self.top_k, self.renormalize)
        if self.gate_up_proj.dtype == FP8_DTYPE:
            return moe_forward_fp8(x, router_logits, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                   self.down_proj_scale, self.top_k, self.renormalize, sum_experts=sum_experts)
        return moe_forward(x, router_logits, self.gate_up_proj, self.down_proj, self.top_k, self.renormalize,
                           sum_experts=sum_experts)


def _parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def declare_expert_stacks(block: nn.Module, experts: int, up_rows: int, hidden: int, inter_local: int, *, dtype,
                          device, fp8: str | None = None, weight_only: WeightOnlyScheme | None = None) -> None:
    """``block.gate_up_proj`` (experts, up_rows, hidden) and ``block.down_proj`` (experts, hidden, inter_local) as
    the scheme stores them: in ``dtype``; FP8 with ``_scale`` per row (``fp8`` "fp8") or per 128 x 128 block
    ("fp8_block"); or integer codes (``weight_only``: uint8, stored_columns wide) with ``_scale`` float32 and
    ``_zero`` uint8 per group. SparseMoeBlock's and Llama 4's experts alike (prepare_integer_experts, the
    expert kernels and the converters read these names)."""
    for name, (rows, cols) in {"gate_up_proj": (up_rows, hidden), "down_proj": (hidden, inter_local)}.items():
        if fp8 is not None:  # "fp8" (a scale per row) or "fp8_block" (per 128 x 128 block)
            setattr(block, name, _parameter(experts, rows, cols, dtype=FP8_DTYPE, device=device))
            scale = (rows,) if fp8 == "fp8" else (blocks(rows), blocks(cols))
            setattr(block, name + "_scale", _parameter(experts, *scale, dtype=torch.float32, device=device))
            continue
        if weight_only is None:
            setattr(block, name, _parameter(experts, rows, cols, dtype=dtype, device=device))
            continue
        groups = weight_only.groups(cols)
        setattr(block, name, _parameter(experts, rows, stored_columns(cols, weight_only.bits), dtype=torch.uint8,
                                        device=device))
        setattr(block, name + "_scale", _parameter(experts, rows, groups, dtype=torch.float32, device=device))
        setattr(block, name + "_zero", _parameter(experts, rows, groups, dtype=torch.uint8, device=device))


def gemv_experts_of(block: nn.Module, top_k: int) -> GemvExperts | None:
    """A block's experts (declare_expert_stacks' tensors, ``weight_only``, ``experts``, ``dtype``) as the runner's
    decode choice times them, ``top_k`` experts a row: integer ones once in the kernels' layout and 4-bit (the
    GEMV takes no other), else None; model-dtype and FP8 ones as stored."""
    if block.weight_only is not None:
        if block.experts is None or not block.experts[0].kernel or block.weight_only.bits != 4:
            return None
        gate_up, down = block.experts
        return GemvExperts(gate_up.kernel["weight"], down.kernel["weight"], top_k, block.dtype,
                           **gemv_quantization(gate_up, down), wna16=block.experts)
    fp8 = block.gate_up_proj.dtype == FP8_DTYPE
    return GemvExperts(block.gate_up_proj, block.down_proj, top_k, block.dtype,
                       block.gate_up_proj_scale if fp8 else None, block.down_proj_scale if fp8 else None)


@torch.no_grad()
def prepare_integer_experts(block: nn.Module) -> None:
    """A block of integer experts (SparseMoeBlock's stored tensors: gate_up_proj / down_proj with _scale and
    _zero, ``weight_only``, ``dtype``; Llama 4's too) -> ``block.experts``, the (gate_up, down) WNA16Experts pair
    in kernels/fused_moe_wna16.py's layout; the stored tensors are then released on CUDA. A no-op where
    ``block.weight_only`` is None or it already ran."""
    if block.weight_only is None or block.experts is not None:
        return
    block.experts = tuple(prepare_wna16_experts(getattr(block, name), getattr(block, name + "_scale"),
                                                getattr(block, name + "_zero"), block.weight_only.bits, block.dtype)
                          for name in ("gate_up_proj", "down_proj"))
    if block.gate_up_proj.is_cuda:
        for name in ("gate_up_proj", "down_proj"):
            for suffix in ("", "_scale", "_zero"):
                setattr(block, name + suffix, nn.Parameter(getattr(block, name + suffix).new_empty(0),
                                                           requires_grad=False))


class MoeLayer(LlamaLayer):
    """A Llama layer (Qwen3's q/k norms included) whose MLP is a SparseMoeBlock when
    ``config.is_moe_layer(layer_index)``, else the dense SwiGLU MLP."""

    def _init_mlp(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        self.moe = None
        if not config.is_moe_layer(self.layer_index):
            super()._init_mlp(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                              quantization=quantization)
            return
        weight_only = quantization if isinstance(quantization, WeightOnlyScheme) else None
        fp8 = quantization if quantization in ("fp8", "fp8_block") else None
        self.moe = SparseMoeBlock(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                                  weight_only=weight_only, fp8=fp8)

    def mlp(self, h: torch.Tensor, lora=None) -> torch.Tensor:
        # LoRA reaches the dense layers' MLP; the experts take none (engine/lora/pool.py says so).
        return super().mlp(h, lora) if self.moe is None else self.moe(h)

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, meta):
        """LlamaLayer's, except that a sparse layer whose experts take the norm (SparseMoeBlock.takes_norm: decode
        steps of 1-2 tokens) runs its post-attention norm inside the router's launch."""
        # (subclasses' own experts, Llama 4's and gpt-oss's, have no normed router launch)
        if not isinstance(self.moe, SparseMoeBlock) or not self.moe.takes_norm(positions.shape[0]):
            return super().forward(x, residual, positions, cos_sin_cache, kv_cache, meta)
        h, residual = rms_norm_into(self.qkv_proj, x, self.input_norm.weight, self.eps, residual)
        h = self.attention(h, positions, cos_sin_cache, kv_cache, meta)
        return self.moe.forward_normed(h, residual, self.post_attn_norm.weight, self.eps)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama-family model with MoeLayer blocks (Mixtral, Qwen3-MoE) for one tensor-parallel
    rank. ``quantization``: None, an integer weight-only scheme, "fp8" or "fp8_block" (attention,
    dense MLPs and experts; the routers stay in the model dtype)."""

    layer_class = MoeLayer
    supports_prefill_graphs = False  # the routed experts' kernels are not checked in a mixed-step graph yet

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization: LinearQuantization = None):
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                         max_positions=max_positions, quantization=quantization)

    @torch.inference_mode()
    def warm_up_kernels(self, max_tokens: int = 8192) -> None:
        """Compile the fused-MoE kernels for every variant a forward of at most ``max_tokens`` may
        pick (kernels.fused_moe.warm_up_token_counts), so the first long prefill does not compile
        them in a request's time. The experts of the first sparse
        layer run on zeros, without the all-reduce (no collective: ranks may warm up apart)."""
        warm_up_experts(next((layer.moe for layer in self.layers if layer.moe is not None), None), max_tokens)

    def decode_experts(self) -> list[GemvExperts]:
        """Each sparse layer's experts that moe_forward / moe_forward_fp8 / moe_forward_wna16 take (SiLU, softmax
        routing; 4-bit ones once in the kernels' layout): the runner's load-time choice
        (kernels/moe_decode_tiles.py) times the one-token grouped tiles (model dtype) and, per decode token
        count, the grouped path against kernels/moe_gemv.py's GEMV launches, and marks gate_up with what won."""
        found = [gemv_experts_of(layer.moe, layer.moe.top_k) for layer in self.layers
                 if layer.moe is not None and not layer.moe.grouped and layer.moe.activation == "silu"]
        return [experts for experts in found if experts is not None]


@torch.inference_mode()
def warm_up_experts(block: SparseMoeBlock | None, max_tokens: int) -> None:
    """Run ``block``'s experts on zeros for every token count whose kernel variant a forward of at
    most ``max_tokens`` may pick (no all-reduce); nothing when ``block`` is None."""
    if block is None:
        return
    for num_tokens in warm_up_token_counts(block.router.out_features, block.top_k, max_tokens):
        x = torch.zeros(num_tokens, block.router.in_features, dtype=block.dtype, device=block.router.weight.device)
        block.routed_experts(x, block.logits(x))
