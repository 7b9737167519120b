"""Model registry: Hugging Face architecture name -> the engine's model class, and what it supports.

Every model class has the same surface:

- ``__init__(config, *, tp_rank, tp_size, tp_group, dtype, device, max_positions)``: parameters
  for one tensor-parallel rank, named as in the engine directory (build on ``device="meta"``
  and load with ``load_state_dict(..., assign=True)``);
- ``init_buffers(device)``: non-weight tensors (rotary tables), once after loading;
- ``forward(input_ids, positions, kv_cache, attn_meta) -> hidden (num_tokens, hidden)``;
- ``compute_logits(hidden_rows) -> float32 logits (rows, vocab)``, all-gathered over ranks.

``MODEL_FAMILIES`` is the one list of what builds; the README's supported-model table is
``supported_models_markdown()`` (a test keeps the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import ConfigError


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # the checkpoint's config.json "architectures"[0]
    module: str
    class_name: str
    checkpoints: str  # the models users know by name, with what the engine does for them
    tensor_parallel: bool = True
    fp8: bool = False  # --quantization fp8 (FP8 weights), and block-FP8 checkpoints (fp8_block)
    # Integer weight-only linears (int8_wo, int4_wo, int4_awq; AWQ/GPTQ/compressed-tensors checkpoints)
    weight_only: bool = False
    sliding_window: bool = False  # the checkpoint's sliding-window attention is applied (kernels/attention.py)


MODEL_FAMILIES = (
    ModelFamily("LlamaForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "Llama 2/3/3.1/3.2, SmolLM2, TinyLlama (rope scaling llama3, linear, yarn, dynamic)", fp8=True, weight_only=True),
    ModelFamily("MistralForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "Mistral 7B, Mistral Nemo (sliding window, out-of-window KV blocks freed)", fp8=True, weight_only=True,
                sliding_window=True),
    ModelFamily("Qwen2ForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "Qwen2, Qwen2.5 (q/k/v bias; use_sliding_window)", fp8=True, weight_only=True, sliding_window=True),
    ModelFamily("GPT2LMHeadModel", "engine.models.gpt2", "GPT2LMHeadModel", "GPT-2 (learned positions)"),
    ModelFamily("Qwen3ForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "Qwen3 dense (per-head q/k RMSNorm; yarn)", fp8=True, weight_only=True, sliding_window=True),
    ModelFamily("Phi3ForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini (fused qkv/gate_up, LongRoPE, partial rotary)", fp8=True, weight_only=True,
                sliding_window=True),
    ModelFamily("SmolLM3ForCausalLM", "engine.models.llama", "LlamaForCausalLM",
                "SmolLM3 (NoPE layers without rope)", fp8=True, weight_only=True, sliding_window=True),
    ModelFamily("Gemma2ForCausalLM", "engine.models.gemma", "GemmaForCausalLM",
                "Gemma 2 (soft-capped attention and logits; alternating sliding/global layers)",
                sliding_window=True),
    ModelFamily("Gemma3ForCausalLM", "engine.models.gemma", "GemmaForCausalLM",
                "Gemma 3 text, and the language model of Gemma3ForConditionalGeneration (q/k norms, "
                "local rope base, 5:1 sliding/global layers)", sliding_window=True),
    ModelFamily("MixtralForCausalLM", "engine.models.moe", "MoeForCausalLM",
                "Mixtral 8x7B, 8x22B (top-2 routed experts, fused-MoE kernel; experts split across TP ranks)",
                fp8=True, sliding_window=True, weight_only=True),
    ModelFamily("Qwen3MoeForCausalLM", "engine.models.moe", "MoeForCausalLM",
                "Qwen3-30B-A3B, Qwen3-235B-A22B (top-8 of 128 experts, norm_topk_prob, q/k RMSNorm)",
                fp8=True, sliding_window=True, weight_only=True),
    ModelFamily("GptOssForCausalLM", "engine.models.gpt_oss", "GptOssForCausalLM",
                "gpt-oss-20b, gpt-oss-120b (attention sinks, alternating sliding/full layers, top-4 experts with "
                "biases and clamped SwiGLU; MXFP4 experts kept as 4 bits, or widened with --mxfp4_experts widen)",
                sliding_window=True),
    ModelFamily("DeepseekV3ForCausalLM", "engine.models.deepseek", "DeepseekForCausalLM",
                "DeepSeek-V3, R1, Kimi-K2, Moonlight (multi-head latent attention over a latent KV pool, absorbed "
                "decode kernel; sigmoid group-limited routing with e_score_correction_bias, shared experts; "
                "block-FP8 checkpoints as shipped)", fp8=True),
    ModelFamily("DeepseekV2ForCausalLM", "engine.models.deepseek", "DeepseekForCausalLM",
                "DeepSeek-V2, V2-Lite (multi-head latent attention, optional q-lora; softmax greedy or "
                "group-limited routing, shared experts)", fp8=True),
    ModelFamily("Llama4ForCausalLM", "engine.models.llama4", "Llama4ForCausalLM",
                "Llama 4 Scout, Maverick: the text model, also of Llama4ForConditionalGeneration checkpoints "
                "(chunked local attention on rope layers, global NoPE layers with temperature tuning, q/k L2 norm, "
                "MoE layers interleaved with dense ones: top-1 sigmoid routing and a shared expert; FP8 per channel "
                "or per block, Meta's compressed-tensors FP8 checkpoints as shipped; INT4 / INT8 weight-only, "
                "compressed-tensors W4A16 checkpoints as shipped)", fp8=True, weight_only=True),
    # The configurable decoder (engine/models/decoder.py): each family is a set of block options.
    ModelFamily("GPTNeoXForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "GPT-NeoX-20B, Pythia (partial rotary, parallel or sequential residual, LayerNorm, biases)",
                fp8=True, weight_only=True),
    ModelFamily("FalconForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "Falcon-7B (multi-query), Falcon-40B/180B (new decoder architecture, grouped KV); parallel "
                "attention and MLP, with or without biases (tensor parallel needs tp_size to divide the KV heads)",
                fp8=True, weight_only=True),
    ModelFamily("GPTJForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "GPT-J-6B (partial rotary in interleaved pairs, parallel residual, lm_head bias)",
                fp8=True, weight_only=True),
    ModelFamily("OPTForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "OPT-125m to OPT-66B, OPT-350m (learned positions at offset 2, ReLU, pre- or post-norm, "
                "projected embeddings), and the language model of Blip2ForConditionalGeneration", fp8=True, weight_only=True),
    ModelFamily("Starcoder2ForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "StarCoder2-3B/7B/15B (sliding window, LayerNorm, biases, GELU-tanh MLP)", fp8=True, weight_only=True,
                sliding_window=True),
    ModelFamily("Glm4ForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "GLM-4-9B, GLM-4-0414 (partial rotary in GLM's interleaved pairs, post-sublayer norms, q/k/v bias)",
                fp8=True, weight_only=True),
    ModelFamily("BloomForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "BLOOM, BLOOMZ (ALiBi in the paged attention kernels, any head count; embedding LayerNorm)",
                fp8=True, weight_only=True),
    ModelFamily("MptForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "MPT-7B, MPT-30B (ALiBi with alibi_bias_max, clip_qkv, no biases)", fp8=True, weight_only=True),
    ModelFamily("BaichuanForCausalLM", "engine.models.decoder", "DecoderForCausalLM",
                "Baichuan 2 7B (rotary) and 13B (ALiBi); remote code read as data: W_pack, NormHead",
                fp8=True, weight_only=True),
    ModelFamily("QWenLMHeadModel", "engine.models.decoder", "DecoderForCausalLM",
                "Qwen (v1) 1.8B/7B/14B (remote code read as data: c_attn, w1/w2; up to seq_length; qwen.tiktoken "
                "converted to a fast tokenizer at build)", fp8=True, weight_only=True),
    # Hybrid Mamba-2 / attention models (engine/ssm/): a state slot per running sequence beside the KV pool.
    ModelFamily("BambaForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Bamba-9B (Mamba-2 layers with a per-request state, "
                "a few rope attention layers; no prefix caching, beams or speculative decoding)", fp8=True),
    ModelFamily("NemotronHForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Nemotron-H 4B/8B/47B/56B, Nemotron-3 Nano (Mamba-2, attention without positions, relu^2 MLP "
                "and MoE layers; FP8 for the dense ones)", fp8=True),
    ModelFamily("GraniteMoeHybridForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Granite 4.0 hybrids: H-Micro dense, H-Tiny and H-Small with routed experts beside a shared MLP "
                "(Mamba-2 and attention layers, muP multipliers)", fp8=True),
    ModelFamily("Mamba2ForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Mamba-2 130M to 2.7B, Mamba-Codestral (Mamba-2 layers only: a fixed-size state per request, "
                "no KV cache; one rank)", tensor_parallel=False, fp8=True),
    ModelFamily("FalconH1ForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Falcon-H1 0.5B to 34B (Mamba-2 and attention side by side in every layer; muP multipliers folded "
                "into the weights at build)", fp8=True),
    ModelFamily("MambaForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Mamba 130M to 2.8B (Mamba-1 selective scan: a fixed-size state per request, no KV cache)",
                tensor_parallel=False),
    ModelFamily("JambaForCausalLM", "engine.ssm.hybrid", "HybridForCausalLM",
                "Jamba v0.1, Jamba 1.5/1.6 Mini and Large (Mamba-1 layers with dt/B/C norms, attention without "
                "positions, routed-expert MLPs)", tensor_parallel=False),
)
_REGISTRY = {family.architecture: family for family in MODEL_FAMILIES}
# Qwen3-VL's language models (ModelConfig.deepstack_layers > 0, engine.config.DEEPSTACK_ARCHITECTURES):
# the family's layers and weights, with a forward that adds the DeepStack levels.
DEEPSTACK_CLASSES = {"Qwen3ForCausalLM": ("engine.models.qwen3_vl", "Qwen3VLForCausalLM"),
                     "Qwen3MoeForCausalLM": ("engine.models.qwen3_vl", "Qwen3VLMoeForCausalLM")}
SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture has no engine model."""


def get_family(architecture: str) -> ModelFamily:
    """The registry entry of ``architecture`` or raise naming the supported ones."""
    if architecture not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _REGISTRY[architecture]


def get_model_class(architecture: str, deepstack_layers: int = 0):
    """Return the model class for ``architecture`` or raise naming the supported ones. ``deepstack_layers``
    (ModelConfig's, > 0 only for Qwen3-VL's language models): the class whose forward adds them."""
    import importlib

    family = get_family(architecture)
    module, class_name = DEEPSTACK_CLASSES[architecture] if deepstack_layers else (family.module, family.class_name)
    return getattr(importlib.import_module(module), class_name)


def supported_models_markdown() -> str:
    """The README's supported-model table, one row per architecture."""
    def mark(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = ["| architecture | checkpoints | tensor parallel | FP8 weights | INT8 / INT4 weights | "
            "sliding-window attention |", "|---|---|---|---|---|---|"]
    rows += [f"| `{f.architecture}` | {f.checkpoints} | {mark(f.tensor_parallel)} | {mark(f.fp8)} | "
             f"{mark(f.weight_only)} | {mark(f.sliding_window)} |" for f in MODEL_FAMILIES]
    return "\n".join(rows)
