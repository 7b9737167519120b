"""Leader mode through a real tritonserver: scripts/launch_triton_server.py --world_size N.

SmolLM2 (9 q / 3 kv heads) built with tp_size 3 runs on 3 ranks (mpirun, oversubscribed on
the 2-core CI machine; gloo) and must answer a set of prompts through the ensemble exactly as
world size 1 does; a tiny random Llama built with tp_size 2 does the same on 2 ranks, and so
does the tiny Llama built with pp_size 2 (a pipeline stage per rank, every rank a tritonserver,
launched over a hostfile as a job spanning nodes is). Killing
a worker rank turns in-flight and new requests into error responses within seconds, and
the model and the ensemble then report not ready. SIGTERM to mpirun stops every rank.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import transformers

from engine.build import build_from_hf
from engine.config import BuildConfig
from engine.convert import getter_from_state_dict
from tp_testing import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="leader mode needs OpenMPI's mpirun"),
]

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write one sentence about the sea."]
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
# Enough for SmolLM2's "The capital of France is Paris." (7 tokens) and for the answers to part ways; every
# token costs a step of each server (on three oversubscribed ranks, the file's slowest part): 20 before.
MAX_TOKENS = 8


def load_script(name: str, folder: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


serve_default = load_script("serve_default", "scripts")
launcher = load_script("launch_triton_server", "scripts")


def build_engine(hf_model, tokenizer, out_dir: Path, tp_size: int, pp_size: int = 1) -> str:
    build = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=256, max_seq_len=512,
                        max_num_tokens=512, tokens_per_block=16, tp_size=tp_size, pp_size=pp_size)
    build_from_hf(hf_model.config, getter_from_state_dict(hf_model.state_dict(), "test"), tokenizer, str(out_dir),
                  build, progress=False)
    return str(out_dir)


def tiny_llama_with_smollm2_vocab() -> transformers.LlamaForCausalLM:
    """A 2-layer random Llama over SmolLM2's vocabulary, so the ensemble's tokenizer fits it."""
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    return model


ENSEMBLE_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")


def prepare_repo(engines_by_suffix: dict[str, str], work: Path, fill: dict | None = None) -> str:
    """One repository serving several engines: engine ``e`` under the model names ``<name><e>``.

    Each engine's models are filled by serve_default.prepare_model_repo, then renamed (with the
    ensemble's steps pointing at the renamed models). The BLS model is left out: not needed here,
    and one Python stub less to start on a 2-core machine. ``fill``: more tensorrt_llm parameters.
    """
    repo = work / "repo"
    repo.mkdir(parents=True)
    for suffix, engine_dir in engines_by_suffix.items():
        # Guided decoding off: no guide is sent here, and each leader would load xgrammar's vocabulary at start.
        filled = Path(serve_default.prepare_model_repo(engine_dir, str(work / f"filled{suffix}"), bls_instances=1,
                                                       overrides={"tensorrt_llm": {"guided_decoding_backend": "",
                                                                                   **(fill or {})}}))
        for model in ENSEMBLE_MODELS:
            shutil.copytree(filled / model, repo / f"{model}{suffix}")
            config = repo / f"{model}{suffix}" / "config.pbtxt"
            text = config.read_text().replace(f'name: "{model}"', f'name: "{model}{suffix}"', 1)
            for step in ENSEMBLE_MODELS:
                text = text.replace(f'model_name: "{step}"', f'model_name: "{step}{suffix}"')
            config.write_text(text)
    return str(repo)


class LeaderModeServer:
    """One launch of the launcher; ``stop()`` sends SIGTERM to mpirun (or tritonserver) and waits."""

    def __init__(self, engines_by_suffix: dict[str, str], world_size: int, work: Path, extra_flags=(),
                 fill: dict | None = None):
        self.work = work
        self.world_size = world_size
        repo = prepare_repo(engines_by_suffix, work, fill)
        self.repo, self.engine_dirs = repo, list(engines_by_suffix.values())
        self.ports = [str(free_port()) for _ in range(3)]
        flags = [f"--model_repo={repo}", "--host=127.0.0.1", f"--http_port={self.ports[0]}",
                 f"--grpc_port={self.ports[1]}", f"--metrics_port={self.ports[2]}", "--force",
                 f"--cache_dir={work / 'cache'}"]
        flags += ["--no-mpi"] if world_size == 1 else [f"--world_size={world_size}", "--oversubscribe"]
        flags += list(extra_flags)
        self.log_path = work / "server.log"
        with open(self.log_path, "w") as log:
            self.process = launcher.launch(launcher.parse_arguments(flags), stdout=log, stderr=log)
        if not serve_default.wait_until_ready(self.process, self.ports[0], timeout=300):
            self.stop()
            self.kill_leftovers()
            pytest.fail(f"world_size {world_size} server did not become ready:\n{self.log()[-6000:]}")

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The engine.tensor_parallel.worker ranks, found by their command line (whichever process launched them)."""
        return pids_matching(f"engine.tensor_parallel.worker --engine_dir={self.engine_dirs[0]}", name="python")

    def server_pids(self) -> list[int]:
        return pids_matching(f"--model-repository={self.repo}", name="tritonserver")

    def rank_pids(self) -> list[int]:
        return self.server_pids() + self.worker_pids()

    def generate(self, text: str, *, stream: bool = False, max_tokens: int = MAX_TOKENS, timeout: float = 120,
                 suffix: str = "", extra: dict | None = None):
        body = {"text_input": text, "max_tokens": max_tokens, "exclude_input_in_output": True, "stream": stream,
                **(extra or {})}
        endpoint = "generate_stream" if stream else "generate"
        return requests.post(f"{self.http}/v2/models/ensemble{suffix}/{endpoint}", json=body, timeout=timeout,
                             stream=stream)

    def answers(self, prompts: list[str], suffix: str = "", extra: dict | None = None) -> list[str]:
        """All prompts at once (so the leader batches them), in prompt order; ``extra``: more JSON
        fields for every request (a LoRA adapter's, say)."""
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda p: self.generate(p, suffix=suffix, extra=extra), prompts))
        for response in responses:
            assert response.status_code == 200, f"{response.text}\n{self.log()[-4000:]}"
        return [response.json()["text_output"] for response in responses]

    def stop(self, timeout: float = 60, via_mpirun: bool = False) -> None:
        """SIGTERM to tritonserver (rank 0 shuts down and releases the workers), or to mpirun
        (which forwards it to every rank after the launcher's odls_base_sigkill_timeout: 3 s here)."""
        if self.process.poll() is None:
            servers = [] if self.world_size == 1 or via_mpirun else self.server_pids()
            for pid in servers or [self.process.pid]:
                os.kill(pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL to every rank and to the launch, for a server whose shutdown is not what its test
        checks (a graceful stop took 5-10 s of each such test); then ``kill_leftovers`` for its stubs."""
        for pid in self.rank_pids() + ([self.process.pid] if self.process.poll() is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """After a failed shutdown, ranks and Python-backend stubs of this server (found by its
        unique repository and engine paths) would outlive the test: kill them (at once: a second's
        sleep here, for them to go by themselves, was a second of every test)."""
        for pid in pids_matching(self.repo) + self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def short_timeouts():
    """Faster fault detection for these servers (the launcher passes the environment on), and SIGTERM to
    mpirun reaching the ranks after 3 s instead of 10 (the tiny jobs' shutdowns take less)."""
    saved = {k: os.environ.get(k) for k in ("TRITONLLM_DIST_HEARTBEAT_S", "TRITONLLM_DIST_TIMEOUT_S",
                                            "TRITONLLM_MPIRUN_SIGKILL_TIMEOUT_S")}
    os.environ.update(TRITONLLM_DIST_HEARTBEAT_S="0.5", TRITONLLM_DIST_TIMEOUT_S="20",
                      TRITONLLM_MPIRUN_SIGKILL_TIMEOUT_S="3")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def engines(smollm2_hf, tmp_path_factory):
    """The tiny Llama's engines (SmolLM2's tokenizer in each). SmolLM2's own are the extended test's
    (smollm2_engines): `make test` serves none of them, and builds none."""
    _, tokenizer = smollm2_hf
    root = tmp_path_factory.mktemp("tp_serving_engines")
    tiny = tiny_llama_with_smollm2_vocab()
    return {
        "tiny_tp1": build_engine(tiny, tokenizer, root / "tiny_tp1", 1),
        "tiny_tp2": build_engine(tiny, tokenizer, root / "tiny_tp2", 2),
        "tiny_pp2": build_engine(tiny, tokenizer, root / "tiny_pp2", 1, pp_size=2),
    }


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_hf, smollm2_engine_dir, tmp_path_factory):
    model, tokenizer = smollm2_hf
    return {
        "smollm2_tp1": smollm2_engine_dir,  # the session's float32 engine: the same weights
        "smollm2_tp3": build_engine(model, tokenizer, tmp_path_factory.mktemp("smollm2_tp3"), 3),
    }


@pytest.fixture(scope="module")
def tiny_adapter(engines, tmp_path_factory) -> dict:
    """A rank-16 PEFT adapter of the tiny Llama, as the ensemble's LoRA inputs (lora_id, lora_path)."""
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from triton_helpers import write_peft_adapter

    path = write_peft_adapter(engines["tiny_tp1"], tmp_path_factory.mktemp("tiny_lora") / "adapter", 16, seed=7)
    return {"lora_id": 11, "lora_path": str(path), "lora_name": "tiny16"}


SMOLLM2_PROMPTS = [CHAT.format(q) for q in QUESTIONS]
TINY_PROMPTS = [CHAT.format(q) for q in QUESTIONS[:2]]


@pytest.fixture(scope="module")
def single_rank_answers(engines, tiny_adapter, tmp_path_factory, short_timeouts):
    """World size 1: the tiny tp-1 engine, also with its LoRA adapter. (SmolLM2 was served beside it for
    the extended test alone: a SmolLM2 engine and three more stubs in every `make test`; that test
    now starts its own world-1 server.)"""
    server = LeaderModeServer({"": engines["tiny_tp1"]}, 1, tmp_path_factory.mktemp("world1"))
    try:
        return {"tiny": server.answers(TINY_PROMPTS), "tiny_lora": server.answers(TINY_PROMPTS, extra=tiny_adapter)}
    finally:
        server.kill()


def pids_matching(text: str, name: str | None = None) -> list[int]:
    """Live processes whose command line contains ``text`` (and whose name starts with ``name``:
    mpirun's own command line holds every rank's)."""
    found = subprocess.run(["pgrep", "-f", "--", text], capture_output=True, text=True).stdout.split()
    pids = [int(pid) for pid in found if int(pid) != os.getpid() and not is_gone(int(pid))]
    if name is not None:
        pids = [pid for pid in pids if (process_name(pid) or "").startswith(name)]
    return pids


def process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def is_gone(pid: int) -> bool:
    """Exited (a zombie counts: this container's init may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_launcher_refuses_an_engine_built_for_another_world_size(engines, tmp_path):
    # (The tiny tp-2 engine on 3 ranks; SmolLM2's tp-3 engine on 2 before: the launcher reads only the
    # engine's config.json, check_engine_world_size, and SmolLM2's build is the extended test's now.)
    repo = prepare_repo({"": engines["tiny_tp2"]}, tmp_path)
    args = launcher.parse_arguments([f"--model_repo={repo}", "--world_size=3", "--http_port=0", "--grpc_port=0",
                                     "--metrics_port=0", "--force", f"--cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(RuntimeError, match=r"built with tp_size 2 .*needs --world_size 2.* --world_size is 3"):
        launcher.launch(args)


# `make test-all` (17.6 s of CI's fresh clone): make test serves leader mode through the launcher and mpirun in the
# pipeline test below (two ranks, each a tritonserver, answering like world size 1, a dead rank failing requests),
# decodes tensor-parallel on two real ranks in tests/distributed/test_tp_engine.py (greedy and overlapped equal
# TP 1) and with LoRA adapters in tests/engine/test_lora_merged.py::test_tp2_with_adapters_equals_tp1 (the ranks'
# shards of A and B; the plan's adapter slots: test_tp_engine's test_batch_encoding_round_trips; enable_lora and
# load_adapter reach the workers as every MIRRORED_METHODS call does, allocate_kv_cache and warmup there). Only here:
# the default python worker rank started by mpirun under tritonserver, and SIGTERM to mpirun stopping every rank.
@pytest.mark.extended
def test_tiny_llama_on_two_ranks_answers_like_one(engines, single_rank_answers, tiny_adapter, tmp_path,
                                                  short_timeouts):
    """Also with a LoRA adapter: the leader loads it into the same slot on both ranks (each its
    shards of A and B) and sends each step's adapter slots in the plan."""
    server = LeaderModeServer({"": engines["tiny_tp2"]}, 2, tmp_path)
    ranks = []
    try:
        assert server.answers(TINY_PROMPTS) == single_rank_answers["tiny"]
        assert single_rank_answers["tiny_lora"] != single_rank_answers["tiny"]
        assert server.answers(TINY_PROMPTS, extra=tiny_adapter) == single_rank_answers["tiny_lora"]
        ranks = server.rank_pids()
        assert len(ranks) == 2 and len(server.worker_pids()) == 1
    finally:
        server.stop(via_mpirun=True)
        # A rank mpirun SIGKILLed may still be in the kernel's exit (its memory unmapped) as mpirun
        # returns: seen as a leftover under load (2 of 4 runs at load 8, the pid gone by the ps below).
        # Gone within 5 s, with no signal from here, still means mpirun's SIGTERM stopped it.
        wait_for(lambda: all(is_gone(pid) for pid in ranks), timeout=5, interval=0.05)
        still_running = [pid for pid in ranks if not is_gone(pid)]
        server.kill_leftovers()
    # SIGTERM to mpirun stopped every rank.
    assert server.process.returncode is not None
    assert not still_running, subprocess.run(["ps", "-ef"], capture_output=True, text=True).stdout


# `make test-all`: make test serves two ranks (the tests above) and fails a dead rank's leader in
# tests/distributed/test_tp_engine.py; this is SmolLM2 on three oversubscribed ranks (~25 s on 2 cores).
@pytest.mark.extended
def test_smollm2_on_three_ranks_answers_like_one_and_survives_a_dead_rank(smollm2_engines, tmp_path, short_timeouts):
    server = LeaderModeServer({"": smollm2_engines["smollm2_tp1"]}, 1, tmp_path / "world1")
    try:
        single_rank = server.answers(SMOLLM2_PROMPTS)
    finally:
        server.kill()
    assert "Paris" in single_rank[0]
    server = LeaderModeServer({"": smollm2_engines["smollm2_tp3"]}, 3, tmp_path / "world3")
    try:
        assert server.answers(SMOLLM2_PROMPTS) == single_rank
        assert_dead_rank_fails_requests_fast(server)
    finally:  # (stopping every rank by SIGTERM to mpirun is the two-rank test's)
        server.kill()


def test_tiny_llama_in_two_pipeline_stages_over_a_hostfile_answers_like_one(engines, single_rank_answers, tmp_path,
                                                                           short_timeouts, monkeypatch):
    """pp 2: rank 0 embeds and runs layer 0, rank 1 runs layer 1 and the logits, with two steps in
    flight (TRITONLLM_PP_STEPS_IN_FLIGHT=2, engine/pipeline/in_flight.py). Started as a job
    across nodes is: over a hostfile (this machine's two slots; the ranks meet at its first host),
    every rank a tritonserver with its own shared-memory prefix, as NVIDIA's Slurm and Kubernetes
    recipes start them (rank 1's tensorrt_llm model runs its worker inside initialize() and never
    serves). A killed stage fails requests within seconds, as a killed tensor-parallel rank does."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    monkeypatch.setenv("TRITONLLM_PP_STEPS_IN_FLIGHT", "2")  # (the launcher passes the environment on)
    server = LeaderModeServer({"": engines["tiny_pp2"]}, 2, tmp_path,
                              extra_flags=[f"--hostfile={hostfile}", "--worker_ranks=tritonserver"])
    try:
        assert server.answers(TINY_PROMPTS) == single_rank_answers["tiny"]
        assert_dead_rank_fails_requests_fast(server, workers=1)
    finally:
        server.kill()


def assert_dead_rank_fails_requests_fast(server: LeaderModeServer, workers: int = 2) -> None:
    stream = server.generate(CHAT.format("Tell me a long story about a dragon."), stream=True, max_tokens=400)
    lines = stream.iter_lines()
    first = next(line for line in lines if line.startswith(b"data: "))
    assert "error" not in json.loads(first[len(b"data: "):])  # generating, across 3 ranks
    pids = server.worker_pids()
    assert len(pids) == workers
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    # In flight: the stream ends with an error event, within seconds.
    events = [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: ")]
    assert events and "error" in events[-1], events[-3:]
    assert events[-1]["error"].count("tensor-parallel rank failure") == 1 and "Traceback" not in events[-1]["error"], events[-1]
    assert time.monotonic() - killed_at < 10
    # New requests: an error response, also within seconds (the rank failure, or once the model
    # has unloaded itself, "unknown model").
    started = time.monotonic()
    response = server.generate(CHAT.format("Are you there?"), timeout=30)
    assert response.status_code >= 400 and ("rank failure" in response.text or "unknown model" in response.text)
    assert time.monotonic() - started < 10
    # The model, and the ensemble that uses it, report not ready.
    for model in ("tensorrt_llm", "ensemble"):
        assert wait_for(lambda: requests.get(f"{server.http}/v2/models/{model}/ready", timeout=5).status_code != 200,
                        timeout=10), f"{model} still ready"
    assert "rank failure" in server.log()


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


# `make test-all`: T5 at TP 2 is tests/distributed/test_encdec_tp.py's (the executor on two ranks, no server); this
# is the served path: the anchor's --world_size launch of the stock repository filled for the T5 decoder.
@pytest.mark.extended
def test_tiny_t5_on_two_ranks_translates_like_transformers(tmp_path, short_timeouts):
    """The tiny T5 v1.1 (tests/tiny_encdec.py) built with tp_size 2, its repository filled with engine_dir the
    decoder (the worker rank finds encoder/ beside it), served on two ranks: the ensemble's answer to the
    anchor's request is the text of transformers' greedy ids, unary and streamed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from engine.build import main as build_main
    from serving.tokenization import decode_tokens
    from tiny_encdec import generate, tokenizer, write_checkpoint

    model = write_checkpoint("t5_v1_1", tmp_path / "checkpoint")
    assert build_main(["--checkpoint", str(tmp_path / "checkpoint"), "--output", str(tmp_path / "engine"),
                       "--dtype", "float32", "--max_encoder_input_len", "64", "--max_seq_len", "64",
                       "--tp_size", "2"]) == 0
    prompt = "translate English to German: This is good"
    ids, _ = generate(model, tokenizer()(prompt).input_ids, MAX_TOKENS)
    expected = decode_tokens(tokenizer(), ids[1:])
    assert expected.strip()
    server = LeaderModeServer({"": str(tmp_path / "engine" / "decoder")}, 2, tmp_path / "served",
                              fill={"enable_lora": "false"})  # (no adapters for encoder-decoder engines)
    try:
        assert server.answers([prompt] * 2, extra={"bad_words": "", "stop_words": ""}) == [expected] * 2
        streamed = server.generate(prompt, stream=True, extra={"bad_words": "", "stop_words": ""})
        assert streamed.status_code == 200, streamed.text
        chunks = [json.loads(line[len(b"data: "):])["text_output"] for line in streamed.iter_lines()
                  if line.startswith(b"data: ")]
        assert "".join(chunks) == expected
        assert len(server.worker_pids()) == 1
    finally:
        server.kill()
