"""EncDecSpec: the shape and block options of an encoder-decoder transformer (T5, BART), from its HF config.

The families differ only in options of one block pair (engine/encoder_decoder/model.py):

| option            | T5 v1.0 / v1.1 / Flan-T5            | BART (mBART)                              |
|-------------------|-------------------------------------|-------------------------------------------|
| norm              | RMS, no bias ("rms")                | LayerNorm with bias                       |
| norm placement    | before each sub-block (pre)         | after the residual add (post); mBART: pre |
| positions         | relative bias, shared by the layers | learned table, looked up at p + 2         |
| score scale       | none (1.0)                          | head_dim ** -0.5                          |
| biases            | none                                | on every projection                       |
| MLP               | ReLU (v1.0), gated GELU-tanh (v1.1) | GELU fc1 -> fc2                           |
| logits            | tied heads scaled by d_model ** -0.5 | final_logits_bias added                  |

Whisper is BART's block with pre-norms, final norms, no key bias and no embedding norm; its
encoder takes log-mel features (T frames of num_mel_bins) through two convolutions (the second
of stride 2: ceil(T / 2) outputs) plus a fixed position table, its decoder learned positions at p.

It is stored as ``extra["encoder_decoder"]`` in both engine directories' config.json.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from engine.config import ConfigError, ModelConfig

FAMILIES = {"T5ForConditionalGeneration": "t5", "BartForConditionalGeneration": "bart",
            "MBartForConditionalGeneration": "bart", "WhisperForConditionalGeneration": "whisper"}
ACTIVATIONS = ("relu", "gelu", "gelu_new")


@dataclass
class EncDecSpec:
    architecture: str
    family: str  # "t5" | "bart"
    vocab_size: int
    d_model: int
    head_dim: int  # the decoder's (its self- and cross-attention)
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn: int
    decoder_ffn: int
    norm: str = "layernorm"  # "rms" (T5: x * rsqrt(mean(x^2) + eps) * w) | "layernorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    embedding_norm: bool = False  # BART's layernorm_embedding after embeddings + positions
    final_norm: bool = True  # a norm after the last layer of each stack
    positions: str = "relative"  # "relative" (T5) | "learned" (BART)
    position_offset: int = 0  # learned: position p reads row p + offset
    max_positions: int = 512  # learned: rows usable (table rows - offset); relative: the build's limit
    relative_buckets: int = 32
    relative_max_distance: int = 128
    scale_scores: bool = False  # scores * head_dim ** -0.5 (T5 folds it into its weights: none)
    bias: bool = False  # biases on the q/k/v/o projections and the MLP
    gated_mlp: bool = False  # act(gate(x)) * up(x); else act(up(x))
    activation: str = "relu"
    embed_scale: float = 1.0  # token embeddings times this (BART scale_embedding: sqrt(d_model))
    logits_scale: float = 1.0  # hidden times this before lm_head (T5 with tied embeddings: d_model ** -0.5)
    final_logits_bias: bool = False
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0
    encoder_head_dim: int = 0  # 0: head_dim
    key_bias: bool = True  # with bias: k has one too (Whisper's has none)
    num_mel_bins: int = 0  # > 0: the encoder takes features (Whisper's conv front-end), not tokens
    encoder_max_positions: int = 0  # the encoder's position table rows (0: max_positions)
    # Whisper's generation config: <|notimestamps|> (-1: unknown, no timestamp rules) and how many
    # steps the first timestamp may be (max_initial_timestamp_index; -1: any)
    no_timestamps_token_id: int = -1
    max_initial_timestamp_index: int = -1
    # ... and the ids it never lets Whisper produce, and those it forbids as the first token
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    # ... and its alignment heads ((decoder layer, head) pairs: token timestamps, whisper_alignment.py;
    # empty: openai-whisper's default, every head of the last half of the layers)
    alignment_heads: tuple[tuple[int, int], ...] = ()

    def validate(self) -> "EncDecSpec":
        self.encoder_head_dim = self.encoder_head_dim or self.head_dim
        self.encoder_max_positions = self.encoder_max_positions or self.max_positions
        if self.family not in ("t5", "bart", "whisper"):
            raise ConfigError(f"encoder-decoder family {self.family!r} is not supported; supported: t5, bart, whisper")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"{self.architecture}: activation {self.activation!r} is not supported; "
                              f"supported: {', '.join(ACTIVATIONS)}")
        if self.norm not in ("rms", "layernorm") or self.positions not in ("relative", "learned"):
            raise ConfigError(f"{self.architecture}: norm {self.norm!r} / positions {self.positions!r} unsupported")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EncDecSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"EncDecSpec: unknown keys {unknown}; allowed keys are {sorted(known)}")
        return cls(**data).validate()

    def decoder_model_config(self) -> ModelConfig:
        """The decoder stack as the executor's ModelConfig: its paged self-attention KV shape
        (decoder_layers x heads x head_dim), its vocabulary and its positions."""
        return ModelConfig(
            architecture=self.architecture, vocab_size=self.vocab_size, hidden_size=self.d_model,
            num_layers=self.decoder_layers, num_heads=self.decoder_heads, num_kv_heads=self.decoder_heads,
            head_dim=self.head_dim, intermediate_size=self.decoder_ffn, norm_eps=self.norm_eps,
            max_position_embeddings=self.max_positions, tie_word_embeddings=self.logits_scale != 1.0,
            hidden_act=self.activation).validate()


def is_encoder_decoder_config(hf_config) -> bool:
    return (getattr(hf_config, "architectures", None) or [""])[0] in FAMILIES


def spec_from_hf(hf_config) -> EncDecSpec:
    """The spec of a T5 or BART checkpoint's config (transformers' T5Config / BartConfig fields)."""
    architecture = hf_config.architectures[0]
    family = FAMILIES[architecture]
    common = {"architecture": architecture, "family": family, "vocab_size": hf_config.vocab_size,
              "decoder_start_token_id": _int(hf_config.decoder_start_token_id, 0),
              "eos_token_id": _int(hf_config.eos_token_id, 1), "pad_token_id": _int(hf_config.pad_token_id, 0)}
    if family == "t5":
        act = hf_config.dense_act_fn
        activation = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu", "gelu": "gelu"}.get(act)
        if activation is None:
            raise ConfigError(f"T5 feed_forward_proj {hf_config.feed_forward_proj!r}: activation {act!r} is not "
                              "supported; supported: relu, gated-gelu (gelu_new)")
        # T5 v1.0 scales the decoder output by d_model ** -0.5 before its (tied) head, v1.1 / Flan-T5 do
        # not; transformers 5 records it as scale_decoder_outputs, older configs as tie_word_embeddings.
        scaled = getattr(hf_config, "scale_decoder_outputs", None)
        if scaled is None:
            scaled = getattr(hf_config, "tie_word_embeddings", True)
        return EncDecSpec(
            **common, d_model=hf_config.d_model, head_dim=hf_config.d_kv,
            encoder_layers=hf_config.num_layers, decoder_layers=hf_config.num_decoder_layers,
            encoder_heads=hf_config.num_heads, decoder_heads=hf_config.num_heads,
            encoder_ffn=hf_config.d_ff, decoder_ffn=hf_config.d_ff, norm="rms",
            norm_eps=hf_config.layer_norm_epsilon, pre_norm=True, final_norm=True, positions="relative",
            max_positions=int(getattr(hf_config, "n_positions", None) or 512),
            relative_buckets=hf_config.relative_attention_num_buckets,
            relative_max_distance=hf_config.relative_attention_max_distance, scale_scores=False, bias=False,
            gated_mlp=bool(hf_config.is_gated_act), activation=activation,
            logits_scale=hf_config.d_model ** -0.5 if scaled else 1.0).validate()
    if family == "whisper":
        return _whisper_spec(hf_config, common)
    mbart = architecture.startswith("MBart")
    d_model, heads = hf_config.d_model, hf_config.decoder_attention_heads
    return EncDecSpec(
        **common, d_model=d_model, head_dim=d_model // heads,
        encoder_layers=hf_config.encoder_layers, decoder_layers=hf_config.decoder_layers,
        encoder_heads=hf_config.encoder_attention_heads, decoder_heads=heads,
        encoder_head_dim=d_model // hf_config.encoder_attention_heads,
        encoder_ffn=hf_config.encoder_ffn_dim, decoder_ffn=hf_config.decoder_ffn_dim, norm="layernorm",
        norm_eps=1e-5, pre_norm=mbart, embedding_norm=True, final_norm=mbart, positions="learned",
        position_offset=2, max_positions=hf_config.max_position_embeddings, scale_scores=True, bias=True,
        gated_mlp=False, activation=_bart_activation(hf_config.activation_function),
        embed_scale=math.sqrt(d_model) if hf_config.scale_embedding else 1.0, final_logits_bias=True).validate()


def _whisper_spec(hf_config, common: dict) -> EncDecSpec:
    d_model = hf_config.d_model
    return EncDecSpec(
        **common, d_model=d_model, head_dim=d_model // hf_config.decoder_attention_heads,
        encoder_layers=hf_config.encoder_layers, decoder_layers=hf_config.decoder_layers,
        encoder_heads=hf_config.encoder_attention_heads, decoder_heads=hf_config.decoder_attention_heads,
        encoder_head_dim=d_model // hf_config.encoder_attention_heads,
        encoder_ffn=hf_config.encoder_ffn_dim, decoder_ffn=hf_config.decoder_ffn_dim, norm="layernorm",
        norm_eps=1e-5, pre_norm=True, embedding_norm=False, final_norm=True, positions="learned",
        position_offset=0, max_positions=hf_config.max_target_positions, scale_scores=True, bias=True,
        key_bias=False, gated_mlp=False, activation=_bart_activation(hf_config.activation_function),
        embed_scale=math.sqrt(d_model) if hf_config.scale_embedding else 1.0, num_mel_bins=hf_config.num_mel_bins,
        encoder_max_positions=hf_config.max_source_positions).validate()


def _bart_activation(name: str) -> str:
    activation = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_new"}.get(name)
    if activation is None:
        raise ConfigError(f"BART activation_function {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return activation


def _int(value, default: int) -> int:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return default if value is None else int(value)
