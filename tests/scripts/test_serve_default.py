import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve_default.py"
spec = importlib.util.spec_from_file_location("serve_default", SCRIPT)
serve = importlib.util.module_from_spec(spec)
sys.modules["serve_default"] = serve
spec.loader.exec_module(serve)


def test_repo_is_filled_completely_outside_the_source_tree(tmp_path):
    engine = tmp_path / "odd, name: dir"  # commas and colons survive fill_template's escaping
    repo = Path(serve.prepare_model_repo(str(engine), str(tmp_path / "repo"), max_batch_size=4))
    for model in serve.MODELS:
        text = (repo / model / "config.pbtxt").read_text()
        assert "max_batch_size: 4" in text
        required = {"triton_max_batch_size", "logits_datatype", "decoupled_mode", "triton_backend",
                    "engine_dir", "tokenizer_dir", "preprocessing_instance_count",
                    "postprocessing_instance_count", "bls_instance_count", "max_queue_size",
                    "max_queue_delay_microseconds", "encoder_input_features_data_type"}
        assert not required & set(re.findall(r"\$\{(\w+)\}", text)), model
    trt = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{engine}"' in trt and 'backend: "python"' in trt
    assert "decoupled: true" in trt
    # Refilling replaces the old repository.
    serve.prepare_model_repo(str(engine), str(repo), decoupled=False)
    assert "decoupled: false" in (repo / "tensorrt_llm" / "config.pbtxt").read_text()


def test_ready_line_has_a_working_curl_example():
    message = serve.ready_message("8000", "8001", "8002")
    assert message.startswith("READY:") and "curl -s -X POST http://127.0.0.1:8000/v2/models/ensemble/generate" in message


def test_ready_line_has_an_openai_curl_example():
    message = serve.ready_message("8000", "8001", "8002", "9000", "smollm2")
    assert "OpenAI API on http://127.0.0.1:9000/v1 (model smollm2)" in message.splitlines()[0]
    assert "curl -s http://127.0.0.1:9000/v1/chat/completions" in message and '"model": "smollm2"' in message


def test_an_engine_with_pipeline_stages_gets_lora_off(tmp_path):
    """Its stages take no adapters yet and refuse enable_lora by name; the default repository has it on."""
    def enable_lora(pp_size: int) -> str:
        engine = tmp_path / f"pp{pp_size}"
        engine.mkdir()
        (engine / "config.json").write_text(f'{{"build": {{"tp_size": 1, "pp_size": {pp_size}}}}}')
        repo = Path(serve.prepare_model_repo(str(engine), str(tmp_path / f"repo{pp_size}")))
        text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
        return re.search(r'key: "enable_lora"\s*value: \{\s*string_value: "(\w+)"', text).group(1)

    assert (enable_lora(1), enable_lora(2)) == ("true", "false")


def test_lookahead_config_flag_fills_decoding_mode_lookahead(tmp_path):
    """--lookahead_config W,N,G -> the tensorrt_llm parameters the model parses into decoding_mode lookahead."""
    from serving.executor_config import executor_settings

    params = serve.lookahead_parameters("4,3,2")
    repo = Path(serve.prepare_model_repo(str(tmp_path / "engine"), str(tmp_path / "repo"),
                                         overrides={"tensorrt_llm": params}))
    text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    filled = dict(re.findall(r'key: "(\w+)"\s*value: \{\s*string_value: "([^"]*)"', text))
    settings = executor_settings(filled, {})
    assert settings["speculative_mode"] == "lookahead"
    assert [settings[f"lookahead_{k}"] for k in ("window_size", "ngram_size", "verification_set_size")] == [4, 3, 2]
    assert serve.lookahead_parameters(None) == {}
    try:
        serve.lookahead_parameters("4,3")
    except SystemExit as exit_:
        assert "--lookahead_config: expected three integers W,N,G" in str(exit_)
    else:
        raise AssertionError("a two-number --lookahead_config was accepted")


def test_kv_events_endpoint_flag_fills_the_tensorrt_llm_parameter(tmp_path):
    """--kv-events-endpoint tcp://*:5557 -> kv_cache_events_endpoint, intact through fill_template."""
    import argparse

    from serving.executor_config import executor_settings

    args = argparse.Namespace(lookahead_config=None, mtp=None, kv_events_endpoint="tcp://*:5557")
    repo = Path(serve.prepare_model_repo(str(tmp_path / "engine"), str(tmp_path / "repo"),
                                         overrides={"tensorrt_llm": serve.engine_parameters(args)}))
    text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    filled = dict(re.findall(r'key: "(\w+)"\s*value: \{\s*string_value: "([^"]*)"', text))
    assert executor_settings(filled, {})["kv_cache_events_endpoint"] == "tcp://*:5557"
    args.kv_events_endpoint = None
    assert serve.engine_parameters(args) == {}
    args.mtp = 3  # --mtp 3: DeepSeek's MTP module drafting 3 tokens a step
    settings = executor_settings(serve.engine_parameters(args), {})
    assert (settings["speculative_mode"], settings["max_draft_len"]) == ("mtp", 3)
