"""A dead engine process under load; Ctrl-C after hang-ups and with requests running.

Killing the engine process (SIGKILL, as the kernel's OOM killer would): every request in flight
gets an error response within 2 s (never a 200 without text), tritonserver stays up, readiness says
not ready until the tensorrt_llm model has started a fresh engine process by itself, and then new
requests are served, without restarting tritonserver. Here through the launcher's mpirun job, on a
server of its own (its engine is killed on purpose); as `make serve` runs tritonserver alone, on
test_streaming_relay.py's server of two instances sharing the engine (kill_the_engine_under_load).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from benchmarks.common import process_tree
from serving.stub_watchdog import STACK_DUMP_SIGNAL
from test_grpc_stream import Stream, text_inputs
from test_hangups import PROMPTS
from test_metrics import scrape, value
from triton_helpers import ROOT, chat, free_port, running_server, wait_for

pytestmark = pytest.mark.integration
# Long enough to outlast a kill or a shutdown's grace on CPU, short enough that five such requests
# fit the test engine's KV cache together (admission reserves prompt + max_tokens).
LONG = 400


def engine_pids(server_pid: int) -> list[int]:
    return [pid for pid, name in process_tree(server_pid) if name.startswith("engine_process")]


def ready(server, model="ensemble") -> bool:
    try:
        return requests.get(f"{server.http}/v2/models/{model}/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


class Outcome:
    """What one in-flight request ended with, and when."""

    def __init__(self):
        self.ok = None
        self.detail = ""
        self.ended_at = None
        self.chunks = 0  # streamed responses received before the end

    def end(self, ok, detail):
        self.ok, self.detail, self.ended_at = ok, detail, time.time()


def unary_http(server, model, outcome):
    body = {"text_input": PROMPTS["ascii"], "max_tokens": LONG, "end_id": -1}
    response = server.generate(model, body, timeout=60)
    text = response.json().get("text_output") if response.status_code == 200 else None
    outcome.end(response.status_code == 200 and bool(text), f"{response.status_code} {response.text[:200]}")


def streamed_http(server, model, outcome):
    body = {"text_input": PROMPTS["japanese"], "max_tokens": LONG, "end_id": -1, "stream": True}
    try:
        with server.generate(model, body, stream=True, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: ") and "error" in json.loads(line[6:]):
                    outcome.end(False, line.decode()[:300])
                    return
                outcome.chunks += line.startswith(b"data: ")
    except requests.RequestException as error:
        outcome.end(False, f"connection: {error}")
        return
    outcome.end(True, "the stream ended without an error")


def streamed_grpc(server, model, outcome):
    stream = Stream(server)
    try:
        stream.send(model, text_inputs([PROMPTS["chinese"]], LONG, end_id=np.int32(-1)))
        while True:
            _, error, final = stream.next(timeout=60)
            if error is not None:
                outcome.end(False, str(error)[:300])
                return
            if final:
                outcome.end(True, "FINAL without an error")
                return
            outcome.chunks += 1
    finally:
        stream.close()


def start_running(server, calls: list) -> tuple[list, list[Outcome]]:
    """Each (call, model) of ``calls`` in a thread of its own, returned once the engine counts them all
    active: (the threads, their outcomes)."""
    outcomes = [Outcome() for _ in calls]
    threads = [threading.Thread(target=call, args=(server, model, outcome), daemon=True)
               for (call, model), outcome in zip(calls, outcomes)]
    for thread in threads:
        thread.start()
    running = wait_for(lambda: value(scrape(server), "nv_trt_llm_request_metrics", request_type="active",
                                     model="tensorrt_llm", version="1") == len(calls), timeout=30)
    assert running, "the requests did not all start"
    return threads, outcomes


def kill_the_engine_under_load(server, engine_pids_of_the_model, ready_within_s: float = 60,
                               signal_named: bool = True) -> int:
    """Five calls through every entry (unary HTTP, SSE, gRPC streams; ensemble and BLS) generating, then
    SIGKILL to the engine process: every call fails within 2 s naming the engine process and SIGKILL (never
    a 200 without text), readiness says not ready, then ready again with one fresh engine process in the
    same tritonserver. ``engine_pids_of_the_model()``: the model's engine processes (one). Returns the
    killed pid. The caller checks the first answer afterwards and the restart counter.
    ``ready_within_s``: a restart's limit (two instances unload and load both). ``signal_named``: each error
    names SIGKILL too (False where an instance that did not start the engine holds calls: only the engine's
    parent sees how it ended, the others say "the engine process exited")."""
    # at most two BLS calls: its two instances each hold one call while it runs
    calls = [(unary_http, "ensemble"), (unary_http, "tensorrt_llm_bls"), (streamed_http, "ensemble"),
             (streamed_grpc, "ensemble"), (streamed_grpc, "tensorrt_llm_bls")]
    threads, outcomes = start_running(server, calls)
    # an error after a stream's first chunks is the hard case (a BLS caller lost it in 2.51)
    assert wait_for(lambda: all(outcome.chunks >= 2 for (call, _), outcome in zip(calls, outcomes)
                                if call is not unary_http), timeout=30), [(c.__name__, m, o.chunks, o.detail) for (c, m), o in zip(calls, outcomes)]
    [engine] = engine_pids_of_the_model()
    os.kill(engine, signal.SIGKILL)
    killed_at = time.time()
    for thread in threads:
        thread.join(timeout=10)
    for (call, model), outcome in zip(calls, outcomes):
        assert outcome.ok is False, (call.__name__, model, outcome.detail)
        assert "engine process" in outcome.detail and ("SIGKILL" in outcome.detail or not signal_named), \
            outcome.detail
        assert outcome.ended_at - killed_at < 2.0, (call.__name__, model, outcome.ended_at - killed_at)
    assert wait_for(lambda: not ready(server), timeout=2, interval=0.05), "still ready after the engine died"
    assert wait_for(lambda: ready(server) and ready(server, "tensorrt_llm"), timeout=ready_within_s, interval=0.25)
    assert os.kill(server.pid, 0) is None  # the same tritonserver
    new_engines = wait_for(engine_pids_of_the_model, timeout=10)
    assert len(new_engines) == 1 and new_engines != [engine], process_tree(server.pid)
    return engine


# Through tritonserver alone (`make serve`'s way) it is test_streaming_relay.py's killed-engine test, on its
# server of two tensorrt_llm instances sharing the engine (one server start fewer than a case of its own here).
# `make test-all`: the recovery itself is the same backend code as that test's; mpirun's way in is
# test_tp_serving.py's (leader mode).
@pytest.mark.extended
def test_killed_engine_fails_requests_at_once_and_comes_back_through_mpirun(smollm2_engine_dir, tmp_path):
    if not shutil.which("mpirun"):
        pytest.skip("OpenMPI's mpirun is not installed")
    with running_server(smollm2_engine_dir, tmp_path, mpi=True) as server:
        kill_the_engine_under_load(server, lambda: engine_pids(server.pid))
        answer = server.generate("ensemble", {"text_input": chat("What is the capital of France?"),
                                              "max_tokens": 7})  # "The capital of France is Paris." whole
        assert answer.status_code == 200 and "Paris" in answer.json()["text_output"], answer.text
        restarts = value(scrape(server), "tritonllm_engine_restarts_total", model="tensorrt_llm", version="1")
        assert restarts == 1


class ServeDefault:
    """`make serve` as a person runs it: scripts/serve_default.py in its own process group, on free
    ports, its log in a file; Ctrl-C is SIGINT to the whole group."""

    def __init__(self, engine_dir, tmp_path):
        ports = [str(free_port()) for _ in range(4)]  # the OpenAI frontend's too: 9000 may be taken (test_soak)
        self.http, self.grpc_url = f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        self.metrics = f"http://127.0.0.1:{ports[2]}"
        self.log_path = tmp_path / "serve.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(ROOT / "scripts" / "serve_default.py"), "--engine_dir", engine_dir,
                 "--repo", str(tmp_path / "repo"), "--http_port", ports[0], "--grpc_port", ports[1],
                 "--metrics_port", ports[2], "--openai_port", ports[3]], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        assert wait_for(lambda: "READY:" in self.log() or self.process.poll() is not None, timeout=300,
                        interval=0.5)
        assert self.process.poll() is None, self.log()[-3000:]

    def log(self):
        return self.log_path.read_text(errors="replace")

    def metrics_text(self):
        return requests.get(f"{self.metrics}/metrics", timeout=10).text

    def generate(self, model, body, stream=False, timeout=120):
        suffix = "generate_stream" if stream else "generate"
        # Connection: close: an idle keep-alive connection would hold tritonserver's shutdown (its
        # HTTP service waits for every open connection, up to the exit timeout); Ctrl-C is tested here.
        return requests.post(f"{self.http}/v2/models/{model}/{suffix}", json=body, stream=stream,
                             timeout=timeout, headers={"Connection": "close"})

    def ctrl_c_and_wait(self, limit_s):
        """Ctrl-C; asserts the whole process tree is gone within `limit_s` without a leftover
        in-flight count or a traceback in the log."""
        tree = process_tree(self.process.pid)
        processes = [pid for pid, _ in tree]
        os.killpg(self.process.pid, signal.SIGINT)
        started = time.time()
        stacks_from = None
        try:
            self.process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            # Over the limit: the stubs and the engine process still running write every thread's
            # Python stack to the log (SIGUSR1, serving/stub_watchdog.py and engine_process.py), so
            # the failure says which call the shutdown waits in (a load-dependent 15-s exit of
            # 2026-12-01 left only Triton's unload lines to read).
            stacks_from = len(self.log())
            for pid, name in tree:
                if name.startswith(("stub:", "engine_process")):
                    try:
                        os.kill(pid, STACK_DUMP_SIGNAL)
                    except ProcessLookupError:
                        continue
                    time.sleep(0.2)  # one process's dump at a time (they share the log)
            self.process.wait(timeout=30)
        took = time.time() - started
        log = self.log()
        stacks = "" if stacks_from is None else f"\nstacks at {limit_s} s:\n{log[stacks_from:][:12000]}\n"
        assert took < limit_s, f"Ctrl-C took {took:.1f} s: {stacks}log's end: {log[-3000:]}"
        assert not re.search(r"has \d+ in-flight inferences", log), log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        left = wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in processes), timeout=5)
        assert left, [pid for pid in processes if Path(f"/proc/{pid}").exists()]

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def test_ctrl_c_ends_running_requests_with_a_clear_error_and_exits(smollm2_engine_dir, tmp_path):
    """Graceful shutdown: requests still generating when Ctrl-C comes get the grace period
    (graceful_shutdown_timeout_ms, 3 s by default), then an error saying why; new requests are refused
    meanwhile; everything exits with nothing left in flight, and the shutdown ends exactly the 4 running
    requests. Ctrl-C with nothing running is test_soak.py's. (Until 2026-11-30 three hang-ups and a
    cancel ran first on this server, then an answer: a 5th request ended here would have been one they
    left behind. test_hangups.py hangs up the same ways, and test_grpc_stream.py and test_streaming_relay.py
    cancel gRPC streams, on servers filled by the same serve_default.prepare_model_repo and served by
    tritonserver alone as here, and wait for the gauges to read no request active and no KV block used;
    25 s of CI's fresh clone with them.)"""
    serve = ServeDefault(smollm2_engine_dir, tmp_path)
    try:
        calls = [(streamed_http, "ensemble"), (streamed_http, "tensorrt_llm_bls"),
                 (streamed_grpc, "ensemble"), (streamed_grpc, "tensorrt_llm_bls")]
        threads, outcomes = start_running(serve, calls)
        assert wait_for(lambda: all(outcome.chunks >= 2 for outcome in outcomes), timeout=30)
        stopped_at = time.time()
        serve.ctrl_c_and_wait(limit_s=12)
        for thread in threads:
            thread.join(timeout=5)
        for (call, model), outcome in zip(calls, outcomes):
            assert outcome.ok is False, (call.__name__, model, outcome.detail)
            assert "shutting down" in outcome.detail, (call.__name__, model, outcome.detail)
            assert 2.5 < outcome.ended_at - stopped_at < 8, (call.__name__, model, outcome.ended_at - stopped_at)
        log = serve.log()
        assert "tensorrt_llm: ended 4 unfinished requests for the shutdown" in log, log[-3000:]
    finally:
        serve.kill()
