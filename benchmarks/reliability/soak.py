"""Soak: many streamed requests with hang-ups, cancellations, stops and bad inputs; then check that
nothing was lost or leaked.

    python benchmarks/reliability/soak.py --requests 2000 --concurrency 64 --hang-up-share 0.2 --bad-share 0.05

By default it starts the embedded default model as `make serve` does (scripts/serve_default.py,
free ports, its own process group) and Ctrl-C's it at the end; `--http/--grpc/--metrics` use a
running server instead (then no RSS figures and no shutdown check).

Each request is one of:
  normal     streamed through the ensemble, gRPC or HTTP SSE (half each): must end within --deadline
  hang-up    SSE connection closed, or gRPC stream cancelled, after 1-4 chunks of a long generation
  stop       a streamed tensorrt_llm request stopped by a second request naming its id: must end
  bad        one of benchmarks/reliability/soak_bad_inputs.py's kinds: must end with its own error (or normally,
             where the input is legal), never hang

Checked afterwards (each failing check makes the exit status 1):
  lost         requests with no final response within --deadline
  unexpected   an outcome other than the kind's (a bad input accepted, a normal request failing)
  leak         within --rest seconds: tensorrt_llm's active requests and used KV blocks must read 0 (for 1 s)
  processes    the server's process tree must be the same processes as after the warm-up
  growth       RSS growth per process above --max-rss-growth-mib, threads above --max-thread-growth
  shutdown     Ctrl-C: the ensemble's in-flight count in the log (must be none), the exit time
               (must be under --max-shutdown-s), a traceback, processes left behind
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import REPO_ROOT, free_port, is_final_response, process_tree  # noqa: E402
from benchmarks.reliability.soak_bad_inputs import BAD_INPUTS, BadInput, ids_request  # noqa: E402
from serving.cancellation import stop_request_inputs  # noqa: E402

PROMPTS = ["Write a haiku about the sea in Japanese.", "用中文写一首关于大海的短诗。",
           "Tell me about the history of Paris.", "Explain how a bicycle stays upright.",
           "Ecris un poème sur la montagne."]
LONG_TOKENS = 200  # hang-ups and stops: long enough that the client leaves mid-stream


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class SoakConfig:
    requests: int = 300
    concurrency: int = 16
    hang_up_share: float = 0.2
    stop_share: float = 0.05
    bad_share: float = 0.05
    deadline_s: float = 120.0
    rest_s: float = 3.0
    max_rss_growth_mib: float = 128.0
    max_thread_growth: int = 8
    max_shutdown_s: float = 10.0
    seed: int = 0
    engine_dir: str | None = None  # own server: the engine it serves (default: serve_default's)
    http: str | None = None  # external server: its URLs instead of starting one
    grpc: str | None = None
    metrics: str | None = None


@dataclass
class Outcome:
    category: str  # normal-grpc, normal-sse, hang-up-sse, cancel-grpc, stop, bad
    kind: str  # the bad input's kind, or the category
    status: str  # ok, error, lost, unexpected
    detail: str = ""
    seconds: float = 0.0


@dataclass
class SoakReport:
    config: dict
    outcomes: Counter = field(default_factory=Counter)  # (category, status) -> count
    bad_kinds: dict = field(default_factory=dict)  # kind -> status (first seen) and detail
    unexpected: list = field(default_factory=list)
    lost: int = 0
    active_after_rest: float | None = None
    used_blocks_after_rest: float | None = None
    processes: dict = field(default_factory=dict)  # name -> {rss_mib_before, rss_mib_after, threads...}
    process_changes: list = field(default_factory=list)
    shutdown: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


# ------------------------------------------------------------------------------------ the server


class OwnServer:
    """scripts/serve_default.py on free ports in its own process group (as `make serve`)."""

    def __init__(self, engine_dir: str | None, work: Path):
        ports = [str(free_port()) for _ in range(4)]  # the OpenAI frontend's too: another server may hold 9000
        self.http, self.grpc = f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        self.metrics = f"http://127.0.0.1:{ports[2]}/metrics"
        self.log_path = work / "serve.log"
        command = [sys.executable, str(REPO_ROOT / "scripts" / "serve_default.py"), "--repo", str(work / "repo"),
                   "--http_port", ports[0], "--grpc_port", ports[1], "--metrics_port", ports[2],
                   "--openai_port", ports[3]]
        if engine_dir:
            command += ["--engine_dir", engine_dir]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        while "READY:" not in self.log() and self.process.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if "READY:" not in self.log():
            self.kill()
            raise RuntimeError(f"the server did not start:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> dict[int, str]:
        return {pid: name for pid, name in process_tree(self.process.pid)}

    def ctrl_c(self, max_s: float) -> dict:
        processes = self.tree()
        os.killpg(self.process.pid, signal.SIGINT)
        started = time.time()
        try:
            self.process.wait(timeout=max_s + 40)
        except subprocess.TimeoutExpired:
            pass
        took = time.time() - started
        settle = time.time() + 5  # stub watchdogs check once a second
        while time.time() < settle and any(Path(f"/proc/{pid}").exists() for pid in processes):
            time.sleep(0.2)
        log = self.log()
        inflight = [int(n) for n in re.findall(r"has (\d+) in-flight inferences", log)]
        return {"seconds": round(took, 2), "max_in_flight_in_log": max(inflight, default=0),
                "traceback": "Traceback" in log,
                "left_behind": sorted(name for pid, name in processes.items() if Path(f"/proc/{pid}").exists())}

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _usage(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, threads) of a live process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024 if "VmRSS" in status else 0.0
    return rss, int(re.search(r"Threads:\s+(\d+)", status).group(1))


def scrape_gauges(metrics_url: str) -> tuple[float | None, float | None]:
    """(active requests, used KV blocks) of tensorrt_llm."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def gauge(family, label):
        match = re.search(rf'^{family}{{[^}}]*{label}[^}}]*model="tensorrt_llm"[^}}]*}} (\S+)', text, re.M) or \
            re.search(rf'^{family}{{[^}}]*model="tensorrt_llm"[^}}]*{label}[^}}]*}} (\S+)', text, re.M)
        return float(match.group(1)) if match else None

    return (gauge("nv_trt_llm_request_metrics", 'request_type="active"'),
            gauge("nv_trt_llm_kv_cache_block_metrics", 'kv_cache_block_type="used"'))


def _rest(metrics_url: str, rest_s: float, settled_s: float = 1.0) -> tuple[float | None, float | None]:
    """The gauges once both have read 0 for ``settled_s`` (a leaked request or block never reads 0), or
    as they are after ``rest_s``: the soak no longer sleeps the whole rest when nothing leaked."""
    started = time.monotonic()
    zero_since = None
    while True:
        gauges = scrape_gauges(metrics_url)
        now = time.monotonic()
        zero_since = (zero_since or now) if gauges == (0, 0) else None
        if now - started >= rest_s or (zero_since is not None and now - zero_since >= settled_s):
            return gauges
        time.sleep(0.2)


# ------------------------------------------------------------------------------------ the clients


class GrpcStream:
    """One gRPC stream; responses land in a queue as (result, error, final)."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._grpcclient = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        self.responses.put((result, error, is_final_response(result)))

    def send(self, model: str, tensors: dict[str, np.ndarray], request_id: str = ""):
        from tritonclient.utils import np_to_triton_dtype

        inputs = []
        for name, value in tensors.items():
            tensor = self._grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def next(self, deadline: float):
        return self.responses.get(timeout=max(0.01, deadline - time.monotonic()))

    def until_end(self, deadline: float) -> tuple[str, str]:
        """('ok'|'error'|'lost', detail) once the final response or an error arrives."""
        try:
            while True:
                _, error, final = self.next(deadline)
                if error is not None:
                    return "error", str(error)[:300]
                if final:
                    return "ok", ""
        except queue.Empty:
            return "lost", "no final response before the deadline"

    def close(self, cancel: bool = False):
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


def _sse_open(http_url: str, model: str, body: bytes, timeout: float):
    url = urllib.parse.urlparse(http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    connection.request("POST", f"/v2/models/{model}/generate_stream", body=body,
                       headers={"Content-Type": "application/json", "Connection": "close"})
    return connection, connection.getresponse()


def _sse_events(response):
    while True:
        line = response.fp.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield json.loads(line[6:])


# ------------------------------------------------------------------------------------ the requests


class Soak:
    def __init__(self, config: SoakConfig, http: str, grpc: str):
        self.config, self.http, self.grpc = config, http, grpc
        self.deadline_s = config.deadline_s

    def normal_grpc(self, rng: random.Random) -> Outcome:
        stream = GrpcStream(self.grpc)
        try:
            stream.send("ensemble", {"text_input": np.array([[chat(rng.choice(PROMPTS)).encode()]], object),
                                     "max_tokens": np.array([[rng.randint(4, 32)]], np.int32),
                                     "stream": np.array([[True]])})
            status, detail = stream.until_end(time.monotonic() + self.deadline_s)
        finally:
            stream.close()
        return Outcome("normal-grpc", "normal-grpc", status, detail)

    def normal_sse(self, rng: random.Random) -> Outcome:
        body = json.dumps({"text_input": chat(rng.choice(PROMPTS)), "max_tokens": rng.randint(4, 32),
                           "stream": True}).encode()
        try:
            connection, response = _sse_open(self.http, "ensemble", body, self.deadline_s)
            try:
                if response.status != 200:
                    return Outcome("normal-sse", "normal-sse", "error", f"HTTP {response.status}")
                events = list(_sse_events(response))
            finally:
                connection.close()
        except socket.timeout:
            return Outcome("normal-sse", "normal-sse", "lost", "no end of stream before the deadline")
        errors = [event["error"] for event in events if "error" in event]
        if errors:
            return Outcome("normal-sse", "normal-sse", "error", errors[0][:300])
        return Outcome("normal-sse", "normal-sse", "ok" if events else "error", "" if events else "no events")

    def hang_up_sse(self, rng: random.Random) -> Outcome:
        body = json.dumps({"text_input": chat(rng.choice(PROMPTS)), "max_tokens": LONG_TOKENS, "end_id": -1,
                           "stream": True}).encode()
        chunks = rng.randint(1, 4)
        connection, response = _sse_open(self.http, "ensemble", body, self.deadline_s)
        seen = 0
        try:
            for event in _sse_events(response):
                if "error" in event:
                    return Outcome("hang-up-sse", "hang-up-sse", "error", event["error"][:300])
                seen += 1
                if seen >= chunks:
                    break
            else:
                return Outcome("hang-up-sse", "hang-up-sse", "unexpected", f"the stream ended after {seen} events")
        finally:
            if connection.sock is not None:
                connection.sock.close()  # the client is gone, mid-stream
            response.close()
            connection.close()
        return Outcome("hang-up-sse", "hang-up-sse", "ok")

    def cancel_grpc(self, rng: random.Random) -> Outcome:
        stream = GrpcStream(self.grpc)
        deadline = time.monotonic() + self.deadline_s
        try:
            stream.send("ensemble", {"text_input": np.array([[chat(rng.choice(PROMPTS)).encode()]], object),
                                     "max_tokens": np.array([[LONG_TOKENS]], np.int32),
                                     "end_id": np.array([[-1]], np.int32), "stream": np.array([[True]])})
            for _ in range(rng.randint(1, 4)):
                _, error, final = stream.next(deadline)
                if error is not None or final:
                    return Outcome("cancel-grpc", "cancel-grpc", "error" if error else "unexpected",
                                   str(error or "ended before the cancel")[:300])
        except queue.Empty:
            return Outcome("cancel-grpc", "cancel-grpc", "lost", "no response before the deadline")
        finally:
            stream.close(cancel=True)
        return Outcome("cancel-grpc", "cancel-grpc", "ok")

    def stop(self, rng: random.Random, index: int) -> Outcome:
        request_id = f"soak-stop-{index}"
        stream = GrpcStream(self.grpc)
        deadline = time.monotonic() + self.deadline_s
        try:
            stream.send("tensorrt_llm", ids_request(request_output_len=np.array([[LONG_TOKENS]], np.int32),
                                                    end_id=np.array([[-1]], np.int32)), request_id=request_id)
            for _ in range(rng.randint(1, 3)):
                _, error, final = stream.next(deadline)
                if error is not None or final:
                    return Outcome("stop", "stop", "error" if error else "unexpected",
                                   str(error or "ended before the stop")[:300])
            stopper = GrpcStream(self.grpc)
            try:
                stopper.send("tensorrt_llm", stop_request_inputs(), request_id=request_id)
                stop_status, stop_detail = stopper.until_end(deadline)
            finally:
                stopper.close()
            status, detail = stream.until_end(min(deadline, time.monotonic() + 10))
        except queue.Empty:
            return Outcome("stop", "stop", "lost", "no response before the deadline")
        finally:
            stream.close()
        if stop_status != "ok":
            return Outcome("stop", "stop", stop_status, f"the stop request: {stop_detail}")
        return Outcome("stop", "stop", status, detail or "")

    def bad(self, bad: BadInput, index: int) -> Outcome:
        started = time.monotonic()
        if bad.protocol == "http":
            try:
                connection, response = _sse_open(self.http, bad.model, bad.build(), self.deadline_s)
                try:
                    if response.status != 200:
                        status, detail = "error", f"HTTP {response.status}: {response.read()[:200]!r}"
                    else:
                        events = list(_sse_events(response))
                        errors = [event["error"] for event in events if "error" in event]
                        status, detail = ("error", errors[0][:300]) if errors else ("ok", "")
                finally:
                    connection.close()
            except socket.timeout:
                status, detail = "lost", "no end before the deadline"
        else:
            stream = GrpcStream(self.grpc)
            try:
                request_id = f"soak-unknown-{index}" if bad.expect == "ok" else ""
                stream.send(bad.model, bad.build(), request_id=request_id)
                status, detail = stream.until_end(time.monotonic() + self.deadline_s)
            finally:
                stream.close()
        if status != "lost" and status != bad.expect:
            detail = f"expected {bad.expect}, got {status}: {detail}"
            status = "unexpected"
        return Outcome("bad", bad.kind, status, detail, time.monotonic() - started)


def plan(config: SoakConfig) -> list[tuple[str, object]]:
    """The requests in random order: (category, argument)."""
    rng = random.Random(config.seed)
    n = config.requests
    hang_ups = round(n * config.hang_up_share)
    stops = round(n * config.stop_share)
    bads = round(n * config.bad_share)
    jobs = [("hang-up-sse", None)] * (hang_ups - hang_ups // 2) + [("cancel-grpc", None)] * (hang_ups // 2)
    jobs += [("stop", None)] * stops
    jobs += [("bad", BAD_INPUTS[i % len(BAD_INPUTS)]) for i in range(bads)]
    normals = max(0, n - len(jobs))
    jobs += [("normal-grpc", None)] * (normals - normals // 2) + [("normal-sse", None)] * (normals // 2)
    rng.shuffle(jobs)
    return jobs


def _run_one(soak: Soak, job: tuple[str, object], index: int) -> Outcome:
    category, argument = job
    rng = random.Random(soak.config.seed * 1_000_003 + index)
    started = time.monotonic()
    try:
        if category == "bad":
            outcome = soak.bad(argument, index)
        elif category == "stop":
            outcome = soak.stop(rng, index)
        else:
            outcome = getattr(soak, category.replace("-", "_"))(rng)
    except Exception as error:  # a client-side failure is a finding too, never a crash of the soak
        outcome = Outcome(category, category if category != "bad" else argument.kind, "unexpected",
                          f"{type(error).__name__}: {error}"[:300])
    outcome.seconds = time.monotonic() - started
    return outcome


def run_soak(config: SoakConfig, log=print) -> SoakReport:
    report = SoakReport(config=asdict(config))
    started = time.monotonic()
    server = None
    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        if config.http is None:
            log("soak: starting the default model's server (scripts/serve_default.py)")
            server = OwnServer(config.engine_dir, Path(work))
            http_url, grpc_url, metrics_url = server.http, server.grpc, server.metrics
        else:
            http_url, grpc_url, metrics_url = config.http, config.grpc, config.metrics
        try:
            _soak(config, report, server, http_url, grpc_url, metrics_url, log)
        finally:
            if server is not None:
                report.shutdown = server.ctrl_c(config.max_shutdown_s)
                server.kill()
    _judge(config, report, server is not None)
    report.seconds = round(time.monotonic() - started, 1)
    return report


def _soak(config, report, server, http_url, grpc_url, metrics_url, log):
    soak = Soak(config, http_url, grpc_url)
    jobs = plan(config)
    warm = [("normal-grpc", None)] * min(config.concurrency, 16)
    log(f"soak: warm-up ({len(warm)} requests)")
    with ThreadPoolExecutor(config.concurrency) as pool:
        list(pool.map(lambda item: _run_one(soak, item[1], -1 - item[0]), enumerate(warm)))
    before = {pid: (name, _usage(pid)) for pid, name in server.tree().items()} if server else {}
    log(f"soak: {len(jobs)} requests at concurrency {config.concurrency}")
    done = [0]
    lock = threading.Lock()

    def run(item):
        outcome = _run_one(soak, item[1], item[0])
        with lock:
            done[0] += 1
            if done[0] % max(1, len(jobs) // 10) == 0:
                log(f"soak: {done[0]}/{len(jobs)}")
        return outcome

    with ThreadPoolExecutor(config.concurrency) as pool:
        outcomes = list(pool.map(run, enumerate(jobs)))
    for outcome in outcomes:
        report.outcomes[(outcome.category, outcome.status)] += 1
        if outcome.category == "bad" and outcome.kind not in report.bad_kinds:
            note = next((bad.note for bad in BAD_INPUTS if bad.kind == outcome.kind), "")
            report.bad_kinds[outcome.kind] = {"status": outcome.status, "detail": (note or outcome.detail)[:160]}
        if outcome.status == "unexpected" or (outcome.status == "error" and outcome.category != "bad"):
            report.unexpected.append(asdict(outcome))
    report.lost = sum(count for (_, status), count in report.outcomes.items() if status == "lost")
    report.active_after_rest, report.used_blocks_after_rest = _rest(metrics_url, config.rest_s)
    if server:
        after = server.tree()
        for pid, (name, usage) in before.items():
            now = _usage(pid) if pid in after else None
            if usage is None:
                continue
            if now is None:
                report.process_changes.append(f"gone: {name}")
                continue
            report.processes[name] = {"rss_mib_before": round(usage[0], 1), "rss_mib_after": round(now[0], 1),
                                      "rss_growth_mib": round(now[0] - usage[0], 1),
                                      "threads_before": usage[1], "threads_after": now[1]}
        report.process_changes += [f"new: {name}" for pid, name in after.items() if pid not in before]


def _judge(config: SoakConfig, report: SoakReport, own_server: bool):
    fail = report.failures.append
    if report.lost:
        fail(f"{report.lost} requests lost (no final response within {config.deadline_s:g} s)")
    if report.unexpected:
        fail(f"{len(report.unexpected)} unexpected outcomes")
    if report.active_after_rest != 0 or report.used_blocks_after_rest != 0:
        fail(f"still after {config.rest_s:g} s of rest: {report.active_after_rest} active requests, "
             f"{report.used_blocks_after_rest} KV blocks used")
    if report.process_changes:
        fail(f"the process tree changed: {report.process_changes}")
    for name, figures in report.processes.items():
        if figures["rss_growth_mib"] > config.max_rss_growth_mib:
            fail(f"{name}: RSS grew by {figures['rss_growth_mib']} MiB")
        if figures["threads_after"] - figures["threads_before"] > config.max_thread_growth:
            fail(f"{name}: threads grew from {figures['threads_before']} to {figures['threads_after']}")
    if own_server:
        shutdown = report.shutdown
        if shutdown.get("max_in_flight_in_log"):
            fail(f"Ctrl-C: {shutdown['max_in_flight_in_log']} ensemble requests still in flight")
        if shutdown.get("seconds", 0) > config.max_shutdown_s:
            fail(f"Ctrl-C took {shutdown['seconds']} s")
        if shutdown.get("traceback"):
            fail("Ctrl-C: a traceback in the server log")
        if shutdown.get("left_behind"):
            fail(f"Ctrl-C: processes left behind: {shutdown['left_behind']}")


def format_report(report: SoakReport) -> str:
    lines = [f"soak: {report.config['requests']} requests at concurrency {report.config['concurrency']} "
             f"in {report.seconds} s"]
    categories = sorted({category for category, _ in report.outcomes})
    for category in categories:
        counts = {status: report.outcomes[(category, status)] for status in ("ok", "error", "lost", "unexpected")}
        lines.append(f"  {category:<12} " + "  ".join(f"{status} {count}" for status, count in counts.items()))
    lines.append(f"  bad input kinds sent: {len(report.bad_kinds)}")
    for kind, seen in sorted(report.bad_kinds.items()):
        lines.append(f"    {kind:<38} {seen['status']:<10} {seen['detail'][:100]}")
    lines.append(f"  lost: {report.lost}; after rest: active {report.active_after_rest}, "
                 f"used KV blocks {report.used_blocks_after_rest}")
    for name, figures in sorted(report.processes.items()):
        lines.append(f"  {name:<40} RSS {figures['rss_mib_before']:>8.1f} -> {figures['rss_mib_after']:>8.1f} MiB "
                     f"({figures['rss_growth_mib']:+.1f}); threads {figures['threads_before']} -> "
                     f"{figures['threads_after']}")
    if report.shutdown:
        lines.append(f"  Ctrl-C: {report.shutdown}")
    for outcome in report.unexpected[:10]:
        lines.append(f"  unexpected: {outcome}")
    lines.append("PASS" if report.ok else "FAIL: " + "; ".join(report.failures))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakConfig()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--hang-up-share", type=float, default=defaults.hang_up_share)
    parser.add_argument("--stop-share", type=float, default=defaults.stop_share)
    parser.add_argument("--bad-share", type=float, default=defaults.bad_share)
    parser.add_argument("--deadline", type=float, default=defaults.deadline_s, dest="deadline_s")
    parser.add_argument("--rest", type=float, default=defaults.rest_s, dest="rest_s")
    parser.add_argument("--max-rss-growth-mib", type=float, default=defaults.max_rss_growth_mib)
    parser.add_argument("--max-thread-growth", type=int, default=defaults.max_thread_growth)
    parser.add_argument("--max-shutdown-s", type=float, default=defaults.max_shutdown_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--engine-dir", dest="engine_dir")
    parser.add_argument("--http", help="a running server's HTTP URL (with --grpc and --metrics)")
    parser.add_argument("--grpc")
    parser.add_argument("--metrics", help="its metrics URL, e.g. http://127.0.0.1:8002/metrics")
    parser.add_argument("--json", help="also write the report here")
    args = vars(parser.parse_args(argv))
    json_path = args.pop("json")
    if args["http"] and not (args["grpc"] and args["metrics"]):
        parser.error("--http needs --grpc and --metrics")
    report = run_soak(SoakConfig(**args))
    print(format_report(report))
    if json_path:
        data = asdict(report)
        data["outcomes"] = {f"{category}/{status}": count for (category, status), count in report.outcomes.items()}
        Path(json_path).write_text(json.dumps(data, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
