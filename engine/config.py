"""Engine configuration: the model's shape, the build limits, and the engine-directory header.

Every config is a plain dataclass validated once, in ``validate()``, with errors that name the
field, the value and what is allowed. ``to_dict``/``from_dict`` round-trip through JSON, so
``config.json`` of an engine directory is exactly ``EngineConfig.to_dict()``.

Stdlib only: the executor and the Triton glue read configs without importing torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FORMAT_VERSION = 2  # 2: build.quantization (fp8 weights); engines of version 1 still load
READABLE_FORMAT_VERSIONS = (1, 2)
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("fp8",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

# Gemma 2 / Gemma 3 text (engine/models/gemma.py): GeGLU MLP, sandwich norms, soft-capping.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES += GEMMA_ARCHITECTURES
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names, per layer


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
                       "final_logit_softcapping", "rope_local_theta")


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, independent of how it is sharded or cast.

    ``architecture`` is the Hugging Face class name. ``rope_scaling`` keeps HF's layout
    (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``). ``head_dim`` may differ from
    ``hidden_size // num_heads`` (some Qwen/Mistral variants).

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

    def validate(self) -> "ModelConfig":
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES,
            f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
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
        elif self.architecture != "GPT2LMHeadModel":  # the Llama block is SwiGLU, nothing else
            _require(
                self.hidden_act == "silu",
                f"{self.architecture} needs hidden_act 'silu' (gated SiLU MLP), got {self.hidden_act!r}",
            )
        self._validate_window_and_caps()
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            _require(
                rope_type in SUPPORTED_ROPE_TYPES,
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            )
        return self

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
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return _from_known_fields(cls, data).validate()


@dataclass
class BuildConfig:
    """Limits fixed at build time, and the parallel mapping the weights were sharded for."""

    dtype: str = "float16"
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    tokens_per_block: int = 64
    tp_size: int = 1
    pp_size: int = 1
    # None: weights in ``dtype``. "fp8": every linear layer of the decoder blocks holds FP8 E4M3
    # weights with per-output-channel scales; activations are quantized per token at run time
    # (kernels/fp8.py). Embeddings, norms and the lm_head stay in ``dtype``.
    quantization: str | None = None
    # None: the KV pool in ``dtype``. "fp8": K and V stored as FP8 E4M3 (scale 1, saturating at
    # +-448), half the bytes per block; the executor's kv_cache_dtype may override it.
    kv_cache_dtype: str | None = None

    def validate(self) -> "BuildConfig":
        _require(
            self.dtype in SUPPORTED_DTYPES,
            f"unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}",
        )
        _positive_ints(
            self,
            ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tokens_per_block",
             "tp_size", "pp_size"),
        )
        _require(
            self.max_input_len <= self.max_seq_len,
            f"max_input_len ({self.max_input_len}) must be <= max_seq_len ({self.max_seq_len})",
        )
        _require(self.pp_size == 1, f"pp_size must be 1 (pipeline parallelism is not supported), got {self.pp_size}")
        _require(self.kv_cache_dtype is None or self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: auto, {', '.join(KV_CACHE_DTYPES)}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS,
                 f"unsupported quantization {self.quantization!r}; supported: none, {', '.join(QUANTIZATIONS)}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildConfig":
        return _from_known_fields(cls, data).validate()


def check_tp_divides(model: ModelConfig, tp_size: int) -> None:
    """Raise ConfigError unless every tensor-parallel split of ``model`` is even for ``tp_size``."""
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
        self.build.validate()
        check_tp_divides(self.model, self.build.tp_size)
        if self.model.architecture == "GPT2LMHeadModel":  # learned positions: no extrapolation
            _require(
                self.build.max_seq_len <= self.model.max_position_embeddings,
                f"max_seq_len ({self.build.max_seq_len}) exceeds GPT-2's learned positions "
                f"({self.model.max_position_embeddings})",
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "build": self.build.to_dict(),
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
