"""What the processes and the engine did while serving_bench timed one run (issue 14's questions).

Two questions decide where a served path loses against the in-process engine:
- Did the engine itself step slower? The executor's iteration log ($TRITONLLM_ITERATION_LOG,
  engine/executor/stats.py) gives each step's period, whether it carried prefill tokens, and how
  long the loop spent handing responses on (a relay that reads late makes that grow).
- Who used the CPU? The CPU seconds of every process under the server (by role: tritonserver, each
  model's stubs, the engine process) and of the benchmark's client processes, over the timed run,
  as cores busy. On a machine whose cores are all busy, a slower engine step is contention.
- Where did a request wait inside the server? Triton's own statistics (/v2/models/stats) per model:
  requests, executions, and the mean time a request queued for an instance and spent in execute.
- How much of the time to first token passed inside `tensorrt_llm`? The mean of its
  `nv_llm_time_to_first_token_seconds` histogram over the run (arrival at the executor to its first
  token); the client's TTFT minus this is the time spent before and after it in the server.
"""
from __future__ import annotations

import json
import statistics
import time
import urllib.request

from benchmarks.common import cpu_seconds
from engine.executor.stats import read_iteration_log

def engine_step_summary(rows: list[dict]) -> dict:
    """Medians of an iteration log's steps: all, decode-only and mixed (prefill tokens in them)."""
    if not rows:
        return {}
    decode = [r["latency_ms"] for r in rows if r["num_ctx_tokens"] == 0]
    mixed = [r["latency_ms"] for r in rows if r["num_ctx_tokens"] > 0]
    prefill_tokens = [r["num_ctx_tokens"] for r in rows if r["num_ctx_tokens"] > 0]
    deliver = sorted(r["deliver_ms"] for r in rows)
    return {
        "engine_steps": len(rows),
        "engine_step_ms_median": statistics.median(r["latency_ms"] for r in rows),
        "engine_decode_step_ms_median": statistics.median(decode) if decode else None,
        "engine_mixed_step_ms_median": statistics.median(mixed) if mixed else None,
        "engine_mixed_step_share": len(mixed) / len(rows),
        "engine_prefill_tokens_per_mixed_step": statistics.fmean(prefill_tokens) if prefill_tokens else None,
        "engine_rows_per_step_mean": statistics.fmean(r["num_gen_tokens"] + (r["num_ctx_tokens"] > 0) for r in rows),
        "engine_deliver_ms_median": deliver[len(deliver) // 2],
        "engine_deliver_ms_p99": deliver[min(len(deliver) - 1, int(len(deliver) * 0.99))],
    }


class RunDiagnostics:
    """``begin()`` before a timed run, ``end()`` after it: the row fields for that run.

    ``processes``: () -> [(pid, role)] of the processes to account (read at both ends; a process
    that appears meanwhile counts from zero). ``iteration_log``: the engine's log path, or None."""

    def __init__(self, processes, iteration_log: str | None, server_url: str | None = None,
                 metrics_url: str | None = None):
        self._processes = processes
        self._iteration_log = iteration_log
        self._server_url = server_url  # a tritonserver's HTTP address: its model statistics
        self._metrics_url = metrics_url  # its metrics address: tensorrt_llm's TTFT histogram
        self._start = None

    def begin(self) -> None:
        stats = model_statistics(self._server_url) if self._server_url else None
        ttft = histogram_totals(self._metrics_url, TTFT_HISTOGRAM) if self._metrics_url else None
        self._start = (time.time_ns(), time.perf_counter(), self._cpu(), stats, ttft)

    def end(self) -> dict:
        start_ns, started, cpu_before, stats_before, ttft_before = self._start
        wall_s = time.perf_counter() - started
        row = {}
        if stats_before is not None:
            row["triton_models"] = model_statistics_delta(stats_before, model_statistics(self._server_url))
        if ttft_before is not None:
            total_s, count = (a - b for a, b in zip(histogram_totals(self._metrics_url, TTFT_HISTOGRAM), ttft_before))
            row["tensorrt_llm_ttft_ms_mean"] = total_s / count * 1e3 if count > 0 else None
        if self._iteration_log:
            row.update(engine_step_summary(read_iteration_log(self._iteration_log, start_ns, time.time_ns())))
        cores: dict[str, float] = {}
        for pid, (role, seconds) in self._cpu().items():
            cores[role] = cores.get(role, 0.0) + (seconds - cpu_before.get(pid, (role, 0.0))[1]) / wall_s
        row["cores_busy"] = {role: round(value, 2) for role, value in sorted(cores.items(), key=lambda kv: -kv[1])}
        row["cores_busy_total"] = round(sum(cores.values()), 2)
        return row

    def _cpu(self) -> dict[int, tuple[str, float]]:
        found = {}
        for pid, role in self._processes():
            seconds = cpu_seconds(pid)
            if seconds is not None:
                found[pid] = (role, seconds)
        return found


TTFT_HISTOGRAM = "nv_llm_time_to_first_token_seconds"


def metric_totals(metrics_url: str, names) -> dict[str, float]:
    """Each named sample of a server's /metrics page (Prometheus text), summed over its label sets."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def histogram_totals(metrics_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram over all its label sets, from a /metrics page."""
    totals = metric_totals(metrics_url, (name + "_sum", name + "_count"))
    return totals[name + "_sum"], totals[name + "_count"]


def model_statistics(server_url: str) -> dict[str, dict]:
    """Each model's cumulative statistics (Triton's /v2/models/stats; all versions summed)."""
    with urllib.request.urlopen(f"{server_url}/v2/models/stats", timeout=10) as response:
        body = json.load(response)
    found: dict[str, dict] = {}
    for model in body.get("model_stats", []):
        totals = found.setdefault(model["name"], {"executions": 0})
        totals["executions"] += int(model.get("execution_count", 0))
        for phase, figures in model.get("inference_stats", {}).items():
            count, ns = totals.get(phase, (0, 0))
            totals[phase] = (count + int(figures.get("count", 0)), ns + int(figures.get("ns", 0)))
    return found


def model_statistics_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per model over the run: requests, executions, mean queue and execute (compute_infer) ms per request."""
    found = {}
    for name, totals in after.items():
        old = before.get(name, {})
        requests = totals.get("success", (0, 0))[0] - old.get("success", (0, 0))[0]
        if requests <= 0:
            continue

        def mean_ms(phase: str) -> float:
            return (totals.get(phase, (0, 0))[1] - old.get(phase, (0, 0))[1]) / requests / 1e6

        found[name] = {"requests": requests, "executions": totals["executions"] - old.get("executions", 0),
                       "queue_ms": round(mean_ms("queue"), 3), "execute_ms": round(mean_ms("compute_infer"), 3)}
    return found


def describe(row: dict) -> str:
    """One line for the progress log."""
    parts = []
    if row.get("engine_steps"):
        decode = row["engine_decode_step_ms_median"]
        parts.append(f"engine step {row['engine_step_ms_median']:.2f} ms (decode-only "
                     f"{'-' if decode is None else f'{decode:.2f}'}, mixed {row['engine_mixed_step_share']:.0%}, "
                     f"deliver p50/p99 {row['engine_deliver_ms_median']:.2f}/{row['engine_deliver_ms_p99']:.2f})")
    if "cores_busy" in row:
        top = ", ".join(f"{role} {value:.2f}" for role, value in list(row["cores_busy"].items())[:6])
        parts.append(f"cores {row['cores_busy_total']:.1f}: {top}")
    if row.get("tensorrt_llm_ttft_ms_mean") is not None:
        parts.append(f"TTFT inside tensorrt_llm {row['tensorrt_llm_ttft_ms_mean']:.1f} ms mean")
    if row.get("triton_models"):
        parts.append("queue/execute ms per request: " + ", ".join(
            f"{name} {m['queue_ms']:.2f}/{m['execute_ms']:.2f}" for name, m in row["triton_models"].items()))
    return "; ".join(parts)
