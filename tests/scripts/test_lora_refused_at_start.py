"""``--lora_modules`` over a repository whose engine model has LoRA off is a configuration mistake:
the launcher refuses it before tritonserver starts, and ``python -m openai_frontend`` refuses it at
start, both naming the parameter to set (it used to start, list the adapters in /v1/models and fail
every adapter request with HTTP 500)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openai_frontend.__main__ import main as frontend_main
from openai_frontend.repository import lora_off_reason
from tritonllm.fill_template import fill_template
from tritonllm.paths import model_templates_dir
from tritonllm.serve import prepare_model_repo

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def adapter(tmp_path):
    path = tmp_path / "sql"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    return path


def filled_repo(tmp_path, **tensorrt_llm_values) -> str:
    """The five-model repository filled as `tritonllm serve` fills it, with these tensorrt_llm values."""
    return prepare_model_repo(str(tmp_path / "engine"), str(tmp_path / "repo"),
                              overrides={"tensorrt_llm": tensorrt_llm_values})


def hand_filled_repo(tmp_path) -> str:
    """The tensorrt_llm template filled by hand as tensorrtllm_backend's docs do: LoRA's parameters
    left as ${placeholders}."""
    repo = tmp_path / "repo"
    shutil.copytree(model_templates_dir() / "tensorrt_llm", repo / "tensorrt_llm")
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(fill_template(config.read_text(), "engine_dir:/engines/x,triton_backend:python"))
    return str(repo)


def test_the_repository_says_whether_lora_is_on(tmp_path):
    assert lora_off_reason(filled_repo(tmp_path / "on"), "tensorrt_llm") is None  # serve's default: on
    off = filled_repo(tmp_path / "off", enable_lora="false")
    reason = lora_off_reason(off, "tensorrt_llm")
    assert "LoRA is not enabled" in reason and "enable_lora" in reason and "config.pbtxt" in reason
    unfilled = hand_filled_repo(tmp_path / "unfilled")
    assert "${enable_lora}" in (Path(unfilled) / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "enable_lora" in lora_off_reason(unfilled, "tensorrt_llm")  # unset and no LoRA cache size: off
    # Sizing the adapter cache turns it on (serving/executor_config.py lora_enabled), as the model reads it.
    assert lora_off_reason(filled_repo(tmp_path / "sized", enable_lora="", max_loras="2"), "tensorrt_llm") is None
    assert lora_off_reason(str(tmp_path / "nowhere"), "tensorrt_llm") is None  # cannot tell: not refused


def test_an_llmapi_model_yaml_with_lora_off_is_named(tmp_path):
    model = tmp_path / "repo" / "tensorrt_llm" / "1"
    model.mkdir(parents=True)
    (model / "model.yaml").write_text(f"model: {tmp_path}\nenable_lora: false\n")
    reason = lora_off_reason(str(tmp_path / "repo"), "tensorrt_llm")
    assert "enable_lora: true" in reason and "model.yaml" in reason
    (model / "model.yaml").write_text(f"model: {tmp_path}\nlora_config:\n  max_lora_rank: 8\n")
    assert lora_off_reason(str(tmp_path / "repo"), "tensorrt_llm") is None


@pytest.mark.parametrize("command", [[str(ROOT / "scripts" / "launch_triton_server.py")],
                                     ["-m", "tritonllm", "launch"]])
def test_the_launcher_refuses_before_starting_tritonserver(tmp_path, adapter, command):
    repo = filled_repo(tmp_path, enable_lora="false")
    run = subprocess.run([sys.executable, *command, f"--model_repo={repo}", "--openai_port=1",
                          "--lora_modules", f"sql={adapter}", "--force"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0
    assert "LoRA is not enabled" in run.stderr and "enable_lora" in run.stderr, run.stderr
    assert "tritonserver started" not in run.stdout


def test_the_frontend_refuses_at_start(tmp_path, adapter):
    repo = filled_repo(tmp_path, enable_lora="false")
    with pytest.raises(SystemExit) as raised:
        frontend_main(["--model_repo", repo, "--port", "1", "--lora_modules", f"sql={adapter}"])
    message = str(raised.value.code)
    assert message.startswith("openai_frontend: --lora_modules: LoRA is not enabled") and "enable_lora" in message
