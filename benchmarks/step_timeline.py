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
  (on a worker rank, whose only work there is the broadcast, it is nearly the idle time itself).

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
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            out = super().forward(batch, all_logits=all_logits)
            end.record()
            timeline = self.__dict__.setdefault("timeline", deque(maxlen=MAX_STEPS))
            timeline.append((len(batch.seq_lens_q), began, time.perf_counter(), start, end))
            return out

        def reset_timeline(self) -> None:
            self.__dict__.pop("timeline", None)

    TimedRunner.__name__ = f"Timed{base.__name__}"
    return TimedRunner


def reset(runner) -> None:
    """Forget the steps timed so far, on every rank (a LeaderRunner mirrors the call)."""
    if hasattr(runner, "call_on_all_ranks"):
        runner.call_on_all_ranks("reset_timeline")
    elif hasattr(runner, "reset_timeline"):
        runner.reset_timeline()


def summarize(runner, *, skip: int = 8) -> dict[int, dict]:
    """Per batch size: medians of host_ms, gpu_ms, period_ms and gap_ms over consecutive steps of
    that size (the first ``skip`` steps of each run of that size left out as warm-up)."""
    local = getattr(runner, "runner", runner)
    steps = list(local.__dict__.get("timeline", ()))
    if not steps:
        return {}
    torch.cuda.synchronize()
    by_size: dict[int, dict[str, list[float]]] = {}
    run_length = 0
    for previous, step in zip([None] + steps[:-1], steps):
        size, began, ended, start, end = step
        run_length = run_length + 1 if previous is not None and previous[0] == size else 1
        if run_length <= skip:
            continue
        entry = by_size.setdefault(size, {"host_ms": [], "gpu_ms": [], "period_ms": [], "gap_ms": []})
        entry["host_ms"].append((ended - began) * 1e3)
        entry["gpu_ms"].append(start.elapsed_time(end))
        entry["period_ms"].append((began - previous[1]) * 1e3)
        entry["gap_ms"].append(previous[4].elapsed_time(start))
    return {size: {"steps": len(values["host_ms"]), **{key: statistics.median(v) for key, v in values.items()}}
            for size, values in sorted(by_size.items())}


def describe(summary: dict[int, dict]) -> str:
    return "; ".join(f"batch {size}: {s['steps']} steps, period {s['period_ms']:.3f} ms, GPU {s['gpu_ms']:.3f} ms, "
                     f"gap {s['gap_ms']:.3f} ms, host in forward {s['host_ms']:.3f} ms"
                     for size, s in summary.items()) or "no decode steps timed"
