#!/usr/bin/env python3
"""End-to-end serving benchmark: what the Triton serving layer costs next to the in-process engine.

    python benchmarks/serving/serving_bench.py --engine_dir engines/smollm2 --clients 1,4 \\
        --input_len 32 --output_len 16 --requests_per_client 2 --out serving.json --results_md benchmarks/results/serving.md
    python benchmarks/serving/serving_bench.py --model llama8b --dtype bfloat16 --synthetic_tokenizer ...

One engine, one executor configuration, one run; for each number of concurrent clients, these paths
(``--paths``, default http,grpc,engine):

- ``http``:   ``POST /v2/models/ensemble/generate_stream`` (server-sent events, aiohttp);
- ``grpc``:   tritonclient.grpc ``start_stream``/``async_stream_infer`` into the ensemble;
- ``grpc_bls``: the same into ``tensorrt_llm_bls``, with exactly the inputs the OpenAI frontend
  sends (log-probs on, temperature 0, top_p 1, min_tokens = max_tokens instead of end_id -1);
- ``openai``: streamed ``/v1/completions`` (or ``/v1/chat/completions`` with ``--openai_api chat``)
  through the OpenAI-compatible frontend (``python -m openai_frontend``, started by the launcher's
  ``--openai_port``), which sends token ids straight to ``tensorrt_llm`` (its default entry); the
  client is aiohttp reading SSE, one connection per client, min_tokens = max_tokens = output_len,
  temperature 0;
- ``openai_bls``: the same through a second frontend whose entry model is ``tensorrt_llm_bls``;
- ``engine``: ``engine.executor.Executor`` in this process, token ids in and out (the baseline).

The OpenAI paths are compared with ``grpc`` (issue 15: >= 0.95 of its throughput, < 3 ms added
TTFT, medians) and with ``grpc_bls``, in a second table.

Both served paths go through a real tritonserver (started by scripts/launch_triton_server.py on
127.0.0.1, free ports, decoupled repository filled by scripts/serve_default.py's
``prepare_model_repo``): preprocessing (tokenize) -> tensorrt_llm (the same Executor, in the
Python-backend stub) -> postprocessing (detokenize), one response per streamed token.

The server and the in-process executor stay loaded side by side (fixed, equal KV pools; the one not
being measured is idle) and the paths run interleaved per setting, ``--rounds`` times, the best
round of each reported: slow drift (other load on a shared CPU) does not land on one path only.
On CPU both engines get one torch thread (``--cpu_threads``). The GPU recipe is
benchmarks/serving/gpu_serving_run.sh. The load is a closed loop: ``clients`` clients each send ``requests_per_client`` requests one
after another, every prompt exactly ``input_len`` tokens, ``end_id`` -1 (never produced, so each
request makes exactly ``output_len`` tokens), greedy. The baseline gets the very token ids the
preprocessing model makes of the same prompts. All times are taken by the client:

- output tokens/s: requests x output_len / (last final response - first send);
- TTFT: first streamed response - send; ITL: gaps between a request's streamed responses;
  TPOT: (last - first response) / (output_len - 1), which stays right if responses coalesce.

Serving overhead = served tokens/s / engine tokens/s (goal: >= 0.90) and served TTFT - engine TTFT
(medians; goal: a few ms). Own-response tokens: the share of output tokens that reached the client
in a response of their own (served: from the server's tritonllm_streamed/coalesced_tokens_total
counters around each timed run; engine: its responses; with --synthetic_tokenizer the client also
counts the words of each response). ``--variants`` serves several repositories one after another
beside the one in-process engine (e.g. 1 vs 4 ``tensorrt_llm`` instances, same lease);
``--client_processes`` spreads a served path's clients over worker processes. Engines: an engine directory (``--engine_dir``), or a config-only
engine with random weights of a named shape (``--model``, weights made on the device at load).
A random-weight model emits any id below its vocab size, so its tokenizer must cover the whole
vocab: ``--tokenizer_dir`` (a real one of that size) or ``--synthetic_tokenizer`` (one word per id).

A second table says where each timed run's time went (benchmarks/serving/serving_diagnostics.py): the
engine's step medians from its iteration log, the CPU each process used, and Triton's per-model
queue and execute times.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from engine.executor.stats import ITERATION_LOG_ENV  # noqa: E402
from benchmarks.common import (REPO_ROOT, command_line, descendant_pids, environment_set, git_commit,  # noqa: E402
                               is_final_response, load_script, machine_description, percentile, process_tree,
                               utc_now, write_config_only_engine)
from benchmarks.serving.serving_diagnostics import (RunDiagnostics, describe as describe_diagnostics,  # noqa: E402
                                                    metric_totals)

GOALS = {"throughput_ratio": 0.90, "added_ttft_ms": 5.0,
         "openai_throughput_ratio": 0.95, "openai_added_ttft_ms": 3.0}  # openai vs grpc (issue 15)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SERVED_PATHS = ("http", "grpc", "grpc_bls", "openai", "openai_bls")
ALL_PATHS = ("engine",) + SERVED_PATHS
OPENAI_MODEL_NAME = "bench"
# A served stream that sends nothing for this long has stalled (--stall_timeout; the environment
# carries it to the client worker processes). Well under gpu_serving_run.sh's per-model budget, so
# a stall ends as an error naming the path, with the stubs' stacks in the server log, not as a kill.
STALL_TIMEOUT_ENV = "SERVING_BENCH_STALL_TIMEOUT_S"
DEFAULT_STALL_TIMEOUT_S = 120.0


class StallError(RuntimeError):
    """A served stream sent nothing for stall_timeout_s()."""


def stall_timeout_s() -> float:
    return float(os.environ.get(STALL_TIMEOUT_ENV, DEFAULT_STALL_TIMEOUT_S))


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One request as its client saw it: send time and arrival time of each streamed response."""

    sent: float
    events: list[float] = field(default_factory=list)
    tokens: int = 0  # counted where the path says (engine: token ids; served: output_len assumed)
    # Tokens in each event, where the client can count them (engine: ids; served: words of the
    # synthetic one-word-per-id tokenizer); empty where it cannot (a real tokenizer's text).
    event_tokens: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.events[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.events, self.events[1:])]


def own_response_fraction(timings: list[Timing], output_len: int) -> float | None:
    """Share of the output tokens that reached the client in a response of their own (None when
    the client could not count tokens per response)."""
    if not timings or any(not t.event_tokens for t in timings):
        return None
    alone = sum(1 for t in timings for n in t.event_tokens if n == 1)
    return min(1.0, alone / (len(timings) * output_len))


def summarize(timings: list[Timing], output_len: int, clients: int, path: str) -> dict:
    """Aggregate one (path, clients) setting; times in ms, throughput in output tokens/s."""
    if not timings or any(not t.events for t in timings):
        raise RuntimeError(f"{path} with {clients} clients: a request got no streamed response")
    start = min(t.sent for t in timings)
    end = max(t.events[-1] for t in timings)
    tokens = len(timings) * output_len
    ttfts = [1e3 * t.ttft for t in timings]
    gaps = [1e3 * g for t in timings for g in t.gaps]
    tpots = [1e3 * (t.events[-1] - t.events[0]) / (output_len - 1) for t in timings] if output_len > 1 else [0.0]
    return {
        "path": path, "clients": clients, "requests": len(timings), "output_tokens": tokens,
        "seconds": end - start, "tok_s": tokens / (end - start),
        "ttft_ms_median": statistics.median(ttfts), "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_median": statistics.median(gaps) if gaps else 0.0, "itl_ms_p99": percentile(gaps, 99) if gaps else 0.0,
        "tpot_ms_median": statistics.median(tpots),
        "responses_per_request": sum(len(t.events) for t in timings) / len(timings),
        "own_response_fraction_client": own_response_fraction(timings, output_len),
    }


# ------------------------------------------------------------------------------------------------
# the engine and its prompts
# ------------------------------------------------------------------------------------------------


def write_random_engine(engine_dir: Path, model: str, dtype: str, max_batch_size: int, max_seq_len: int,
                        max_num_tokens: int, tokens_per_block: int) -> None:
    """A config-only engine directory (random weights made on the device at load, seed 0) whose
    prompts may fill the whole sequence (max_input_len = max_seq_len)."""
    write_config_only_engine(model, dtype, max_batch_size, max_seq_len, max_num_tokens, tokens_per_block,
                             engine_dir=str(engine_dir), max_input_len=max_seq_len)


def write_synthetic_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly one word per id (``<eos>``, ``<pad>``, ``<unk>``, w3 ...).

    Why: a random-weight model emits any id below its vocab size; a tokenizer of another model
    (SmolLM2: 49,152 ids) cannot decode Llama-3.1-8B's 128,256, while this one decodes every id,
    so the whole ensemble (tokenize -> generate -> detokenize) runs unchanged. Words are split on
    whitespace, so a prompt of n words is exactly n tokens.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<eos>", "<pad>", "<unk>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tokenizer.save_pretrained(str(folder))


def prepare_engine(args: argparse.Namespace, work: Path) -> str:
    """The engine directory to serve, with tokenizer files that cover its vocabulary."""
    if args.engine_dir:
        return os.path.abspath(args.engine_dir)
    engine_dir = work / "engine"
    engine_dir.mkdir(parents=True, exist_ok=True)
    max_clients = max(args.clients)
    seq_len = args.input_len + args.output_len
    write_random_engine(engine_dir, args.model, args.dtype, max_batch_size=max_clients, max_seq_len=seq_len,
                        max_num_tokens=max(args.max_num_tokens, seq_len), tokens_per_block=args.tokens_per_block)
    if args.synthetic_tokenizer:
        from benchmarks.common import MODELS

        write_synthetic_tokenizer(engine_dir, MODELS[args.model]["vocab_size"])
    elif args.tokenizer_dir:
        for name in TOKENIZER_FILES:
            if (Path(args.tokenizer_dir) / name).exists():
                shutil.copy(Path(args.tokenizer_dir) / name, engine_dir / name)
    else:
        raise SystemExit("--model needs --tokenizer_dir or --synthetic_tokenizer")
    return str(engine_dir)


def check_tokenizer_covers_vocab(tokenizer, vocab_size: int) -> None:
    if len(tokenizer) < vocab_size:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} ids but the model emits ids up to {vocab_size - 1}; "
                         "pass --synthetic_tokenizer (or a tokenizer of the model's vocab size)")


def single_token_words(tokenizer, limit: int = 4000) -> list[str]:
    """Alphabetic words that are one token both alone and after a space (so n words = n tokens)."""
    words = []
    for token_id in range(min(len(tokenizer), limit)):
        word = tokenizer.decode([token_id]).strip()
        if word.isalnum() and word.isascii() and len(word) > 1:
            if (len(tokenizer.encode(word, add_special_tokens=False)) == 1
                    and len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1):
                words.append(word)
    return sorted(set(words))


def make_prompts(tokenizer, count: int, input_len: int, seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """`count` distinct prompts of exactly `input_len` tokens, and their ids as preprocessing makes them."""
    words = single_token_words(tokenizer)
    if len(words) < 16:
        raise SystemExit("could not find enough single-token words in the tokenizer to build prompts")
    rng = random.Random(seed)
    special = len(tokenizer.encode("", add_special_tokens=True))  # a BOS, if the tokenizer adds one
    prompts, ids = [], []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(input_len - special))
        token_ids = tokenizer.encode(text, add_special_tokens=True)
        if len(token_ids) != input_len:
            raise RuntimeError(f"a prompt came out as {len(token_ids)} tokens, not {input_len}")
        prompts.append(text)
        ids.append(token_ids)
    return prompts, ids


# ------------------------------------------------------------------------------------------------
# the repository and the server
# ------------------------------------------------------------------------------------------------


VARIANT_SETTINGS = ("engine_process", "tensorrt_llm_instances", "preprocessing_instances", "postprocessing_instances",
                    "read_poll_us", "stream_interval", "prefill_graphs")


def parse_variants(text: str | None, args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """--variants "before:tensorrt_llm_instances=1 after:tensorrt_llm_instances=4" -> named
    server settings, each starting from the single-value flags; none given: one unnamed variant."""
    defaults = {name: str(getattr(args, name)) for name in VARIANT_SETTINGS}
    if not text:
        return [("", defaults)]
    variants = []
    for item in text.split():
        name, _, pairs = item.partition(":")
        settings = dict(defaults)
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            if key not in VARIANT_SETTINGS or not value:
                raise SystemExit(f"--variants: {pair!r} in {item!r} is not <setting>=<value> with a setting of "
                                 f"{', '.join(VARIANT_SETTINGS)}")
            settings[key] = value
        variants.append((name, settings))
    return variants


def repo_overrides(settings: dict[str, str], kv_tokens: int) -> dict[str, dict[str, str]]:
    """What this benchmark changes in serve_default's repository: a fixed KV pool (so both paths get
    the same one whatever memory the other holds), no prefix reuse, beam width 1, and the variant's
    settings (parse_variants)."""
    return {
        "tensorrt_llm": {"max_tokens_in_paged_kv_cache": str(kv_tokens), "enable_kv_cache_reuse": "False",
                         "max_beam_width": "1", "exclude_input_in_output": "True",
                         "engine_process": settings["engine_process"], "stream_interval": settings["stream_interval"]},
        "postprocessing": {"postprocessing_instance_count": settings["postprocessing_instances"]},
        "preprocessing": {"preprocessing_instance_count": settings["preprocessing_instances"]},
    }


def server_environment(settings: dict[str, str]) -> dict[str, str]:
    """Environment variables a variant sets for its server (and so its stubs and engine process)."""
    from engine.executor.engine_process import READ_POLL_ENV
    from engine.executor.runner import PREFILL_GRAPHS_ENV

    names = {"read_poll_us": READ_POLL_ENV, "prefill_graphs": PREFILL_GRAPHS_ENV}
    return {env: settings[key] for key, env in names.items() if settings.get(key) not in (None, "None")}


def set_instance_count(repo: str, model: str, count: int) -> None:
    """Set the instance_group count of a filled model config (the tensorrt_llm template has a
    literal 1, as the reference's does)."""
    path = Path(repo) / model / "config.pbtxt"
    text, replaced = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", rf"\g<1>{count}", path.read_text())
    if replaced != 1:
        raise RuntimeError(f"no instance_group count found in {path}")
    path.write_text(text)


def tensorrt_llm_parameters(repo: str) -> dict[str, str]:
    """The filled ``parameters`` of the served tensorrt_llm model (as model.py reads them)."""
    text = (Path(repo) / "tensorrt_llm" / "config.pbtxt").read_text()
    pairs = re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    return {key: value for key, value in pairs}


def executor_config_of_repo(repo: str):
    """The ExecutorConfig the served tensorrt_llm model builds, made the same way (serving's mapping)."""
    from engine.executor import ExecutorConfig
    from serving.executor_config import executor_settings, to_executor_config

    settings = executor_settings(tensorrt_llm_parameters(repo), {})
    config, _ = to_executor_config(ExecutorConfig, settings)
    return config


class ServedEnsemble:
    """A tritonserver over a filled repository, started by the project's launcher; a context manager."""

    def __init__(self, repo: str, work: Path, ready_timeout: float, openai: bool = False,
                 openai_bls: bool = False, openai_workers: int | None = None, environment: dict[str, str] | None = None):
        self.serve = load_script("serve_default")
        self.launcher = load_script("launch_triton_server")
        ports = [str(self.launcher.free_port()) for _ in range(5)]
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port, self.openai_bls_port = ports
        self.openai_bls = openai_bls  # a second frontend whose entry model is tensorrt_llm_bls
        self.log_path = work / "tritonserver.log"
        self.iteration_log = work / "engine_iterations.log"  # the served engine's steps (serving_diagnostics)
        self.frontend_log_path = work / "openai_frontend.log"
        # No --openai_workers: the launcher's own default (one per 4 cores), as a user gets it.
        openai_flags = ([f"--openai_port={ports[3]}", f"--openai_model_name={OPENAI_MODEL_NAME}",
                         *([f"--openai_workers={openai_workers}"] if openai_workers else [])]
                        if openai or openai_bls else [])
        self.args = self.launcher.parse_arguments([
            f"--model_repo={repo}", "--no-mpi", "--host=127.0.0.1", "--force", f"--http_port={ports[0]}",
            f"--grpc_port={ports[1]}", f"--metrics_port={ports[2]}", f"--cache_dir={work / 'cache'}", *openai_flags])
        self.ready_timeout = ready_timeout
        self.environment = environment or {}  # set for the server's lifetime (its processes inherit it)
        self.process = None
        self.frontends = []  # the OpenAI frontend processes (the BLS-entry one second)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def openai_bls_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_bls_port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def __enter__(self) -> "ServedEnsemble":
        # The Python models import engine/ and serving/ from here where tritonllm is not installed.
        os.environ.setdefault("TRITONLLM_ROOT", str(REPO_ROOT))
        started = time.perf_counter()
        # The server's processes inherit these (ITERATION_LOG_ENV: the engine process's steps).
        with environment_set({**self.environment, ITERATION_LOG_ENV: str(self.iteration_log)}):
            with open(self.log_path, "w") as log:
                self.process = self.launcher.launch(self.args, stdout=log, stderr=log)
        try:
            ready = self.serve.wait_until_ready(self.process, self.http_port, timeout=self.ready_timeout)
        except BaseException:  # a time limit (SIGTERM -> SystemExit) during the load: stop it too
            self.__exit__()
            raise
        if not ready:
            self.__exit__()
            raise RuntimeError(f"tritonserver did not become ready; its log ends:\n{self.log_tail()}")
        self.load_seconds = time.perf_counter() - started
        if self.args.openai_port:
            self._start_frontend()
        return self

    def _start_frontend(self) -> None:
        """The launcher's frontend (entry: tensorrt_llm), and with openai_bls a second one on its own
        port whose entry is tensorrt_llm_bls (same server, same request handling otherwise)."""
        entries = [(self.openai_port, None, self.frontend_log_path)]
        if self.openai_bls:
            entries.append((self.openai_bls_port, "tensorrt_llm_bls", self.frontend_log_path.with_name(
                "openai_frontend_bls.log")))
        for port, entry_model, log_path in entries:
            args = argparse.Namespace(**{**vars(self.args), "openai_port": port, "openai_entry_model": entry_model})
            with open(log_path, "w") as log:
                frontend = self.launcher.launch_openai_frontend(args, stdout=log, stderr=log)
            self.frontends.append(frontend)
            if not self.serve.wait_until_frontend_ready(frontend, port, timeout=120):
                self.__exit__()
                raise RuntimeError(f"the OpenAI frontend (port {port}) did not become ready; its log ends:\n"
                                   + log_path.read_text(errors="replace")[-4000:])

    def __exit__(self, *exc) -> None:
        for frontend in self.frontends:
            if frontend.poll() is None:
                frontend.terminate()
                try:
                    frontend.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    frontend.kill()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:  # it waits up to 30 s for open connections by default; do not
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------------------------------------------
# the paths: each runs the closed loop and returns one Timing per request
# ------------------------------------------------------------------------------------------------


class PromptFeed:
    """Hands out prompts round-robin to every client (thread-safe)."""

    def __init__(self, prompts: list, ids: list[list[int]]):
        self.prompts, self.ids, self.next = prompts, ids, 0
        self.lock = threading.Lock()

    def take(self) -> tuple[str, list[int]]:
        with self.lock:
            index = self.next % len(self.prompts)
            self.next += 1
        return self.prompts[index], self.ids[index]


async def http_client(session, url: str, feed: PromptFeed, requests: int, output_len: int,
                      count_words: bool = False) -> list[Timing]:
    timings = []
    for _ in range(requests):
        prompt, _ = feed.take()
        body = {"text_input": prompt, "max_tokens": output_len, "stream": True, "end_id": -1,
                "exclude_input_in_output": True}
        timing = Timing(sent=time.perf_counter())
        async with session.post(url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"generate_stream error: {event['error']}")
                if "text_output" in event:
                    timing.events.append(time.perf_counter())
                    if count_words:
                        timing.event_tokens.append(len(event["text_output"].split()))
        timings.append(timing)
    return timings


def run_http(server_url: str, feed: PromptFeed, clients: int, requests: int, output_len: int,
             count_words: bool = False) -> list[Timing]:
    """`clients` concurrent SSE streams on one event loop (one connection each)."""
    url = f"{server_url}/v2/models/ensemble/generate_stream"
    return run_sse_clients(lambda session: http_client(session, url, feed, requests, output_len, count_words),
                           clients, "http (ensemble generate_stream)")


def run_sse_clients(client, clients: int, label: str) -> list[Timing]:
    """``clients`` concurrent ``client(session)`` coroutines (one SSE connection each) on one event
    loop; a read that waits longer than the stall timeout fails the run."""
    import aiohttp

    async def main() -> list[Timing]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=stall_timeout_s())
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            per_client = await asyncio.gather(*[client(session) for _ in range(clients)])
        return [t for timings in per_client for t in timings]

    return run_stream_loop(main(), label)


def run_stream_loop(coroutine, what: str) -> list[Timing]:
    """asyncio.run for the aiohttp paths; a read that waited stall_timeout_s() becomes a StallError."""
    try:
        return asyncio.run(coroutine)
    except asyncio.TimeoutError:
        raise StallError(f"{what}: a stream sent nothing for {stall_timeout_s():.0f} s") from None


def grpc_inputs(prompt: str, output_len: int, like_openai: bool = False) -> list:
    """The ensemble request of the http/grpc paths, or (``like_openai``) exactly what the OpenAI
    frontend sends tensorrt_llm_bls for a greedy request of output_len tokens."""
    import numpy as np

    arrays = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[output_len]], np.int32), "stream": np.array([[True]], np.bool_),
              "exclude_input_in_output": np.array([[True]], np.bool_)}
    if like_openai:
        arrays.update({"return_log_probs": np.array([[True]], np.bool_),
                       "temperature": np.array([[0.0]], np.float32), "top_p": np.array([[1.0]], np.float32),
                       "min_tokens": np.array([[output_len]], np.int32)})
    else:
        arrays["end_id"] = np.array([[-1]], np.int32)
    return grpc_tensors(arrays)


def grpc_tensors(arrays: dict) -> list:
    """name -> numpy array, as tritonclient gRPC inputs."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_client(url: str, feed: PromptFeed, requests: int, output_len: int, timings: list, errors: list,
                model: str = "ensemble", count_words: bool = False) -> None:
    """One client: one bidirectional stream, requests one after another, each until its final response."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    arrivals: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)))
    failed = False
    try:
        for index in range(requests):
            prompt, _ = feed.take()
            inputs = grpc_inputs(prompt, output_len, like_openai=model == "tensorrt_llm_bls")
            timing = Timing(sent=time.perf_counter())
            client.async_stream_infer(model, inputs, request_id=str(index), enable_empty_final_response=True)
            while True:
                try:
                    when, result, error = arrivals.get(timeout=stall_timeout_s())
                except queue.Empty:
                    raise StallError(f"gRPC into {model}: nothing for {stall_timeout_s():.0f} s on this client's "
                                     f"request {index} ({len(timing.events)} text responses of it so far)") from None
                if error is not None:
                    raise RuntimeError(f"gRPC stream error: {error}")
                text = result.as_numpy("text_output")
                if text is not None and (model == "ensemble" or text.reshape(-1)[0]):
                    timing.events.append(when)  # (the BLS's empty final-chunk text is no token)
                    if count_words:
                        timing.event_tokens.append(len(text.reshape(-1)[0].split()))
                if is_final_response(result):
                    break
            timings.append(timing)
    except Exception as error:  # noqa: BLE001 - reported by the caller after all threads end
        failed = True
        errors.append(error)
    finally:
        # After a failure (a stall above all) cancel what is in flight: a plain stop_stream waits
        # for every request's final response, and a stalled one never sends it.
        client.stop_stream(cancel_requests=failed)
        client.close()


def run_grpc(grpc_url: str, feed: PromptFeed, clients: int, requests: int, output_len: int,
             model: str = "ensemble", count_words: bool = False) -> list[Timing]:
    """`clients` threads, each with its own gRPC stream (tritonclient delivers through callbacks)."""
    timings: list[Timing] = []
    errors: list[Exception] = []
    threads = [threading.Thread(target=grpc_client,
                                args=(grpc_url, feed, requests, output_len, timings, errors, model, count_words))
               for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return timings


class ClientProcesses:
    """The served paths' clients spread over worker processes.

    Why: one Python process receiving every stream's responses is itself paced by its interpreter
    lock (256 streams of the 8B shape make about 20,000 responses a second), which would read as
    lumps of the server. Each worker runs its share of the clients (``run_http``/``run_grpc`` on
    its own prompts) and returns their timings; ``time.perf_counter`` is CLOCK_MONOTONIC, one clock
    for every process of the machine, and every call starts the workers at one agreed instant.
    Workers are spawned, not forked (the parent holds gRPC channels and CUDA), once, and kept.
    """

    START_DELAY_S = 0.3

    def __init__(self, processes: int, prompts: list[str]):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(processes)]
        self._workers = [context.Process(target=client_worker, args=(i, prompts[i::processes], self._tasks[i],
                                                                     self._results), daemon=True)
                         for i in range(processes)]
        for worker in self._workers:
            worker.start()

    @property
    def workers(self) -> list:
        return self._workers

    def run(self, path: str, url: str, clients: int, requests: int, output_len: int,
            count_words: bool, chat: bool = False) -> list[Timing]:
        used = min(len(self._workers), clients)
        shares = [clients // used + (1 if i < clients % used else 0) for i in range(used)]
        start_at = time.perf_counter() + self.START_DELAY_S
        for tasks, share in zip(self._tasks, shares):
            tasks.put((path, url, share, requests, output_len, count_words, chat, start_at))
        timings, errors = [], []
        for _ in range(used):
            _, rows, error = self._results.get(timeout=900)
            if error:
                errors.append(error)
            timings.extend(Timing(sent=sent, events=events, event_tokens=counts) for sent, events, counts in rows)
        if errors:
            raise RuntimeError(f"{path} client process failed: {errors[0]}")
        return timings

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()


def client_worker(index: int, prompts: list[str], tasks, results) -> None:
    """One ClientProcesses worker: runs client tasks until it gets None. Timings travel as tuples
    (a class of a spawned ``__main__`` does not unpickle in the parent)."""
    feed = PromptFeed(prompts, [[] for _ in prompts])
    while True:
        task = tasks.get()
        if task is None:
            return
        path, url, clients, requests, output_len, count_words, chat, start_at = task
        time.sleep(max(0.0, start_at - time.perf_counter()))
        try:
            timings = run_served_path(path, url, feed, clients, requests, output_len, count_words, chat)
            results.put((index, [(t.sent, t.events, t.event_tokens) for t in timings], None))
        except Exception as error:  # noqa: BLE001 - reported by the parent
            results.put((index, [], f"{type(error).__name__}: {error}"))


def run_served_path(path: str, url: str, feed: PromptFeed, clients: int, requests: int, output_len: int,
                    count_words: bool, chat: bool) -> list[Timing]:
    """One served path's closed loop, in this process (the parent, or a ClientProcesses worker)."""
    if path == "http":
        return run_http(url, feed, clients, requests, output_len, count_words=count_words)
    if path == "grpc":
        return run_grpc(url, feed, clients, requests, output_len, count_words=count_words)
    if path == "grpc_bls":
        return run_grpc(url, feed, clients, requests, output_len, model="tensorrt_llm_bls")
    if path in ("openai", "openai_bls"):
        return run_openai(url, feed, clients, requests, output_len, chat=chat)
    raise ValueError(f"unknown served path {path!r}")


async def openai_client(session, url: str, feed: PromptFeed, requests: int, output_len: int,
                        chat: bool) -> list[Timing]:
    """One client of the OpenAI frontend: streamed requests one after another, each read to [DONE];
    a chunk carrying text is a token's arrival."""
    timings = []
    for _ in range(requests):
        prompt, _ = feed.take()
        body = {"model": OPENAI_MODEL_NAME, "max_tokens": output_len, "min_tokens": output_len, "temperature": 0,
                "stream": True}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        timing = Timing(sent=time.perf_counter())
        async with session.post(url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"OpenAI frontend HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"OpenAI frontend stream error: {event['error']}")
                choice = event["choices"][0] if event["choices"] else {}
                if (choice.get("delta", {}).get("content") if chat else choice.get("text")):
                    timing.events.append(time.perf_counter())
        timings.append(timing)
    return timings


def run_openai(frontend_url: str, feed: PromptFeed, clients: int, requests: int, output_len: int,
               chat: bool = False) -> list[Timing]:
    """`clients` concurrent SSE streams through the OpenAI frontend, on one event loop."""
    url = f"{frontend_url}/v1/{'chat/completions' if chat else 'completions'}"
    return run_sse_clients(lambda session: openai_client(session, url, feed, requests, output_len, chat),
                           clients, "openai (frontend SSE)")


def run_engine(executor, feed: PromptFeed, clients: int, requests: int, output_len: int) -> list[Timing]:
    """The same closed loop straight on the Executor: a finished request's client sends its next one."""
    from engine.executor import OutputConfig, Request

    pending: dict[int, tuple[int, Timing]] = {}
    left = [requests] * clients
    done: list[Timing] = []

    def send(client: int) -> None:
        left[client] -= 1
        _, ids = feed.take()
        timing = Timing(sent=time.perf_counter())
        request = Request(input_token_ids=ids, max_tokens=output_len, end_id=-1, streaming=True,
                          output=OutputConfig(exclude_input_from_output=True))
        pending[executor.enqueue_request(request)] = (client, timing)

    for client in range(clients):
        send(client)
    while pending:
        responses = executor.await_responses(timeout=600)
        if not responses:
            raise RuntimeError("the executor sent nothing for 600 s")
        now = time.perf_counter()
        for response in responses:
            if response.has_error:
                raise RuntimeError(f"executor error: {response.error}")
            client, timing = pending[response.request_id]
            new_tokens = len(response.result.output_token_ids[0])
            if new_tokens:
                timing.events.append(now)
                timing.event_tokens.append(new_tokens)
                timing.tokens += new_tokens
            if response.is_final:
                del pending[response.request_id]
                if timing.tokens != output_len:
                    raise RuntimeError(f"a request made {timing.tokens} tokens, not {output_len}")
                done.append(timing)
                if left[client]:
                    send(client)
    return done


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


def measure(results: dict, path: str, run, args: argparse.Namespace, feed: PromptFeed, clients: int,
            round_index: int, variant: str = "", stream_counts=None, diagnostics=None) -> None:
    """Warm up (every client once, a few tokens: compiles kernels for these batch shapes), then time.

    ``stream_counts``: a served path's () -> the server's streamed-token counters, read before and
    after the timed run (the warm-up's are left out). ``diagnostics``: a RunDiagnostics for the
    engine's steps and the processes' CPU over the timed run."""
    run(feed, clients, 1, min(args.output_len, 4))
    before = stream_counts() if stream_counts else None
    if diagnostics is not None:
        diagnostics.begin()
    timings = run(feed, clients, requests_per_client(args, clients), args.output_len)
    diagnosed = diagnostics.end() if diagnostics is not None else {}
    row = summarize(timings, args.output_len, clients, path)
    row.update(diagnosed)
    row["round"] = round_index
    row["variant"] = variant
    if stream_counts:
        row.update(server_stream_figures(before, stream_counts()))
    results["all_rows"].append(row)
    write_json(results, args.out)  # a run stopped later keeps every setting measured so far
    own = own_fraction(row)
    print(f"  round {round_index} {path_label(row):16s} clients {clients:3d}: {row['tok_s']:9.1f} tok/s  "
          f"TTFT {row['ttft_ms_median']:8.2f} ms  ITL {row['itl_ms_median']:7.2f} ms  "
          f"responses/request {row['responses_per_request']:6.1f}  "
          f"own-response tokens {'-' if own is None else f'{own:.1%}'}", flush=True)
    if diagnosed:
        print(f"    {describe_diagnostics(diagnosed)}", flush=True)


def requests_per_client(args: argparse.Namespace, clients: int) -> int:
    return max(args.requests_per_client, -(-args.min_requests // clients))


def path_label(row: dict) -> str:
    return f"{row['path']} ({row['variant']})" if row.get("variant") else row["path"]


def own_fraction(row: dict) -> float | None:
    """Tokens in a response of their own: the server's counters where there are some, else the client's count."""
    server = row.get("own_response_fraction_server")
    return server if server is not None else row.get("own_response_fraction_client")


def best_rows(all_rows: list[dict]) -> list[dict]:
    """Per (path, variant, clients) the round with the highest throughput (the least disturbed one)."""
    best: dict[tuple[str, str, int], dict] = {}
    for row in all_rows:
        key = (row["path"], row.get("variant", ""), row["clients"])
        if key not in best or row["tok_s"] > best[key]["tok_s"]:
            best[key] = row
    return list(best.values())


# The tensorrt_llm model's streamed-token counters (all_models/tensorrt_llm/1/model.py), published
# every stats_check_period_ms (100 ms here): read them after twice that.
STREAM_METRICS = ("tritonllm_streamed_tokens_total", "tritonllm_coalesced_tokens_total",
                  "tritonllm_streamed_responses_total")
STREAM_METRICS_SETTLE_S = 0.3


def scrape_stream_counts(metrics_url: str) -> dict[str, float]:
    """The streamed-token counters from the server's Prometheus text (summed over label sets)."""
    time.sleep(STREAM_METRICS_SETTLE_S)
    return metric_totals(metrics_url, STREAM_METRICS)


def server_stream_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What tensorrt_llm sent during one timed run: tokens per streamed response, and the share
    of tokens that went out in a response of their own."""
    tokens = after["tritonllm_streamed_tokens_total"] - before["tritonllm_streamed_tokens_total"]
    coalesced = after["tritonllm_coalesced_tokens_total"] - before["tritonllm_coalesced_tokens_total"]
    responses = after["tritonllm_streamed_responses_total"] - before["tritonllm_streamed_responses_total"]
    if tokens <= 0:
        return {"own_response_fraction_server": None, "server_tokens_per_response": None}
    return {"own_response_fraction_server": 1.0 - coalesced / tokens,
            "server_tokens_per_response": tokens / responses if responses else None}


def run_all(results: dict, args: argparse.Namespace, variants: list[tuple[str, str]], engine_dir: str, config,
            work: Path, feed: PromptFeed) -> None:
    """The in-process executor loaded throughout; one server per variant (name, repository), one
    after the other; paths interleaved per setting and round, the engine measured beside the first.

    Interleaving keeps slow drift (other load on a shared CPU, clocks) out of the comparison; the
    engine that is not being measured is idle (its loop waits on a condition variable), and the
    KV pools are fixed in size, so neither one's memory depends on the other.
    """
    from contextlib import ExitStack

    with ExitStack() as stack:
        executor = None
        if "engine" in args.paths:
            results["engine_iteration_log"] = str(work / "engine_iterations_in_process.log")
            executor = start_executor(results, engine_dir, config)
            stack.callback(stop_executor, executor)
        served = [p for p in SERVED_PATHS if p in args.paths]
        processes = client_processes(args)
        pool = None
        if served and processes > 1:
            pool = ClientProcesses(processes, feed.prompts)
            stack.callback(pool.close)
        results["client_processes"] = processes
        if not served:
            run_variant(results, args, feed, executor, None, "", pool)
        for index, (variant, repo, environment) in enumerate(variants if served else []):
            run_variant(results, args, feed, executor if index == 0 else None,
                        (repo, work / f"server{index}", environment), variant, pool)


def run_variant(results: dict, args: argparse.Namespace, feed: PromptFeed, executor, server_setup,
                variant: str, pool) -> None:
    """Every setting and round for one server (and the in-process engine when given)."""
    from contextlib import ExitStack

    count_words = bool(args.synthetic_tokenizer)
    with ExitStack() as stack:
        runners, counters = {}, {}
        server = None
        if server_setup is not None:
            repo, server_work, environment = server_setup
            server_work.mkdir(parents=True, exist_ok=True)
            server = stack.enter_context(ServedEnsemble(repo, server_work, args.ready_timeout,
                                                        openai="openai" in args.paths,
                                                        openai_bls="openai_bls" in args.paths,
                                                        openai_workers=args.openai_workers, environment=environment))
            results.setdefault("server_load_s", {})[variant] = server.load_seconds
            print(f"tritonserver{f' ({variant})' if variant else ''} ready in {server.load_seconds:.1f} s "
                  f"(HTTP {server.http_port}, gRPC {server.grpc_port}"
                  f"{', OpenAI ' + server.openai_port if server.frontends else ''})", flush=True)
            urls = {"http": server.http_url, "grpc": server.grpc_url, "grpc_bls": server.grpc_url,
                    "openai": server.openai_url, "openai_bls": server.openai_bls_url}
            chat = args.openai_api == "chat"
            # Every served path's clients in the worker processes when there are some: a path whose
            # clients share the parent (its interpreter lock, its CUDA context and idle executor) is
            # not measured like the others (the BLS paths were, until 2026-11-24).
            for path in SERVED_PATHS:
                if pool is not None:
                    runners[path] = lambda f, c, r, n, p=path: pool.run(p, urls[p], c, r, n, count_words, chat)
                else:
                    runners[path] = lambda f, c, r, n, p=path: run_served_path(p, urls[p], f, c, r, n,
                                                                              count_words, chat)
            for path in ("http", "grpc"):  # the ensemble paths: the server's streamed-token counters
                counters[path] = lambda: scrape_stream_counts(server.metrics_url)
        if executor is not None:
            runners["engine"] = lambda f, c, r, n: run_engine(executor, f, c, r, n)
        diagnostics = run_diagnostics(results, server, executor, pool)
        paths = [p for p in ALL_PATHS if p in args.paths and p in runners]
        try:
            for round_index in range(args.rounds):
                for clients in args.clients:
                    order = paths[round_index % len(paths):] + paths[:round_index % len(paths)]
                    for path in order:
                        measure(results, path, runners[path], args, feed, clients, round_index,
                                variant="" if path == "engine" else variant, stream_counts=counters.get(path),
                                diagnostics=diagnostics.get("engine" if path == "engine" else "served"))
        except Exception as error:
            if server is not None:
                if isinstance(error, StallError) or "StallError" in str(error):  # (from a client process too)
                    dumped = dump_server_stacks(server.process.pid)
                    print(f"serving_bench: {error}\n  asked {dumped} stub and engine processes for their stacks "
                          f"(in {server.log_path}); the server log ends:\n{server.log_tail(6000)}",
                          file=sys.stderr, flush=True)
                results["server_log_tail"] = server.log_tail(20000)
            raise


def run_diagnostics(results: dict, server, executor, pool) -> dict:
    """RunDiagnostics for the in-process engine ("engine": this process) and for the served paths
    ("served": the server's processes by role, and the client processes)."""
    def client_pids() -> list[tuple[int, str]]:
        return [(worker.pid, "clients") for worker in pool.workers] if pool is not None else [(os.getpid(), "clients")]

    found = {}
    if executor is not None:
        found["engine"] = RunDiagnostics(lambda: [(os.getpid(), "benchmark (engine and its clients)")],
                                         results.get("engine_iteration_log"))
    if server is not None:
        def served_pids() -> list[tuple[int, str]]:
            tree = [(pid, name.rsplit(" (", 1)[0]) for pid, name in process_tree(server.process.pid)]
            return [(server.process.pid, "tritonserver")] + tree + client_pids()

        found["served"] = RunDiagnostics(served_pids, str(server.iteration_log), server.http_url, server.metrics_url)
    return found


# Processes of a server that dump their threads' Python stacks on STACK_DUMP_SIGNAL: the Python
# backend's stubs (serving/stub_watchdog.py) and the engine process (engine/executor/engine_process.py).
STACK_DUMP_PROCESSES = ("triton_python_backend_stub", "engine.executor.engine_process")


def dump_server_stacks(server_pid: int, settle_s: float = 1.0) -> int:
    """Ask every stub and engine process under the server for all its threads' Python stacks
    (written to the server's log); returns how many were asked. Only processes named in
    STACK_DUMP_PROCESSES are signalled (to any other, the signal would be fatal)."""
    from serving.stub_watchdog import STACK_DUMP_SIGNAL

    asked = 0
    for pid in descendant_pids(server_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if not any(name in command for name in STACK_DUMP_PROCESSES):
                continue
            os.kill(pid, STACK_DUMP_SIGNAL)
            asked += 1
            # faulthandler's dumps do not name their process; they reach the log in this order.
            print(f"  stacks asked of pid {pid}: {command.replace(chr(0), ' ')[:160]}", file=sys.stderr, flush=True)
        except OSError:  # gone meanwhile
            continue
        time.sleep(settle_s / 20)  # one at a time: dumps written at once interleave in the shared log
    if asked:
        time.sleep(settle_s)  # let them write before the log is read
    return asked


def client_processes(args: argparse.Namespace) -> int:
    """--client_processes, or by default one process per 32 streams up to a quarter of the cores
    (on a CPU-only machine: 1; the server needs the cores more)."""
    if args.client_processes:
        return args.client_processes
    import torch

    if not torch.cuda.is_available():
        return 1
    return max(1, min(-(-max(args.clients) // 32), (os.cpu_count() or 4) // 4))


def start_executor(results: dict, engine_dir: str, config):
    from engine.executor import Executor

    started = time.perf_counter()
    with environment_set({ITERATION_LOG_ENV: results["engine_iteration_log"]}):  # this executor's steps
        executor = Executor(engine_dir, config)
    results["engine_load_s"] = time.perf_counter() - started
    print(f"in-process executor ready in {results['engine_load_s']:.1f} s", flush=True)
    return executor


def stop_executor(executor) -> None:
    executor.shutdown()
    release_device_memory()


def release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def overheads(rows: list[dict]) -> list[dict]:
    """Per served path, variant and concurrency: throughput and ITL ratios to the engine, TTFT added (medians)."""
    engine = {row["clients"]: row for row in rows if row["path"] == "engine"}
    out = []
    for row in rows:
        base = engine.get(row["clients"])
        if row["path"] == "engine" or base is None:
            continue
        out.append({"path": row["path"], "variant": row.get("variant", ""), "clients": row["clients"],
                    "throughput_ratio": row["tok_s"] / base["tok_s"],
                    "added_ttft_ms": row["ttft_ms_median"] - base["ttft_ms_median"],
                    "added_itl_ms": row["itl_ms_median"] - base["itl_ms_median"],
                    "itl_ratio": row["itl_ms_median"] / base["itl_ms_median"] if base["itl_ms_median"] else None})
    return out


def frontend_overheads(rows: list[dict]) -> list[dict]:
    """The OpenAI frontend against gRPC, per concurrency and frontend path (``openai``: entry
    tensorrt_llm; ``openai_bls``: entry tensorrt_llm_bls): throughput ratios and added TTFT/ITL
    (medians) against ``grpc`` (the ensemble, issue 15's yardstick) and ``grpc_bls``."""
    by_key = {(row["path"], row["clients"]): row for row in rows}
    out = []
    for (path, clients), row in sorted(by_key.items(), key=lambda item: (item[0][1], item[0][0])):
        if path not in ("openai", "openai_bls"):
            continue
        entry = {"clients": clients, "path": path}
        for base_path in ("grpc", "grpc_bls"):
            base = by_key.get((base_path, clients))
            if base is not None:
                entry[f"throughput_vs_{base_path}"] = row["tok_s"] / base["tok_s"]
                entry[f"added_ttft_ms_vs_{base_path}"] = row["ttft_ms_median"] - base["ttft_ms_median"]
                entry[f"added_itl_ms_vs_{base_path}"] = row["itl_ms_median"] - base["itl_ms_median"]
        out.append(entry)
    return out


def frontend_markdown(results: dict) -> str:
    """The OpenAI frontend's table: each frontend path against grpc and grpc_bls, with the goals."""
    entries = results.get("frontend_overheads") or []
    if not entries:
        return ""

    def cell(entry, key, fmt):
        return format(entry[key], fmt) if key in entry else "-"

    lines = [f"\nOpenAI frontend ({results.get('openai_api', 'completions')}; `openai`: entry tensorrt_llm, "
             f"`openai_bls`: entry tensorrt_llm_bls) against gRPC streaming into the ensemble (`grpc`) and "
             f"into tensorrt_llm_bls with the frontend's request (`grpc_bls`). Goals (issue 15): "
             f">= {GOALS['openai_throughput_ratio']:.0%} of the gRPC throughput, "
             f"< {GOALS['openai_added_ttft_ms']:.0f} ms added TTFT.\n",
             "| clients | path | tok/s vs grpc | added TTFT ms vs grpc | added ITL ms vs grpc "
             "| tok/s vs grpc_bls | added TTFT ms vs grpc_bls |", "|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['clients']} | {e['path']} | {cell(e, 'throughput_vs_grpc', '.3f')} "
                     f"| {cell(e, 'added_ttft_ms_vs_grpc', '+.2f')} | {cell(e, 'added_itl_ms_vs_grpc', '+.2f')} "
                     f"| {cell(e, 'throughput_vs_grpc_bls', '.3f')} | {cell(e, 'added_ttft_ms_vs_grpc_bls', '+.2f')} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    """The dated table for benchmarks/results/serving.md: every row, its throughput ratio and added TTFT, the goals."""
    ratios = {(o["path"], o.get("variant", ""), o["clients"]): o for o in results["overheads"]}
    lines = [
        f"\n### Serving overhead, {results['model']}: {results['date']}, {results['machine']['device']}, "
        f"commit {results['commit']}\n",
        f"`{results['command']}`  ",
        f"Input {results['input_len']} / output {results['output_len']} tokens, {results['requests_per_client']} "
        f"requests per client, at least {results['min_requests']} per setting (closed loop), best of "
        f"{results['rounds']} interleaved round(s), greedy, end_id -1; tokenizer: {results['tokenizer']}. "
        f"Goals: served throughput >= {GOALS['throughput_ratio']:.0%} of the in-process engine's; "
        f"added TTFT a few ms (<= {GOALS['added_ttft_ms']:.0f} ms). Clients in {results.get('client_processes', 1)} "
        f"process(es). Own-response tokens: share of output tokens that reached the client in a response of "
        f"their own (served: the server's tritonllm_*_tokens_total counters; engine: its responses).\n",
        "| clients | path | output tok/s | vs engine (goal >= 0.90) | TTFT med ms | TTFT p99 ms | added TTFT ms "
        "| ITL med ms | ITL vs engine | ITL p99 ms | TPOT med ms | responses/request | own-response tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = lambda r: (r["clients"], r["path"] != "engine", r.get("variant", ""), r["path"])  # noqa: E731
    for row in sorted(results["rows"], key=order):
        extra = ratios.get((row["path"], row.get("variant", ""), row["clients"]))
        ratio = f"{extra['throughput_ratio']:.3f}" if extra else "1 (baseline)"
        added = f"{extra['added_ttft_ms']:+.2f}" if extra else "-"
        itl_ratio = f"{extra['itl_ratio']:.2f}" if extra and extra.get("itl_ratio") else "-"
        own = own_fraction(row)
        lines.append(f"| {row['clients']} | {path_label(row)} | {row['tok_s']:.1f} | {ratio} | {row['ttft_ms_median']:.2f} "
                     f"| {row['ttft_ms_p99']:.2f} | {added} | {row['itl_ms_median']:.2f} | {itl_ratio} "
                     f"| {row['itl_ms_p99']:.2f} | {row['tpot_ms_median']:.2f} | {row['responses_per_request']:.1f} "
                     f"| {'-' if own is None else f'{own:.1%}'} |")
    lines += diagnostics_markdown(sorted(results["rows"], key=order))
    if results.get("error"):
        lines.append(f"\nIncomplete run: {results['error']}")
    return "\n".join(lines) + "\n" + frontend_markdown(results)


def diagnostics_markdown(rows: list[dict]) -> list[str]:
    """Where each timed run's time went (serving_diagnostics): the engine's steps and cores busy."""
    rows = [row for row in rows if "cores_busy" in row]
    if not rows:
        return []
    ms = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    lines = ["", f"Where the time went (the engine's iteration log; CPU of each process over the timed run, "
                 f"{os.cpu_count()} cores here; Triton's statistics: mean ms a request queued for a model "
                 f"instance / spent in its execute):", "",
             "| clients | path | engine step med ms | decode-only step ms | mixed step ms | steps with prefill "
             "| prefill tokens per mixed step | TTFT mean ms inside tensorrt_llm "
             "| deliver p50 / p99 ms | cores busy | busiest processes (cores) | queue / execute ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        busiest = ", ".join(f"{role} {value:.2f}" for role, value in list(row["cores_busy"].items())[:5])
        mixed = f"{row['engine_mixed_step_share']:.0%}" if row.get("engine_steps") else "-"
        models = ", ".join(f"{name} {m['queue_ms']:.2f} / {m['execute_ms']:.2f}"
                           for name, m in row.get("triton_models", {}).items()) or "-"
        lines.append(f"| {row['clients']} | {path_label(row)} | {ms(row.get('engine_step_ms_median'))} "
                     f"| {ms(row.get('engine_decode_step_ms_median'))} | {ms(row.get('engine_mixed_step_ms_median'))} "
                     f"| {mixed} | {ms(row.get('engine_prefill_tokens_per_mixed_step'))} "
                     f"| {ms(row.get('tensorrt_llm_ttft_ms_mean'))} "
                     f"| {ms(row.get('engine_deliver_ms_median'))} / {ms(row.get('engine_deliver_ms_p99'))} "
                     f"| {row['cores_busy_total']:.1f} | {busiest} | {models} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine = parser.add_mutually_exclusive_group(required=True)
    engine.add_argument("--engine_dir", help="an engine directory with its tokenizer files (e.g. engines/smollm2)")
    engine.add_argument("--model", help="a shape of benchmarks/common.py MODELS (random weights)")
    parser.add_argument("--dtype", default="bfloat16", help="--model only: engine dtype")
    parser.add_argument("--tokenizer_dir", help="--model only: copy this tokenizer (must cover the vocab)")
    parser.add_argument("--synthetic_tokenizer", action="store_true", help="--model only: one word per id")
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--max_num_tokens", type=int, default=8192, help="--model only: engine max_num_tokens")
    parser.add_argument("--clients", default="1,16,64", help="concurrent clients, comma-separated")
    parser.add_argument("--input_len", type=int, default=128)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--requests_per_client", type=int, default=4)
    parser.add_argument("--min_requests", type=int, default=1,
                        help="at least this many requests per setting (few clients send more each)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat every setting, paths interleaved; the best round of each is reported")
    parser.add_argument("--paths", default="http,grpc,engine", help="subset of " + ",".join(ALL_PATHS))
    parser.add_argument("--openai_workers", type=int, default=None,
                        help="OpenAI frontend processes (the launcher's --openai_workers), for both frontends; "
                             "default: the launcher's default (one per 4 CPU cores, 1 to 4)")
    parser.add_argument("--openai_api", default="completions", choices=["completions", "chat"],
                        help="openai path: /v1/completions (prompts of exactly input_len tokens) or "
                             "/v1/chat/completions (the chat template adds tokens: needs an engine with room)")
    parser.add_argument("--engine_process", default="true", choices=["true", "false"],
                        help="the served model's engine_process parameter (false: the executor in the stub)")
    parser.add_argument("--tensorrt_llm_instances", type=int, default=1,
                        help="instances of the served tensorrt_llm model (they share one engine process)")
    parser.add_argument("--preprocessing_instances", type=int, default=1)
    parser.add_argument("--postprocessing_instances", type=int, default=1)
    parser.add_argument("--read_poll_us", type=int, default=None,
                        help="the served engine's $TRITONLLM_READ_POLL_US (engine/executor/engine_process.py; "
                             "0: the stubs' readers block; default: unset)")
    parser.add_argument("--prefill_graphs", default=None, choices=["0", "1"],
                        help="the served engine's $TRITONLLM_PREFILL_GRAPHS (0: steps with prompt tokens run "
                             "eagerly; default: unset, graphs on)")
    parser.add_argument("--stream_interval", type=int, default=1,
                        help="the served model's stream_interval parameter: tokens per streamed response "
                             "(the first and the last go out at once); the in-process engine keeps 1")
    parser.add_argument("--variants", default=None,
                        help="several servers one after another beside one in-process engine, e.g. "
                             "'before:tensorrt_llm_instances=1 after:tensorrt_llm_instances=4,postprocessing_instances=4' "
                             f"(settings: {', '.join(VARIANT_SETTINGS)}; unnamed ones take the flags above)")
    parser.add_argument("--client_processes", type=int, default=0,
                        help="processes the served clients run in (0: one per 32 streams up to a quarter "
                             "of the cores on a GPU machine, 1 on CPU)")
    parser.add_argument("--cpu_threads", type=int, default=None,
                        help="torch threads of both engines (default: 1 on CPU, unchanged on a GPU)")
    parser.add_argument("--ready_timeout", type=float, default=600.0)
    parser.add_argument("--stall_timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                        help="seconds a served stream may send nothing before the run fails as stalled "
                             "(the stubs' Python stacks then go to the server log)")
    parser.add_argument("--work_dir", default=None, help="repository, engine and server log (default: a temp dir)")
    parser.add_argument("--out", default="serving_bench.json")
    parser.add_argument("--results_md", default=None, help="append the dated table to this file")
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(args.paths) - set(ALL_PATHS))
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)}; choose from {', '.join(ALL_PATHS)}")
    if args.output_len < 2:
        parser.error("--output_len must be >= 2 (inter-token latency needs two tokens)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ[STALL_TIMEOUT_ENV] = str(args.stall_timeout)  # before the client processes are spawned
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="serving-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    from engine.config import EngineConfig
    from serving.tokenization import load_tokenizer

    engine_dir = prepare_engine(args, work)
    engine_config = EngineConfig.load(engine_dir)
    tokenizer = load_tokenizer(engine_dir)
    check_tokenizer_covers_vocab(tokenizer, engine_config.model.vocab_size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit still stops the server
    cpu_threads = limit_cpu_threads(args.cpu_threads)
    total_requests = max(c * (requests_per_client(args, c) + 1) for c in args.clients)
    feed = PromptFeed(*make_prompts(tokenizer, min(total_requests, 512), args.input_len))
    tpb = engine_config.build.tokens_per_block
    kv_tokens = max(args.clients) * (-(-(args.input_len + args.output_len) // tpb) + 1) * tpb
    # A tensorrt_llm_bls instance serves many requests at once; on the BLS paths a few more than
    # make serve's 2 spread its per-response work over processes.
    bls_instances = 4 if {"grpc_bls", "openai_bls"} & set(args.paths) else 2
    variants = []
    for index, (variant, settings) in enumerate(parse_variants(args.variants, args)):
        repo = load_script("serve_default").prepare_model_repo(
            engine_dir, str(work / f"repo{index}"), overrides=repo_overrides(settings, kv_tokens),
            max_batch_size=min(max(args.clients), engine_config.build.max_batch_size), decoupled=True,
            bls_instances=bls_instances)
        set_instance_count(repo, "tensorrt_llm", int(settings["tensorrt_llm_instances"]))
        variants.append((variant, repo, server_environment(settings)))
    results = {
        "date": utc_now(), "commit": git_commit(),
        "machine": machine_description(), "command": command_line(__file__, argv),
        "model": args.model or os.path.basename(engine_dir.rstrip("/")), "engine": engine_config.to_dict(),
        "tokenizer": "synthetic (one word per id)" if args.synthetic_tokenizer else f"{type(tokenizer).__name__}, "
                     f"{len(tokenizer)} ids", "input_len": args.input_len, "output_len": args.output_len,
        "requests_per_client": args.requests_per_client, "min_requests": args.min_requests, "kv_cache_tokens": kv_tokens, "cpu_threads": cpu_threads, "goals": GOALS, "rounds": args.rounds,
        "rows": [], "all_rows": [], "variants": dict(parse_variants(args.variants, args)),
    }
    # The in-process baseline streams every token whatever a variant's stream_interval: it measures the engine.
    config = dataclasses.replace(executor_config_of_repo(variants[0][1]), stream_interval=1)
    results["executor_config"] = dataclasses.asdict(config)
    try:
        run_all(results, args, variants, engine_dir, config, work, feed)
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # keep what was measured; say what broke
        results["error"] = f"{type(error).__name__}: {error}"
        print(f"serving_bench: {results['error']}", file=sys.stderr)
    results["rows"] = best_rows(results["all_rows"])
    results["overheads"] = overheads(results["rows"])
    results["frontend_overheads"] = frontend_overheads(results["rows"])
    results["openai_api"] = args.openai_api
    write_json(results, args.out)
    table = markdown(results)
    print(table)
    if args.results_md and results["rows"]:
        with open(args.results_md, "a") as f:
            f.write(table)
    if results.get("error"):
        sys.exit(1)
    return results


def limit_cpu_threads(requested: int | None) -> int | None:
    """On CPU, give the in-process engine and the served one (through the inherited environment)
    the same number of torch threads, 1 by default: with 2 spinning OpenMP threads per process on
    a shared 2-core machine, a step waits for scheduler slices (measured here: 38 ms a tiny step
    instead of 2 ms), which says nothing about the serving layer. On a GPU: left alone."""
    import torch

    if torch.cuda.is_available() and requested is None:
        return None
    threads = requested or 1
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def write_json(results: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
