"""What the processes and the engine did while serving_bench timed one run (issue 14's questions).

Two questions decide where a served path loses against the in-process engine:
- Did the engine itself step slower? The executor's iteration log ($TRITONLLM_ITERATION_LOG,
  engine/executor/stats.py) gives each step's period, whether it carried prefill tokens, and how
  long the loop spent handing responses on (a relay that reads late makes that grow).
- Who used the CPU? The CPU seconds of every process under the server (by role: tritonserver, each
  model's stubs, the engine process) and of the benchmark's client processes, over the timed run,
  as cores busy. On a machine whose cores are all busy, a slower engine step is contention.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from engine.executor.stats import read_iteration_log

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)


def engine_step_summary(rows: list[dict]) -> dict:
    """Medians of an iteration log's steps: all, decode-only and mixed (prefill tokens in them)."""
    if not rows:
        return {}
    decode = [r["latency_ms"] for r in rows if r["num_ctx_tokens"] == 0]
    mixed = [r["latency_ms"] for r in rows if r["num_ctx_tokens"] > 0]
    deliver = sorted(r["deliver_ms"] for r in rows)
    return {
        "engine_steps": len(rows),
        "engine_step_ms_median": statistics.median(r["latency_ms"] for r in rows),
        "engine_decode_step_ms_median": statistics.median(decode) if decode else None,
        "engine_mixed_step_ms_median": statistics.median(mixed) if mixed else None,
        "engine_mixed_step_share": len(mixed) / len(rows),
        "engine_rows_per_step_mean": statistics.fmean(r["num_gen_tokens"] + (r["num_ctx_tokens"] > 0) for r in rows),
        "engine_deliver_ms_median": deliver[len(deliver) // 2],
        "engine_deliver_ms_p99": deliver[min(len(deliver) - 1, int(len(deliver) * 0.99))],
    }


class RunDiagnostics:
    """``begin()`` before a timed run, ``end()`` after it: the row fields for that run.

    ``processes``: () -> [(pid, role)] of the processes to account (read at both ends; a process
    that appears meanwhile counts from zero). ``iteration_log``: the engine's log path, or None."""

    def __init__(self, processes, iteration_log: str | None):
        self._processes = processes
        self._iteration_log = iteration_log
        self._start = None

    def begin(self) -> None:
        self._start = (time.time_ns(), time.perf_counter(), self._cpu())

    def end(self) -> dict:
        start_ns, started, cpu_before = self._start
        wall_s = time.perf_counter() - started
        row = {}
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
    return "; ".join(parts)
