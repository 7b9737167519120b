"""engine.build from a HF directory, config round-trips, and every bad input as a clear error."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.build import build_engine, main
from engine.config import BuildConfig, ConfigError, EngineConfig, EngineFormatError, ModelConfig
from engine.convert import CheckpointError, model_config_from_hf
from engine.executor.runner import ModelRunner
from engine.models import UnsupportedArchitectureError, get_model_class
from engine_testing import PagedSession, hf_logits, make_engine, tiny_hf

SUPPORTED = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel"


def _cli_args(checkpoint, output, **overrides) -> list[str]:
    args = dict(dtype="float32", max_batch_size=2, max_input_len=64, max_seq_len=128, tokens_per_block=8)
    args.update(overrides)
    return ["--checkpoint", str(checkpoint), "--output", str(output)] + [
        token for key, value in args.items() for token in (f"--{key}", str(value))
    ]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 checkpoint saved by transformers as a HF safetensors directory."""
    model = tiny_hf("qwen2_qkv_bias")
    path = tmp_path_factory.mktemp("hf_qwen2")
    model.save_pretrained(path)
    return model, path


def test_cli_builds_a_hf_directory(hf_dir, tmp_path, capsys):
    model, path = hf_dir
    assert main(_cli_args(path, tmp_path / "engine")) == 0
    config = EngineConfig.load(tmp_path / "engine")
    assert config.model.architecture == "Qwen2ForCausalLM" and config.model.qkv_bias
    assert config.build.tokens_per_block == 8 and config.build.max_seq_len == 128
    prompt = list(range(3, 20))
    (logits,) = PagedSession(ModelRunner(str(tmp_path / "engine"))).step([(0, prompt)])
    assert (logits - hf_logits(model, prompt)).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_build_casts_weights(hf_dir, tmp_path, dtype, torch_dtype):
    _, path = hf_dir
    build_engine(str(path), str(tmp_path / dtype), BuildConfig(dtype=dtype, max_seq_len=128, max_input_len=64),
                 progress=False)
    weights = load_file(tmp_path / dtype / "rank0.safetensors")
    assert {t.dtype for t in weights.values()} == {torch_dtype}


def test_config_json_round_trip():
    model = ModelConfig("LlamaForCausalLM", 96, 64, 2, 4, 2, 16, 96, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    config = EngineConfig(model, BuildConfig(dtype="bfloat16", tp_size=2)).validate()
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# ---- bad input ------------------------------------------------------------------------------

def test_unknown_architecture_lists_the_supported_ones():
    rwkv = transformers.LlamaConfig(architectures=["RwkvForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match=f"'RwkvForCausalLM'; supported: {SUPPORTED}"):
        model_config_from_hf(rwkv)
    with pytest.raises(UnsupportedArchitectureError, match="supported: LlamaForCausalLM"):
        get_model_class("BertModel")


def test_unknown_architecture_in_a_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, architectures=["BertModel"]).save_pretrained(tmp_path / "ckpt")
    save_file({"x": torch.zeros(1)}, tmp_path / "ckpt" / "model.safetensors")
    assert main(_cli_args(tmp_path / "ckpt", tmp_path / "out")) == 2
    assert f"unsupported architecture 'BertModel'; supported: {SUPPORTED}" in capsys.readouterr().err


def test_bad_dtype_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="unsupported dtype 'int8'; supported: float32, float16, bfloat16"):
        BuildConfig(dtype="int8").validate()
    with pytest.raises(SystemExit):  # argparse rejects it before anything loads
        main(["--checkpoint", "x", "--output", "y", "--dtype", "int8"])


def test_bad_build_limits():
    with pytest.raises(ConfigError, match="tokens_per_block must be a positive integer, got 0"):
        BuildConfig(tokens_per_block=0).validate()
    with pytest.raises(ConfigError, match=r"max_input_len \(4096\) must be <= max_seq_len \(2048\)"):
        BuildConfig(max_input_len=4096, max_seq_len=2048).validate()


def test_missing_checkpoint_files(tmp_path, capsys):
    assert main(_cli_args(tmp_path / "nope", tmp_path / "out")) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        build_engine(str(tmp_path / "empty"), str(tmp_path / "out"), BuildConfig())


def test_checkpoint_without_weights(hf_dir, tmp_path):
    _, path = hf_dir
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors files"):
        build_engine(str(tmp_path / "ckpt"), str(tmp_path / "out"), BuildConfig(max_seq_len=128, max_input_len=64))


def test_corrupt_checkpoint_weights(hf_dir, tmp_path):
    _, path = hf_dir
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "ckpt" / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        build_engine(str(tmp_path / "ckpt"), str(tmp_path / "out"), BuildConfig(max_seq_len=128, max_input_len=64))


def test_checkpoint_missing_a_tensor(hf_dir, tmp_path):
    _, path = hf_dir
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text((path / "config.json").read_text())
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks the tensor 'model.layers.1.mlp.up_proj.weight'"):
        build_engine(str(tmp_path / "ckpt"), str(tmp_path / "out"), BuildConfig(max_seq_len=128, max_input_len=64))


@pytest.fixture
def engine_dir(tmp_path):
    return make_engine(tiny_hf("llama"), tmp_path / "engine")


def _edit_config(engine_dir, edit) -> None:
    path = os.path.join(engine_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def test_engine_of_another_format_version(engine_dir):
    _edit_config(engine_dir, lambda d: d.update(format_version=99))
    with pytest.raises(EngineFormatError, match="format_version 99 is not supported; this build reads format_version 1, 2, 3, 4"):
        ModelRunner(engine_dir)


def test_engine_with_unknown_architecture(engine_dir):
    _edit_config(engine_dir, lambda d: d["model"].update(architecture="RwkvForCausalLM"))
    with pytest.raises(EngineFormatError, match=f"'RwkvForCausalLM'; supported: {SUPPORTED}"):
        EngineConfig.load(engine_dir)


def test_engine_config_missing_or_not_json(engine_dir, tmp_path):
    with pytest.raises(EngineFormatError, match="is not an engine directory"):
        ModelRunner(str(tmp_path / "nowhere"))
    with open(os.path.join(engine_dir, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(EngineFormatError, match="is not valid JSON"):
        ModelRunner(engine_dir)


def test_engine_weights_missing_or_corrupt(engine_dir):
    weights_path = os.path.join(engine_dir, "rank0.safetensors")
    data = open(weights_path, "rb").read()
    with open(weights_path, "wb") as f:
        f.write(data[:500])
    with pytest.raises(EngineFormatError, match="corrupt or truncated"):
        ModelRunner(engine_dir)
    os.remove(weights_path)
    with pytest.raises(EngineFormatError, match="no weights for rank 0"):
        ModelRunner(engine_dir)


def test_engine_weights_of_another_model(engine_dir, tmp_path):
    other = make_engine(tiny_hf("qwen2_qkv_bias"), tmp_path / "other")
    os.replace(os.path.join(other, "rank0.safetensors"), os.path.join(engine_dir, "rank0.safetensors"))
    with pytest.raises(EngineFormatError, match="unexpected .*qkv_proj.bias"):
        ModelRunner(engine_dir)


def test_inconsistent_forward_batch(engine_dir):
    from engine.executor.runner import ForwardBatch

    runner = ModelRunner(engine_dir)
    runner.allocate_kv_cache(4)
    with pytest.raises(ValueError, match="3 token_ids, 3 positions, sum\\(seq_lens_q\\) = 2"):
        runner.forward(ForwardBatch([1, 2, 3], [0, 1, 2], [2], [2], [[0]], [1]))


def test_sliding_window_is_kept_beyond_max_seq_len(tmp_path):
    """A window shorter than max_seq_len is applied, not refused (tests/engine/test_sliding_window.py)."""
    hf = tiny_hf("mistral")
    hf.config.sliding_window = 64
    config = EngineConfig.load(make_engine(hf, tmp_path / "e", max_seq_len=256))
    assert config.model.sliding_window == 64 and config.model.layer_types is None and config.model.kv_window == 64


def test_unsupported_rope_scaling_is_named():
    config = ModelConfig("LlamaForCausalLM", 96, 64, 2, 4, 2, 16, 96, rope_scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ConfigError, match="unsupported rope_scaling type 'mrope'; supported: default, llama3, linear, "
                                          "yarn, dynamic, longrope"):
        config.validate()
    yarn = ModelConfig("LlamaForCausalLM", 96, 64, 2, 4, 2, 16, 96, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="rope_scaling of type 'yarn' lacks original_max_position_embeddings"):
        yarn.validate()


def test_rebuild_replaces_every_rank_file(tmp_path):
    hf = tiny_hf("llama")
    make_engine(hf, tmp_path / "e", tp_size=2)
    make_engine(hf, tmp_path / "e", tp_size=1)
    assert sorted(p.name for p in (tmp_path / "e").glob("rank*")) == ["rank0.safetensors"]


def test_hf_directory_tokenizer_is_copied(smollm2_hf, hf_dir, tmp_path):
    """A HF directory's tokenizer (here SmolLM2's, chat template included) lands in the engine."""
    _, tokenizer = smollm2_hf
    model, _ = hf_dir
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    assert main(_cli_args(ckpt, tmp_path / "engine")) == 0
    copied = transformers.AutoTokenizer.from_pretrained(tmp_path / "engine")
    messages = [{"role": "user", "content": "hi"}]
    assert copied.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_llama_family_needs_silu():
    config = transformers.LlamaConfig(**{"hidden_act": "gelu", "vocab_size": 96, "hidden_size": 64,
                                         "intermediate_size": 96, "num_hidden_layers": 1,
                                         "num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(ConfigError, match="needs hidden_act 'silu'"):
        model_config_from_hf(config)


def test_module_entry_point_shows_progress(smollm2_engine_dir, smollm2_engine_build_stderr):
    """`python -m engine.build` as users run it: the session's SmolLM2 engine is built so, from the .gguf
    (tests/conftest.py, which checks its exit status 0 and keeps its stderr): a progress bar on stderr.
    (Until 2026-12-01 a build of a tiny checkpoint of its own: a process and torch's import, ~4-8 s of
    make test; the in-process main's HF-directory build is test_cli_builds_a_hf_directory's.)"""
    stderr = smollm2_engine_build_stderr
    assert "converting" in stderr and "100%" in stderr, stderr[-2000:]
    assert (Path(smollm2_engine_dir) / "config.json").exists()


def test_cli_reports_tp_size_that_does_not_divide(hf_dir, tmp_path, capsys):
    _, path = hf_dir
    assert main(_cli_args(path, tmp_path / "f", tp_size=3)) == 2
    assert "error: tp_size 3 does not divide num_heads (4)" in capsys.readouterr().err


def test_engine_weights_of_the_wrong_shape(engine_dir):
    _edit_config(engine_dir, lambda d: d["model"].update(intermediate_size=128))
    with pytest.raises(EngineFormatError, match="(?s)wrong tensor shapes: .*gate_up_proj"):
        ModelRunner(engine_dir)
