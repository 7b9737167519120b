"""gpt-oss (gpt-oss-20b, gpt-oss-120b): the Llama block with attention sinks, biases everywhere and
routed experts with a clamped SwiGLU, following transformers' GptOssForCausalLM:

- attention: GQA with head_dim 64 and biases on q/k/v and o_proj; each head's learned sink logit
  joins its softmax denominator (kernels/attention.py ``sinks``); sliding-window (128) and full
  layers alternate (``layer_types``); yarn rope;
- every layer's MLP is sparse: router = linear with bias, the top-k (4) logits softmaxed over the
  chosen experts (the same as softmax, top-k, renormalise: kernels/fused_moe.py routes so), and

      h   = x @ gate_up[e].T + gate_up_bias[e]                       [gate | up]
      act = (clamp(up, -L, L) + 1) * g * sigmoid(1.702 * g),  g = min(gate, L),  L = swiglu_limit
      out = sum over the chosen e of  w_e * (act @ down[e].T + down_bias[e])

  (kernels/moe_epilogue.py ``swiglu_clamped``).

Tensor parallelism: attention as the Llama block (each rank its heads, and its heads' sinks); the
experts sliced along their width as Mixtral's (engine/models/moe.py), gate_up_bias with them. The
down bias of each chosen expert joins that expert's output before its routing weight scales it, a
term per (token, expert) that a single vector added after the all-reduce cannot be; so rank 0
alone passes ``down_bias`` to the kernel, and the layer's all-reduce brings it to every rank once.

Weights per rank of layer i (engine-directory names), beyond the Llama block's: ``qkv_proj.bias``,
``o_proj.bias``, ``sinks`` (heads_r,), ``moe.router.weight`` (E, H) and ``.bias`` (E,),
``moe.gate_up_proj`` (E, 2 * I_r, H) rows [gate_r | up_r], ``moe.gate_up_bias`` (E, 2 * I_r),
``moe.down_proj`` (E, H, I_r), ``moe.down_bias`` (E, H) replicated.

MXFP4 experts (``config.expert_quantization == "mxfp4"``, an MXFP4 checkpoint built with
``--mxfp4_experts keep``, the default; engine/mxfp4.py): ``moe.gate_up_proj`` uint8 (E, 2 * I_r, H/2),
two E2M1 codes a byte (value 2j low nibble), with ``moe.gate_up_proj_scale`` uint8 (E, 2 * I_r, H/32)
E8M0 exponents, and ``moe.down_proj`` (E, H, I_r/2) with ``moe.down_proj_scale`` (E, H, I_r/32);
the biases as above. kernels/fused_moe_mxfp4.py multiplies them (laid out for its kernels once,
``prepare_weights``), so gpt-oss-20b's weights take ~14 GB instead of ~42. Built with
``--mxfp4_experts widen``, the experts are in the model dtype, exactly the same values.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import Linear, RowParallelLinear, qkv_heads, tp_all_reduce
from engine.models.llama import LlamaForCausalLM, LlamaLayer
from kernels.attention_metadata import AttentionMetadata
from kernels.fused_moe import moe_forward, warm_up_token_counts
from kernels.fused_moe_mxfp4 import MXFP4Experts, moe_forward_mxfp4, mxfp4_warm_up_token_counts, prepare_mxfp4_experts
from kernels.moe_epilogue import ExpertEpilogue
from kernels.moe_gemv import GemvExperts
from kernels.rope_attention import rope_paged_attention


def _parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class GptOssExperts(nn.Module):
    """Router + every expert's slice for one tensor-parallel rank; output all-reduced over ranks."""

    def __init__(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        inter_local = config.moe_intermediate_size // tp_size
        self.top_k = config.num_experts_per_tok
        self.swiglu_limit = config.swiglu_limit
        self.tp_group = tp_group
        self.dtype = dtype
        self.adds_down_bias = True  # rank 0 only (module docstring); set by GptOssForCausalLM
        self.mxfp4 = config.expert_quantization == "mxfp4"
        self.experts: tuple[MXFP4Experts, MXFP4Experts] | None = None  # prepare_weights(): (gate_up, down)
        self.router = Linear(hidden, experts, bias=True, dtype=dtype, device=device)
        for name, (rows, cols) in {"gate_up_proj": (2 * inter_local, hidden), "down_proj": (hidden, inter_local)}.items():
            if not self.mxfp4:
                setattr(self, name, _parameter(experts, rows, cols, dtype=dtype, device=device))
                continue
            if cols % 32:
                raise ValueError(f"MXFP4 experts of {cols} input columns a rank (tp_size {tp_size}) cut a 32-value "
                                 "scale group")
            setattr(self, name, _parameter(experts, rows, cols // 2, dtype=torch.uint8, device=device))
            setattr(self, name + "_scale", _parameter(experts, rows, cols // 32, dtype=torch.uint8, device=device))
        self.gate_up_bias = _parameter(experts, 2 * inter_local, dtype=dtype, device=device)
        self.down_bias = _parameter(experts, hidden, dtype=dtype, device=device)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """MXFP4 experts -> the kernels' layout (kernels/fused_moe_mxfp4.py; on CPU widened to the
        model dtype); the stored tensors are then released on CUDA. A no-op for model-dtype experts."""
        if not self.mxfp4 or self.experts is not None:
            return
        self.experts = tuple(prepare_mxfp4_experts(getattr(self, name), getattr(self, name + "_scale"), self.dtype)
                             for name in ("gate_up_proj", "down_proj"))
        if self.gate_up_proj.is_cuda:
            for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
                setattr(self, name, nn.Parameter(getattr(self, name).new_empty(0), requires_grad=False))

    def epilogue(self) -> ExpertEpilogue:
        """The experts' biases (the down bias on rank 0 only) and clamped SwiGLU."""
        return ExpertEpilogue(self.gate_up_bias, self.down_bias if self.adds_down_bias else None, "swiglu_clamped",
                              self.swiglu_limit)

    def gemv_experts(self) -> GemvExperts:
        """These experts as kernels/moe_gemv_choice.py times them (the runner's load-time choice between the
        grouped path and the GEMV launches at 1-8 tokens): MXFP4 codes in their kernel layout, or model-dtype."""
        if self.mxfp4:
            self.prepare_weights()
            gate_up, down = self.experts
            if gate_up.kernel:
                return GemvExperts(gate_up.kernel["codes"], down.kernel["codes"], self.top_k, self.dtype,
                                   gate_up.kernel["scales"], down.kernel["scales"], mxfp4=self.experts,
                                   epilogue=self.epilogue())
            return GemvExperts(gate_up.dense, down.dense, self.top_k, self.dtype, epilogue=self.epilogue())
        return GemvExperts(self.gate_up_proj, self.down_proj, self.top_k, self.dtype, epilogue=self.epilogue())

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the chosen experts' outputs (num_tokens, hidden)."""
        ep = self.epilogue()
        epilogue = dict(gate_up_bias=ep.gate_up_bias, down_bias=ep.down_bias, activation=ep.activation,
                        swiglu_limit=ep.swiglu_limit)
        if self.mxfp4:
            self.prepare_weights()
            return moe_forward_mxfp4(x, self.router(x), *self.experts, self.top_k, True, **epilogue)
        return moe_forward(x, self.router(x), self.gate_up_proj, self.down_proj, self.top_k, True, **epilogue)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.tp_group is None else tp_all_reduce(out, self.tp_group)


class GptOssLayer(LlamaLayer):
    """The Llama layer with an o_proj bias, attention sinks and GptOssExperts as its MLP."""

    def _init_attention(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        super()._init_attention(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                                quantization=quantization)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size, bias=True,
                                        tp_group=tp_group, dtype=dtype, device=device)
        self.sinks = _parameter(self.num_heads, dtype=dtype, device=device)

    def _init_mlp(self, config: ModelConfig, *, tp_size: int, tp_group, dtype, device, quantization) -> None:
        self.moe = GptOssExperts(config, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device)

    def attention(self, x, positions, cos_sin_cache, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = qkv_heads(self.qkv_proj(x, meta.lora), self.num_heads, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[self.layer_index, 0], kv_cache[self.layer_index, 1]
        out = rope_paged_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, self.scale,
                                   sliding_window=self.sliding_window, sinks=self.sinks)
        return self.o_proj(out.reshape(out.shape[0], -1), meta.lora)

    def mlp(self, h: torch.Tensor, lora=None) -> torch.Tensor:
        return self.moe(h)  # the routed experts take no adapter (engine/lora/pool.py says so)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss for one tensor-parallel rank; weights in the model dtype (no FP8 or integer schemes),
    the experts in MXFP4 when ``config.expert_quantization`` says so (module docstring)."""

    layer_class = GptOssLayer
    supports_prefill_graphs = False  # the routed experts' kernels are not checked in a mixed-step graph yet
    supports_lora = True  # on the attention projections, as for Mixtral and Qwen3-MoE

    def __init__(self, config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
                 dtype: torch.dtype = torch.float32, device=None, max_positions: int | None = None,
                 quantization: str | None = None):
        if quantization is not None:
            raise ValueError(f"quantization {quantization!r} is not supported for GptOssForCausalLM; weights stay "
                             "in the model dtype, the experts of MXFP4 checkpoints in MXFP4 (or widened at build)")
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group, dtype=dtype, device=device,
                         max_positions=max_positions)
        for layer in self.layers:
            layer.moe.adds_down_bias = tp_rank == 0

    def init_buffers(self, device: torch.device) -> None:
        """The Llama model's buffers, and MXFP4 experts laid out for their kernels (once, after
        loading: never inside a CUDA-graph capture)."""
        super().init_buffers(device)
        for layer in self.layers:
            layer.moe.prepare_weights()

    def decode_experts(self) -> list[GemvExperts]:
        """Each layer's routed experts for the runner's load-time choice (engine/executor/runner.py choose_kernels,
        kernels/moe_decode_tiles.py): per decode token count, the grouped path or kernels/moe_gemv.py's GEMV
        launches (MXFP4 codes read as 4 bits, biases and the clamped SwiGLU in their epilogues)."""
        return [layer.moe.gemv_experts() for layer in self.layers]

    @torch.inference_mode()
    def warm_up_kernels(self, max_tokens: int = 8192) -> None:
        """Compile the fused-MoE kernels (biases, clamped SwiGLU) for every variant a forward of at
        most ``max_tokens`` may pick, as MoeForCausalLM.warm_up_kernels does: the first layer's
        experts on zeros, without the all-reduce (ranks may warm up apart)."""
        block = self.layers[0].moe
        counts = mxfp4_warm_up_token_counts if block.mxfp4 else warm_up_token_counts
        for num_tokens in counts(block.router.out_features, block.top_k, max_tokens):
            block.routed(torch.zeros(num_tokens, block.router.in_features, dtype=block.router.weight.dtype,
                                     device=block.router.weight.device))
