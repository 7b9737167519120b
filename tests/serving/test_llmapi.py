"""The LLM-API model's parsing modules without a server: model.yaml (serving/llmapi_yaml.py) and
requests/responses (serving/llmapi_params.py)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from serving.engine_cache import checkpoint_build_args
from serving.llmapi_params import (DEFAULT_MAX_TOKENS, ResponseState, TextStream, parse_request, perf_values,
                                   response_tensors)
from serving.llmapi_yaml import (build_options, check_triton_config, check_world_size, engine_dir_for,
                                 executor_parameters, is_engine_dir, load_llmapi_config, parse_llmapi_config)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


# ----------------------------------------------------------------------------- model.yaml

def test_a_full_model_yaml_becomes_build_options_and_executor_parameters(checkpoint):
    config = parse_llmapi_config({
        "model": checkpoint, "backend": "pytorch", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
        "dtype": "bfloat16", "max_batch_size": 16, "max_seq_len": 4096, "max_num_tokens": 8192,
        "quant_config": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
        "kv_cache_config": {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": False, "max_tokens": 10000},
        "cuda_graph_config": {"batch_sizes": [1, 2, 4]}, "disable_overlap_scheduler": True,
        "enable_chunked_prefill": True, "enable_lora": True, "lora_config": {"max_lora_rank": 16, "max_loras": 2},
        "triton_config": {"max_batch_size": 0, "decoupled": False, "cancellation_check_period_ms": 50}})
    options = build_options(config, has_gpu=True)
    assert options == {"dtype": "bfloat16", "max_batch_size": 16, "tp": 1, "pp": 1, "max_seq_len": 4096,
                       "quantization": "fp8", "kv_cache_dtype": "fp8", "extra": ["--max_num_tokens", "8192"]}
    params = executor_parameters(config, "/engines/x")
    assert params["gpt_model_path"] == "/engines/x" and params["tokenizer_dir"] == "/engines/x"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.5" and params["enable_kv_cache_reuse"] == "false"
    assert params["max_tokens_in_paged_kv_cache"] == "10000" and params["cuda_graph_mode"] == "true"
    assert params["cuda_graph_cache_size"] == "3" and params["disable_overlap_scheduler"] == "true"
    assert params["enable_chunked_context"] == "true" and params["cancellation_check_period_ms"] == "50"
    assert params["enable_lora"] == "true" and params["lora_cache_max_adapter_size"] == "16"
    assert params["max_loras"] == "2"
    assert config.decoupled is False and config.triton_max_batch_size == 0


def test_speculative_config_and_the_host_kv_tier_become_tensorrt_llm_parameters(checkpoint, tmp_path):
    """TensorRT-LLM's LLM-API names: speculative_config NGram / DraftTarget -> decoding_mode and its
    parameters (the draft's engine as draft_model_path); kv_cache_config host_cache_size /
    onboard_blocks -> the KV host tier's parameters."""
    config = parse_llmapi_config({"model": checkpoint, "kv_cache_config": {"host_cache_size": 1 << 30,
                                                                          "onboard_blocks": True},
                                  "speculative_config": {"decoding_type": "NGram", "max_draft_len": 4,
                                                         "max_matching_ngram_size": 2}})
    params = executor_parameters(config, "/engines/x")
    assert params["decoding_mode"] == "ngram" and params["max_draft_len"] == "4"
    assert params["max_matching_ngram_size"] == "2" and "draft_model_path" not in params
    assert params["kv_cache_host_memory_bytes"] == str(1 << 30) and params["kv_cache_onboard_blocks"] == "true"
    assert config.draft_model is None
    (tmp_path / "draft").mkdir()
    config = parse_llmapi_config({"model": checkpoint, "speculative_config": {
        "decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": "draft"}}, str(tmp_path))
    assert config.draft_model == str(tmp_path / "draft")
    params = executor_parameters(config, "/engines/x", draft_engine_dir="/engines/draft")
    assert params["decoding_mode"] == "draft_target" and params["draft_model_path"] == "/engines/draft"
    with pytest.raises(ValueError, match="speculative_config.decoding_type: DraftTarget runs its draft on one GPU"):
        parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2, "speculative_config": {
            "decoding_type": "DraftTarget", "speculative_model_dir": str(tmp_path / "draft")}})


def test_speculative_config_medusa_names_heads_and_tree(checkpoint, tmp_path):
    """decoding_type Medusa (TensorRT-LLM's MedusaDecodingConfig) -> decoding_mode medusa, the heads'
    directory as medusa_model_path and medusa_choices in the tensorrt_llm parameter's spelling."""
    (tmp_path / "heads").mkdir()
    config = parse_llmapi_config({"model": checkpoint, "speculative_config": {
        "decoding_type": "Medusa", "max_draft_len": 8, "speculative_model_dir": "heads",
        "medusa_choices": [[0], [0, 0], [1]], "num_medusa_heads": 2}}, str(tmp_path))
    params = executor_parameters(config, "/engines/x")
    assert params["decoding_mode"] == "medusa" and params["max_draft_len"] == "8"
    assert params["medusa_model_path"] == str(tmp_path / "heads") and params["medusa_choices"] == "{0}, {0, 0}, {1}"
    with pytest.raises(ValueError, match="speculative_config.medusa_choices: a list of paths of ranks"):
        parse_llmapi_config({"model": checkpoint, "speculative_config": {"decoding_type": "Medusa",
                                                                         "medusa_choices": "{0}"}})


def test_speculative_config_lookahead_gives_the_three_sizes(checkpoint):
    """decoding_type Lookahead (TensorRT-LLM's LookaheadDecodingConfig, defaults 4/3/4) -> decoding_mode
    lookahead and the lookahead_* parameters; sizes out of range and a draft model are refused by name."""
    params = executor_parameters(parse_llmapi_config({"model": checkpoint, "speculative_config": {
        "decoding_type": "Lookahead", "max_window_size": 5, "max_ngram_size": 4}}), "/engines/x")
    assert params["decoding_mode"] == "lookahead"
    assert [params[f"lookahead_{k}"] for k in ("window_size", "ngram_size", "verification_set_size")] == ["5", "4", "4"]
    for bad, named in [({"max_ngram_size": 1}, "speculative_config.max_ngram_size: expected an integer 2..64"),
                       ({"speculative_model_dir": "x"}, "speculative_config.speculative_model_dir: Lookahead drafts"),
                       ({"decoding_type": "NGram", "max_window_size": 3}, "speculative_config.max_window_size: only")]:
        with pytest.raises(ValueError, match=named):
            parse_llmapi_config({"model": checkpoint, "speculative_config": {"decoding_type": "Lookahead", **bad}})


def test_speculative_config_eagle_names_heads_and_tree(checkpoint, tmp_path):
    (tmp_path / "eagle3").mkdir()
    config = parse_llmapi_config({"model": checkpoint, "speculative_config": {
        "decoding_type": "Eagle", "speculative_model_dir": "eagle3", "eagle_choices": [[0], [0, 0], [1]]}},
        str(tmp_path))
    params = executor_parameters(config, "/engines/x")
    assert params["decoding_mode"] == "eagle" and params["eagle_model_path"] == str(tmp_path / "eagle3")
    assert params["eagle_choices"] == "{0}, {0, 0}, {1}"
    config = parse_llmapi_config({"model": checkpoint, "speculative_config": {  # EAGLE-2's dynamic tree
        "decoding_type": "Eagle3", "use_dynamic_tree": True, "dynamic_tree_max_topK": 10, "num_eagle_layers": 6,
        "eagle_fp8_head": True}})
    params = executor_parameters(config, "/engines/x")
    assert (params["use_dynamic_tree"], params["dynamic_tree_max_topK"], params["num_eagle_layers"]) == ("true", "10", "6")
    assert params["eagle_fp8_head"] == "true"


def test_speculative_config_mtp_sets_its_drafts(checkpoint):
    """decoding_type MTP (TensorRT-LLM's MTPDecodingConfig): num_nextn_predict_layers drafts a step ->
    decoding_mode mtp, max_draft_len; a draft model or the key under another type is refused by name."""
    params = executor_parameters(parse_llmapi_config({"model": checkpoint, "speculative_config": {
        "decoding_type": "MTP", "num_nextn_predict_layers": 3}}), "/engines/x")
    assert params["decoding_mode"] == "mtp" and params["max_draft_len"] == "3"
    for bad, named in [({"speculative_model_dir": "x"}, "speculative_config.speculative_model_dir: MTP drafts"),
                       ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers: expected an integer 1..64"),
                       ({"decoding_type": "NGram", "num_nextn_predict_layers": 2}, "num_nextn_predict_layers: only")]:
        with pytest.raises(ValueError, match=named):
            parse_llmapi_config({"model": checkpoint, "speculative_config": {"decoding_type": "MTP", **bad}})


def test_moe_expert_parallel_size_builds_whole_experts_per_rank(checkpoint):
    """moe_expert_parallel_size (the LLM API's name) -> engine.build --moe_ep_size; 1 or tp only."""
    config = parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2, "moe_expert_parallel_size": 2})
    assert build_options(config, has_gpu=True)["extra"][-2:] == ["--moe_ep_size", "2"]
    assert "--moe_ep_size" not in build_options(parse_llmapi_config({"model": checkpoint}), has_gpu=True)["extra"]
    with pytest.raises(ValueError, match=r"moe_expert_parallel_size: must be 1 or tensor_parallel_size \(2\)"):
        parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2, "moe_expert_parallel_size": 4})


def test_defaults_and_dtype_auto(checkpoint):
    config = parse_llmapi_config({"model": checkpoint})
    assert config.decoupled is True and config.triton_max_batch_size == 0
    assert build_options(config, has_gpu=False)["dtype"] == "float32"
    assert build_options(config, has_gpu=True)["dtype"] == "bfloat16"
    assert executor_parameters(config, "/e")["enable_lora"] == "false"
    no_graphs = parse_llmapi_config({"model": checkpoint, "cuda_graph_config": None})
    assert no_graphs.parameters["cuda_graph_mode"] == "false"


@pytest.mark.parametrize("change, key, allowed", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", ">= 1"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size", ">= 1"),
    ({"max_num_tokenz": 4}, "max_num_tokenz", "allowed: model"),
    ({"dtype": "int8"}, "dtype", "allowed: auto, float32"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "kv_cache_config.free_gpu_memory_fraction", "(0, 1]"),
    ({"kv_cache_config": {"enable_block_reuse": "yes"}}, "kv_cache_config.enable_block_reuse", "true or false"),
    ({"kv_cache_config": {"secondary_offload_min_priority": 1}}, "kv_cache_config.secondary_offload_min_priority",
     "allowed: free_gpu"),
    ({"kv_cache_config": {"host_cache_size": -1}}, "kv_cache_config.host_cache_size", ">= 0"),
    ({"speculative_config": {"decoding_type": "ReDrafter"}}, "speculative_config.decoding_type",
     "allowed: NGram, DraftTarget"),
    ({"speculative_config": {"decoding_type": "DraftTarget"}}, "speculative_config.speculative_model_dir",
     "required for DraftTarget"),
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 0}}, "speculative_config.max_draft_len",
     "1..64"),
    ({"speculative_config": {"decoding_type": "DraftTarget", "max_matching_ngram_size": 2,
                             "speculative_model_dir": "."}}, "speculative_config.max_matching_ngram_size",
     "only for decoding_type NGram"),
    ({"quant_config": {"quant_algo": "NVFP4"}}, "quant_config.quant_algo", "allowed: FP8"),
    ({"cuda_graph_config": {"batch_sizes": []}}, "cuda_graph_config.batch_sizes", "a list of integers"),
    ({"triton_config": {"decoupled": "true"}}, "triton_config.decoupled", "true or false"),
    ({"triton_config": {"max_batch_size": -1}}, "triton_config.max_batch_size", ">= 0"),
    ({"triton_config": {"instance_count": 2}}, "triton_config.instance_count", "allowed: max_batch_size"),
    ({"logits_post_processors": {"a": "m:f"}}, "logits_post_processors", "not supported"),
    ({"backend": "vllm"}, "backend", "allowed: pytorch"),
    ({"model": "/no/such/checkpoint"}, "model", "does not exist"),
])
def test_bad_values_name_the_key_and_what_is_allowed(checkpoint, change, key, allowed):
    with pytest.raises(ValueError) as error:
        parse_llmapi_config({"model": checkpoint, **change})
    assert f"model.yaml: {key}:" in str(error.value) and allowed in str(error.value)


def test_load_reads_relative_paths_from_the_model_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "model.yaml").write_text("model: ckpt\ntriton_config:\n  decoupled: false\n")
    config = load_llmapi_config(str(tmp_path / "model.yaml"))
    assert config.model == str(tmp_path / "ckpt") and not config.decoupled
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_llmapi_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="not found"):
        load_llmapi_config(str(tmp_path / "missing.yaml"))


def test_triton_config_must_match_what_triton_loaded(checkpoint):
    config = parse_llmapi_config({"model": checkpoint, "triton_config": {"decoupled": False}})
    with pytest.raises(ValueError, match="triton_config.decoupled: false here, but Triton loaded"):
        check_triton_config(config, decoupled=True, max_batch_size=0)
    with pytest.raises(ValueError, match="triton_config.max_batch_size: 0 here"):
        check_triton_config(config, decoupled=False, max_batch_size=8)
    check_triton_config(config, decoupled=False, max_batch_size=0)


def test_tensor_parallel_size_builds_with_tp_and_must_match_the_world_size(checkpoint):
    config = parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2})
    assert build_options(config, has_gpu=True)["tp"] == 2
    check_world_size(config, 2)
    with pytest.raises(ValueError) as error:
        check_world_size(config, 1)
    message = str(error.value)
    assert message.startswith("model.yaml: tensor_parallel_size: 2, but the server runs with world size 1")
    assert "scripts/launch_triton_server.py --world_size 2" in message
    with pytest.raises(ValueError, match="tensor_parallel_size: 1, but the server runs with world size 4"):
        check_world_size(parse_llmapi_config({"model": checkpoint}), 4)
    staged = parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert (build_options(staged, has_gpu=True)["tp"], build_options(staged, has_gpu=True)["pp"]) == (2, 2)
    assert "--pp_size" in checkpoint_build_args(argparse.Namespace(**build_options(staged, has_gpu=True)))
    check_world_size(staged, 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 \(x pipeline_parallel_size 2 = 4\), but the server "
                                         r"runs with world size 2; .*--world_size 4"):
        check_world_size(staged, 2)


def test_the_checkpoint_engine_is_built_with_tp_size(checkpoint):
    """engine_dir_for hands serve_default the build arguments; --tp_size carries N."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "serve_default_for_llmapi_tests", Path(__file__).resolve().parents[2] / "scripts" / "serve_default.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    asked = []
    serve.ensure_checkpoint_engine = lambda model, build_args: asked.append((model, build_args)) or "/cache/x"
    config = parse_llmapi_config({"model": checkpoint, "tensor_parallel_size": 2, "max_num_tokens": 512})
    assert engine_dir_for(config, False, serve) == "/cache/x"
    (model, build_args), = asked
    assert model == checkpoint
    assert build_args[build_args.index("--tp_size") + 1] == "2"
    assert build_args[build_args.index("--dtype") + 1] == "float32"
    assert build_args[-2:] == ["--max_num_tokens", "512"]


def test_engine_directories_are_told_from_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"format_version": 4, "build": {}, "model": {}}))
    assert is_engine_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_engine_dir(str(tmp_path))


# ----------------------------------------------------------------------------- requests

def parse(tensors, decoupled=True):
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    return parse_request({name: np.asarray(value) for name, value in tensors.items()}, decoupled=decoupled,
                         encode=encode, encode_word=encode, end_id=2, pad_id=2, max_input_len=100)


def text(value):
    return np.array([value.encode()], dtype=object)


def test_a_request_becomes_an_executor_spec():
    request = parse({"text_input": text("Hi"), "sampling_param_max_tokens": np.array([5], np.int32),
                     "sampling_param_temperature": np.array([0.5], np.float32),
                     "sampling_param_top_k": np.array([3], np.int32), "sampling_param_seed": np.array([7], np.uint64),
                     "sampling_param_stop": np.array([b"!", b""], dtype=object), "streaming": np.array([True]),
                     "return_cumulative_logprob": np.array([True]),
                     "sampling_param_return_perf_metrics": np.array([True])})
    spec = request.spec
    assert spec.input_token_ids == [72, 105] and spec.max_tokens == 5 and spec.streaming
    assert spec.sampling == {"temperature": 0.5, "top_k": 3, "seed": 7}
    assert spec.stop_words == [[33]] and request.stop_strings == ["!"] and spec.end_id == 2
    assert spec.output["exclude_input_from_output"] and spec.output["return_log_probs"]
    assert request.outputs == {"return_finish_reason": False, "return_stop_reason": False,
                               "return_cumulative_logprob": True, "return_perf_metrics": True}
    assert parse({"text_input": text("Hi")}).spec.max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("tensors, named", [
    ({"image_url": np.array([b"https://x/cat.png"], dtype=object)}, "image_url"),
    ({"sampling_param_best_of": np.array([2], np.int32)}, "sampling_param_best_of"),
    ({"lora_ckpt_source": text("nemo")}, "lora_ckpt_source"),
    ({"lora_path": text("/adapters/a")}, "lora_path"),
    ({"sampling_param_max_tokens": np.array([0], np.int32)}, "sampling_param_max_tokens"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input"),
    ({"text_input": text("")}, "text_input"),
    ({"text_input": text("x" * 101)}, "max_input_len"),
])
def test_refusals_name_the_input(tensors, named):
    with pytest.raises(ValueError, match=named):
        parse({"text_input": text("Hi"), **tensors})


def test_streaming_needs_decoupled_and_lora_inputs_name_an_adapter():
    with pytest.raises(ValueError, match="decoupled"):
        parse({"text_input": text("Hi"), "streaming": np.array([True])}, decoupled=False)
    assert parse({"text_input": text("Hi"), "image_url": np.array([b""], dtype=object)}).spec.lora is None
    lora = parse({"text_input": text("Hi"), "lora_id": np.array([3], np.uint64), "lora_name": text("sql"),
                  "lora_path": text("/adapters/sql"), "lora_ckpt_source": text("hf")}).spec.lora
    assert lora == {"task_id": 3, "weights": None, "config": None, "path": "/adapters/sql", "name": "sql"}


# ----------------------------------------------------------------------------- responses

def decode(ids):
    return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_before_it():
    stream = TextStream(decode, ["END"])
    pieces = [stream.push([ord(c) for c in chunk], final=False) for chunk in ("ab", "cE", "N", "Dxy")]
    assert pieces == ["ab", "c", "", ""] and stream.stop_reason == "END" and stream.text == "abc"
    assert stream.push([ord("z")], final=True) == ""
    unstopped = TextStream(decode, ["END"])
    assert unstopped.push([ord("E")], final=False) == "" and unstopped.push([ord("x")], final=True) == "Ex"


def test_text_stream_chunks_add_up_to_the_whole_text():
    whole = TextStream(decode).push([ord(c) for c in "hello world"], final=True)
    stream = TextStream(decode)
    pieces = [stream.push([ord(c) for c in chunk], final=last) for chunk, last in (("hel", False), ("lo w", False),
                                                                                    ("orld", True))]
    assert "".join(pieces) == whole == "hello world"


def state_for(tensors, streaming=False):
    request = parse({"text_input": text("Hi"), "streaming": np.array([streaming]), **tensors})
    return ResponseState(request, TextStream(decode, request.stop_strings), tokens_per_block=16)


def result_tensors(ids, **perf):
    out = {"output_ids": np.array([[ids]], dtype=np.int32), "sequence_length": np.array([[len(ids)]], np.int32)}
    out.update({name: np.array([[value]]) for name, value in perf.items()})
    return out


def test_response_tensors_carry_the_requested_outputs():
    state = state_for({"return_finish_reason": np.array([True]), "return_stop_reason": np.array([True]),
                       "return_cumulative_logprob": np.array([True]),
                       "sampling_param_return_perf_metrics": np.array([True]),
                       "sampling_param_exclude_input_from_output": np.array([False])})

    class Result:
        finish_reasons = ["length"]
        cum_log_probs = [-1.5]

    state.on_result(Result())
    out = response_tensors(state, result_tensors([ord("o"), ord("k")], kv_cache_reused_blocks=0,
                                                 kv_cache_alloc_total_blocks=1, arrival_time_ns=10), final=True)
    assert out["text_output"].tolist() == [b"Hiok"]  # the prompt echoed: exclude_input_from_output false
    assert out["finish_reason"].tolist() == [b"length"] and out["stop_reason"].tolist() == [b"None"]
    assert out["cumulative_logprob"].dtype == np.float32 and out["cumulative_logprob"][0] == -1.5
    assert out["kv_cache_missed_block"].tolist() == [1] and out["kv_cache_hit_rate"].tolist() == [0.0]
    assert out["arrival_time_ns"].dtype == np.int64 and out["arrival_time_ns"].tolist() == [10]
    batched = response_tensors(state_for({}), result_tensors([ord("a")]), final=True, batched=True)
    assert batched["text_output"].shape == (1, 1)


def test_a_stream_sends_nothing_for_held_back_or_post_stop_chunks():
    state = state_for({"sampling_param_stop": np.array([b"b"], dtype=object),
                       "return_finish_reason": np.array([True])}, streaming=True)
    assert response_tensors(state, result_tensors([ord("a"), ord("b")]), final=False)["text_output"].tolist() == [b"a"]
    assert state.text.stopped
    assert response_tensors(state, result_tensors([ord("c")]), final=False) is None
    final = response_tensors(state, result_tensors([]), final=True)
    assert final["text_output"].tolist() == [b""] and final["finish_reason"].tolist() == [b"stop"]


def test_perf_values_derive_missed_blocks_and_hit_rate():
    values = perf_values({"kv_cache_reused_blocks": np.array([[2]])}, prompt_tokens=40, tokens_per_block=16)
    assert values["kv_cache_reused_block"][0] == 2 and values["kv_cache_missed_block"][0] == 1
    assert values["kv_cache_hit_rate"][0] == pytest.approx(2 / 3) and values["acceptance_rate"][0] == 0.0
