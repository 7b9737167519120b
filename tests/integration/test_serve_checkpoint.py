"""`make serve MODEL=<checkpoint>` (scripts/serve_default.py --model) as a new user runs it: a
Hugging Face checkpoint directory of their own (a tiny random Llama written by transformers, with
SmolLM2's tokenizer), one command, then curl-style HTTP and the official `openai` client; the
engine is built once into the cache and a second start reuses it."""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
import transformers

from triton_helpers import ROOT, free_port

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "scripts" / "serve_default.py"


@pytest.fixture(scope="module")
def checkpoint(smollm2_engine_dir, tmp_path_factory) -> Path:
    """A 2-layer Llama over SmolLM2's whole vocabulary (so any text tokenizes into it), saved as
    save_pretrained writes it, with SmolLM2's tokenizer files (its chat template included)."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(smollm2_engine_dir) / name).exists():
            shutil.copy(Path(smollm2_engine_dir) / name, folder)
    return folder


# The build options the served test's command line gives (serving/engine_cache.py checkpoint_build_args of
# --dtype float32 --max_batch_size 4 --max_seq_len 256): the server finds the engine the keyed test's build made.
BUILD = ["--dtype", "float32", "--max_batch_size", "4", "--tp_size", "1", "--max_seq_len", "256"]


@pytest.fixture(scope="module")
def cache(checkpoint, tmp_path_factory) -> tuple[Path, Path, str]:
    """(cache folder, engine, what the build printed): the checkpoint's engine built ONCE per module,
    in-process through serve_default's ensure_checkpoint_engine; the keyed test checks that build and
    the served test starts a server on the same cache, which must reuse it (one engine.build, not two)."""
    folder = tmp_path_factory.mktemp("engine_cache")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setenv("TRITONLLM_CACHE", str(folder))
        engine = _load_serve_default().ensure_checkpoint_engine(str(checkpoint), BUILD)
    return folder, engine, out.getvalue()


def _load_serve_default():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_default_for_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_cache_is_keyed_by_checkpoint_and_options(checkpoint, cache, monkeypatch, capsys):
    folder, engine, printed = cache
    monkeypatch.setenv("TRITONLLM_CACHE", str(folder))
    serve = _load_serve_default()
    build = BUILD
    assert "building" in printed  # the module's one build, in-process
    assert engine.parent == folder / "engines" and engine.name.startswith("tiny-llama-")
    assert json.loads((engine / "config.json").read_text())["build"]["max_seq_len"] == 256
    built_at = (engine / "config.json").stat().st_mtime_ns
    assert serve.ensure_checkpoint_engine(str(checkpoint), build) == engine  # reused, not rebuilt
    assert (engine / "config.json").stat().st_mtime_ns == built_at
    assert "reusing the cached engine" in capsys.readouterr().out
    assert serve.cached_engine_dir(str(checkpoint), build[:-1] + ["128"]) != engine  # other options
    changed = checkpoint / "generation_config.json"  # the checkpoint changed (a newer file): another key
    before = changed.stat()
    os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    try:
        assert serve.cached_engine_dir(str(checkpoint), build) != engine
    finally:  # back as it was: the served test's server reuses this engine
        os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert serve.cached_engine_dir(str(checkpoint), build) == engine
    assert not list((folder / "engines").glob("*.partial-*"))  # builds land whole


def test_a_missing_checkpoint_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    serve = _load_serve_default()
    with pytest.raises(SystemExit, match="checkpoint /no/such/model does not exist"):
        serve.ensure_checkpoint_engine("/no/such/model", [])


def test_one_command_serves_a_checkpoint(checkpoint, cache, tmp_path):
    """Find the engine in the cache (the module's build), fill, launch, answer over HTTP and the OpenAI
    API under the checkpoint's name."""
    ports = {name: str(free_port()) for name in ("http", "grpc", "metrics", "openai")}
    folder, engine, _ = cache
    env = {**os.environ, "TRITONLLM_CACHE": str(folder)}
    command = [sys.executable, str(SCRIPT), "--model", str(checkpoint), "--dtype", "float32", "--max_seq_len", "256",
               "--max_batch_size", "4", "--repo", str(tmp_path / "repo"), "--bls_instances", "1",
               "--http_port", ports["http"], "--grpc_port", ports["grpc"], "--metrics_port", ports["metrics"],
               "--openai_port", ports["openai"]]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 420
        while not any(line.startswith("READY:") for line in lines):
            assert process.poll() is None and time.time() < deadline, "".join(lines[-40:])
            time.sleep(0.5)
        ready = next(line for line in lines if line.startswith("READY:"))
        assert "serves tiny-llama" in ready and "(model tiny-llama)" in ready
        body = json.dumps({"text_input": "The capital of France is", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{ports['http']}/v2/models/ensemble/generate", data=body)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert isinstance(json.loads(response.read())["text_output"], str)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai']}/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["tiny-llama"]
            completion = client.chat.completions.create(model="tiny-llama", max_tokens=4, temperature=0,
                                                        messages=[{"role": "user", "content": "Hi"}])
            assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
    finally:  # a kill: a graceful stop (5-10 s) is not what this test is about (test_engine_recovery's Ctrl-C is)
        try:
            os.killpg(process.pid, signal.SIGKILL)  # tritonserver, its stubs, the engine process, the frontend
        except ProcessLookupError:
            pass
        process.wait()
    # A second start reuses the engine the first built (the build itself: the keyed test).
    assert any(f"reusing the cached engine {engine}" in line for line in lines)
    assert not any(line.startswith("tritonllm: building") for line in lines)
