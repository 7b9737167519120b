"""benchmarks/engine/step_trace.py: a PP 2 decode loop's chrome traces (torch.profiler's format, made up here: the
CPU tests have no CUDA activity) read back into the figures the GPU call reports -- each GPU activity placed in the
step whose launch issued it (graph kernels through their cudaGraphLaunch's correlation), the compute stream's idle
gaps with what ended them (a late launch: the host; else the other stream's activity that ended last: an NCCL
receive), the host's synchronize waits, and the loop from rank 0's graph of step k to that of step k + 2 lined up
across the two ranks' clocks. Then the tracer itself on a real stage runner's steps over gloo is tp_bench's CPU
rehearsal (``--trace_steps`` with ``--model tiny --device cpu``), run by hand: it needs two ranks."""
import statistics

import pytest

from benchmarks.engine import step_trace

S0, S1, HEAD = 4000.0, 3600.0, 400.0  # us: rank 0's graph, rank 1's graph, its LM head + argmax
HOP, IDS = 30.0, 20.0  # the hidden states' receive on rank 1, the ids' on rank 0 (after their sender's work)
OFFSET = {0: 1e9, 1: 2e9}  # each rank's trace clock: epoch us = ts + ..., different per process
FIRST, LAST = 3, 6  # analysed steps (1-2: warm, 7-10: tail)


class Trace:
    def __init__(self, rank: int):
        self.rank, self.events, self.marks, self.correlation = rank, [], [], 0

    def annotate(self, what: str, step: int, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": f"pp_trace {what} {step}", "tid": 11,
                            "ts": ts, "dur": dur})
        self.marks.append((step, what, int((ts + OFFSET[self.rank]) * 1e3)))

    def op(self, name: str, ts: float, dur: float) -> None:
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "tid": 11, "ts": ts, "dur": dur})

    def gpu(self, api: str, launched: float, name: str, start: float, end: float, stream: int,
            cat: str = "kernel") -> None:
        """One API call at ``launched`` on the loop thread and the activity it issued on ``stream``."""
        self.correlation += 1
        self.events.append({"ph": "X", "cat": "cuda_driver" if api.startswith("cu") and not api.startswith("cuda")
                            else "cuda_runtime", "name": api, "tid": 11, "ts": launched, "dur": 3.0,
                            "args": {"correlation": self.correlation}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.rank, "tid": stream, "ts": start,
                            "dur": end - start, "args": {"stream": stream, "correlation": self.correlation,
                                                         "device": self.rank}})

    def sync(self, ts: float, dur: float) -> None:
        """The loop thread blocked in cudaEventSynchronize."""
        self.correlation += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "tid": 11, "ts": ts,
                            "dur": dur, "args": {"correlation": self.correlation}})

    def graph(self, launched: float, start: float, span: float, kernels: int = 4) -> None:
        """A replay: one cudaGraphLaunch, ``kernels`` kernels back to back (same correlation)."""
        self.correlation += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 11, "ts": launched,
                            "dur": 5.0, "args": {"correlation": self.correlation}})
        for i in range(kernels):
            self.events.append({"ph": "X", "cat": "kernel", "name": f"layer_kernel_{i}", "pid": self.rank, "tid": 7,
                                "ts": start + i * span / kernels, "dur": span / kernels,
                                "args": {"stream": 7, "correlation": self.correlation}})


def pipeline_traces(late_step: int | None = None, restart: float = 20.0, s1: float = S1):
    """Two ranks stepping a depth-2 pipeline, simulated (one time base, rank 1's shifted to its own clock at the
    end). Rank 0's stream runs launch(k) (copies, graph, the clone sent on), then the store of step k - 1 once its
    ids arrived; rank 1 receives step k once its stream finished step k - 1 (NCCL's stream waits on it), copies,
    graph, head. ``late_step``: rank 0's host issues that step's launch 300 us after its stream went idle; ``s1``:
    rank 1's graph (longer than rank 0's step: rank 0 waits for the ids).
    Returns the two traces and the truth: per step, rank 0's and rank 1's graph starts, the ids' arrival."""
    r0, r1 = Trace(0), Trace(1)
    truth = {"g0": {}, "g1": {}, "ids": {}, "stored": {}}
    r0_free = r1_free = 100.0
    for k in range(1, 11):
        # rank 0: the host issued the launch 500 us before its stream could take it (or late)
        ready = r0_free
        h = ready - 500.0 if k != late_step else ready + 300.0
        copies = max(ready, h + 20.0)
        r0.annotate("launch", k, h, 100.0)
        r0.gpu("cudaMemcpyAsync", h + 10, "Memcpy HtoD (Pinned -> Device)", copies, copies + 10, 7, "gpu_memcpy")
        g0 = copies + 15
        truth["g0"][k] = g0
        r0.graph(h + 20, g0, S0)
        end0 = g0 + S0
        r0.gpu("cudaLaunchKernel", h + 30, "clone_kernel", end0, end0 + 10, 7)
        r0.op("pp_p2p send", h + 40, 20)
        # rank 1: its receive runs once rank 0 sent and rank 1's stream finished the step before
        received = max(end0 + 10, r1_free) + HOP
        r0.gpu("cuLaunchKernelEx", h + 45, "ncclDevKernel_SendRecv", end0 + 10, received, 20)
        h1 = h + 200.0
        r1.annotate("launch", k, h1, 300.0)
        r1.op("pp_p2p recv", h1 + 5, 20)
        r1.gpu("cuLaunchKernelEx", h1 + 10, "ncclDevKernel_SendRecv", max(h1 + 12, r1_free), received, 20)
        r1.gpu("cudaMemcpyAsync", h1 + 40, "Memcpy HtoD (Pinned -> Device)", received + 5, received + 10, 7,
               "gpu_memcpy")
        g1 = received + 15
        truth["g1"][k] = g1
        r1.graph(h1 + 50, g1, s1)
        r1.gpu("cudaLaunchKernel", h1 + 60, "lm_head_gemm", g1 + s1, g1 + s1 + HEAD - 20, 7)
        r1.gpu("cuLaunchKernelEx", h1 + 70, "argmax_kernel", g1 + s1 + HEAD - 20, g1 + s1 + HEAD, 7)
        r1_free = g1 + s1 + HEAD
        r1.op("pp_p2p send", h1 + 80, 20)
        ids = r1_free + IDS
        truth["ids"][k] = ids
        r1.gpu("cuLaunchKernelEx", h1 + 85, "ncclDevKernel_SendRecv", r1_free, ids, 24)
        r1.annotate("finish", k, h1 + 300, 5)
        r1.sync(h1 + 310, 3.0)
        r0.op("pp_p2p recv", h + 60, 20)
        r0.gpu("cuLaunchKernelEx", h + 65, "ncclDevKernel_SendRecv", end0 + 20, ids, 21)
        r0_free = end0 + 10
        if k >= 2:  # the store of step k - 1, queued after launch(k), runs once its ids arrived
            store = max(r0_free, truth["ids"][k - 1]) + restart
            r0.annotate("finish", k - 1, h + 150, 10)
            r0.annotate("store", k - 1, h + 170, 20)
            r0.gpu("cudaLaunchKernel", h + 175, "index_put_kernel", store, store + 10, 7)
            r0.gpu("cudaMemcpyAsync", h + 185, "Memcpy DtoH (Device -> Pinned)", store + 10, store + 15, 7,
                   "gpu_memcpy")
            r0_free = truth["stored"][k - 1] = store + 15
    # rank 1's events were written on rank 0's clock: shift them to its own (the marks keep the epoch)
    for e in r1.events:
        e["ts"] = e["ts"] + OFFSET[0] - OFFSET[1]
    r1.marks = [(k, what, ns + int((OFFSET[0] - OFFSET[1]) * 1e3)) for k, what, ns in r1.marks]
    return r0, r1, truth


def summarize(trace: Trace) -> dict:
    return step_trace.summarize_rank(trace.events, trace.marks, rank=trace.rank, first=FIRST, last=LAST,
                                     batch_sizes={k: 256 for k in range(1, 11)})


def test_rank_figures_place_activities_in_their_steps():
    r0, r1, truth = pipeline_traces()
    s0, s1 = summarize(r0), summarize(r1)
    assert [row["step"] for row in s0["steps"] if row["analysed"]] == [3, 4, 5, 6]
    assert [row["step"] for row in s0["steps"]] == list(range(1, 11))  # (recorded: warm and tail steps too)
    assert s0["compute_stream"] == 7 and s1["compute_stream"] == 7
    s0["steps"], s1["steps"] = s0["steps"][2:6], s1["steps"][2:6]
    row = s0["steps"][0]
    assert row["graph_ms"] == pytest.approx(S0 / 1e3)
    assert row["graph_start_us"] == pytest.approx(truth["g0"][3] + OFFSET[0])
    assert row["host_launch_ms"] == pytest.approx(0.1)
    # the finish and store annotated in step 3's host period are step 2's
    assert row["host_finish_ms"] == pytest.approx(0.01) and row["host_store_ms"] == pytest.approx(0.02)
    assert [n["label"] for n in row["nccl"]] == ["nccl send", "nccl recv"]
    assert row["nccl"][1]["end_us"] == pytest.approx(truth["ids"][3] + OFFSET[0])
    # rank 0's device period from one launch's first activity to the next: its copies, graph and clone, and the
    # store and copy home of the step before (their own kinds)
    assert row["device_period_ms"] == pytest.approx((truth["g0"][4] - truth["g0"][3]) / 1e3)
    assert row["busy_ms"]["graph"] == pytest.approx(S0 / 1e3)
    assert row["busy_ms"]["kernel [store]"] == pytest.approx(0.01)
    assert row["busy_ms"]["memcpy [store]"] == pytest.approx(0.005)
    one = s1["steps"][0]
    assert one["graph_start_us"] == pytest.approx(truth["g1"][3] + OFFSET[0])  # on rank 1's own clock, lined up
    assert one["busy_ms"]["kernel"] == pytest.approx(HEAD / 1e3)
    assert one["host_sync_ms"] == pytest.approx(0.003) and one["host_sync_in_launch_ms"] == 0.0
    assert [n["label"] for n in one["nccl"]] == ["nccl recv", "nccl send"]
    assert "nccl recv ms" in s1["median"] and s1["median"]["graph_ms"] == pytest.approx(S1 / 1e3)
    # kernel by kernel, ms a step: the graph's four, the head's two (not NCCL's, not the copies)
    assert s1["kernels_ms_per_step"]["lm_head_gemm"] == pytest.approx((HEAD - 20) / 1e3)
    assert s1["kernels_ms_per_step"]["layer_kernel_0"] == pytest.approx(S1 / 4 / 1e3)
    assert not any("nccl" in name.lower() or "Memcpy" in name for name in s1["kernels_ms_per_step"])
    assert "index_put_kernel" not in s0["kernels_ms_per_step"]  # (a token store: an older step's finish)


def test_gaps_say_what_ended_them():
    r0, r1, truth = pipeline_traces(late_step=5, s1=S1 + 600)
    s0, s1 = summarize(r0), summarize(r1)
    s0["steps"], s1["steps"] = s0["steps"][2:6], s1["steps"][2:6]  # the analysed ones
    # rank 1 idles from its head's end to the next step's input copies, which wait for the NCCL receive
    for row in s1["steps"]:
        assert [(g["cause"], g["next"].split(":")[0]) for g in row["gaps"]] == [("after nccl recv", "memcpy")]
        assert row["short_gaps"] == {"count": 1, "ms": 0.005}  # its copies -> its graph
    # rank 0: the store waits for the ids (their receive); step 5's launch came from the host after the stream
    # idled: the gap before its copies, in step 4's period, is the host's
    causes = {row["step"]: [(g["cause"], g["next"].split(":")[0]) for g in row["gaps"]] for row in s0["steps"]}
    assert causes[3] == [("after nccl recv", "kernel")]
    assert causes[4][-1] == ("host", "memcpy")
    assert all(cause != "host" for step in (3, 5, 6) for cause, _ in causes[step])
    host_gap = [g for g in s0["steps"][1]["gaps"] if g["cause"] == "host"][0]
    assert host_gap["ms"] == pytest.approx(0.3 + 0.02)  # issued 300 us late, its copies 20 us after the call
    assert s0["gap_causes_ms_per_step"]["short gaps (< 10 us each: between a graph's kernels, launches)"] == \
        pytest.approx(0.005)  # copies -> graph, each step
    assert s0["gap_causes_ms_per_step"]["host -> memcpy"] == pytest.approx(0.32 / 4)
    # without a late launch, no gap is the host's
    r0, _, _ = pipeline_traces(s1=S1 + 600)
    assert all(g["cause"] != "host" for row in summarize(r0)["steps"] for g in row.get("gaps", []))


@pytest.mark.parametrize("restart", [20.0, 300.0])
def test_the_loop_lines_up_both_ranks(restart):
    r0, r1, truth = pipeline_traces(restart=restart)
    loop = step_trace.pipeline_loop(summarize(r0), summarize(r1), depth=2)
    m = loop["median"]
    assert [row["step"] for row in loop["steps"]] == [3, 4, 5, 6]
    assert m["s0"] == pytest.approx(S0 / 1e3) and m["s1"] == pytest.approx(S1 / 1e3)
    expected_hop = statistics.median(truth["g1"][k] - truth["g0"][k] - S0 for k in range(3, 7)) / 1e3
    assert m["to_rank1"] == pytest.approx(expected_hop)
    assert m["head"] == pytest.approx(HEAD / 1e3) and m["ids_back"] == pytest.approx(IDS / 1e3)
    expected_stored = statistics.median(truth["stored"][k] - truth["ids"][k] for k in range(3, 7)) / 1e3
    assert m["stored"] == pytest.approx(expected_stored) and m["stored"] >= (restart + 15) / 1e3
    expected_loop = statistics.median(truth["g0"][k + 2] - truth["g0"][k] for k in range(3, 7)) / 1e3
    assert m["loop"] == pytest.approx(expected_loop)
    parts = m["s0"] + m["to_rank1"] + m["s1"] + m["head"] + m["ids_back"] + m["restart"]
    assert m["loop"] == pytest.approx(parts)  # the parts tile the loop
    text = step_trace.describe([summarize(r0), summarize(r1)], loop)
    assert "loop step k -> k+2" in text and f"= loop {m['loop']:.3f}" in text


def test_no_window_says_so(tmp_path):
    tracer = step_trace.StepTracer(steps=4, skip=100, warm=1, batch=8, out=str(tmp_path / "t.json"))
    summary = tracer.finish()
    assert "no window" in summary["error"]
    assert "no window" in step_trace.describe([summary])
