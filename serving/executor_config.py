"""`tensorrt_llm` model parameters -> executor settings, with the reference's error texts.

The result is a flat dict of setting name -> value with unset entries dropped, so executor
defaults apply; `to_executor_config` then fills whichever of those settings the engine's
`ExecutorConfig` has. Settings it does not have are features this backend accepts and
ignores (LoRA cache, orchestrator, CUDA-graph knobs, ...): model.py logs them once.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from serving.params import get_parameter, parse_int_list

SCHEDULER_POLICIES = {"max_utilization": "max_utilization", "guaranteed_no_evict": "guaranteed_no_evict"}
BATCHING_TYPES = {"inflight_fused_batching": "inflight", "inflight_batching": "inflight", "v1": "static"}
DECODING_MODES = ("auto", "top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter",
                  "explicit_draft_tokens", "lookahead", "eagle", "mtp")
# Beyond the reference: decoding_mode values that turn on speculative decoding with per-step drafts
# (engine/executor/speculative/), named after TensorRT-LLM's NGram and Draft-Target modes ->
# SpeculativeConfig.mode. draft_model is accepted as another name for draft_target.
SPECULATIVE_DECODING_MODES = {"ngram": "ngram", "draft_target": "draft_model", "draft_model": "draft_model",
                              "medusa": "medusa", "lookahead": "lookahead", "eagle": "eagle", "mtp": "mtp",
                              "redrafter": "redrafter", "explicit_draft_tokens": "redrafter"}
# With them: max_draft_len (TensorRT-LLM's name: drafts verified per step; also the most
# draft_input_ids a request may send, with any decoding_mode), max_matching_ngram_size (TensorRT-LLM's
# NGram name: the longest suffix looked up in the sequence) and draft_model_path <- ${draft_engine_dir}
# (the draft engine, named like gpt_model_path <- ${engine_dir}).
SPECULATIVE_SETTINGS = {"max_draft_len": int, "max_matching_ngram_size": int, "draft_engine_dir": str,
                        "medusa_model_path": str, "medusa_choices": list, "lookahead_window_size": int,
                        "lookahead_ngram_size": int, "lookahead_verification_set_size": int,
                        "eagle_model_path": str, "eagle_choices": list, "eagle_dynamic_tree": bool,
                        "eagle_dynamic_depth": int, "eagle_dynamic_top_k": int, "eagle_fp8_head": bool,
                        "redrafter_model_path": str,
                        "redrafter_num_beams": int, "redrafter_draft_len_per_beam": int}
# medusa: the heads in medusa_model_path (default: the engine directory's medusa/), the tree in
# medusa_choices (engine/executor/speculative/medusa.py). lookahead: the reference's three
# lookahead_* parameters, all required (engine/executor/speculative/lookahead.py). eagle: EAGLE-3
# heads in eagle_model_path (default: the engine directory's eagle3/), the tree in eagle_choices, or
# EAGLE-2's dynamic tree with use_dynamic_tree (dynamic_tree_max_topK, num_eagle_layers: TensorRT-LLM's
# EagleDecodingConfig names) (engine/executor/speculative/eagle3.py). mtp: the engine's own
# multi-token prediction module (DeepSeek-V3's) drafting max_draft_len tokens a step, chained
# (engine/executor/speculative/mtp.py). redrafter (also explicit_draft_tokens, TensorRT-LLM's
# DecodingMode name): Apple's recurrent drafter in redrafter_model_path (default: the engine
# directory's redrafter/), redrafter_num_beams x redrafter_draft_len_per_beam (TensorRT-LLM's
# converter names; unset: the checkpoint's, else 5 x 5) (engine/executor/speculative/redrafter.py).
EAGLE_DYNAMIC_PARAMETERS = {"use_dynamic_tree": ("eagle_dynamic_tree", bool),
                            "dynamic_tree_max_topK": ("eagle_dynamic_top_k", int),
                            "num_eagle_layers": ("eagle_dynamic_depth", int)}
LOOKAHEAD_PARAMETERS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")

# parameter name -> (setting name, type)
SIMPLE_SETTINGS = {
    "max_beam_width": ("max_beam_width", int),
    "enable_kv_cache_reuse": ("enable_block_reuse", bool),
    "max_tokens_in_paged_kv_cache": ("kv_cache_max_tokens", int),
    "sink_token_length": ("sink_token_length", int),
    "kv_cache_free_gpu_mem_fraction": ("kv_cache_free_gpu_mem_fraction", float),
    "cross_kv_cache_fraction": ("cross_kv_cache_fraction", float),
    "cross_kv_cache_dtype": ("cross_kv_cache_dtype", str),  # beyond the reference: auto or fp8 (the cross-KV pool)
    "encoder_model_path": ("encoder_engine_dir", str),  # ${encoder_engine_dir}: a T5/BART engine's encoder/
    "kv_cache_host_memory_bytes": ("kv_cache_host_memory_bytes", int),
    "kv_cache_onboard_blocks": ("kv_cache_onboard_blocks", bool),
    "kv_cache_events_endpoint": ("kv_cache_events_endpoint", str),  # beyond the reference (vLLM's kv-events-config)
    "kv_cache_events_topic": ("kv_cache_events_topic", str),
    "enable_chunked_context": ("enable_chunked_context", bool),
    "normalize_log_probs": ("normalize_log_probs", bool),
    "disable_overlap_scheduler": ("disable_overlap_scheduler", bool),
    "stream_interval": ("stream_interval", int),  # beyond the reference (SGLang's and vLLM's name)
    "kv_cache_dtype": ("kv_cache_dtype", str),  # beyond the reference: auto or fp8  # beyond the reference (TRT-LLM LLM API's name)
    "exclude_input_in_output": ("exclude_input_from_output", bool),
    "lora_cache_optimal_adapter_size": ("lora_cache_optimal_adapter_size", int),
    "lora_cache_max_adapter_size": ("lora_cache_max_adapter_size", int),
    "lora_cache_gpu_memory_fraction": ("lora_cache_gpu_memory_fraction", float),
    "lora_cache_host_memory_bytes": ("lora_cache_host_memory_bytes", int),
    "lora_prefetch_dir": ("lora_prefetch_dir", str),
    "enable_lora": ("enable_lora", bool),  # beyond the reference (our engines take adapters at run time)
    "max_loras": ("max_loras", int),  # beyond the reference (vLLM's name): device slots for adapters
    "enable_context_fmha_fp32_acc": ("enable_context_fmha_fp32_acc", bool),
    "multi_block_mode": ("multi_block_mode", bool),
    "cuda_graph_mode": ("cuda_graph_mode", bool),
    "cuda_graph_cache_size": ("cuda_graph_cache_size", int),
    "gpu_weights_percent": ("gpu_weights_percent", float),
    "iter_stats_max_iterations": ("iter_stats_max_iterations", int),
    "request_stats_max_iterations": ("request_stats_max_iterations", int),
}

# Guided decoding (structured output): guided_decoding_backend "xgrammar" turns it on; unset or
# empty leaves it off (a guided request then gets an error saying to set it). tokenizer_dir gives
# the grammar's vocabulary; unlike the reference, which requires it, the engine directory's
# tokenizer files serve when it is unset. grammar_cache_size (beyond the reference): compiled
# grammars kept (LRU).
GUIDED_DECODING_BACKENDS = ("xgrammar",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
NEEDS_TOKENIZER = "Guided decoding requires tokenizer's information. Please provide 'tokenizer_dir'."


def _choice(params, name: str, choices) -> str | None:
    value = get_parameter(params, name, str)
    if value is None:
        return None
    key = value.lower()
    if key not in choices:
        raise ValueError(f"{name} value of '{value}' is not supported.")
    return choices[key] if isinstance(choices, dict) else key


def parse_choices(text: str | None) -> list[list[int]] | None:
    """`"{0, 0, 0}, {0, 1}"` -> [[0, 0, 0], [0, 1]] (medusa/eagle choices)."""
    if text is None:
        return None
    text = text.strip()
    if text.count("{") != text.count("}") or not text.startswith("{") or not text.endswith("}"):
        raise ValueError("Invalid format for medusa_choices")
    try:
        return [[int(x) for x in group.strip(" {},").split(",") if x.strip()]
                for group in text.split("}") if group.strip(" ,")]
    except ValueError as error:
        raise ValueError("Invalid format for medusa_choices") from error


def executor_settings(params: dict[str, str], model_config: dict) -> dict[str, Any]:
    """Every executor-level parameter of the contract, parsed; unset ones are left out."""
    if get_parameter(params, "enable_trt_overlap", bool):
        raise ValueError("enable_trt_overlap=true is not supported.")
    if get_parameter(params, "worker_path", str):
        raise ValueError("worker_path is not supported; use executor_worker_path")
    settings: dict[str, Any] = {}
    for name, (setting, kind) in SIMPLE_SETTINGS.items():
        settings[setting] = get_parameter(params, name, kind)
    settings["batch_scheduler_policy"] = _choice(params, "batch_scheduler_policy", SCHEDULER_POLICIES)
    settings["batching_type"] = _choice(params, "gpt_model_type", BATCHING_TYPES)
    settings.update(decoding_mode_settings(params))
    window = parse_int_list(params.get("max_attention_window_size"))
    settings["max_attention_window"] = window
    settings["device_ids"] = parse_int_list(params.get("gpu_device_ids"))
    settings["medusa_choices"] = parse_choices(get_parameter(params, "medusa_choices", str))
    settings["eagle_choices"] = parse_choices(get_parameter(params, "eagle_choices", str))
    settings.update(guided_decoding_settings(params))
    if settings["enable_lora"] is None and lora_enabled(params):
        settings["enable_lora"] = True
    queue_policy = model_config.get("dynamic_batching", {}).get("default_queue_policy", {})
    max_queue_size = int(queue_policy.get("max_queue_size", 0) or 0)
    settings["max_queue_size"] = max_queue_size if max_queue_size > 0 else None
    if os.environ.get("TRTLLM_ORCHESTRATOR") == "1":
        raise ValueError("Orchestrator mode is not supported by this backend; use leader mode "
                         "(scripts/launch_triton_server.py --world_size N)")
    return {key: value for key, value in settings.items() if value is not None}


def decoding_mode_settings(params: dict[str, str]) -> dict[str, Any]:
    """decoding_mode (the reference's values are accepted and left to the engine's defaults) and
    the speculative-decoding settings; a speculative mode becomes speculative_mode."""
    settings: dict[str, Any] = {
        "max_draft_len": get_parameter(params, "max_draft_len", int),
        "max_matching_ngram_size": get_parameter(params, "max_matching_ngram_size", int),
        "draft_engine_dir": get_parameter(params, "draft_model_path", str),
        "medusa_model_path": get_parameter(params, "medusa_model_path", str),
        "eagle_model_path": get_parameter(params, "eagle_model_path", str),
        "eagle_fp8_head": get_parameter(params, "eagle_fp8_head", bool),
        **{setting: get_parameter(params, name, kind) for name, (setting, kind) in EAGLE_DYNAMIC_PARAMETERS.items()},
        "redrafter_model_path": get_parameter(params, "redrafter_model_path", str),
        "redrafter_num_beams": get_parameter(params, "redrafter_num_beams", int),
        "redrafter_draft_len_per_beam": get_parameter(params, "redrafter_draft_len_per_beam", int),
    }
    mode = _choice(params, "decoding_mode", {**{m: m for m in DECODING_MODES}, **{m: m for m in SPECULATIVE_DECODING_MODES}})
    if mode in SPECULATIVE_DECODING_MODES:
        settings["speculative_mode"] = SPECULATIVE_DECODING_MODES[mode]
        if mode == "lookahead":
            settings.update({name: get_parameter(params, name, int) for name in LOOKAHEAD_PARAMETERS})
            missing = [name for name in LOOKAHEAD_PARAMETERS if settings[name] is None]
            if missing:
                raise ValueError(f"decoding_mode lookahead needs {', '.join(missing)}: set all three of "
                                 f"{', '.join(LOOKAHEAD_PARAMETERS)}")
        if settings["speculative_mode"] == "draft_model" and settings["draft_engine_dir"] is None:
            raise ValueError(f"decoding_mode {mode} needs the draft engine: set draft_model_path (${{draft_engine_dir}})")
    else:
        settings["decoding_mode"] = mode
    return settings


def guided_decoding_settings(params: dict[str, str]) -> dict[str, Any]:
    """guided_decoding_backend, tokenizer_dir and grammar_cache_size; {} while it is off."""
    backend = get_parameter(params, "guided_decoding_backend", str)
    if backend is None:
        return {}  # tokenizer_dir still serves the stream decoder (all_models/tensorrt_llm)
    if backend.lower() not in GUIDED_DECODING_BACKENDS:
        raise ValueError(f"guided_decoding_backend value of '{backend}' is not supported; allowed: "
                         f"{', '.join(GUIDED_DECODING_BACKENDS)} (or leave it unset: no guided decoding)")
    tokenizer_dir = get_parameter(params, "tokenizer_dir", str)
    if tokenizer_dir is None:
        engine_dir = get_parameter(params, "gpt_model_path", str)
        if engine_dir and os.path.isdir(engine_dir) and not any(
                os.path.exists(os.path.join(engine_dir, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"{NEEDS_TOKENIZER} (it is unset and the engine directory {engine_dir} "
                             f"holds none of {', '.join(TOKENIZER_FILES)})")
    return {"guided_decoding_backend": backend.lower(), "tokenizer_dir": tokenizer_dir,
            "grammar_cache_size": get_parameter(params, "grammar_cache_size", int)}


# Filling any of these turns LoRA on unless enable_lora says false: the reference's engines take
# adapters when built for them, ours at run time, and a user who sizes the adapter cache wants one.
LORA_SETTINGS = ("lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes",
                 "lora_prefetch_dir", "max_loras")


def lora_enabled(params: dict[str, str]) -> bool:
    """Whether a `tensorrt_llm` model with these parameters takes LoRA adapters: enable_lora, or
    when it is unset, any of LORA_SETTINGS filled. The launcher and the OpenAI frontend ask this of
    the repository before serving --lora_modules (openai_frontend/repository.py)."""
    enabled = get_parameter(params, "enable_lora", bool)
    if enabled is not None:
        return enabled
    return any(get_parameter(params, name, SIMPLE_SETTINGS[name][1]) is not None for name in LORA_SETTINGS)


# Our setting names -> other spellings an ExecutorConfig may use for the same thing.
ALIASES = {
    "batch_scheduler_policy": ("scheduler_policy", "batch_scheduler_policy"),
    "kv_cache_max_tokens": ("max_tokens_in_paged_kv_cache", "kv_cache_max_tokens", "max_kv_tokens"),
    "kv_cache_free_gpu_mem_fraction": ("free_gpu_memory_fraction", "kv_cache_free_gpu_mem_fraction",
                                       "free_mem_fraction"),
    "enable_block_reuse": ("enable_block_reuse", "enable_kv_cache_reuse"),
    "max_attention_window": ("max_attention_window", "max_attention_window_size"),
    "lora_cache_max_adapter_size": ("max_lora_rank", "lora_cache_max_adapter_size"),
}


def to_executor_config(config_cls, settings: dict[str, Any]):
    """Build `config_cls` (a dataclass) from the settings it has a field for.

    Returns (config, ignored setting names). Nested dataclass fields (e.g. a kv-cache config)
    are filled the same way from the same flat settings.
    """
    kwargs, used = _fill(config_cls, settings)
    if settings.get("speculative_mode") is not None and "speculative" in {f.name for f in dataclasses.fields(config_cls)}:
        kwargs["speculative"] = _speculative_config(config_cls, settings)
        used |= {"speculative_mode"} | (set(SPECULATIVE_SETTINGS) & set(settings))
    return config_cls(**kwargs), sorted(set(settings) - used)


def _speculative_config(config_cls, settings: dict[str, Any]):
    """The engine's SpeculativeConfig (the type of config_cls's optional `speculative` field)."""
    import typing

    hint = typing.get_type_hints(config_cls)["speculative"]
    spec_cls = next(t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t))
    names = {f.name for f in dataclasses.fields(spec_cls)}
    return spec_cls(mode=settings["speculative_mode"],
                    **{k: v for k, v in settings.items() if k in SPECULATIVE_SETTINGS and k in names})


def _fill(config_cls, settings) -> tuple[dict[str, Any], set[str]]:
    import typing

    hints = typing.get_type_hints(config_cls)
    kwargs, used = {}, set()
    for field in dataclasses.fields(config_cls):
        field_type = hints.get(field.name)
        if dataclasses.is_dataclass(field_type):
            nested, nested_used = _fill(field_type, settings)
            if nested:
                kwargs[field.name] = field_type(**nested)
                used |= nested_used
            continue
        for setting, value in settings.items():
            if field.name == setting or field.name in ALIASES.get(setting, ()):
                kwargs[field.name] = value
                used.add(setting)
                break
    return kwargs, used
