import dataclasses

import numpy as np
import pytest

from engine.executor.executor import ExecutorConfig
from serving.bls import StreamText, first_stop, validate
from serving.executor_config import executor_settings, parse_choices, to_executor_config


def params(**values):
    return {k: v for k, v in values.items()}


FULL = params(max_beam_width="2", batch_scheduler_policy="MAX_UTILIZATION", enable_kv_cache_reuse="false",
              max_tokens_in_paged_kv_cache="2560", kv_cache_free_gpu_mem_fraction="0.5",
              enable_chunked_context="true", normalize_log_probs="false", exclude_input_in_output="True",
              gpt_model_type="inflight_fused_batching", gpu_device_ids="0,1",
              max_attention_window_size="2560", lora_cache_max_adapter_size="64",
              multi_block_mode="true", iter_stats_max_iterations="50", decoding_mode="top_k_top_p",
              disable_overlap_scheduler="true", stream_interval="3", cross_kv_cache_dtype="fp8")
MODEL_CONFIG = {"dynamic_batching": {"default_queue_policy": {"max_queue_size": 7}}}


def test_every_parameter_maps_to_the_executor_config():
    settings = executor_settings(FULL, MODEL_CONFIG)
    config, ignored = to_executor_config(ExecutorConfig, settings)
    config.validate()
    assert config.max_beam_width == 2 and config.batch_scheduler_policy == "max_utilization"
    assert config.enable_kv_cache_reuse is False and config.max_tokens_in_paged_kv_cache == 2560
    assert config.kv_cache_free_gpu_mem_fraction == 0.5 and config.enable_chunked_context is True
    assert config.normalize_log_probs is False and config.exclude_input_from_output is True
    assert config.max_queue_size == 7 and config.iter_stats_max_iterations == 50
    assert config.disable_overlap_scheduler is True and config.stream_interval == 3
    assert config.cross_kv_cache_dtype == "fp8"
    # accepted, but the executor has no such knob
    assert not set(ignored) & {field.name for field in dataclasses.fields(ExecutorConfig)}
    assert {"device_ids", "max_attention_window", "multi_block_mode", "decoding_mode"} <= set(ignored)
    # the LoRA cache's size is ours to honour: filling it turns LoRA on (serving/executor_config.py)
    assert config.max_lora_rank == 64 and config.enable_lora is True


def test_unfilled_template_gives_executor_defaults():
    unfilled = {name: "${" + name + "}" for name in FULL}
    settings = executor_settings(unfilled, {"dynamic_batching": {"default_queue_policy": {"max_queue_size": 0}}})
    assert settings == {}
    config, ignored = to_executor_config(ExecutorConfig, settings)
    assert config == ExecutorConfig() and ignored == []


@pytest.mark.parametrize("name,value,message", [
    ("batch_scheduler_policy", "other", "batch_scheduler_policy value of 'other' is not supported."),
    ("gpt_model_type", "other", "gpt_model_type value of 'other' is not supported."),
    ("decoding_mode", "other", "decoding_mode value of 'other' is not supported."),
    ("enable_trt_overlap", "true", "enable_trt_overlap=true is not supported."),
    ("medusa_choices", "{0, 1", "Invalid format for medusa_choices"),
])
def test_invalid_parameters_fail_the_model_load(name, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        executor_settings({name: value}, {})


def test_batching_types_and_choices():
    for value, expected in [("inflight_batching", "inflight"), ("V1", "static")]:
        assert executor_settings({"gpt_model_type": value}, {})["batching_type"] == expected
    assert parse_choices("{0, 0, 0}, {0, 1}") == [[0, 0, 0], [0, 1]]
    with pytest.raises(ValueError, match="Invalid format for medusa_choices"):
        parse_choices("{0, a}")


def test_bls_validation_texts():
    with pytest.raises(ValueError, match="text_input is required"):
        validate({"max_tokens": np.array([4])})
    with pytest.raises(ValueError, match="max_tokens must be a single value > 0"):
        validate({"text_input": np.array([[b"hi"]], object)})
    with pytest.raises(ValueError, match="max_tokens must be a single value > 0"):
        validate({"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[0]])})
    validate({"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[4]])})


def test_string_stop_words_in_streams_and_whole_texts():
    assert first_stop("Paris. Rome.", [".", "Rome"]) == 6
    assert first_stop("Q: a. A: b.", ["."], start=5) == 11
    stream = StreamText(stop_words=["Par"])
    assert stream.update("The capital is P", False) == "The capital is P"
    assert stream.update("The capital is Paris", False) == "ar"  # cut inside a chunk
    assert stream.stopped and stream.update("The capital is Paris.", True) == ""
    # A growing stream searches only the tail a chunk can complete, and still finds a stop word
    # split over chunks, or one that ends in a character still unfinished in the previous chunk.
    growing = StreamText(stop_words=["STOP", "x"], grows=True)
    text = "a" * 1000 + "ST"
    assert growing.update(text, False) == text and growing.search_start == len(text) - 3
    assert growing.update(text + "OP and more", False) == "OP" and growing.stopped
    unfinished = StreamText(stop_words=["é!"], grows=True)
    assert unfinished.update("caf\ufffd", False) == "caf" and unfinished.search_start == 2
    assert unfinished.update("café!", False) == "é!" and unfinished.stopped
    accumulating = StreamText(accumulate=True)
    assert accumulating.update("Hello \ufffd", False) == "Hello "
    assert accumulating.update("Hello world", False) == "Hello world"
    assert accumulating.update("Hello there", True) == "Hello there"  # a rewritten beam
