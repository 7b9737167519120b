"""tools/assemble_repository.py's disaggregated kind (tritonllm/repository.py): the anchor's layout,
every placeholder filled, the ensemble and tensorrt_llm_bls routed through disaggregated_serving_bls."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _assemble(engine_dir: Path, output: Path, *extra: str, kind: str = "disaggregated") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "assemble_repository.py"), "--kind", kind,
                           "--engine_dir", str(engine_dir), "--output", str(output), *extra],
                          capture_output=True, text=True, cwd=ROOT)


def _parameter(config: str, key: str) -> str:
    return re.search(r'key: "' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config).group(1)


def test_two_phase_models_behind_the_disaggregated_bls(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    run = _assemble(engine, tmp_path / "repo", "--set", "generation:gpu_device_ids=1")
    assert run.returncode == 0, run.stderr
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir()) == ["context", "disaggregated_serving_bls", "ensemble", "generation",
                                                      "postprocessing", "preprocessing", "tensorrt_llm_bls"]
    configs = {p.parent.name: p.read_text() for p in repo.glob("*/config.pbtxt")}
    assert _assemble(engine, tmp_path / "text", kind="text").returncode == 0
    aggregated = (tmp_path / "text" / "tensorrt_llm" / "config.pbtxt").read_text()
    for phase in ("context", "generation"):  # tensorrt_llm's filled config but for its name and KV share
        assert f'\nname: "{phase}"' in configs[phase]
        assert _parameter(configs[phase], "kv_cache_free_gpu_mem_fraction") == "0.45"  # both fit one GPU
        differ = {line.strip() for line in set(configs[phase].splitlines()) ^ set(aggregated.splitlines())}
        assert differ <= {f'name: "{phase}"', 'name: "tensorrt_llm"', 'string_value: "0.45"', 'string_value: "1"',
                          'string_value: "${kv_cache_free_gpu_mem_fraction}"', 'string_value: "${gpu_device_ids}"'}
    assert "${" not in configs["disaggregated_serving_bls"]
    assert _parameter(configs["generation"], "gpu_device_ids") == "1"
    bls = configs["disaggregated_serving_bls"]
    assert (_parameter(bls, "context_model_name"), _parameter(bls, "generation_model_name")) == ("context", "generation")
    assert 'model_name: "disaggregated_serving_bls"' in configs["ensemble"]
    assert 'model_name: "tensorrt_llm"' not in configs["ensemble"]
    assert _parameter(configs["tensorrt_llm_bls"], "tensorrt_llm_model_name") == "disaggregated_serving_bls"
    assert _parameter(configs["postprocessing"], "tensorrt_llm_model_name") == "generation"  # cancellation's stop


@pytest.mark.parametrize("part", ["vision_encoder", "decoder"])
def test_vision_and_encoder_decoder_engines_are_refused_by_name(tmp_path, part):
    engine = tmp_path / "engine"
    (engine / part).mkdir(parents=True)
    extra = {"extra": {"encoder_decoder": {"num_mel_bins": 80}}} if part == "decoder" else {}
    (engine / part / "config.json").write_text(json.dumps(extra))
    run = _assemble(engine, tmp_path / "repo")
    assert run.returncode == 2 and "disaggregated serving takes decoder-only text engines" in run.stderr
