"""Where a pipeline stage's decode steps go, from a torch.profiler window on each rank (``tp_bench.py --trace_steps``).

``traced(StageRunnerClass, tracer)`` returns a subclass whose ``launch`` counts the decode-only steps of at least
``tracer.batch`` sequences (every rank counts the same plans, so the k-th such step is the same step on every
rank) and, from the ``skip + 1``-th on, records a torch.profiler window (CPU and CUDA activity) over ``warm +
steps + TAIL_STEPS`` of them, each step's ``launch``, ``finish`` and ``store_sampled_tokens`` inside a
``pp_trace <what> <k>`` annotation. Right after the window (or at ``StepTracer.finish``, if the steps ended inside
it) the tracer reads the window's chrome trace and keeps, per analysed step (the ``steps`` after the ``warm`` ones; the profiler's start perturbs the first):

- host: the loop thread's period between launches, its time inside launch / finish / the token store, and its time
  blocked in CUDA synchronize calls (cudaEventSynchronize: the executor's TokenTransfer.wait on rank 0, the decode
  graphs' pinned-input ``_copied.synchronize()``);
- device, on the compute stream (the one with the most non-NCCL kernel time), from the step's first activity to the
  next step's: busy time by kind (the stage's graph replay, other kernels such as the LM head and argmax, copies)
  and each idle gap with what ended it: ``host`` (the activity after the gap was launched only after the stream went
  idle) or the activity of another stream that ended last before it (an NCCL receive or send, a copy);
- the NCCL kernels each step launched (send or receive by the op that launched them), with absolute times.

Times are made absolute (epoch microseconds) with each rank's own offset (its annotations' start against
``time.time_ns()``), so ``pipeline_loop`` lines two ranks' steps up: a step's stage-0 graph on rank 0, the hop to
rank 1, its graph and LM head there, the ids' way back, and rank 0's graph of the step ``depth`` later, which
waits for those ids. Without CUDA (the CPU rehearsal) only the host figures come out.
"""
from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import torch

PREFIX = "pp_trace"
TAIL_STEPS = 4  # steps recorded after the analysed ones: the loop reads step k + depth's graph
GAP_MIN_US = 2.0  # idle time on the compute stream shorter than this is not a gap
GAP_LISTED_US = 10.0  # shorter gaps (between a graph's kernels, say) are only counted, per step
SYNC_CALLS = ("Synchronize", "cudaEventQuery", "cudaStreamQuery")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_KEPT: list = []  # the finished windows' profilers (StepTracer._stop says why)
RAW_TRACE_MAX_BYTES = 15 << 20  # a gzipped raw trace larger than this is not kept (a device call's file limit)


class _LabelledP2P:
    """torch.distributed with its point-to-point calls inside annotations that name them (the NCCL kernels they
    launch are then told apart as sends and receives); installed in engine.pipeline.runner while tracing."""

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def isend(self, *args, **kwargs):
        with torch.profiler.record_function("pp_p2p send"):
            return self._dist.isend(*args, **kwargs)

    def irecv(self, *args, **kwargs):
        with torch.profiler.record_function("pp_p2p recv"):
            return self._dist.irecv(*args, **kwargs)

    def recv(self, *args, **kwargs):
        with torch.profiler.record_function("pp_p2p recv"):
            return self._dist.recv(*args, **kwargs)


def label_point_to_point(module) -> None:
    """Name ``module``'s (engine.pipeline.runner's) sends and receives in the trace (_LabelledP2P)."""
    if not isinstance(module.dist, _LabelledP2P):
        module.dist = _LabelledP2P(module.dist)


class StepTracer:
    """One rank's profiler window over decode-only steps (module docstring)."""

    def __init__(self, *, steps: int, skip: int, warm: int, batch: int, out: str, raw_out: str | None = None,
                 rank: int = 0):
        self.steps, self.skip, self.warm, self.batch = steps, skip, warm, batch
        self.out, self.raw_out, self.rank = out, raw_out, rank
        self.count = 0  # matching steps launched so far
        self.profiler = None
        self.done = False
        self.marks: list[tuple[int, str, int]] = []  # (step, what, time.time_ns() at the annotation's start)
        self.batch_sizes: dict[int, int] = {}
        self._steps_of: dict[int, int] = {}  # id(launched step or its batch) -> step number
        self.depth: int | None = None  # rank 0: the executor's steps in flight (the loop's step k + depth)
        self.summary: dict | None = None

    @property
    def last_recorded(self) -> int:
        return self.skip + self.warm + self.steps + TAIL_STEPS

    def matches(self, batch, all_logits: bool) -> bool:
        n = len(batch.seq_lens_q)
        return not all_logits and n >= max(1, self.batch) and len(batch.token_ids) == n

    def on_launch(self, batch, all_logits: bool) -> int | None:
        """The step's number if it is recorded (the window opens before it and closes after the last)."""
        if self.done or not self.matches(batch, all_logits):
            return None
        self.count += 1
        if self.count == self.skip + 1 and self.profiler is None:
            self._start()
        if self.profiler is None:
            return None
        if self.count > self.last_recorded:
            self._stop()
            return None
        self.batch_sizes[self.count] = len(batch.seq_lens_q)
        return self.count

    def annotate(self, step: int, what: str):
        self.marks.append((step, what, time.time_ns()))
        return torch.profiler.record_function(f"{PREFIX} {what} {step}")

    def remember(self, key: object, step: int) -> None:
        self._steps_of[id(key)] = step
        if len(self._steps_of) > 64:  # (only the steps in flight are looked up)
            for old in list(self._steps_of)[:32]:
                del self._steps_of[old]

    def step_of(self, key: object) -> int | None:
        return self._steps_of.get(id(key)) if self.profiler is not None else None

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        kwargs = {}
        try:  # the compute stream's waits on other streams' events (torch >= 2.2)
            kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
        except (AttributeError, TypeError):
            pass
        self.profiler = profile(activities=activities, **kwargs)
        self.profiler.start()

    def _stop(self) -> None:
        """Stop, export, analyse and write, on the thread that recorded (rank 0: the executor's loop thread;
        exporting from another thread crashed the process on CPU), right after the window: the summary is on disk
        before the phase ends (whatever its end), at the cost of a few seconds' stall of the steps after it."""
        if self.profiler is None or self.done:
            return
        began = time.monotonic()
        self.profiler.stop()
        self.done = True
        handle, path = tempfile.mkstemp(prefix=f"pp_trace{self.rank}-", suffix=".json")  # (the export reopens it)
        os.close(handle)
        try:
            self.profiler.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            if self.raw_out:
                _write_raw(trace, self.raw_out)
            summary = summarize_rank(trace.get("traceEvents", []), self.marks, rank=self.rank,
                                     first=self.skip + self.warm + 1, last=self.skip + self.warm + self.steps,
                                     batch_sizes=self.batch_sizes)
        except Exception as err:  # noqa: BLE001  (a failed analysis must not cost the run its figures)
            summary = {"rank": self.rank, "error": f"{type(err).__name__}: {err}"}
        finally:
            if os.path.exists(path):
                os.remove(path)
            # The profiler is never let go: collecting it crashed the process (CPU runs, torch 2.13, in the garbage
            # collector, whether at exit or by gc.collect()); the ranks leave by os._exit (tp_bench.main)
            _KEPT.append(self.profiler)
        summary["depth"] = self.depth
        summary["stop_export_analysis_s"] = round(time.monotonic() - began, 2)
        self.summary = summary
        _write_json(self.out, summary)

    def finish(self) -> dict:
        """The window's summary (the window closed and analysed now if the steps ended inside it), written."""
        if self.profiler is None:
            self.summary = {"rank": self.rank, "error": f"no window: {self.count} matching steps (skip {self.skip})"}
            _write_json(self.out, self.summary)
        self._stop()
        return self.summary


def init_profiler_here() -> None:
    """Open and close an empty profiler window on this (the main) thread, so that the profiler's backend registers
    here: a window first opened on the executor's loop thread made the process crash at exit (CPU, torch 2.13)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        pass


def traced(base: type, tracer: StepTracer) -> type:
    """``base`` (StageRunner or a subclass) with ``tracer``'s window around its decode steps."""

    class TracedStageRunner(base):
        def launch(self, batch, *, all_logits: bool = False, prompt_embeds=None):
            step = tracer.on_launch(batch, all_logits)
            if step is None:
                return super().launch(batch, all_logits=all_logits, prompt_embeds=prompt_embeds)
            with tracer.annotate(step, "launch"):
                launched = super().launch(batch, all_logits=all_logits, prompt_embeds=prompt_embeds)
            tracer.remember(launched, step)
            tracer.remember(batch, step)
            return launched

        def finish(self, launched):
            step = tracer.step_of(launched)
            if step is None or tracer.done:
                return super().finish(launched)
            with tracer.annotate(step, "finish"):
                return super().finish(launched)

        def store_sampled_tokens(self, token_ids, batch) -> None:
            step = tracer.step_of(batch)
            if step is None or tracer.done:
                return super().store_sampled_tokens(token_ids, batch)
            with tracer.annotate(step, "store"):
                return super().store_sampled_tokens(token_ids, batch)

    TracedStageRunner.__name__ = f"Traced{base.__name__}"
    return TracedStageRunner


# ---- the analysis: chrome-trace events -> per-step figures --------------------------------------------


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def _write_raw(trace: dict, path: str) -> None:
    data = gzip.compress(json.dumps(trace).encode(), compresslevel=6)
    if len(data) <= RAW_TRACE_MAX_BYTES:
        with open(path, "wb") as f:
            f.write(data)


_ANNOTATION = re.compile(rf"^{PREFIX} (launch|finish|store) (\d+)$")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end_so_far = 0.0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total / 1e3


def _enclosing(intervals: dict, tid, ts: float, *, skip_prefix: str | None = None) -> list[str]:
    """Names of the intervals of thread ``tid`` (sorted by start: (starts, list of (start, end, name))) holding ts."""
    starts, rows = intervals.get(tid, ([], []))
    i = bisect.bisect_right(starts, ts)
    names = []
    for start, end, name in reversed(rows[max(0, i - 400):i]):
        if start <= ts <= end and not (skip_prefix and name.startswith(skip_prefix)):
            names.append(name)
    return names


def summarize_rank(events: list[dict], marks: list[tuple[int, str, int]], *, rank: int, first: int, last: int,
                   batch_sizes: dict[int, int] | None = None) -> dict:
    """One rank's chrome-trace ``events`` -> the figures of steps ``first``..``last`` (module docstring).
    ``marks``: (step, what, time.time_ns()) taken as each annotation opened (the clock offset)."""
    annotations = []  # (ts, end, tid, what, step)
    ops_by_tid: dict = {}
    runtime = {}  # correlation -> (ts, end, tid, name)
    gpu = []  # dicts: start, end, stream, correlation, name, cat
    sync_events = 0  # cuda_sync events (the stream waits): only counted, to show the profiler recorded them
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, ts = e.get("cat", ""), e.get("name", ""), float(e.get("ts", 0.0))
        end = ts + float(e.get("dur", 0.0))
        args = e.get("args") or {}
        if cat in ("user_annotation", "cpu_op"):
            match = _ANNOTATION.match(name) if cat == "user_annotation" else None
            if match:
                annotations.append((ts, end, e.get("tid"), match.group(1), int(match.group(2))))
            ops_by_tid.setdefault(e.get("tid"), []).append((ts, end, name))
        elif cat in ("cuda_runtime", "cuda_driver"):
            if "correlation" in args:
                runtime[args["correlation"]] = (ts, end, e.get("tid"), name)
        elif cat in GPU_CATEGORIES:
            gpu.append({"start": ts, "end": end, "stream": args.get("stream", e.get("tid")),
                        "correlation": args.get("correlation"), "name": name, "cat": cat})
        elif cat == "cuda_sync":
            sync_events += 1
    intervals = {}
    for tid, rows in ops_by_tid.items():
        rows.sort()
        intervals[tid] = ([r[0] for r in rows], rows)
    annotations.sort()
    # the clock: epoch us = trace ts + offset (median over the annotations, matched in order per (step, what))
    opened = {(step, what): ns / 1e3 for step, what, ns in marks}
    offsets = [opened[(step, what)] - ts for ts, _, _, what, step in annotations if (step, what) in opened]
    offset = _median(offsets) or 0.0
    out: dict = {"rank": rank, "steps": [], "first": first, "last": last, "clock_offset_us": offset,
                 "annotations": len(annotations), "gpu_activities": len(gpu), "sync_events": sync_events}
    launches = {step: (ts, end, tid) for ts, end, tid, what, step in annotations if what == "launch"}
    if not launches:
        out["error"] = "no step annotations in the trace"
        return out
    loop_tid = launches[min(launches)][2]
    # (were the CUDA calls' thread ids not the annotations', calls are placed by time alone)
    use_tid = any(call[2] == loop_tid for call in runtime.values()) or not runtime
    by_thread = [(ts, end, what, step) for ts, end, tid, what, step in annotations if tid == loop_tid]
    thread_starts = [row[0] for row in by_thread]

    def step_of_call(ts: float, tid) -> tuple[int | None, str | None]:
        if use_tid and tid != loop_tid:
            return None, None
        i = bisect.bisect_right(thread_starts, ts) - 1
        if i >= 0 and by_thread[i][0] <= ts <= by_thread[i][1]:
            return by_thread[i][3], by_thread[i][2]
        return None, None

    # each GPU activity: its step and what launched it (launch / finish / store), graph replay or not
    for act in gpu:
        call = runtime.get(act["correlation"])
        act["launched_at"] = call[1] if call else None
        act["api"] = call[3] if call else None
        act["step"], act["phase"] = step_of_call(call[0], call[2]) if call else (None, None)
        act["nccl"] = "nccl" in act["name"].lower()
        act["label"] = act["name"]
        if act["nccl"] and call:
            enclosing = " ".join(_enclosing(intervals, call[2], call[0], skip_prefix=PREFIX)).lower()
            act["label"] = "nccl recv" if "recv" in enclosing else "nccl send" if "send" in enclosing else "nccl"
        act["kind"] = ("graph" if act["api"] == "cudaGraphLaunch" else act["cat"].replace("gpu_", "")
                       if act["cat"] != "kernel" else "nccl" if act["nccl"] else "kernel")
    busy_by_stream: dict = {}
    for act in gpu:
        if not act["nccl"]:
            busy_by_stream.setdefault(act["stream"], []).append((act["start"], act["end"]))
    if busy_by_stream:
        compute = max(busy_by_stream, key=lambda s: _union_ms(busy_by_stream[s]))
        out["compute_stream"] = compute
        out["streams_busy_ms"] = {str(s): round(_union_ms(v), 3) for s, v in busy_by_stream.items()}
    else:
        compute = None
    stream_acts = sorted((a for a in gpu if a["stream"] == compute), key=lambda a: a["start"])
    previous_step = None
    for act in stream_acts:  # activities no launch call names (none expected): the step before them on the stream
        if act["step"] is None:
            act["step"], act["phase"] = previous_step, "unnamed"
        previous_step = act["step"]
    others = sorted((a for a in gpu if a["stream"] != compute), key=lambda a: a["end"])
    other_ends = [a["end"] for a in others]
    first_on_stream = {}
    for act in stream_acts:
        if act["phase"] == "launch" and act["step"] is not None:
            first_on_stream.setdefault(act["step"], act["start"])
    syncs_on_loop = [(ts, end, name) for ts, end, tid, name in
                     ((r[0], r[1], r[2], r[3]) for r in runtime.values()) if (tid == loop_tid or not use_tid)
                     and any(word in name for word in SYNC_CALLS)]
    syncs_on_loop.sort()
    for step in sorted(launches):  # every recorded step; the figures are of first..last (``analysed``)
        began, ended, _ = launches[step]
        following = launches.get(step + 1)
        row = {"step": step, "analysed": first <= step <= last, "batch": (batch_sizes or {}).get(step),
               "host_launch_ms": (ended - began) / 1e3}
        if following:
            period = (following[0] - began)
            row["host_period_ms"] = period / 1e3
            inside = [(ts, end, what) for ts, end, what, s in by_thread if began <= ts < following[0]]
            for what in ("finish", "store"):
                row[f"host_{what}_ms"] = sum(end - ts for ts, end, w in inside if w == what) / 1e3
            waits = [(ts, min(end, following[0])) for ts, end, _ in syncs_on_loop if began <= ts < following[0]]
            row["host_sync_ms"] = sum(end - ts for ts, end in waits) / 1e3
            row["host_sync_in_launch_ms"] = sum(min(end, ended) - ts for ts, end in waits if ts < ended) / 1e3
        start = first_on_stream.get(step)
        stop = first_on_stream.get(step + 1)
        nccl = [a for a in gpu if a["nccl"] and a["step"] == step]
        row["nccl"] = [{"label": a["label"], "stream": a["stream"], "phase": a["phase"],
                        "start_us": a["start"] + offset, "end_us": a["end"] + offset,
                        "ms": (a["end"] - a["start"]) / 1e3} for a in sorted(nccl, key=lambda a: a["start"])]
        mine = [a for a in stream_acts if a["step"] == step]
        graph = [a for a in mine if a["kind"] == "graph"]
        launch_acts = [a for a in mine if a["phase"] in ("launch", "unnamed")]
        if launch_acts:  # the step's own stage work (rank 0's finish and store of it come a step or more later)
            row["stream_start_us"] = min(a["start"] for a in launch_acts) + offset
            row["stream_end_us"] = max(a["end"] for a in launch_acts) + offset
        for phase in ("finish", "store"):
            acts = [a for a in mine if a["phase"] == phase]
            if acts:
                row[f"{phase}_start_us"] = min(a["start"] for a in acts) + offset
                row[f"{phase}_end_us"] = max(a["end"] for a in acts) + offset
        if graph:
            row["graph_start_us"] = graph[0]["start"] + offset
            row["graph_end_us"] = max(a["end"] for a in graph) + offset
            row["graph_ms"] = (row["graph_end_us"] - row["graph_start_us"]) / 1e3
        if start is not None and stop is not None:
            window = [a for a in stream_acts if a["end"] > start and a["start"] < stop]
            busy: dict[str, list] = {}
            for a in window:  # (rank 0: an older step's finish and token store run in this one's period)
                key = a["kind"] if a["phase"] in ("launch", "unnamed") else f"{a['kind']} [{a['phase']}]"
                busy.setdefault(key, []).append((max(a["start"], start), min(a["end"], stop)))
            row["device_period_ms"] = (stop - start) / 1e3
            row["busy_ms"] = {kind: round(_union_ms(v), 4) for kind, v in busy.items()}
            row["idle_ms"] = row["device_period_ms"] - _union_ms([iv for v in busy.values() for iv in v])
            after = next((a for a in stream_acts if a["start"] >= stop), None)  # the next step's first activity
            gaps = _gaps(window + ([after] if after else []), start, stop, others, other_ends)
            row["gaps"] = [g for g in gaps if g["ms"] * 1e3 >= GAP_LISTED_US]
            short = [g["ms"] for g in gaps if g["ms"] * 1e3 < GAP_LISTED_US]
            row["short_gaps"] = {"count": len(short), "ms": round(sum(short), 4)}
            top: dict[str, float] = {}
            for a in window:
                if a["kind"] == "kernel":
                    top[a["name"][:60]] = top.get(a["name"][:60], 0.0) + (a["end"] - a["start"]) / 1e3
            row["other_kernels_ms"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:4])
        out["steps"].append(row)
    analysed = [row for row in out["steps"] if row["analysed"]]
    # the compute stream's kernels of the analysed steps' launches by name, ms a step (ranks compared kernel by kernel)
    names: dict[str, float] = {}
    numbers = {row["step"] for row in analysed}
    for act in stream_acts:
        if act["step"] in numbers and act["phase"] in ("launch", "unnamed") and act["cat"] == "kernel":
            names[act["name"][:80]] = names.get(act["name"][:80], 0.0) + (act["end"] - act["start"]) / 1e3
    out["kernels_ms_per_step"] = {name: round(ms / max(1, len(numbers)), 4)
                                  for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:16]}
    out["median"] = _medians(analysed)
    out["gap_causes_ms_per_step"] = _gap_causes(analysed)
    return out


def _gaps(window: list[dict], start: float, stop: float, others: list[dict], other_ends: list[float]) -> list[dict]:
    """Idle spans of the compute stream in [start, stop) and what ended each (module docstring)."""
    gaps = []
    busy_until = start
    for act in window:  # (the last may be the next step's first activity: the gap before it is this step's)
        if act["start"] - busy_until >= GAP_MIN_US and start < act["start"] <= stop:
            gap_start, gap_end = busy_until, act["start"]
            if act["launched_at"] is not None and act["launched_at"] > gap_start + 1.0:
                cause = "host"  # launched after the stream went idle
            else:
                # what ended in the gap on other streams: the activity of the same step if any (a step's copies
                # wait for its own receive), else the last to end; none: the stream waited on something else
                i = bisect.bisect_right(other_ends, gap_end + 2.0)
                ended = [o for o in others[max(0, i - 50):i] if o["end"] >= gap_start]
                same = [o for o in ended if o["step"] is not None and o["step"] == act["step"]]
                other = (same or ended or [None])[-1]
                cause = "wait" if other is None else f"after {other['label'] if other['nccl'] else other['kind']}"
            gaps.append({"ms": round((gap_end - gap_start) / 1e3, 4), "cause": cause,
                         "next": f"{act['kind']}:{act['name'][:40]}", "next_phase": act["phase"],
                         "at_ms": round((gap_start - start) / 1e3, 4)})
        busy_until = max(busy_until, act["end"])
    return gaps


def _medians(rows: list[dict]) -> dict:
    keys = ("host_period_ms", "host_launch_ms", "host_finish_ms", "host_store_ms", "host_sync_ms",
            "host_sync_in_launch_ms", "device_period_ms", "idle_ms", "graph_ms")
    out = {key: _median([r[key] for r in rows if key in r]) for key in keys}
    kinds = {kind for r in rows for kind in r.get("busy_ms", {})}
    out["busy_ms"] = {kind: _median([r["busy_ms"].get(kind, 0.0) for r in rows if "busy_ms" in r]) for kind in kinds}
    for label in sorted({n["label"] for r in rows for n in r.get("nccl", [])}):
        out[f"{label} ms"] = _median([n["ms"] for r in rows for n in r.get("nccl", []) if n["label"] == label])
    return out


def _gap_causes(rows: list[dict]) -> dict:
    with_gaps = [r for r in rows if "gaps" in r]
    if not with_gaps:
        return {}
    short = f"short gaps (< {GAP_LISTED_US:.0f} us each: between a graph's kernels, launches)"
    total: dict[str, float] = {short: sum(r["short_gaps"]["ms"] for r in with_gaps)}
    for r in with_gaps:
        for gap in r["gaps"]:
            key = f"{gap['cause']} -> {gap['next'].split(':')[0] or '-'}"
            total[key] = total.get(key, 0.0) + gap["ms"]
    return {k: round(v / len(with_gaps), 4) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


# ---- two ranks together: the pipeline's loop ------------------------------------------------------------


def pipeline_loop(rank0: dict, rank1: dict, depth: int = 2) -> dict:
    """PP 2: per analysed step k, where the loop from rank 0's graph of step k to its graph of step k + depth
    goes (ms): ``s0`` (rank 0's graph), ``to_rank1`` (its graph's end to rank 1's graph start: the hidden states'
    hop, rank 1's receive and input copies, or rank 1 still busy: ``rank1_busy`` of it), ``s1`` (rank 1's graph),
    ``head`` (rank 1's work after its graph: LM head, argmax, send), ``ids_back`` (to the end of rank 0's receive of
    the ids; ``stored``: from there to the end of rank 0's token store of the step), ``restart`` (to rank 0's
    graph of step k + depth: the token store, input copies, or rank 0 still busy with step k + 1: ``rank0_busy`` of
    it). The loop's sum is about ``depth`` step periods."""
    steps0 = {r["step"]: r for r in rank0.get("steps", [])}
    steps1 = {r["step"]: r for r in rank1.get("steps", [])}
    rows = []
    for k, a in steps0.items():
        if not a.get("analysed", True):
            continue
        b, again = steps1.get(k), steps0.get(k + depth)
        if b is None or "graph_end_us" not in a or "graph_start_us" not in b:
            continue
        row = {"step": k, "s0": (a["graph_end_us"] - a["graph_start_us"]) / 1e3,
               "to_rank1": (b["graph_start_us"] - a["graph_end_us"]) / 1e3}
        before = steps1.get(k - 1)
        if before and "stream_end_us" in before:
            row["rank1_busy"] = max(0.0, min(before["stream_end_us"], b["graph_start_us"]) - a["graph_end_us"]) / 1e3
        row["s1"] = (b["graph_end_us"] - b["graph_start_us"]) / 1e3
        row["head"] = (b["stream_end_us"] - b["graph_end_us"]) / 1e3
        ids = [n for n in a.get("nccl", []) if n["label"] == "nccl recv"]
        if ids:
            row["ids_back"] = (ids[-1]["end_us"] - b["stream_end_us"]) / 1e3
            if "store_end_us" in a:
                row["stored"] = (a["store_end_us"] - ids[-1]["end_us"]) / 1e3
            if again is not None and "graph_start_us" in again:
                row["restart"] = (again["graph_start_us"] - ids[-1]["end_us"]) / 1e3
                nxt = steps0.get(k + 1)
                if nxt and "stream_end_us" in nxt:
                    row["rank0_busy"] = max(0.0, min(nxt["stream_end_us"], again["graph_start_us"])
                                            - ids[-1]["end_us"]) / 1e3
        if again is not None and "graph_start_us" in again:
            row["loop"] = (again["graph_start_us"] - a["graph_start_us"]) / 1e3
        rows.append(row)
    keys = ("s0", "to_rank1", "rank1_busy", "s1", "head", "ids_back", "stored", "restart", "rank0_busy", "loop")
    median = {key: _median([r[key] for r in rows if key in r]) for key in keys}
    return {"depth": depth, "steps": rows, "median": median}


def describe(rank_summaries: list[dict], loop: dict | None = None) -> str:
    """A few lines: each rank's medians and its idle time by cause, then the pipeline's loop."""
    lines = []

    def ms(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    for s in rank_summaries:
        if s.get("error") and not s.get("steps"):
            lines.append(f"rank {s.get('rank')}: {s['error']}")
            continue
        m = s.get("median", {})
        busy = ", ".join(f"{kind} {ms(v)}" for kind, v in sorted(m.get("busy_ms", {}).items()))
        nccl = ", ".join(f"{k[:-3]} {ms(v)}" for k, v in m.items() if k.startswith("nccl"))
        analysed = sum(1 for row in s["steps"] if row.get("analysed", True))
        lines.append(f"rank {s['rank']} ({analysed} steps {s['first']}-{s['last']}, medians ms): host period "
                     f"{ms(m.get('host_period_ms'))} (in launch {ms(m.get('host_launch_ms'))}, finish "
                     f"{ms(m.get('host_finish_ms'))}, store {ms(m.get('host_store_ms'))}; blocked in synchronize "
                     f"{ms(m.get('host_sync_ms'))}, of it in launch {ms(m.get('host_sync_in_launch_ms'))})")
        lines.append(f"  device period {ms(m.get('device_period_ms'))}: busy {busy or '-'}; idle {ms(m.get('idle_ms'))}"
                     f"; graph span {ms(m.get('graph_ms'))}; NCCL kernels {nccl or '-'}")
        causes = s.get("gap_causes_ms_per_step", {})
        if causes:
            lines.append("  idle by cause (ms a step): " + "; ".join(f"{k} {v:.3f}" for k, v in list(causes.items())[:6]))
        kernels = s.get("kernels_ms_per_step", {})
        if kernels:
            lines.append("  top kernels (ms a step, durations): "
                         + "; ".join(f"{name[:48]} {per_step:.3f}" for name, per_step in list(kernels.items())[:6]))
    if loop and loop.get("steps"):
        m = loop["median"]
        lines.append(f"loop step k -> k+{loop['depth']} (medians of {len(loop['steps'])}, ms): rank 0 graph "
                     f"{ms(m['s0'])} | to rank 1's graph {ms(m['to_rank1'])} (rank 1 busy {ms(m['rank1_busy'])}) | "
                     f"rank 1 graph {ms(m['s1'])} | head+argmax+send {ms(m['head'])} | ids to rank 0 {ms(m['ids_back'])} "
                     f"| rank 0 restart {ms(m['restart'])} (ids stored after {ms(m['stored'])}; rank 0 busy {ms(m['rank0_busy'])}) "
                     f"= loop {ms(m['loop'])} (~{loop['depth']} step periods)")
    return "\n".join(lines)
