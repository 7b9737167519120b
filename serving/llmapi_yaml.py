"""`model.yaml` of the LLM-API model repository (all_models/llmapi/tensorrt_llm/1/model.yaml) ->
what our engine and the `tensorrt_llm` model need (plain Python; no Triton import).

TensorRT-LLM's LLM-API repository describes its model in a YAML file of `tensorrt_llm.LLM`
arguments plus a `triton_config` section. Here the same keys choose a checkpoint (a Hugging Face
directory, a .gguf file, or an engine directory built by ``python -m engine.build``), the build
options of its cached engine, and the executor settings (the `tensorrt_llm` model's parameter
names). Every key is checked: an unknown key, a bad value or a feature this backend does not have
is a ValueError naming the key and what is allowed, so the model fails to load with that text.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.executor.lookahead_sizes import MAX_LOOKAHEAD_SIZE, MIN_LOOKAHEAD_SIZES  # (no torch)

BACKENDS = ("pytorch", "tensorrt", "trt")  # accepted names; our engine serves all of them the same
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANT_ALGOS = {"FP8": "fp8", "FP8_BLOCK_SCALES": "fp8_block", "W8A16": "int8_wo", "W4A16": "int4_wo",
               "W4A16_AWQ": "int4_awq", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": "int8_sq"}
KV_CACHE_QUANT_ALGOS = {"FP8": "fp8"}
KV_CACHE_KEYS = ("free_gpu_memory_fraction", "enable_block_reuse", "max_tokens", "dtype", "host_cache_size",
                 "onboard_blocks")
CUDA_GRAPH_KEYS = ("batch_sizes", "max_batch_size", "enable_padding")
TRITON_KEYS = ("max_batch_size", "decoupled", "cancellation_check_period_ms", "stats_check_period_ms")
QUANT_KEYS = ("quant_algo", "kv_cache_quant_algo")
TOP_KEYS = ("model", "tokenizer", "backend", "tensor_parallel_size", "pipeline_parallel_size", "dtype",
            "max_batch_size", "max_seq_len", "max_input_len", "max_num_tokens", "max_beam_width",
            "quant_config", "kv_cache_config", "cuda_graph_config", "use_cuda_graph",
            "disable_overlap_scheduler", "enable_chunked_prefill", "logits_post_processors",
            "skip_tokenizer_init", "trust_remote_code", "enable_lora", "lora_config", "triton_config",
            "speculative_config", "moe_expert_parallel_size")
LORA_KEYS = ("max_lora_rank", "max_loras")
SPECULATIVE_KEYS = ("decoding_type", "max_draft_len", "max_matching_ngram_size", "speculative_model_dir",
                    "speculative_model", "medusa_choices", "num_medusa_heads", "max_window_size", "max_ngram_size",
                    "max_verification_set_size", "eagle_choices", "eagle3_one_model", "num_eagle_layers",
                    "num_nextn_predict_layers", "use_dynamic_tree", "dynamic_tree_max_topK", "eagle_fp8_head")
# TensorRT-LLM's decoding_type names (its NGramDecodingConfig / DraftTargetDecodingConfig) -> the
# tensorrt_llm model's decoding_mode values (serving/executor_config.py).
DECODING_TYPES = {"ngram": "ngram", "drafttarget": "draft_target", "draft_target": "draft_target", "medusa": "medusa",
                  "lookahead": "lookahead", "eagle": "eagle", "eagle3": "eagle",  # Eagle3: TensorRT-LLM's newer name
                  "mtp": "mtp"}
# decoding_type Lookahead (TensorRT-LLM's LookaheadDecodingConfig, its defaults) -> the lookahead_* parameters.
LOOKAHEAD_KEYS = {"max_window_size": ("lookahead_window_size", 4), "max_ngram_size": ("lookahead_ngram_size", 3),
                  "max_verification_set_size": ("lookahead_verification_set_size", 4)}


@dataclass
class LlmapiConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_batch_size: int = 64  # the engine's (`tritonllm serve`'s default), not Triton's
    max_seq_len: int | None = None
    max_input_len: int | None = None
    max_num_tokens: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    decoupled: bool = True
    triton_max_batch_size: int = 0
    tensor_parallel_size: int = 1  # with pipeline_parallel_size, the ranks of the leader-mode job (--world_size)
    pipeline_parallel_size: int = 1
    moe_expert_parallel_size: int = 1  # engine.build --moe_ep_size: 1 or tensor_parallel_size (DeepSeek)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
    parameters: dict[str, str] = field(default_factory=dict)  # tensorrt_llm model parameters
    draft_model: str | None = None  # speculative_config's draft: an engine dir or a checkpoint (built like `model`)


def _fail(key: str, message: str) -> ValueError:
    return ValueError(f"model.yaml: {key}: {message}")


def _mapping(value: Any, key: str, allowed: tuple[str, ...]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(key, f"expected a mapping of {', '.join(allowed)}, got {value!r}")
    for name in value:
        if name not in allowed:
            raise _fail(f"{key}.{name}", f"unknown key; allowed: {', '.join(allowed)}")
    return value


def _int(value: Any, key: str, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise _fail(key, f"expected an integer {bound}, got {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, f"expected true or false, got {value!r}")
    return value


def _choice(value: Any, key: str, allowed) -> str:
    if value not in allowed:
        raise _fail(key, f"{value!r} is not supported; allowed: {', '.join(map(str, allowed))}")
    return value


def _fraction(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _fail(key, f"expected a number in (0, 1], got {value!r}")
    return float(value)


def _existing_path(path: str, key: str, base_dir: str | None, why_local: str = "") -> str:
    """`path` taken from `base_dir` when relative; it must exist (ValueError naming `key`)."""
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    if not os.path.exists(path):
        raise _fail(key, f"{path} does not exist{why_local}")
    return path


def parse_llmapi_config(data: Any, base_dir: str | None = None) -> LlmapiConfig:
    """Validate a loaded model.yaml; relative paths are taken from `base_dir` (the model's dir)."""
    if not isinstance(data, dict):
        raise ValueError(f"model.yaml: expected a mapping of {', '.join(TOP_KEYS)}, got {data!r}")
    for key in data:
        if key not in TOP_KEYS:
            raise _fail(key, f"unknown key; allowed: {', '.join(TOP_KEYS)}")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "required: a Hugging Face checkpoint directory, a .gguf file or an engine "
                             "directory on this machine")
    model = _existing_path(model, "model", base_dir, " (this backend reads local checkpoints only: a Hugging "
                                                      "Face directory, a .gguf file or an engine directory; Hub "
                                                      "names are not fetched)")
    config = LlmapiConfig(model=model)
    tokenizer = data.get("tokenizer")
    if tokenizer is not None:
        if not isinstance(tokenizer, str) or not os.path.isdir(tokenizer):
            raise _fail("tokenizer", f"expected a tokenizer directory on this machine, got {tokenizer!r}")
        config.tokenizer = tokenizer
        config.parameters["tokenizer_dir"] = tokenizer
    if "backend" in data:
        _choice(data["backend"], "backend", BACKENDS)
    # N > 1 runs in leader mode: the launcher's --world_size N starts the ranks (check_world_size)
    config.tensor_parallel_size = _int(data.get("tensor_parallel_size", 1), "tensor_parallel_size", 1)
    # Pipeline stages: the engine is built with --pp_size; the job has tp x pp ranks.
    config.pipeline_parallel_size = _int(data.get("pipeline_parallel_size", 1), "pipeline_parallel_size", 1)
    config.moe_expert_parallel_size = _int(data.get("moe_expert_parallel_size", 1), "moe_expert_parallel_size", 1)
    if config.moe_expert_parallel_size not in (1, config.tensor_parallel_size):
        raise _fail("moe_expert_parallel_size", f"must be 1 or tensor_parallel_size ({config.tensor_parallel_size}): "
                                                f"whole experts split across the tensor-parallel ranks (DeepSeek)")
    config.dtype = _choice(data.get("dtype", "auto"), "dtype", DTYPES)
    if "max_batch_size" in data:
        config.max_batch_size = _int(data["max_batch_size"], "max_batch_size", 1)
    for name in ("max_seq_len", "max_input_len", "max_num_tokens"):
        if data.get(name) is not None:
            setattr(config, name, _int(data[name], name, 1))
    if "max_beam_width" in data:
        config.parameters["max_beam_width"] = str(_int(data["max_beam_width"], "max_beam_width", 1))
    quant = _mapping(data.get("quant_config"), "quant_config", QUANT_KEYS)
    if quant.get("quant_algo") is not None:
        config.quantization = QUANT_ALGOS[_choice(quant["quant_algo"], "quant_config.quant_algo", QUANT_ALGOS)]
    if quant.get("kv_cache_quant_algo") is not None:
        config.kv_cache_dtype = KV_CACHE_QUANT_ALGOS[_choice(quant["kv_cache_quant_algo"],
                                                             "quant_config.kv_cache_quant_algo",
                                                             KV_CACHE_QUANT_ALGOS)]
    _kv_cache(data.get("kv_cache_config"), config)
    _cuda_graphs(data, config)
    for name, parameter in (("disable_overlap_scheduler", "disable_overlap_scheduler"),
                            ("enable_chunked_prefill", "enable_chunked_context")):
        if name in data:
            config.parameters[parameter] = str(_bool(data[name], name)).lower()
    if data.get("logits_post_processors"):
        raise _fail("logits_post_processors", "custom logits post-processors are not supported by this backend; "
                                              "leave the key out or empty")
    if data.get("skip_tokenizer_init"):
        raise _fail("skip_tokenizer_init", "true is not supported: this model takes text and needs the "
                                           "tokenizer; allowed: false")
    if "trust_remote_code" in data:
        _bool(data["trust_remote_code"], "trust_remote_code")
    _lora(data, config)
    _speculative(data.get("speculative_config"), config, base_dir)
    _triton(data.get("triton_config"), config)
    return config


def _speculative(value: Any, config: LlmapiConfig, base_dir: str | None) -> None:
    """speculative_config, TensorRT-LLM's names: decoding_type NGram (max_draft_len,
    max_matching_ngram_size) or DraftTarget (max_draft_len, speculative_model_dir: the draft's
    checkpoint or engine directory, same tokenizer) -> the tensorrt_llm model's decoding_mode,
    max_draft_len, max_matching_ngram_size and draft_model_path (docs/features/speculative-decoding.md)."""
    spec = _mapping(value, "speculative_config", SPECULATIVE_KEYS)
    if not spec:
        return
    kind = spec.get("decoding_type")
    mode = DECODING_TYPES.get(kind.lower()) if isinstance(kind, str) else None
    if mode is None:
        raise _fail("speculative_config.decoding_type", f"{kind!r} is not supported; allowed: NGram, DraftTarget, "
                                                        f"Medusa, Lookahead, Eagle, MTP")
    config.parameters["decoding_mode"] = mode
    if spec.get("max_draft_len") is not None:
        config.parameters["max_draft_len"] = str(_int(spec["max_draft_len"], "speculative_config.max_draft_len", 1, 64))
    if spec.get("max_matching_ngram_size") is not None:
        if mode != "ngram":
            raise _fail("speculative_config.max_matching_ngram_size", "only for decoding_type NGram")
        config.parameters["max_matching_ngram_size"] = str(
            _int(spec["max_matching_ngram_size"], "speculative_config.max_matching_ngram_size", 1))
    draft = spec.get("speculative_model_dir", spec.get("speculative_model"))
    if "num_nextn_predict_layers" in spec and mode != "mtp":
        raise _fail("speculative_config.num_nextn_predict_layers", "only for decoding_type MTP")
    if mode == "mtp":
        _mtp(spec, draft, config)
        return
    lookahead = [key for key in LOOKAHEAD_KEYS if key in spec]
    if lookahead and mode != "lookahead":
        raise _fail(f"speculative_config.{lookahead[0]}", "only for decoding_type Lookahead")
    if mode == "lookahead":
        _lookahead(spec, draft, config)
        return
    if mode == "medusa":
        _medusa(spec, draft, config, base_dir)
        return
    if mode == "eagle":
        _eagle(spec, draft, config, base_dir)
        return
    if mode == "ngram":
        if draft is not None:
            raise _fail("speculative_config.speculative_model_dir", "NGram drafts from the request's own tokens: "
                                                                   "leave the draft model out")
        return
    if not isinstance(draft, str) or not draft:
        raise _fail("speculative_config.speculative_model_dir", "required for DraftTarget: the draft model's "
                                                               "checkpoint or engine directory (same tokenizer)")
    draft = _existing_path(draft, "speculative_config.speculative_model_dir", base_dir)
    if config.tensor_parallel_size > 1:
        raise _fail("speculative_config.decoding_type", "DraftTarget runs its draft on one GPU beside the target, "
                                                        "so it needs tensor_parallel_size 1; NGram works with any")
    config.draft_model = draft


def _lookahead(spec: dict, draft: Any, config: LlmapiConfig) -> None:
    """decoding_type Lookahead: max_window_size, max_ngram_size, max_verification_set_size (the
    tensorrt_llm model's lookahead_*; TensorRT-LLM's defaults 4, 3, 4); no draft model; one rank. The
    trees' (N-1)*(W+G) drafts set the verify width, whatever max_draft_len says."""
    if draft is not None:
        raise _fail("speculative_config.speculative_model_dir", "Lookahead drafts from the target's own Jacobi "
                                                               "iterations: leave the draft model out")
    for key, (parameter, default) in LOOKAHEAD_KEYS.items():
        value = spec.get(key, default)
        low = MIN_LOOKAHEAD_SIZES[parameter.removeprefix("lookahead_")]
        config.parameters[parameter] = str(_int(value, f"speculative_config.{key}", low, MAX_LOOKAHEAD_SIZE))
    if config.tensor_parallel_size > 1:
        raise _fail("speculative_config.decoding_type", "Lookahead runs on one rank: it needs tensor_parallel_size 1")


def _mtp(spec: dict, draft: Any, config: LlmapiConfig) -> None:
    """decoding_type MTP (TensorRT-LLM's MTPDecodingConfig): num_nextn_predict_layers drafts a step
    (default 1; more reuse the checkpoint's one MTP module, chained) -> max_draft_len; the drafts
    come from the engine's own MTP module (DeepSeek-V3/R1), so no draft model; one rank."""
    if draft is not None:
        raise _fail("speculative_config.speculative_model_dir", "MTP drafts with the checkpoint's own multi-token "
                                                               "prediction module: leave the draft model out")
    n = spec.get("num_nextn_predict_layers", spec.get("max_draft_len", 1))
    config.parameters["max_draft_len"] = str(_int(n, "speculative_config.num_nextn_predict_layers", 1, 64))
    if config.tensor_parallel_size > 1:
        raise _fail("speculative_config.decoding_type", "MTP runs on one rank: it needs tensor_parallel_size 1")


def _eagle(spec: dict, heads: Any, config: LlmapiConfig, base_dir: str | None) -> None:
    """decoding_type Eagle (TensorRT-LLM's EagleDecodingConfig): speculative_model_dir is the EAGLE-3
    checkpoint (config.json + model.safetensors; default: the engine's eagle3/), eagle_choices the
    tree as rank paths -> eagle_model_path and eagle_choices; use_dynamic_tree, dynamic_tree_max_topK
    and num_eagle_layers (EAGLE-2's dynamic tree: its depth) keep their names; beyond the reference,
    eagle_fp8_head (the head's products in FP8; unset: as the target). One rank."""
    _heads_and_tree(spec, heads, config, base_dir, "eagle", "Eagle", "the EAGLE-3 checkpoint's directory")
    for key in ("use_dynamic_tree", "eagle_fp8_head"):
        if spec.get(key) is not None:
            config.parameters[key] = str(_bool(spec[key], f"speculative_config.{key}")).lower()
    for key in ("dynamic_tree_max_topK", "num_eagle_layers"):
        if spec.get(key) is not None:
            config.parameters[key] = str(_int(spec[key], f"speculative_config.{key}", 1, 64))


def _medusa(spec: dict, heads: Any, config: LlmapiConfig, base_dir: str | None) -> None:
    """decoding_type Medusa (TensorRT-LLM's MedusaDecodingConfig): speculative_model_dir is the heads'
    directory (FasterDecoding's medusa_lm_head format; default: the engine's medusa/), medusa_choices
    the tree as a list of rank paths -> medusa_model_path and medusa_choices ("{0}, {0, 0}")."""
    _heads_and_tree(spec, heads, config, base_dir, "medusa", "Medusa",
                    "the Medusa heads' directory (config.json and medusa_lm_head.safetensors or .pt)")


def _heads_and_tree(spec: dict, heads: Any, config: LlmapiConfig, base_dir: str | None, name: str, kind: str,
                    heads_hint: str) -> None:
    """speculative_model_dir -> <name>_model_path, <name>_choices (rank paths) -> the tensorrt_llm
    spelling ("{0}, {0, 0}"); tree methods run on one rank."""
    if heads is not None:
        if not isinstance(heads, str) or not heads:
            raise _fail("speculative_config.speculative_model_dir", heads_hint)
        config.parameters[f"{name}_model_path"] = _existing_path(heads, "speculative_config.speculative_model_dir",
                                                                 base_dir)
    choices = spec.get(f"{name}_choices")
    if choices is not None:
        if not (isinstance(choices, list) and choices and all(
                isinstance(c, list) and c and all(isinstance(r, int) and r >= 0 for r in c) for c in choices)):
            raise _fail(f"speculative_config.{name}_choices", f"a list of paths of ranks, e.g. [[0], [0, 0], [1]]; "
                                                              f"got {choices!r}")
        config.parameters[f"{name}_choices"] = ", ".join("{" + ", ".join(map(str, c)) + "}" for c in choices)
    if config.tensor_parallel_size > 1:
        raise _fail("speculative_config.decoding_type", f"{kind} runs on one rank: it needs tensor_parallel_size 1")


def _lora(data: dict, config: LlmapiConfig) -> None:
    """enable_lora and lora_config (max_lora_rank, max_loras): requests may then name a PEFT adapter
    with lora_id/lora_name/lora_path (the tensorrt_llm parameters enable_lora,
    lora_cache_max_adapter_size, max_loras)."""
    lora = _mapping(data.get("lora_config"), "lora_config", LORA_KEYS)
    enable = _bool(data["enable_lora"], "enable_lora") if "enable_lora" in data else bool(lora)
    config.parameters["enable_lora"] = str(enable).lower()
    if lora.get("max_lora_rank") is not None:
        rank = _int(lora["max_lora_rank"], "lora_config.max_lora_rank", 1)
        config.parameters["lora_cache_max_adapter_size"] = str(rank)
    if lora.get("max_loras") is not None:
        config.parameters["max_loras"] = str(_int(lora["max_loras"], "lora_config.max_loras", 1))


def _kv_cache(value: Any, config: LlmapiConfig) -> None:
    kv = _mapping(value, "kv_cache_config", KV_CACHE_KEYS)
    if kv.get("free_gpu_memory_fraction") is not None:
        config.parameters["kv_cache_free_gpu_mem_fraction"] = str(
            _fraction(kv["free_gpu_memory_fraction"], "kv_cache_config.free_gpu_memory_fraction"))
    if kv.get("enable_block_reuse") is not None:
        config.parameters["enable_kv_cache_reuse"] = str(
            _bool(kv["enable_block_reuse"], "kv_cache_config.enable_block_reuse")).lower()
    if kv.get("max_tokens") is not None:
        config.parameters["max_tokens_in_paged_kv_cache"] = str(
            _int(kv["max_tokens"], "kv_cache_config.max_tokens", 1))
    if kv.get("host_cache_size") is not None:  # bytes of pinned host memory for evicted reusable blocks
        config.parameters["kv_cache_host_memory_bytes"] = str(
            _int(kv["host_cache_size"], "kv_cache_config.host_cache_size", 0))
    if kv.get("onboard_blocks") is not None:
        config.parameters["kv_cache_onboard_blocks"] = str(
            _bool(kv["onboard_blocks"], "kv_cache_config.onboard_blocks")).lower()
    if kv.get("dtype") is not None:
        dtype = _choice(kv["dtype"], "kv_cache_config.dtype", ("auto", "fp8"))
        if dtype == "fp8":
            config.kv_cache_dtype = "fp8"


def _cuda_graphs(data: dict, config: LlmapiConfig) -> None:
    """cuda_graph_config (a mapping, or null for none) or the older use_cuda_graph flag: checked,
    and passed on as the `tensorrt_llm` model's cuda_graph_mode / cuda_graph_cache_size parameters,
    which our executor accepts and ignores (logged at load): on a GPU it always captures its graphs."""
    if "use_cuda_graph" in data:
        config.parameters["cuda_graph_mode"] = str(_bool(data["use_cuda_graph"], "use_cuda_graph")).lower()
    if "cuda_graph_config" not in data:
        return
    graphs = data["cuda_graph_config"]
    if graphs is None:
        config.parameters["cuda_graph_mode"] = "false"
        return
    graphs = _mapping(graphs, "cuda_graph_config", CUDA_GRAPH_KEYS)
    config.parameters["cuda_graph_mode"] = "true"
    sizes = graphs.get("batch_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not sizes:
            raise _fail("cuda_graph_config.batch_sizes", f"expected a list of integers >= 1, got {sizes!r}")
        sizes = [_int(size, "cuda_graph_config.batch_sizes", 1) for size in sizes]
        config.parameters["cuda_graph_cache_size"] = str(len(sizes))
    if graphs.get("max_batch_size") is not None:
        _int(graphs["max_batch_size"], "cuda_graph_config.max_batch_size", 1)
    if graphs.get("enable_padding") is not None:
        _bool(graphs["enable_padding"], "cuda_graph_config.enable_padding")


def _triton(value: Any, config: LlmapiConfig) -> None:
    triton = _mapping(value, "triton_config", TRITON_KEYS)
    if "max_batch_size" in triton:
        config.triton_max_batch_size = _int(triton["max_batch_size"], "triton_config.max_batch_size", 0)
    if "decoupled" in triton:
        config.decoupled = _bool(triton["decoupled"], "triton_config.decoupled")
    for name in ("cancellation_check_period_ms", "stats_check_period_ms"):
        if name in triton:
            config.parameters[name] = str(_int(triton[name], f"triton_config.{name}", 1))


def load_llmapi_config(path: str) -> LlmapiConfig:
    """Read and validate a model.yaml file (ValueError naming the file or the key)."""
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"model.yaml: {path} not found (the LLM-API model reads its settings from it; "
                         "LLM_CONFIG_PATH names another file in the model's directory)")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as error:
            raise ValueError(f"model.yaml: {path} is not valid YAML: {error}") from None
    return parse_llmapi_config(data, os.path.dirname(os.path.abspath(path)))


def is_engine_dir(path: str) -> bool:
    """An engine directory written by ``python -m engine.build`` (used as it is, nothing built)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "format_version" in data and "build" in data


def build_options(config: LlmapiConfig, has_gpu: bool | Callable[[], bool]) -> dict[str, Any]:
    """Options of serving/engine_cache.py's checkpoint_build_args for this model (dtype auto:
    bfloat16 with a GPU, float32 without), and engine.build flags beyond them. ``has_gpu`` may be a
    function, asked only for dtype auto (the LLM-API stub's asks torch, which it otherwise never imports)."""
    dtype = None if config.dtype == "auto" else config.dtype
    if dtype is None:
        dtype = "bfloat16" if (has_gpu() if callable(has_gpu) else has_gpu) else "float32"
    options = {"dtype": dtype, "max_batch_size": config.max_batch_size,
               "tp": config.tensor_parallel_size, "pp": config.pipeline_parallel_size, "max_seq_len": config.max_seq_len,
               "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype}
    extra = []
    for name in ("max_input_len", "max_num_tokens"):
        if getattr(config, name) is not None:
            extra += [f"--{name}", str(getattr(config, name))]
    if config.moe_expert_parallel_size > 1:
        extra += ["--moe_ep_size", str(config.moe_expert_parallel_size)]
    options["extra"] = extra
    return options


def check_world_size(config: LlmapiConfig, world_size: int) -> None:
    """tensor_parallel_size x pipeline_parallel_size against the ranks this server was started
    with (MPI's world size; 1 without MPI). Checked before anything is built: a mismatch would
    build an engine no rank of this job can load."""
    if config.world_size != world_size:
        pp = config.pipeline_parallel_size
        product = (f"{config.tensor_parallel_size}" if pp == 1 else
                   f"{config.tensor_parallel_size} (x pipeline_parallel_size {pp} = {config.world_size})")
        raise _fail("tensor_parallel_size", f"{product}, but the server runs with world size "
                                            f"{world_size}; start it with scripts/launch_triton_server.py "
                                            f"--world_size {config.world_size} (one rank per GPU), "
                                            f"or set tensor_parallel_size x pipeline_parallel_size to {world_size}")


def engine_dir_for(config: LlmapiConfig, has_gpu: bool | Callable[[], bool], engine_cache) -> str:
    """The engine of model.yaml's `model`: an engine directory as it is, else the checkpoint's
    engine in the engine cache (`engine_cache`: serving/engine_cache.py, or a module with its
    names; built now when missing, once however many processes ask at once). RuntimeError naming
    `model` on failure."""
    import argparse

    if is_engine_dir(config.model):
        return config.model
    options = build_options(config, has_gpu)
    extra = options.pop("extra")
    build_args = engine_cache.checkpoint_build_args(argparse.Namespace(**options)) + extra
    try:
        return str(engine_cache.ensure_checkpoint_engine(config.model, build_args))
    except SystemExit as error:  # the cache's way of failing
        raise RuntimeError(f"model.yaml: model: {error.code}") from None


def check_triton_config(config: LlmapiConfig, decoupled: bool, max_batch_size: int) -> None:
    """model.yaml's triton_config against the configuration Triton loaded. Triton applies
    triton_config through the model's auto_complete_config; a server started with
    --disable-auto-complete-config (scripts/launch_triton_server.py passes it) reads config.pbtxt
    alone, so both must say the same."""
    for key, wanted, loaded, where in (
            ("decoupled", config.decoupled, decoupled, "model_transaction_policy { decoupled }"),
            ("max_batch_size", config.triton_max_batch_size, max_batch_size, "max_batch_size")):
        if wanted != loaded:
            raise _fail(f"triton_config.{key}", f"{json.dumps(wanted)} here, but Triton loaded the model with "
                                                f"{where} {json.dumps(loaded)} from config.pbtxt (auto-complete is "
                                                "off, as scripts/launch_triton_server.py runs tritonserver); "
                                                "set both to the same value")


def executor_parameters(config: LlmapiConfig, engine_dir: str, draft_engine_dir: str | None = None) -> dict[str, str]:
    """The `tensorrt_llm` model's parameters (config.pbtxt names, string values) for this model;
    `draft_engine_dir`: the engine of speculative_config's draft model, when it has one."""
    params = {"gpt_model_path": engine_dir, "batch_scheduler_policy": "guaranteed_no_evict",
              "tokenizer_dir": engine_dir}
    params.update(config.parameters)
    if draft_engine_dir is not None:
        params["draft_model_path"] = draft_engine_dir
    return params
