"""Where the first steps of an offline vision-language run go: host and device times of the executor's
first steps and of the encode queue's forwards, on one clock (ms after the run's start).

Why: an iteration's figure (engine/executor/executor.py ``_record_stats``) runs from the step before it
to when the host read its tokens, so a slow one does not say whether the host launched late (the loop
thread waited for the GIL, a lock, a garbage collection) or the device ran the step late (its kernels
waited for SMs held by the tower's). Here, per executor step: when the host began and ended its launch
(``Executor._launch``: packing, copies queued, the graph replayed, sampling queued) and when the device
reached the step's start and finished it (CUDA events on the loop's stream around the launch); per
tower forward the same (``ImageEncodeQueue._launch`` on the queue's stream) and when its futures were
completed; and when the loop thread waited for tokens (``Executor._finish_in_flight``).

    timeline = LoopTimeline(ex, queue, started).__enter__()
    ...  # the run
    timeline.__exit__(); timeline.summary()

Device times come from CUDA events with timing, read after the run (``summary`` synchronizes); a device
time is ``base.elapsed_time(event)``, ``base`` being an event recorded on the idle default stream at the
start. On the CPU only the host times are kept. The wrappers are instance attributes, removed on exit.
"""
from __future__ import annotations

import time

import torch

MAX_STEPS = 24  # executor steps kept (the first ones: where the stalls were)
MAX_FORWARDS = 40  # tower forwards kept


class LoopTimeline:
    def __init__(self, ex, queue=None, origin: float | None = None):
        self.ex, self.queue = ex, queue
        self.origin = time.perf_counter() if origin is None else origin
        self.cuda = ex.runner.device.type == "cuda"
        self.base = None
        self.steps: list[list] = []  # [host began, host ended, start event, end event, prompt tokens, rows]
        self.finishes: list[list] = []  # [host began, host ended] of _finish_in_flight (waits for tokens)
        self.forwards: list[list] = []  # [host began, host ended, start event, end event, images, completed]

    def _ms(self) -> float:
        return round((time.perf_counter() - self.origin) * 1e3, 2)

    def _event(self, stream=None):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def __enter__(self) -> "LoopTimeline":
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record(torch.cuda.default_stream(self.ex.runner.device))
        ex, queue = self.ex, self.queue
        launch, finish = ex._launch, ex._finish_in_flight

        def timed_launch(plan, started):
            if len(self.steps) >= MAX_STEPS:
                return launch(plan, started)
            began, start = self._ms(), self._event()  # (the loop thread's current stream: the executor's)
            step = launch(plan, started)
            self.steps.append([began, self._ms(), start, self._event(), plan.num_context_tokens,
                               len(plan.scheduled) - plan.num_context_sequences])
            return step

        def timed_finish(*args, **kwargs):
            if len(self.finishes) >= MAX_STEPS:
                return finish(*args, **kwargs)
            began = self._ms()
            try:
                return finish(*args, **kwargs)
            finally:
                self.finishes.append([began, self._ms()])
        ex._launch, ex._finish_in_flight = timed_launch, timed_finish
        if queue is not None:
            forward, complete = queue._launch, queue._complete

            def timed_forward(items, slot):
                if len(self.forwards) >= MAX_FORWARDS:
                    return forward(items, slot)
                began, start = self._ms(), self._event(queue.stream)
                launched = forward(items, slot)
                entry = [began, self._ms(), start, self._event(queue.stream),
                         sum(len(grids) for _, grids, _ in items), None]
                self.forwards.append(entry)
                if launched is not None:
                    launched.timeline_entry = entry
                return launched

            def timed_complete(launched):
                complete(launched)
                entry = getattr(launched, "timeline_entry", None)
                if entry is not None:
                    entry[5] = self._ms()
            queue._launch, queue._complete = timed_forward, timed_complete
        return self

    def __exit__(self, *exc) -> None:
        for owner, names in ((self.ex, ("_launch", "_finish_in_flight")), (self.queue, ("_launch", "_complete"))):
            for name in names:
                if owner is not None and name in owner.__dict__:
                    delattr(owner, name)

    def _device_ms(self, event) -> float | None:
        return None if event is None or self.base is None else round(self.base.elapsed_time(event), 2)

    def summary(self) -> dict:
        """{"steps": [[host launch began, ended, device start, end, prompt tokens, decode rows], ...],
        "token_waits": [[began, ended], ...], "forwards": [[host launch began, ended, device start, end, images,
        futures completed], ...]}, all ms after the run's start (device times None on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.ex.runner.device)
        return {"steps": [[a, b, self._device_ms(s), self._device_ms(e), tokens, rows]
                          for a, b, s, e, tokens, rows in self.steps],
                "token_waits": self.finishes,
                "forwards": [[a, b, self._device_ms(s), self._device_ms(e), images, done]
                             for a, b, s, e, images, done in self.forwards]}
