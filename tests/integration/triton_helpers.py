"""Helpers of the integration tests: start a real tritonserver on a filled repository, talk to it."""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from benchmarks.common import descendant_pids, process_name, start_ticks
from benchmarks.common import load_script  # tests also import it from here
from benchmarks.serving.serving_bench import grpc_tensors as grpc_inputs  # {name: array} -> gRPC InferInputs
from free_ports import free_port  # tests also import it from here

ROOT = Path(__file__).resolve().parents[2]
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
               "<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


@dataclass
class Server:
    http: str  # "http://127.0.0.1:PORT"
    grpc_url: str  # "127.0.0.1:PORT"
    metrics: str
    log_path: Path
    pid: int = 0
    repo: Path | None = None  # the model repository it serves

    def load_models(self, *names: str) -> None:
        """Load models added to its repository since the start, in this order (the launcher's explicit
        model control loads every model at start and more on request)."""
        for name in names:
            response = requests.post(f"{self.http}/v2/repository/models/{name}/load", timeout=300)
            assert response.status_code == 200, (name, response.text)

    def generate(self, model: str, body: dict, stream: bool = False, timeout: float = 120):
        endpoint = "generate_stream" if stream else "generate"
        return requests.post(f"{self.http}/v2/models/{model}/{endpoint}", json=body, timeout=timeout,
                             stream=stream)

    def metrics_text(self) -> str:
        return requests.get(f"{self.metrics}/metrics", timeout=10).text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def chat(question: str) -> str:
    return CHAT_PROMPT.format(question=question)


# tensorrt_llm template values that leave guided decoding off (serve_default fills xgrammar).
GUIDED_OFF = {"guided_decoding_backend": ""}


@contextmanager
def running_server(engine_dir: str, work: Path, decoupled: bool = True, mpi: bool = False,
                   tensorrt_llm_instances: int = 1, tensorrt_llm_parameters: dict[str, str] | None = None,
                   guided: bool = False, generation_phase: bool = False, add_models=None):
    """Fill a repository for `engine_dir` under `work`, serve it, yield a Server, stop it.
    `mpi`: through mpirun (world size 1) as the launcher does by default, else tritonserver alone
    as `make serve` runs it. `tensorrt_llm_instances`: its instance_group count (they share one
    engine process). `tensorrt_llm_parameters`: template values of that model to override.
    `guided`: guided_decoding_backend xgrammar as serve_default fills it; off unless a test sends
    guides (the engine process loads the tokenizer and xgrammar's vocabulary at start, ~1.3 CPU-s).
    `generation_phase`: also a second engine process, model `generation` (tensorrt_llm's copy), and
    disaggregated_serving_bls with context tensorrt_llm and generation `generation` (add_generation_phase).
    `add_models`: called with the filled repository's Path before the start, to add models beside."""
    serve = load_script("serve_default")
    parameters = {**({} if guided else GUIDED_OFF), **(tensorrt_llm_parameters or {})}
    repo = serve.prepare_model_repo(engine_dir, str(work / "repo"), bls_instances=2, decoupled=decoupled,
                                    overrides={"tensorrt_llm": parameters})
    if tensorrt_llm_instances != 1:
        config = Path(repo) / "tensorrt_llm" / "config.pbtxt"
        text, replaced = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+",
                                 rf"\g<1>{tensorrt_llm_instances}", config.read_text())
        assert replaced == 1, "no instance_group count in the tensorrt_llm template"
        config.write_text(text)
    if generation_phase:
        add_generation_phase(Path(repo), decoupled)
    if add_models is not None:
        add_models(Path(repo))
    with serving_repository(repo, work, mpi=mpi) as server:
        yield server


# The unary repository's copies of tensorrt_llm for speculative decoding (running_unary_server).
DRAFT_MODEL = "tensorrt_llm_draft"
DRAFT_TARGET_MODEL = "tensorrt_llm_draft_target"


def _copy_model(repo: Path, source: str, name: str, config_text: str) -> None:
    shutil.copytree(repo / source / "1", repo / name / "1", ignore=shutil.ignore_patterns("__pycache__"))
    text, count = re.subn(rf'^name: "{source}"', f'name: "{name}"', config_text, count=1, flags=re.M)
    assert count == 1
    (repo / name / "config.pbtxt").write_text(text)


@contextmanager
def running_unary_server(engine_dir: str, work: Path, draft_target: bool = True):
    """The five-model repository non-decoupled (one response per request, as end_to_end_test.py,
    benchmark_core_model.py and e2e_grpc_speculative_decoding_client.py need), the BLS naming
    DRAFT_MODEL as its draft model, plus copies of tensorrt_llm on the same engine: DRAFT_MODEL
    (decoding_mode ngram) and, with ``draft_target``, DRAFT_TARGET_MODEL (decoding_mode draft_target, the
    engine as its own draft model: an engine process holding the model twice); served on free ports
    (conftest.unary_server)."""
    serve = load_script("serve_default")
    # No guides and no adapters here: the three engine processes start without xgrammar's vocabulary
    # (~1.3 CPU-s each) and LoRA slots.
    unused = {**GUIDED_OFF, "enable_lora": "false"}
    repo = Path(serve.prepare_model_repo(engine_dir, str(work / "repo"), decoupled=False, bls_instances=2,
                                         overrides={"tensorrt_llm_bls": {"tensorrt_llm_draft_model_name": DRAFT_MODEL},
                                                    "tensorrt_llm": unused}))
    # the copies: the template filled like tensorrt_llm's, with their decoding modes
    template = serve.model_templates_dir() / "tensorrt_llm" / "config.pbtxt"
    base = {**serve.default_substitutions(os.path.abspath(engine_dir), decoupled=False)["tensorrt_llm"], **unused}
    copies = [(DRAFT_MODEL, {"decoding_mode": "ngram", "max_draft_len": "4", "max_matching_ngram_size": "3"})]
    if draft_target:
        copies.append((DRAFT_TARGET_MODEL, {"decoding_mode": "draft_target", "max_draft_len": "4",
                                            "draft_engine_dir": os.path.abspath(engine_dir)}))
    for name, values in copies:
        pairs = ",".join(f"{k}:{serve._escape(v)}" for k, v in {**base, **values}.items())
        _copy_model(repo, "tensorrt_llm", name, serve.fill_template(template.read_text(), pairs, str(template)))
    with serving_repository(repo, work) as running:
        yield running


def add_disaggregated_bls(repo: Path, context: str, generation: str, decoupled: bool, instances: int = 2) -> None:
    """disaggregated_serving_bls from all_models/, filled as the anchor's docs fill it, in a filled
    repository: prefill on ``context``, decode on ``generation``, ``instances`` model instances."""
    from tritonllm.fill_template import fill_template

    shutil.copytree(ROOT / "all_models" / "disaggregated_serving_bls", repo / "disaggregated_serving_bls",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / "disaggregated_serving_bls" / "config.pbtxt"
    config.write_text(fill_template(config.read_text(), (
        f"triton_max_batch_size:8,decoupled_mode:{str(decoupled).lower()},disaggregated_serving_bls_count:{instances},"
        f"context_model_name:{context},generation_model_name:{generation},"
        "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32")))


def add_generation_phase(repo: Path, decoupled: bool) -> None:
    """Disaggregated serving across two engine processes in a filled text repository: ``generation``
    (tensorrt_llm's filled copy, answering to its folder's name) and disaggregated_serving_bls with
    context tensorrt_llm, generation ``generation`` (the KV goes through host shared memory)."""
    shutil.copytree(repo / "tensorrt_llm", repo / "generation")
    config = repo / "generation" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "tensorrt_llm"', 'name: "generation"', 1))
    add_disaggregated_bls(repo, "tensorrt_llm", "generation", decoupled)


@contextmanager
def serving_repository(repo: str | Path, work: Path, mpi: bool = False):
    """Serve an already filled repository on free ports through the launcher, yield a Server, stop it."""
    serve = load_script("serve_default")
    launcher = load_script("launch_triton_server")
    ports = [str(free_port()) for _ in range(3)]
    args = launcher.parse_arguments([f"--model_repo={repo}", *([] if mpi else ["--no-mpi"]), "--host=127.0.0.1",
                                     f"--http_port={ports[0]}", f"--grpc_port={ports[1]}",
                                     f"--metrics_port={ports[2]}", "--force",
                                     f"--cache_dir={work / 'cache'}"])
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = launcher.launch(args, stdout=log, stderr=log)
    running_servers.add(process)
    try:
        if not serve.wait_until_ready(process, ports[0], timeout=300):
            pytest.fail(f"tritonserver did not become ready:\n{log_path.read_text()[-5000:]}")
        yield Server(http=f"http://127.0.0.1:{ports[0]}", grpc_url=f"127.0.0.1:{ports[1]}",
                     metrics=f"http://127.0.0.1:{ports[2]}", log_path=log_path, pid=process.pid, repo=Path(repo))
    finally:
        stop(process)
        assert_nothing_left(str(repo))


# A stopping tritonserver waits for its clients' idle keep-alive connections (a test's requests and
# tritonclient sessions hold some) up to its exit timeout, 30 s, before it unloads the models. A
# test's server has nothing left to finish when it is stopped, so it gets this long, then SIGKILL,
# and so does every process that was below it. (1 s until 2026-11-30: a server's log showed it still
# waiting on a connection when the SIGKILL came, so each stop was a second of waiting for nothing; a
# frontend or a process that ends on SIGTERM still ends by itself within this.)
STOP_WAIT_S = 0.2
# Servers started and not stopped yet: stopped at interpreter exit too, where a fixture's teardown
# did not run (SIGKILL and os._exit still skip both).
running_servers: set[subprocess.Popen] = set()


def _tree(process: subprocess.Popen) -> dict[int, str]:
    """{pid: start time} of every process below ``process`` now."""
    started = {pid: start_ticks(pid) for pid in descendant_pids(process.pid)}
    return {pid: start for pid, start in started.items() if start is not None}


def stop(*processes: subprocess.Popen) -> None:
    """SIGTERM to each, STOP_WAIT_S for all of them together (not one after another), then SIGKILL
    to each one left and to every process that was below one of them. Killing the parent alone is
    not enough: on SIGTERM mpirun sends its ranks SIGCONT, and SIGTERM only a second later
    (odls_base_sigkill_timeout, 1 s for one rank), so a SIGKILL at STOP_WAIT_S that came first
    (under load) left the rank's tritonserver running with parent 1, for good (21 minutes once,
    until killed by hand); a killed tritonserver's stubs and engine processes leave only once they notice."""
    trees = {process: _tree(process) for process in processes}
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            trees[process].update(_tree(process))  # what it started meanwhile (a restarted engine process)
            process.kill()
            process.wait()
    for tree in trees.values():
        for pid, start in tree.items():
            if start_ticks(pid) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    running_servers.difference_update(processes)


@atexit.register
def _stop_servers_left_running() -> None:
    if running_servers:
        stop(*running_servers)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a server's model repository path is in
    its tritonserver's and its stubs' command lines). Zombies have an empty one."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return found


def assert_nothing_left(repo: str) -> None:
    """No process names the stopped server's repository (an orphan tritonserver once outlived its
    pytest run by 21 minutes); SIGKILLed processes get a few seconds to go, the ones left are
    SIGKILLed before the failure."""
    if wait_for(lambda: not processes_naming(repo), timeout=5, interval=0.1):
        return
    left = [(pid, process_name(pid)) for pid in processes_naming(repo)]
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"still running after the server's stop: {left}")


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.2):
    """Poll until predicate() is truthy; returns its last value."""
    deadline = time.time() + timeout
    value = predicate()
    while not value and time.time() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


@contextmanager
def running_frontend(grpc_url, engine_dir, work, *extra_args, model: str = "smollm2"):
    """`python -m openai_frontend` on a free port, serving ``model``; yields its base URL once it answers."""
    port = free_port()
    log_path = work / f"frontend_{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "openai_frontend", f"--grpc_url={grpc_url}", f"--tokenizer_dir={engine_dir}",
             f"--served_model_name={model}", "--host=127.0.0.1", f"--port={port}", *extra_args],
            cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def up():  # it answers, ready (200) or not yet, like /health (503 while Triton is not ready)
        try:
            return requests.get(f"{url}/health", timeout=2).status_code in (200, 503)
        except requests.ConnectionError:
            return process.poll() is not None

    try:
        assert wait_for(up, timeout=120) and process.poll() is None, log_path.read_text()
        yield url
    finally:
        stop(process)


@contextmanager
def in_process_frontends(configs: dict):
    """OpenAI frontends (openai_frontend.app) of ``configs`` ({name: FrontendConfig}) in this process on free
    ports, served by one event loop in a thread (no interpreter, torch import and encoder load per frontend, as
    a `python -m openai_frontend` process has); yields {name: base url}."""
    import asyncio
    import threading

    from aiohttp import web

    from openai_frontend.app import create_app

    loop, started = asyncio.new_event_loop(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(30)
    urls, runners = {}, []
    try:
        for name, config in configs.items():
            runner, port = web.AppRunner(create_app(config)), free_port()

            async def start(runner=runner, port=port):
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()

            asyncio.run_coroutine_threadsafe(start(), loop).result(30)
            urls[name] = f"http://127.0.0.1:{port}"
            runners.append(runner)
        yield urls
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def write_peft_adapter(engine_dir: str, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA directory for the engine's model, every projection, B large enough to
    move greedy decoding (benchmarks/features/lora_bench.py writes it)."""
    import torch

    from benchmarks.features.lora_bench import write_peft_adapter as write_random_adapter
    from engine.config import EngineConfig

    write_random_adapter(EngineConfig.load(engine_dir).model, str(path), rank, seed, torch.float32, b_std=0.05)
    return path
