"""`tritonllm serve` on encoder-decoder engines (engine.build's encoder/ + decoder/): the repository
checkpoint_repository fills, checked at function level on a stub engine directory (only the
decoder's config.json is read; the served paths are tests/integration/test_model_families_served.py's)."""
import json
import re
from pathlib import Path

import pytest

from tritonllm.serve import checkpoint_repository, refuse_lora_on_encoder_decoder


def _engine(root: Path, spec: dict, max_seq_len: int = 448) -> Path:
    for stack in ("encoder", "decoder"):
        (root / stack).mkdir(parents=True)
        (root / stack / "config.json").write_text(json.dumps({"build": {"max_seq_len": max_seq_len},
                                                              "extra": {"stack": stack, "encoder_decoder": spec}}))
    return root


def _value(config: Path, key: str) -> str:
    text = config.read_text()
    if key == "decoupled":
        return re.search(r"decoupled: (\w+)", text).group(1)
    return re.search(rf'key: "{key}"\s*value: {{\s*string_value: "([^"]*)"', text).group(1)


def test_t5_gets_the_text_repository_of_its_decoder_with_the_encoder_fill_keys(tmp_path):
    engine = _engine(tmp_path / "engine", {"num_mel_bins": 0})
    repo, models = checkpoint_repository(str(engine), str(tmp_path / "repo"), bls_instances=1)
    assert models == "tensorrt_llm"
    assert sorted(p.name for p in Path(repo).iterdir()) == [
        "ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    llm = Path(repo) / "tensorrt_llm" / "config.pbtxt"
    assert _value(llm, "gpt_model_path") == str(engine / "decoder")
    assert _value(llm, "encoder_model_path") == str(engine / "encoder")
    assert (_value(llm, "cross_kv_cache_fraction"), _value(llm, "exclude_input_in_output")) == ("0.5", "True")
    assert _value(llm, "enable_lora") == "false" and _value(llm, "decoupled") == "true"
    assert _value(Path(repo) / "preprocessing" / "config.pbtxt", "tokenizer_dir") == str(engine / "decoder")


def test_whisper_gets_the_whisper_repository(tmp_path):
    engine = _engine(tmp_path / "engine", {"num_mel_bins": 128})
    repo, models = checkpoint_repository(str(engine), str(tmp_path / "repo"))
    assert models == "tensorrt_llm"
    assert sorted(p.name for p in Path(repo).iterdir()) == ["tensorrt_llm", "whisper_bls"]
    llm, bls = (Path(repo) / name / "config.pbtxt" for name in ("tensorrt_llm", "whisper_bls"))
    assert _value(llm, "encoder_model_path") == str(engine / "encoder") and _value(llm, "decoupled") == "false"
    assert (_value(bls, "n_mels"), _value(bls, "engine_dir"), _value(bls, "decoupled")) == \
        ("128", str(engine / "decoder"), "false")
    assert "${" not in bls.read_text() and _value(bls, "max_tokens") == "96"
    # a decoder too short for 96 tokens after the prompt gets half its max_seq_len
    short = _engine(tmp_path / "short", {"num_mel_bins": 8}, max_seq_len=40)
    repo, _ = checkpoint_repository(str(short), str(tmp_path / "short_repo"))
    assert _value(Path(repo) / "whisper_bls" / "config.pbtxt", "max_tokens") == "20"


def test_lora_modules_on_an_encoder_decoder_checkpoint_are_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    refuse_lora_on_encoder_decoder(str(tmp_path), [])  # no adapters: served
    with pytest.raises(SystemExit, match=r"--lora_modules: T5ForConditionalGeneration \(encoder-decoder\)"):
        refuse_lora_on_encoder_decoder(str(tmp_path), ["a=/adapters/a"])


def test_whisper_ready_message_shows_the_audio_requests():
    from tritonllm.serve import ready_message

    message = ready_message("8000", "8001", "8002", "9000", "whisper", "whisper", audio=True)
    assert "tools/whisper/client.py --server-port 8001" in message and "/v1/audio/transcriptions" in message
    assert "ensemble" not in message and "chat/completions" not in message
