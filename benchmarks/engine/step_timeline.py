"""Where a decode step's time goes on the device, from CUDA events around every runner forward.

``timed(RunnerClass)`` returns a subclass whose ``forward`` records, for every decode-only step
(one new token per sequence), the host time spent inside forward and two CUDA events on the
rank's stream: one enqueued when forward begins (before its input copies) and one when it
returns (after the logits). ``summarize(runner)`` then reports, per batch size, medians of:

- ``host_ms``: host time inside forward (packing, copies enqueued, graph launch);
- ``gpu_ms``: device time from the step's start event to its end event;
- ``period_ms``: host time between the starts of consecutive steps (1 / steps per second);
- ``gap_ms``: device time from one step's end event to the next step's start event. What runs
  there is the sampler, the sampled-token copy home and, in leader mode, their broadcast; the
  rest is the GPU waiting for the host. So this is an upper bound of the GPU's idle time per step
  (on a worker rank, whose only work there is waiting in the broadcast for the leader's sampler).
- ``idle_ms`` (where the executor stores the sampled tokens, ``store_sampled_tokens``): device
  time from an event enqueued right after the step's sampler and token store to the next step's
  start event: the GPU's idle time per step, but for the two small copies of the tokens home;
- ``graph_host_ms``: host time inside the decode graphs' ``run`` (input copies enqueued, the replay
  launched), and ``graph_steps``: how many of the steps replayed a decode graph at all (the others ran
  eagerly: a few hundred launches from Python, which alone takes milliseconds of host time);
- ``cpu_in_forward_ms`` / ``cpu_period_ms``: the loop thread's own CPU time (``time.thread_time``) inside
  forward / from one step's start to the next. Far below host_ms / period_ms: the thread waited (for the
  GIL, a lock, the device); about equal: it worked (launches, Python).

``summarize(runner, since=t0, until=t1)`` keeps the steps that began in [t0, t1) (perf_counter): a
torch.profiler window leaves CUPTI attached to a process with CUDA graphs for good (torch turns its
teardown off then), so steps after a window are timed under its overhead; the benchmarks report the
steps before their first window apart.

The events are recorded only on CUDA devices; the newest ``MAX_STEPS`` steps are kept.
"""
from __future__ import annotations

import statistics
import time
from collections import deque

import torch

MAX_STEPS = 8192


def timed(base: type) -> type:
    """``base`` (a ModelRunner class) with the per-step timeline described above."""

    class TimedRunner(base):
        def forward(self, batch, *, all_logits: bool = False):
            decode_only = len(batch.token_ids) == len(batch.seq_lens_q)
            if self.device.type != "cuda" or all_logits or not decode_only:
                return super().forward(batch, all_logits=all_logits)
            graphs = getattr(self, "decode_graphs", None)
            graphs = graphs if hasattr(graphs, "replays") else None  # (engine/executor/cuda_graphs.py's)
            if graphs is not None and "run" not in graphs.__dict__:
                _time_graph_runs(graphs)
            replays = sum(graphs.replays.values()) if graphs is not None else 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began, cpu_began = time.perf_counter(), time.thread_time()
            start.record()
            out = super().forward(batch, all_logits=all_logits)
            end.record()
            timeline = self.__dict__.setdefault("timeline", deque(maxlen=MAX_STEPS))
            replayed = graphs is not None and sum(graphs.replays.values()) > replays
            timeline.append([len(batch.seq_lens_q), began, time.perf_counter(), start, end, None,
                             graphs.last_run_s if replayed else None, cpu_began, time.thread_time()])
            return out

        def store_sampled_tokens(self, token_ids, batch) -> None:
            super().store_sampled_tokens(token_ids, batch)
            timeline = self.__dict__.get("timeline")
            if self.device.type == "cuda" and timeline and timeline[-1][5] is None:
                sampled = torch.cuda.Event(enable_timing=True)
                sampled.record()
                timeline[-1][5] = sampled

        def reset_timeline(self) -> None:
            self.__dict__.pop("timeline", None)

    TimedRunner.__name__ = f"Timed{base.__name__}"
    return TimedRunner


def _time_graph_runs(graphs) -> None:
    """Wrap this DecodeGraphs' ``run`` so that it keeps its last call's host time (``last_run_s``)."""
    run = graphs.run

    def timed_run(*args, **kwargs):
        began = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            graphs.last_run_s = time.perf_counter() - began

    graphs.last_run_s = 0.0
    graphs.run = timed_run


def reset(runner) -> None:
    """Forget the steps timed so far, on every rank (a LeaderRunner mirrors the call)."""
    if hasattr(runner, "call_on_all_ranks"):
        runner.call_on_all_ranks("reset_timeline")
    elif hasattr(runner, "reset_timeline"):
        runner.reset_timeline()


def summarize(runner, *, skip: int = 8, since: float | None = None, until: float | None = None) -> dict[int, dict]:
    """Per batch size: medians of host_ms, gpu_ms, period_ms and gap_ms over consecutive steps of
    that size (the first ``skip`` steps of each run of that size left out as warm-up), of the steps
    that began in [since, until) (perf_counter; None: unbounded); graph_steps counts the replays."""
    local = getattr(runner, "runner", runner)
    steps = list(local.__dict__.get("timeline", ()))
    if not steps:
        return {}
    torch.cuda.synchronize()
    by_size: dict[int, dict[str, list[float]]] = {}
    replayed: dict[int, int] = {}
    run_length = 0
    for previous, step in zip([None] + steps[:-1], steps):
        size, began, ended, start, end, _, graph_run_s, cpu_began, cpu_ended = step
        run_length = run_length + 1 if previous is not None and previous[0] == size else 1
        if run_length <= skip or (since is not None and began < since) or (until is not None and began >= until):
            continue
        entry = by_size.setdefault(size, {"host_ms": [], "gpu_ms": [], "period_ms": [], "gap_ms": [], "idle_ms": [],
                                          "graph_host_ms": [], "cpu_in_forward_ms": [], "cpu_period_ms": []})
        replayed[size] = replayed.get(size, 0) + (graph_run_s is not None)
        if graph_run_s is not None:
            entry["graph_host_ms"].append(graph_run_s * 1e3)
        entry["host_ms"].append((ended - began) * 1e3)
        entry["cpu_in_forward_ms"].append((cpu_ended - cpu_began) * 1e3)
        entry["cpu_period_ms"].append((cpu_began - previous[7]) * 1e3)
        entry["gpu_ms"].append(start.elapsed_time(end))
        entry["period_ms"].append((began - previous[1]) * 1e3)
        entry["gap_ms"].append(previous[4].elapsed_time(start))
        if previous[5] is not None:
            entry["idle_ms"].append(previous[5].elapsed_time(start))
    return {size: {"steps": len(values["host_ms"]), "graph_steps": replayed[size],
                   **{key: statistics.median(v) for key, v in values.items() if v},
                   # a bimodal step (every other one slow, a stall every n) shows here, not in medians
                   **{f"{key}_p10_p90": _deciles(values[key]) for key in ("period_ms", "host_ms", "gpu_ms")},
                   **{f"{key}_first": [round(v, 3) for v in values[key][:HEAD_STEPS]]
                      for key in ("period_ms", "host_ms", "gpu_ms", "cpu_period_ms")}}
            for size, values in sorted(by_size.items())}


HEAD_STEPS = 24  # steps summarize lists one by one (after the warm-up), per batch size


def _deciles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return values * 2
    cuts = statistics.quantiles(values, n=10)
    return [round(cuts[0], 3), round(cuts[-1], 3)]


def describe(summary: dict[int, dict]) -> str:
    def idle(s: dict) -> str:
        return f", idle {s['idle_ms']:.3f} ms" if "idle_ms" in s else ""

    return "; ".join(f"batch {size}: {s['steps']} steps, period {s['period_ms']:.3f} ms, GPU {s['gpu_ms']:.3f} ms, "
                     f"gap {s['gap_ms']:.3f} ms{idle(s)}, host in forward {s['host_ms']:.3f} ms"
                     for size, s in summary.items()) or "no decode steps timed"


def profile_device(runner, seconds: float) -> dict:
    """Every CUDA activity of this process (kernels, graph kernels, copies) for ``seconds`` of
    the running workload, by the profiler: the device's busy time (union of activity intervals)
    and idle time between the first and last activity, per decode step timed meanwhile, and the
    top kernels by device time. An exact idle figure where ``gap_ms`` is an upper bound."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    local = getattr(runner, "runner", runner)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        window = time.perf_counter()
        time.sleep(seconds)
        window = (window, time.perf_counter())
    # Steps launched while the profiler recorded (starting and stopping it takes a while itself).
    steps = sum(1 for step in list(local.__dict__.get("timeline", ())) if window[0] <= step[1] <= window[1])
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    intervals = [(start, end) for start, end, _ in kernels]
    if not intervals or steps <= 0:
        return {"steps": steps, "activities": len(intervals)}
    busy, (run_start, run_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = intervals[-1][1] - intervals[0][0]
    top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50)
    return {"steps": steps, "activities": len(intervals), "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_ms_per_step": (span - busy) / 1e3 / steps, "busy_ms_per_step": busy / 1e3 / steps,
            "top_kernels": top, "critical_path": critical_path(kernels, steps)}


def critical_path(kernels: list[tuple[float, float, str]], steps: int, context: int = 4) -> list[dict]:
    """What each kernel adds to the stream's timeline: its end minus the later of the previous
    kernel's end and its own start. With PDL a kernel starts during its predecessor and waits, so
    its own duration overstates it; this share counts the handoff and its work after the wait, and
    no idle time. Kernels are told apart by name and the names of the ``context`` kernels before
    them (so the four products of a layer come out as four rows). Per step, largest first.
    ``kernels``: (start, end, name) of every device activity, sorted by start (``profile_device``)."""
    short = [name[:28] for _, _, name in kernels]
    rows: dict[tuple, list[float]] = {}
    for i in range(context, len(kernels)):
        start, end, _ = kernels[i]
        share = end - max(kernels[i - 1][1], start)
        rows.setdefault(tuple(short[i - context:i + 1]), []).append(share)
    out = [{"kernel": key[-1], "after": " < ".join(reversed(key[:-1])), "us_per_step": sum(v) / steps,
            "count_per_step": len(v) / steps, "mean_us": sum(v) / len(v)} for key, v in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])[:40]
