"""Engine configuration: the model's shape, the build limits, and the engine-directory header.

Every config is a plain dataclass validated once, in ``validate()``, with errors that name the
field, the value and what is allowed. ``to_dict``/``from_dict`` round-trip through JSON, so
``config.json`` of an engine directory is exactly ``EngineConfig.to_dict()``.

Stdlib only: the executor and the Triton glue read configs without importing torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# 2: build.quantization (fp8 weights); 3: integer weight-only schemes; 4: fp8_block (128 x 128 block
# scales, from block-FP8 checkpoints) and FP8 experts of mixture-of-experts models
FORMAT_VERSION = 4
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)
# Weight-only integer schemes (kernels/wna16.py): bits of the codes, and whether the build's own
# round-to-nearest quantization stores zero points (asymmetric) or not.
WEIGHT_ONLY_BITS = {"int8_wo": 8, "int4_wo": 4, "int4_awq": 4}
FP8_QUANTIZATIONS = ("fp8", "fp8_block")
# SmoothQuant W8A8 INT8 (kernels/int8_sq.py, engine/weight_only/smoothquant.py): int8 weights per
# output channel, int8 activations per token, smoothing scales calibrated at build.
INT8_SQ = "int8_sq"
QUANTIZATIONS = FP8_QUANTIZATIONS + tuple(WEIGHT_ONLY_BITS) + (INT8_SQ,)
# Group sizes the kernels take (columns of K sharing a scale and zero); 0 = one group per output row.
WEIGHT_ONLY_GROUP_SIZES = (0, 32, 64, 128, 256)
DEFAULT_GROUP_SIZE = {8: 0, 4: 128}
KV_CACHE_DTYPES = ("fp8",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM")
# Mixture-of-experts families (engine/models/moe.py): the only ones whose num_experts may be > 0.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
SUPPORTED_ARCHITECTURES += MOE_ARCHITECTURES
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic", "longrope")
# A default max_seq_len (one taken from the checkpoint's max_position_embeddings) never exceeds this:
# models that advertise 128k-1M positions would otherwise get decode CUDA graphs, block tables and
# attention split counts sized for contexts few deployments serve. Pass --max_seq_len to go beyond.
MAX_DEFAULT_SEQ_LEN = 32768
# max_num_tokens from the checkpoint: at least this many tokens per step (enough to batch many
# prefills), and never less than max_input_len (so any allowed prompt fits one step unchunked).
MIN_DEFAULT_MAX_NUM_TOKENS = 8192

# Qwen3-VL's language models (engine/models/qwen3_vl.py): Qwen3 / Qwen3-MoE with DeepStack levels.
DEEPSTACK_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# Gemma 2 / Gemma 3 text (engine/models/gemma.py): GeGLU MLP, sandwich norms, soft-capping.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES += GEMMA_ARCHITECTURES
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names, per layer

# The configurable decoder (engine/models/decoder.py): families that differ from one another only in
# the block options of ModelConfig (norm_kind, positions, residual, biases, MLP form, ...).
DECODER_ARCHITECTURES = ("GPTNeoXForCausalLM", "FalconForCausalLM", "GPTJForCausalLM", "OPTForCausalLM",
                         "Starcoder2ForCausalLM", "Glm4ForCausalLM", "BloomForCausalLM", "MptForCausalLM",
                         "BaichuanForCausalLM", "QWenLMHeadModel")
SUPPORTED_ARCHITECTURES += DECODER_ARCHITECTURES
# Hybrid Mamba-2 / attention models (engine/ssm/): their ModelConfig.ssm holds the Mamba shape and
# the order of the blocks (engine/ssm/spec.py); hidden_act is the Mamba layers' SiLU.
HYBRID_ARCHITECTURES = ("BambaForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "Mamba2ForCausalLM",
                        "FalconH1ForCausalLM", "MambaForCausalLM", "JambaForCausalLM")
# Hybrids with routed experts (the spec's "moe" blocks), read from num_experts and the fields after it.
HYBRID_MOE_ARCHITECTURES = ("JambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM")
SUPPORTED_ARCHITECTURES += HYBRID_ARCHITECTURES
# DeepSeek-V2/V3 (engine/models/deepseek.py): multi-head latent attention over a latent KV pool,
# shared + routed experts with DeepSeek's routing (MLA_TOPK_METHODS).
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# DeepSeek's routing weights stay float32 whatever the engine dtype, as transformers keeps gate.weight
# and e_score_correction_bias (in bf16 a near tie between experts' scores can pick another expert):
# the converter writes them float32 and the loader keeps a float32 tensor of these names so. Nemotron-H's
# MoE layers route the same way (engine/ssm/hybrid.py: ``blocks.{i}.mixer.experts.router.weight``).
FLOAT32_WEIGHT_SUFFIXES = (".moe.router.weight", ".moe.score_bias", ".experts.router.weight", ".experts.score_bias")


def keeps_float32(architecture: str, name: str) -> bool:
    """Whether engine tensor ``name`` of ``architecture`` is stored float32 whatever the engine dtype."""
    return ((architecture in MLA_ARCHITECTURES or architecture == "NemotronHForCausalLM")
            and name.endswith(FLOAT32_WEIGHT_SUFFIXES))

SUPPORTED_ARCHITECTURES += MLA_ARCHITECTURES
# DeepSeek's names for how a token picks its experts: greedy (softmax, top-k: V2), group_limited_greedy
# (softmax, the best topk_group groups by their best expert, top-k among them: V2), noaux_tc (sigmoid,
# plus e_score_correction_bias for the choice only, groups ranked by their two best: V3).
MLA_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Llama 4 text (engine/models/llama4.py): chunked local attention on rope layers, global NoPE layers,
# dense and MoE layers interleaved (top-1 sigmoid routing, a shared expert).
LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM",)
SUPPORTED_ARCHITECTURES += LLAMA4_ARCHITECTURES
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned", "alibi")
# sequential: x += attn(norm1(x)); x += mlp(norm2(x)). parallel: x += attn(norm1(x)) + mlp(norm1(x))
# (GPT-J, Falcon-7B: one norm). parallel_two_norms: x += attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX,
# Falcon's new decoder architecture). post_norm: x = norm1(x + attn(x)); x = norm2(x + mlp(x)) (OPT-350m).
RESIDUAL_KINDS = ("sequential", "parallel", "parallel_two_norms", "post_norm")
# How ALiBi's per-head slopes are made: BLOOM's (closest power of two, then the odd powers of the next
# one) or MPT's (alibi_bias_max spread over the next power of two, then interleaved).
ALIBI_SLOPE_KINDS = ("bloom", "mpt")
# Encoder-decoder families (engine/encoder_decoder/): a ModelConfig of theirs describes the decoder
# stack (its paged self-attention KV); the block options live in engine/encoder_decoder/spec.py.
# Llama 3.2 Vision (MllamaForConditionalGeneration) is one too: a decoder whose cross-attention layers read
# the images' vision states, held in the same cross-KV pool (engine/encoder_decoder/mllama_*.py).
ENCODER_DECODER_ARCHITECTURES = ("T5ForConditionalGeneration", "BartForConditionalGeneration",
                                 "MBartForConditionalGeneration", "WhisperForConditionalGeneration",
                                 "MllamaForConditionalGeneration")


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names field, value and rule."""


class EngineFormatError(ValueError):
    """An engine directory is missing, corrupt, or of another format version."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive_ints(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}",
        )


def _from_known_fields(cls, data: dict[str, Any]):
    """Build ``cls`` from a dict, refusing unknown keys (a typo must not pass silently)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    _require(not unknown, f"{cls.__name__}: unknown keys {unknown}; allowed keys are {sorted(known)}")
    return cls(**data)


_OPTIONAL_WHEN_NONE = ("sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                       "final_logit_softcapping", "rope_local_theta", "swiglu_limit", "expert_quantization", "ssm",
                       "q_lora_rank", "attention_chunk_size", "nope_floor_scale", "nope_attn_scale")
# The configurable decoder's block options: left out of config.json at their (the Llama block's)
# defaults, so the engines of the other families keep the config.json older readers accept.
_OPTIONAL_AT_DEFAULT = ("norm_kind", "norm_bias", "positions", "learned_position_offset", "alibi_slopes",
                        "alibi_bias_max", "residual", "post_sublayer_norms", "attention_out_bias", "mlp_bias",
                        "mlp_gated", "embedding_norm", "word_embed_proj_dim", "final_norm", "lm_head_bias", "clip_qkv",
                        "rotary_interleaved", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                        "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "topk_method", "qk_l2_norm",
                        "deepstack_layers", "num_nextn_predict_layers", "moe_ep_size")


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, independent of how it is sharded or cast.

    ``architecture`` is the Hugging Face class name. ``rope_scaling`` keeps HF's layout
    (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``), completed by engine.convert with the
    ``original_max_position_embeddings``/``max_position_embeddings`` its frequencies need.
    ``head_dim`` may differ from ``hidden_size // num_heads`` (some Qwen/Mistral variants).
    Fields added after format version 2 shipped have defaults, so older engines still load.

    Sliding-window attention: ``sliding_window`` W applies to the layers whose ``layer_types``
    entry is "sliding_attention", to every layer when ``layer_types`` is None (Mistral); a query
    at position p sees keys p - W < k <= p (kernels/attention.py). Gemma fields: attention scale
    ``query_pre_attn_scalar ** -0.5`` (None: ``head_dim ** -0.5``), tanh soft-caps of the attention
    scores and of the final logits (None: none), and Gemma 3's rope base of its sliding layers.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None

    def layer_window(self, layer_index: int) -> int | None:
        """The attention window of one layer (None: it attends to its whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_index] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """The window of every layer when all layers have one (then KV blocks that fall out of it
        can be freed), else None: a global layer reads every block of the sequence."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else max(windows)
    # Qwen3: RMSNorm over each q and k head (head_dim wide, weights q_norm/k_norm) before rope.
    qk_norm: bool = False
    # Phi-4-mini and others: rope rotates only the first int(head_dim * factor) dims of each head.
    partial_rotary_factor: float = 1.0
    # SmolLM3 (NoPE layers): indices of the layers whose attention uses no rotary embedding.
    layers_without_rope: list[int] = field(default_factory=list)
    # Mixture of experts (MOE_ARCHITECTURES). num_experts 0: every layer has the dense MLP of
    # width intermediate_size. Otherwise a layer is sparse (router + experts of width
    # moe_intermediate_size, each token through its num_experts_per_tok best) unless it is in
    # mlp_only_layers or (index + 1) is not a multiple of decoder_sparse_step (Qwen3-MoE's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # gpt-oss (engine/models/gpt_oss.py): its experts' clamped SwiGLU, gate clamped above and up on
    # both sides at this limit (kernels/moe_epilogue.py); None for the plain SwiGLU of other families.
    swiglu_limit: float | None = None
    # gpt-oss: "mxfp4" when the experts stay as the checkpoint's MXFP4 codes and E8M0 scales
    # (kernels/fused_moe_mxfp4.py; engine/mxfp4.py); None: experts in the model dtype. Left out of
    # config.json when None, so an engine with MXFP4 experts is refused by readers that predate it.
    expert_quantization: str | None = None
    # ---- block options of the configurable decoder (DECODER_ARCHITECTURES; the Llama block's values
    # are the defaults, and to_dict leaves a field at its default out of config.json) ----
    norm_kind: str = "rmsnorm"
    norm_bias: bool = False  # LayerNorm with a bias (MPT's has none)
    positions: str = "rope"  # POSITION_KINDS; "learned": a (max_position_embeddings + offset, hidden) table
    learned_position_offset: int = 0  # OPT looks position p up at row p + 2
    alibi_slopes: str | None = None  # ALIBI_SLOPE_KINDS, with positions "alibi"
    alibi_bias_max: float = 8.0  # MPT's; BLOOM's slopes are MPT's at 8 for a power-of-two head count
    residual: str = "sequential"  # RESIDUAL_KINDS
    post_sublayer_norms: bool = False  # GLM-4: each sub-block's output is normed before it joins the residual
    attention_out_bias: bool = False  # a bias on o_proj
    mlp_bias: bool = False  # biases on the MLP's two projections
    mlp_gated: bool = True  # act(gate) * up over a fused [gate | up] projection; False: act(fc_in(x))
    embedding_norm: bool = False  # BLOOM: a LayerNorm right after the token embeddings
    word_embed_proj_dim: int | None = None  # OPT-350m: embeddings of this width, projected in and out
    final_norm: bool = True  # a norm before the lm_head (OPT's post-norm models have none)
    lm_head_bias: bool = False  # GPT-J
    clip_qkv: float | None = None  # MPT: q, k and v clamped to [-clip_qkv, clip_qkv]
    # GPT-J, GLM-4: rope rotates adjacent pairs (2i, 2i + 1) in the checkpoint; engine.convert reorders
    # each q/k head's dims so the kernels' halves (i, i + rotary_dim / 2) rotate exactly those pairs.
    rotary_interleaved: bool = False
    # Hybrid Mamba models (HYBRID_ARCHITECTURES): engine/ssm/spec.py SsmSpec as a dict; None otherwise.
    ssm: dict[str, Any] | None = None
    # ---- DeepSeek-V2/V3 (MLA_ARCHITECTURES; engine/models/deepseek.py). head_dim is the rope part of
    # a q/k head (qk_rope_head_dim), num_kv_heads == num_heads; the dense layers are mlp_only_layers
    # (first_k_dense_replace of them) ----
    q_lora_rank: int | None = None  # q through a low-rank (hidden -> q_lora_rank -> heads) path; None: one q_proj
    kv_lora_rank: int = 0  # width of the compressed latent the KV pool holds (0: not MLA)
    qk_nope_head_dim: int = 0  # the part of each q/k head without rope
    v_head_dim: int = 0
    n_shared_experts: int = 0  # a dense MLP of width n_shared_experts * moe_intermediate_size beside the routed experts
    n_group: int = 1  # experts in n_group groups; a token chooses among the best topk_group groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    topk_method: str = "greedy"  # MLA_TOPK_METHODS
    # Multi-token prediction (DeepSeek-V3's layer num_layers of the checkpoint): 1 when the engine holds
    # the MTP module (the model's ``mtp``; drafts for decoding_mode mtp), 0 when the checkpoint has none.
    num_nextn_predict_layers: int = 0
    # Expert parallelism (engine.build --moe_ep_size): 1, each rank holds a slice of every routed
    # expert's width; tp_size, each rank holds num_experts / tp_size whole experts (attention stays
    # split by heads; the activations are replicated, so the routed partial sums meet in the layer's
    # one all-reduce, as the width slices do).
    moe_ep_size: int = 1
    # ---- Llama 4 (LLAMA4_ARCHITECTURES; engine/models/llama4.py): rope layers attend within chunks of
    # attention_chunk_size positions (a query at p sees keys (p // C) * C .. p) and normalise q and k
    # per head (no weight) after rope; layers_without_rope are global, their q scaled by
    # 1 + nope_attn_scale * log1p(floor((p + 1) / nope_floor_scale)) (None: no temperature tuning);
    # experts top-k by logit, sigmoid weights scaling each expert's input, plus n_shared_experts ----
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    nope_floor_scale: float | None = None
    nope_attn_scale: float | None = None
    # ---- Qwen3-VL's language model (DEEPSTACK_ARCHITECTURES; engine/models/qwen3_vl.py): its decoder
    # layers 0..deepstack_layers-1 each add one DeepStack level of an image's features at the image's
    # positions; the levels ride in the prompt table's rows, (1 + deepstack_layers) * hidden_size wide ----
    deepstack_layers: int = 0

    @property
    def prompt_table_width(self) -> int:
        """The width of a prompt-embedding table's rows: hidden_size, DeepStack levels beside it."""
        return self.hidden_size * (1 + self.deepstack_layers)

    def is_moe_layer(self, layer_index: int) -> bool:
        return (self.num_experts > 0 and layer_index not in self.mlp_only_layers
                and (layer_index + 1) % self.decoder_sparse_step == 0)

    def validate(self) -> "ModelConfig":
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES + ENCODER_DECODER_ARCHITECTURES,
            f"unsupported architecture {self.architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES + ENCODER_DECODER_ARCHITECTURES)}",
        )
        _positive_ints(
            self,
            ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "intermediate_size", "max_position_embeddings"),
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})",
        )
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps!r}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}")
        _require(
            self.hidden_act in SUPPORTED_ACTIVATIONS,
            f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}",
        )
        if self.architecture in GEMMA_ARCHITECTURES:  # GeGLU: gelu(gate) * up
            _require(
                self.hidden_act in ("gelu_pytorch_tanh", "gelu"),
                f"{self.architecture} needs hidden_act 'gelu_pytorch_tanh' or 'gelu' (GeGLU MLP), got {self.hidden_act!r}",
            )
        elif self.architecture in DECODER_ARCHITECTURES:
            self._validate_decoder_options()
        elif self.architecture not in ("GPT2LMHeadModel",) + ENCODER_DECODER_ARCHITECTURES:  # Llama: SwiGLU
            _require(
                self.hidden_act == "silu",
                f"{self.architecture} needs hidden_act 'silu' (gated SiLU MLP), got {self.hidden_act!r}",
            )
        self._validate_window_and_caps()
        self._validate_experts()
        _require((self.ssm is not None) == (self.architecture in HYBRID_ARCHITECTURES),
                 f"{self.architecture}: ssm must be set exactly for the hybrid Mamba architectures "
                 f"({', '.join(HYBRID_ARCHITECTURES)}), got {self.ssm!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            _require(
                rope_type in SUPPORTED_ROPE_TYPES,
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            )
        self._validate_rotary_layout()
        self._validate_rope_scaling_keys()
        _require(isinstance(self.deepstack_layers, int) and 0 <= self.deepstack_layers <= self.num_layers
                 and (not self.deepstack_layers or self.architecture in DEEPSTACK_ARCHITECTURES),
                 f"deepstack_layers {self.deepstack_layers!r} of {self.architecture}: allowed 0..num_layers "
                 f"({self.num_layers}), and above 0 only for {', '.join(DEEPSTACK_ARCHITECTURES)} (Qwen3-VL)")
        return self

    def _validate_decoder_options(self) -> None:
        for name, allowed in (("norm_kind", NORM_KINDS), ("positions", POSITION_KINDS), ("residual", RESIDUAL_KINDS)):
            _require(getattr(self, name) in allowed,
                     f"unsupported {name} {getattr(self, name)!r}; supported: {', '.join(allowed)}")
        if self.positions == "alibi":
            _require(self.alibi_slopes in ALIBI_SLOPE_KINDS,
                     f"positions 'alibi' needs alibi_slopes in {', '.join(ALIBI_SLOPE_KINDS)}, got {self.alibi_slopes!r}")
            _require(self.alibi_bias_max > 0, f"alibi_bias_max must be > 0, got {self.alibi_bias_max!r}")
            _require(self.rope_scaling is None,
                     f"{self.architecture}: ALiBi positions with rope_scaling {self.rope_scaling!r} cannot work "
                     "(the model has no rotary embedding to scale); remove rope_scaling")
        _require(not self.mlp_gated or self.hidden_act == "silu",
                 f"{self.architecture}: a gated MLP needs hidden_act 'silu', got {self.hidden_act!r}")
        _require(self.word_embed_proj_dim is None or self.word_embed_proj_dim > 0,
                 f"word_embed_proj_dim must be a positive integer or null, got {self.word_embed_proj_dim!r}")
        _require(self.clip_qkv is None or self.clip_qkv > 0, f"clip_qkv must be > 0 or null, got {self.clip_qkv!r}")
        _require(self.learned_position_offset >= 0,
                 f"learned_position_offset must be >= 0, got {self.learned_position_offset!r}")

    def _validate_window_and_caps(self) -> None:
        if self.sliding_window is not None:
            _positive_ints(self, ("sliding_window",))
        if self.layer_types is not None:
            _require(
                isinstance(self.layer_types, list) and len(self.layer_types) == self.num_layers
                and all(t in LAYER_TYPES for t in self.layer_types),
                f"layer_types must list one of {', '.join(LAYER_TYPES)} per layer ({self.num_layers} layers), "
                f"got {self.layer_types!r}",
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, (int, float)) and value > 0),
                     f"{name} must be a positive number or null, got {value!r}")

    def _validate_experts(self) -> None:
        if self.architecture in MLA_ARCHITECTURES:
            self._validate_mla()
            return
        if self.architecture in LLAMA4_ARCHITECTURES:
            _positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"))
            _require(self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
            _require(self.attention_chunk_size is None or self.attention_chunk_size > 0,
                     f"attention_chunk_size must be a positive integer or null, got {self.attention_chunk_size!r}")
            _require(not self.qkv_bias and self.rotary_dim == self.head_dim,
                     f"{self.architecture} with attention bias or partial rotary is not supported")
            return
        if self.architecture in HYBRID_MOE_ARCHITECTURES and self.num_experts:
            _positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                                  "topk_group"))
            _require(self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
            # softmax routing (Jamba, Granite 4.0) or Nemotron-H's sigmoid group-limited noaux_tc
            _require(self.topk_method in ("greedy", "noaux_tc"),
                     f"{self.architecture}: topk_method must be greedy or noaux_tc, got {self.topk_method!r}")
            _require(self.num_experts % self.n_group == 0 and self.topk_group <= self.n_group,
                     f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and topk_group "
                     f"({self.topk_group}) must be <= n_group")
            return
        if self.architecture not in MOE_ARCHITECTURES:
            _require(self.num_experts == 0, f"{self.architecture} has no experts; num_experts must be 0, "
                                            f"got {self.num_experts!r}")
            return
        _positive_ints(self, ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"))
        _require(self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
        _require(all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.mlp_only_layers),
                 f"mlp_only_layers must hold layer indices in [0, {self.num_layers}), got {self.mlp_only_layers!r}")
        _require((not self.qkv_bias or self.architecture == "GptOssForCausalLM") and self.rotary_dim == self.head_dim
                 and not self.layers_without_rope,
                 f"{self.architecture} with q/k/v bias, partial rotary or layers without rope is not supported")
        _require(self.swiglu_limit is None or (isinstance(self.swiglu_limit, (int, float)) and self.swiglu_limit > 0),
                 f"swiglu_limit must be a positive number or null, got {self.swiglu_limit!r}")
        _require(self.expert_quantization is None or (self.expert_quantization == "mxfp4"
                                                      and self.architecture == "GptOssForCausalLM"),
                 f"expert_quantization must be null, or 'mxfp4' for GptOssForCausalLM; got "
                 f"{self.expert_quantization!r} for {self.architecture}")

    def _validate_mla(self) -> None:
        _positive_ints(self, ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
                              "moe_intermediate_size", "n_group", "topk_group"))
        _require(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
                 f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        _require(self.num_kv_heads == self.num_heads, f"{self.architecture}: num_kv_heads ({self.num_kv_heads}) must "
                                                      f"equal num_heads ({self.num_heads}) (MLA has no KV heads)")
        _require(self.topk_method in MLA_TOPK_METHODS,
                 f"unsupported topk_method {self.topk_method!r}; supported: {', '.join(MLA_TOPK_METHODS)}")
        _require(self.num_experts % self.n_group == 0 and self.topk_group <= self.n_group,
                 f"num_experts ({self.num_experts}) must split into n_group ({self.n_group}) groups, and topk_group "
                 f"({self.topk_group}) must be <= n_group")
        _require(self.num_experts_per_tok <= self.num_experts // self.n_group * self.topk_group,
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= the experts of topk_group groups")
        _require(self.topk_method != "noaux_tc" or self.num_experts // self.n_group >= 2,
                 "topk_method noaux_tc ranks groups by their two best experts: groups need >= 2 experts")
        _require(isinstance(self.moe_ep_size, int) and self.moe_ep_size >= 1
                 and self.num_experts % self.moe_ep_size == 0,
                 f"moe_ep_size must be a positive integer dividing num_experts ({self.num_experts}), "
                 f"got {self.moe_ep_size!r}")
        _require(self.num_nextn_predict_layers in (0, 1),
                 f"num_nextn_predict_layers must be 0 or 1 (the engine holds one MTP module, reused for every "
                 f"draft), got {self.num_nextn_predict_layers!r}")
        _require(self.n_shared_experts >= 0 and self.routed_scaling_factor > 0,
                 f"n_shared_experts must be >= 0 and routed_scaling_factor > 0, got {self.n_shared_experts!r}, "
                 f"{self.routed_scaling_factor!r}")
        _require(not self.qkv_bias and not self.layers_without_rope and self.rotary_dim == self.head_dim,
                 f"{self.architecture} with attention bias, partial rotary or layers without rope is not supported")

    def _validate_rope_scaling_keys(self) -> None:
        """The keys each scaling's frequencies need (engine.convert fills them in from the HF config)."""
        needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "linear": ("factor",),
                  "yarn": ("original_max_position_embeddings",),
                  "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
        missing = [key for key in needed.get(self.rope_type, ()) if self.rope_scaling.get(key) is None]
        _require(not missing, f"rope_scaling of type {self.rope_type!r} lacks {', '.join(missing)}")
        if self.rope_type == "yarn" or self.rope_type == "longrope":
            _require(self.rope_scaling.get("factor") is not None or self.rope_scaling.get("max_position_embeddings"),
                     f"rope_scaling of type {self.rope_type!r} needs factor or max_position_embeddings")
        if self.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                _require(len(self.rope_scaling[key]) == self.rotary_dim // 2,
                         f"rope_scaling {key} has {len(self.rope_scaling[key])} values; the rotary dims "
                         f"({self.rotary_dim}) need {self.rotary_dim // 2}")

    def _validate_rotary_layout(self) -> None:
        _require(0 < self.partial_rotary_factor <= 1,
                 f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        _require(self.head_dim % 2 == 0 and self.rotary_dim % 2 == 0,
                 f"head_dim ({self.head_dim}) and rotary dims ({self.rotary_dim}) must be even")
        bad = [i for i in self.layers_without_rope if not 0 <= i < self.num_layers]
        _require(not bad, f"layers_without_rope {bad} are not layer indices; allowed: 0..{self.num_layers - 1}")

    @property
    def max_positions(self) -> tuple[int, str]:
        """(the longest sequence the model's positions cover, where that number comes from).

        yarn extends a model to ``factor * original_max_position_embeddings`` (Qwen3's recipe keeps
        max_position_embeddings at the pretrained length); every other kind of position is bounded
        by max_position_embeddings (dynamic NTK included: its static table is exact only there).
        """
        extended = 0
        if self.rope_type == "yarn" and self.rope_scaling.get("factor"):
            extended = int(self.rope_scaling["factor"] * self.rope_scaling["original_max_position_embeddings"])
        if extended > self.max_position_embeddings:
            return extended, f"yarn factor x original_max_position_embeddings ({extended})"
        return self.max_position_embeddings, f"max_position_embeddings ({self.max_position_embeddings})"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head (in the checkpoint's order) rope rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def to_dict(self) -> dict[str, Any]:
        """asdict, without the window / Gemma fields when unset: an engine that uses none of them
        keeps the config.json an older reader accepts (it refuses unknown keys)."""
        data = asdict(self)
        for name in _OPTIONAL_WHEN_NONE:
            if data[name] is None:
                del data[name]
        defaults = {f.name: f.default for f in fields(self) if f.name in _OPTIONAL_AT_DEFAULT}
        for name, default in defaults.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _from_known_fields(cls, data).validate()


@dataclass(frozen=True)
class WeightOnlyScheme:
    """Integer weight-only linear layers (kernels/wna16.py): ``bits`` 4 or 8, ``group_size`` input
    columns per scale and zero (0: one group per output row, i.e. the layer's whole K), and
    ``act_order``: layers hold an ``input_perm`` that reorders their input columns into group order.
    ``float_linears``: engine names of Linear weights (``layers.3.qkv_proj.weight``) an integer checkpoint left
    unquantized, which the model holds in its dtype (the families whose model class says so: Llama 4)."""

    bits: int
    group_size: int
    act_order: bool = False
    float_linears: tuple[str, ...] = ()

    def groups(self, in_features: int) -> int:
        """Scale groups per row of a layer with ``in_features`` input columns (on this rank)."""
        _require(self.group_size == 0 or in_features % self.group_size == 0,
                 f"a layer with {in_features} input columns (on one tensor-parallel rank) does not divide into "
                 f"groups of {self.group_size}; use a group size that divides every layer's input width, or 0")
        return 1 if self.group_size == 0 else in_features // self.group_size


@dataclass
class BuildConfig:
    """Limits fixed at build time, and the parallel mapping the weights were sharded for."""

    dtype: str = "float16"
    max_batch_size: int = 8
    # None: taken from the checkpoint by ``resolve_build_limits`` (which the build calls):
    # max_seq_len = the model's positions (ModelConfig.max_positions: max_position_embeddings,
    # or what yarn extends it to; at most MAX_DEFAULT_SEQ_LEN, and within an
    # unsupported sliding window), max_input_len = max_seq_len, max_num_tokens =
    # max(MIN_DEFAULT_MAX_NUM_TOKENS, max_input_len) but at most max_batch_size * max_seq_len.
    max_input_len: int | None = None
    max_seq_len: int | None = None
    max_num_tokens: int | None = None
    tokens_per_block: int = 64
    tp_size: int = 1
    pp_size: int = 1
    # Layers per pipeline stage, in stage order (e.g. [8, 12, 14, 14]); None: the even split
    # (pipeline_layer_counts). engine.build --pp_layers balanced records the split balanced by
    # cost (engine/pipeline/layout.py balanced_pp_layers). Ranks = tp_size * pp_size.
    pp_layers: list[int] | None = None
    # None: weights in ``dtype``. "fp8": every linear layer of the decoder blocks (and the experts)
    # holds FP8 E4M3 weights with per-output-channel scales; activations are quantized per token at
    # run time (kernels/fp8.py). "fp8_block": the scheme of block-FP8 checkpoints (DeepSeek-V3,
    # Qwen3-*-FP8): one scale per 128 x 128 block of each weight, activations quantized per token
    # and 128-column group (kernels/fp8_block.py); a layer the checkpoint left unquantized keeps its
    # weight in ``dtype``. "int8_sq": SmoothQuant W8A8 INT8, int8 weights per output channel of the
    # SmoothQuant-smoothed model, int8 activations per token (kernels/int8_sq.py). Embeddings, norms,
    # routers and the lm_head stay in ``dtype``.
    quantization: str | None = None
    # Integer weight-only schemes (int8_wo, int4_wo, int4_awq; or read from an AWQ/GPTQ/compressed-
    # tensors checkpoint): input columns per scale group, 0 = per output channel; None = the
    # scheme's default (int4: 128, int8: per channel). ``quant_act_order``: the linear layers carry
    # an ``input_perm`` (a GPTQ act-order checkpoint's group order, engine/weight_only/convert.py).
    quant_group_size: int | None = None
    quant_act_order: bool = False
    # Integer checkpoints: engine names of the Linear weights the checkpoint left unquantized, held in ``dtype``
    # (WeightOnlyScheme.float_linears; set by the build for the families that take it); None: every linear integer.
    quant_float_linears: list[str] | None = None
    # None: the KV pool in ``dtype``. "fp8": K and V stored as FP8 E4M3 (scale 1, saturating at
    # +-448), half the bytes per block; the executor's kv_cache_dtype may override it.
    kv_cache_dtype: str | None = None

    def validate(self) -> "BuildConfig":
        _require(
            self.dtype in SUPPORTED_DTYPES,
            f"unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}",
        )
        _positive_ints(self, ("max_batch_size", "tokens_per_block", "tp_size", "pp_size"))
        _positive_ints(self, tuple(name for name in LIMITS_FROM_MODEL if getattr(self, name) is not None))
        _require(
            None in (self.max_input_len, self.max_seq_len) or self.max_input_len <= self.max_seq_len,
            f"max_input_len ({self.max_input_len}) must be <= max_seq_len ({self.max_seq_len})",
        )
        _require(self.pp_layers is None or len(self.pp_layers) == self.pp_size,
                 f"pp_layers {self.pp_layers} must give one layer count per stage (pp_size {self.pp_size})")
        _require(self.kv_cache_dtype is None or self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: auto, {', '.join(KV_CACHE_DTYPES)}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"unsupported quantization {self.quantization!r}; supported: none, {', '.join(QUANTIZATIONS)}")
        weight_only = self.quantization in WEIGHT_ONLY_BITS
        _require(self.quant_group_size is None or weight_only,
                 f"quant_group_size applies to {', '.join(WEIGHT_ONLY_BITS)}, not to quantization {self.quantization}")
        _require(self.quant_group_size is None or self.quant_group_size in WEIGHT_ONLY_GROUP_SIZES,
                 f"unsupported quant_group_size {self.quant_group_size}; supported: "
                 f"{', '.join(map(str, WEIGHT_ONLY_GROUP_SIZES[1:]))} or 0 (per output channel)")
        _require(not self.quant_act_order or weight_only, "quant_act_order applies only to integer weight-only schemes")
        _require(self.quant_float_linears is None or weight_only,
                 "quant_float_linears applies only to integer weight-only schemes")
        return self

    @property
    def weight_only(self) -> "WeightOnlyScheme | None":
        """The integer weight-only scheme of the linear layers, None for model-dtype or FP8 weights."""
        if self.quantization not in WEIGHT_ONLY_BITS:
            return None
        bits = WEIGHT_ONLY_BITS[self.quantization]
        group = DEFAULT_GROUP_SIZE[bits] if self.quant_group_size is None else self.quant_group_size
        return WeightOnlyScheme(bits=bits, group_size=group, act_order=self.quant_act_order,
                                float_linears=tuple(self.quant_float_linears or ()))

    @property
    def world_size(self) -> int:
        """Ranks an engine of this mapping runs on: tp_size x pp_size."""
        return self.tp_size * self.pp_size

    def to_dict(self) -> dict[str, Any]:
        """asdict, without pp_layers and quant_float_linears when unset: a config.json an older reader takes."""
        data = asdict(self)
        for name in ("pp_layers", "quant_float_linears"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildConfig":
        return _from_known_fields(cls, data).validate()


LIMITS_FROM_MODEL = ("max_input_len", "max_seq_len", "max_num_tokens")


def resolve_build_limits(build: BuildConfig, model: ModelConfig) -> BuildConfig:
    """A copy of ``build`` whose unset limits come from the model (see BuildConfig), after
    checking the set ones against it. A limit the user set that contradicts the model raises
    ConfigError naming both numbers. (A sliding window bounds nothing: the engine applies it.)
    """
    build.validate()
    positions, source = model.max_positions
    _require(build.max_seq_len is None or build.max_seq_len <= positions,
             f"max_seq_len ({build.max_seq_len}) exceeds the model's {source}; "
             f"allowed: max_seq_len <= {positions}, or leave it out to use {min(positions, MAX_DEFAULT_SEQ_LEN)}")
    default_seq_len = min(positions, MAX_DEFAULT_SEQ_LEN)
    if build.max_input_len is not None and build.max_seq_len is None:
        default_seq_len = max(default_seq_len, min(build.max_input_len, positions))
    max_seq_len = build.max_seq_len or default_seq_len
    max_input_len = build.max_input_len or max_seq_len
    _require(max_input_len <= max_seq_len,
             f"max_input_len ({max_input_len}) must be <= max_seq_len ({max_seq_len}"
             f"{'' if build.max_seq_len else ', from the model'})")
    max_num_tokens = build.max_num_tokens or min(max(MIN_DEFAULT_MAX_NUM_TOKENS, max_input_len),
                                                 build.max_batch_size * max_seq_len)
    return replace(build, max_seq_len=max_seq_len, max_input_len=max_input_len, max_num_tokens=max_num_tokens)


def pipeline_layer_counts(num_layers: int, pp_size: int, pp_layers: list[int] | None = None) -> list[int]:
    """Decoder layers per pipeline stage. None: even, the first ``num_layers % pp_size`` stages one
    layer more (32 over 3: 11, 11, 10); a list is checked (one positive count per stage, summing to
    the model's layers). ConfigError names the numbers and what is allowed."""
    _require(pp_size <= num_layers,
             f"pp_size {pp_size} is larger than the model's {num_layers} layers; every pipeline stage needs at "
             f"least one layer: allowed pp_size 1..{num_layers}")
    if pp_layers is None:
        base, extra = divmod(num_layers, pp_size)
        return [base + (1 if stage < extra else 0) for stage in range(pp_size)]
    _require(len(pp_layers) == pp_size and sum(pp_layers) == num_layers and min(pp_layers) >= 1,
             f"pp_layers {','.join(map(str, pp_layers))} must give {pp_size} positive layer counts (one per stage, "
             f"pp_size {pp_size}) adding up to the model's {num_layers} layers")
    return list(pp_layers)


def mamba_tp_error(num_heads: int, n_groups: int, tp_size: int) -> str | None:
    """Why a Mamba-2 layer of ``num_heads`` heads and ``n_groups`` B/C groups cannot split over
    ``tp_size`` ranks (engine/ssm/mamba_shard.py), or None."""
    if num_heads % tp_size:
        return (f"tp_size {tp_size} does not divide the Mamba-2 heads (num_heads {num_heads}), which are split "
                f"across ranks; allowed tp_size values divide {num_heads}")
    if n_groups % tp_size and tp_size % n_groups:
        return (f"tp_size {tp_size} and the Mamba-2 B/C groups (n_groups {n_groups}) do not split evenly: a "
                f"rank's heads would read parts of two groups; allowed tp_size values divide n_groups or are a "
                f"multiple of it")
    return None


def _check_ssm_tp(model: ModelConfig, tp_size: int) -> None:
    """Hybrid Mamba models: their Mamba-2 layers split evenly, and they have attention layers (a pure
    Mamba-2 model's attention fields are placeholders of one KV head, which does not split)."""
    ssm = model.ssm
    _require(tp_size == 1 or ssm.get("mamba_version", 2) == 2,
             f"{model.architecture}: tensor parallelism is not supported for Mamba-1 layers yet (got tp_size "
             f"{tp_size}); build with tp_size 1 (the Mamba-2 hybrids split)")
    if tp_size > 1 and "n_groups" in ssm:
        _require(not (error := mamba_tp_error(ssm["num_heads"], ssm["n_groups"], tp_size)),
                 f"{model.architecture}: {error}")
    attention = any(kind in ("attention", "parallel") for kind in ssm.get("blocks", ()))
    _require(attention or tp_size == 1,
             f"{model.architecture} without attention layers (pure Mamba-2) does not take tensor parallelism "
             f"(got tp_size {tp_size}); build it with tp_size 1 (the hybrids with attention layers split)")


def check_tp_divides(model: ModelConfig, tp_size: int) -> None:
    """Raise ConfigError unless every tensor-parallel split of ``model`` is even for ``tp_size``."""
    if model.ssm is not None:
        _check_ssm_tp(model, tp_size)
    if model.moe_ep_size > 1:  # whole experts per rank (engine/models/deepseek.py)
        _require(model.moe_ep_size == tp_size,
                 f"moe_ep_size ({model.moe_ep_size}) must be 1 or tp_size ({tp_size}): the experts are split "
                 f"across the tensor-parallel ranks")
    elif model.num_experts:  # every rank holds a slice of every expert's width (engine/models/moe.py)
        _require(model.moe_intermediate_size % tp_size == 0,
                 f"tp_size {tp_size} does not divide moe_intermediate_size ({model.moe_intermediate_size}), "
                 f"the experts' width, which is split across ranks")
    for name in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        value = getattr(model, name)
        _require(
            value % tp_size == 0,
            f"tp_size {tp_size} does not divide {name} ({value}); allowed tp_size values divide "
            f"num_heads ({model.num_heads}), num_kv_heads ({model.num_kv_heads}), "
            f"intermediate_size ({model.intermediate_size}) and vocab_size ({model.vocab_size})",
        )


@dataclass
class EngineConfig:
    """The header of an engine directory: ``config.json``."""

    model: ModelConfig
    build: BuildConfig
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (source checkpoint, ...)

    def validate(self) -> "EngineConfig":
        self.model.validate()
        if None in (getattr(self.build, name) for name in LIMITS_FROM_MODEL):
            self.build = resolve_build_limits(self.build, self.model)
        self.build.validate()
        check_tp_divides(self.model, self.build.tp_size)
        pipeline_layer_counts(self.model.num_layers, self.build.pp_size, self.build.pp_layers)
        if self.model.architecture == "GPT2LMHeadModel" or self.model.positions == "learned":  # no extrapolation
            _require(
                self.build.max_seq_len <= self.model.max_position_embeddings,
                f"max_seq_len ({self.build.max_seq_len}) exceeds {self.model.architecture}'s learned positions "
                f"({self.model.max_position_embeddings})",
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """``pretrained_config.mapping`` repeats the build's parallel mapping where TensorRT-LLM's
        engines keep it, with the resolved layers per stage; it is written for readers and tools,
        never read back (``build`` is the source)."""
        build = self.build
        return {
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "build": build.to_dict(),
            "pretrained_config": {"mapping": {
                "world_size": build.world_size, "tp_size": build.tp_size, "pp_size": build.pp_size,
                "pp_layers": pipeline_layer_counts(self.model.num_layers, build.pp_size, build.pp_layers)}},
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS:
            raise EngineFormatError(
                f"engine format_version {version!r} is not supported; this build reads format_version "
                f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))} (rebuild the engine with python -m engine.build)"
            )
        try:
            config = cls(
                model=ModelConfig.from_dict(data["model"]),
                build=BuildConfig.from_dict(data["build"]),
                format_version=version,
                extra=data.get("extra", {}),
            )
            return config.validate()
        except KeyError as missing:
            raise EngineFormatError(f"engine config.json lacks the section {missing}") from None
        except ConfigError as err:
            raise EngineFormatError(f"engine config.json is invalid: {err}") from None

    def save(self, engine_dir: str) -> None:
        os.makedirs(engine_dir, exist_ok=True)
        with open(os.path.join(engine_dir, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, engine_dir: str) -> "EngineConfig":
        path = os.path.join(engine_dir, "config.json")
        if not os.path.isfile(path):
            raise EngineFormatError(f"{engine_dir!r} is not an engine directory: {path} does not exist")
        try:
            with open(path) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise EngineFormatError(f"engine config {path} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise EngineFormatError(f"engine config {path} must hold a JSON object")
        return cls.from_dict(data)
