"""The built wheel, as a user installs it: ``pip wheel`` of the sources, installed into a fresh virtual
environment outside the checkout, gives a ``tritonllm`` command whose ``serve`` fills the packaged
model-repository templates and answers a request, and whose ``launch``, ``fill-template`` and
``templates`` work; nothing is read from the checkout.

Kept cheap: the fresh environment gets no dependencies of its own (a .pth file lists this
environment's site-packages, whose own .pth files, among them the checkout's editable install, are
not processed from there), the wheel is installed with ``--no-deps --no-index``, and the served model
is the session's SmolLM2 engine (``smollm2_engine_dir``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from free_ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject.toml and setup.py say what goes in); the rest of the
# checkout (tests, benchmarks, docs, built engines) stays behind.
SOURCES = ("pyproject.toml", "setup.py", "engine", "kernels", "serving", "openai_frontend", "tritonllm", "all_models")
# The Ctrl-C's grace before the kill: a graceful stop takes 5-10 s, so the wait always ran out (2.0 s until
# 2026-11-30); 0.2 s as tests/integration/triton_helpers.py's stop waits.
STOP_WAIT_S = 0.2
CHAT = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def without_pythonpath(env: dict) -> dict:
    """``env`` without PYTHONPATH: a suite run with PYTHONPATH=<checkout> (a worktree's way) would otherwise
    have the fresh environment import the checkout, not the wheel."""
    return {name: value for name, value in env.items() if name != "PYTHONPATH"}


def run(command: list[str], cwd: Path, timeout: float = 120, env: dict | None = None) -> str:
    env = without_pythonpath(os.environ if env is None else env)
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:  # every process of the group has exited
        pass


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh environment's bin/ with the wheel installed (built from a copy of the sources, so
    the checkout gets no build/ or egg-info of it)."""
    work = tmp_path_factory.mktemp("wheel")
    (work / "src").mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, work / "src" / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(source, work / "src" / name)
    # --no-build-isolation: setuptools from this environment, not downloaded into a throwaway one
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"),
         str(work / "src")], cwd=work)
    wheel, = (work / "dist").glob("tritonllm-*.whl")
    env_dir = work / "venv"
    venv.create(env_dir, with_pip=False)
    fresh_site = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    (fresh_site / "project_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # pip comes from this environment (through the .pth); --ignore-installed: this environment's
    # editable tritonllm is seen there and must be neither counted as installed nor uninstalled.
    run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--ignore-installed", str(wheel)], cwd=work)
    return env_dir / "bin"


def test_the_package_is_imported_from_the_fresh_environment(installed, tmp_path):
    env = {**os.environ, "TRITONLLM_CACHE": str(tmp_path / "cache")}
    where = json.loads(run([str(installed / "python"), "-c", (
        "import json, engine, openai_frontend, serving, tritonllm.paths as p;"
        "print(json.dumps([p.__file__, str(p.model_templates_dir()), engine.__file__, serving.__file__,"
        " openai_frontend.__file__, str(p.checkout_root()), str(p.default_engine_dir()), str(p.default_repo_dir())]))")],
        cwd=tmp_path, env=env))
    site_packages = str(installed.parent / "lib")
    assert all(path.startswith(site_packages) for path in where[:5]), where
    assert where[5] == "None" and not any(path.startswith(str(ROOT)) for path in where), where
    # what `tritonllm serve` builds and fills goes to the cache, not into site-packages
    assert where[6:] == [str(tmp_path / "cache" / "engines" / "smollm2"), str(tmp_path / "cache" / "triton_repo")]


def test_the_commands_work_without_the_checkout(installed, tmp_path):
    tritonllm = str(installed / "tritonllm")
    assert all(f"tritonllm {command} " in run([tritonllm, "--help"], tmp_path)
               for command in ("serve", "launch", "fill-template", "templates"))
    assert "--lora_modules" in run([tritonllm, "serve", "--help"], tmp_path)
    assert "--model_repo" in run([tritonllm, "launch", "--help"], tmp_path)
    run([tritonllm, "templates", "repo"], tmp_path)
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        assert (tmp_path / "repo" / model / "config.pbtxt").is_file()
    assert (tmp_path / "repo" / "ensemble" / "1").is_dir()  # tritonserver needs the version folder
    assert (tmp_path / "repo" / "tensorrt_llm" / "1" / "model.py").is_file()
    run([tritonllm, "fill-template", "-i", "repo/postprocessing/config.pbtxt", "tokenizer_dir:/engines/x"], tmp_path)
    assert 'string_value: "/engines/x"' in (tmp_path / "repo" / "postprocessing" / "config.pbtxt").read_text()
    run([tritonllm, "templates", "--llmapi", "llmapi"], tmp_path)
    assert (tmp_path / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").is_file()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_serve_answers_a_request(installed, smollm2_engine_dir, tmp_path):
    """``tritonllm serve`` from the wheel, in a directory without the checkout: the packaged templates
    filled, tritonserver's Python models and the OpenAI frontend running the installed packages; one
    HTTP generate and one OpenAI chat completion answered."""
    http, grpc, metrics, openai_port = (str(free_port()) for _ in range(4))
    env = without_pythonpath({**os.environ, "TRITONLLM_CACHE": str(tmp_path / "cache")})
    process = subprocess.Popen(
        [str(installed / "tritonllm"), "serve", "--engine_dir", smollm2_engine_dir, "--repo", "repo",
         "--bls_instances", "1", "--openai_port", openai_port, "--http_port", http, "--grpc_port", grpc,
         "--metrics_port", metrics], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        deadline = time.time() + 300
        while not any(line.startswith("READY:") for line in lines):
            assert process.poll() is None and time.time() < deadline, "".join(lines[-60:])
            time.sleep(0.2)
        model = Path(smollm2_engine_dir).name  # the OpenAI name of the embedded model's engine
        with ThreadPoolExecutor(2) as pool:  # at once: one batch of the engine's, not two requests' steps in turn
            generated = pool.submit(post, f"http://127.0.0.1:{http}/v2/models/ensemble/generate",
                                    {"text_input": CHAT, "max_tokens": 8, "exclude_input_in_output": True})
            chat = pool.submit(post, f"http://127.0.0.1:{openai_port}/v1/chat/completions", {
                "model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            generated, chat = generated.result(), chat.result()
        assert "Paris" in generated["text_output"]
        assert "Paris" in chat["choices"][0]["message"]["content"]
    finally:  # Ctrl-C, then (a graceful stop is not what this test is about) a kill after STOP_WAIT_S
        signal_group(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        signal_group(process.pid, signal.SIGKILL)  # tritonserver, its stubs and the engine process too
        process.wait()
    config = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{smollm2_engine_dir}"' in config  # filled from the packaged template
