"""benchmarks/engine/step_timeline.py on CPU (fake CUDA events): summarize keeps the steps of a time range
(those before a profiler window apart from those after it) and counts the steps that replayed a decode graph;
the graph-run wrapper keeps each run's host time. Why it matters: an INT4 batch-1 run read 17 ms a step after
its profiler window, with nothing to tell a graph miss from CUPTI's overhead (issue 52)."""
import collections

import pytest

from benchmarks.engine import step_timeline


class _Event:
    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


def _step(size: int, began_s: float, host_ms: float, gpu_ms: float, graph_ms: float | None) -> list:
    """A timeline entry as TimedRunner.forward appends it (device clock = host clock here)."""
    start_ms = began_s * 1e3
    return [size, began_s, began_s + host_ms / 1e3, _Event(start_ms), _Event(start_ms + gpu_ms), None,
            None if graph_ms is None else graph_ms / 1e3, began_s / 10, began_s / 10 + host_ms / 2e3]


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(step_timeline.torch.cuda, "synchronize", lambda *a, **k: None)
    steps = [_step(1, 0.003 * i, 0.2, 2.5, 0.15) for i in range(20)]  # 3 ms steps, graphed
    steps += [_step(1, 0.1 + 0.017 * i, 6.9, 7.0, None) for i in range(10)]  # 17 ms steps, eager
    holder = type("Runner", (), {})()
    holder.timeline = collections.deque(steps)
    return holder


def test_summarize_splits_at_a_window_and_counts_graph_steps(runner):
    before = step_timeline.summarize(runner, until=0.1)[1]
    assert (before["steps"], before["graph_steps"]) == (12, 12)  # 20 - 8 warm-up steps
    assert before["period_ms"] == pytest.approx(3.0) and before["graph_host_ms"] == pytest.approx(0.15)
    assert before["host_ms"] == pytest.approx(0.2) and before["gpu_ms"] == pytest.approx(2.5)
    after = step_timeline.summarize(runner, since=0.1)[1]
    assert (after["steps"], after["graph_steps"]) == (10, 0) and "graph_host_ms" not in after
    assert after["period_ms"] == pytest.approx(17.0) and after["host_ms"] == pytest.approx(6.9)
    assert after["cpu_in_forward_ms"] == pytest.approx(3.45) and after["cpu_period_ms"] == pytest.approx(1.7)
    assert after["period_ms_first"][1:] == [17.0] * 9 and after["host_ms_p10_p90"] == [6.9, 6.9]
    every = step_timeline.summarize(runner)[1]
    assert every["steps"] == 22 and every["period_ms_p10_p90"] == [3.0, 17.0]


def test_graph_runs_keep_their_host_time():
    class Graphs:
        replays = collections.Counter()

        def run(self, token_ids):
            self.replays[len(token_ids)] += 1
            return "hidden"

    graphs = Graphs()
    step_timeline._time_graph_runs(graphs)
    assert graphs.run([5]) == "hidden" and graphs.replays == {1: 1} and 0 <= graphs.last_run_s < 1
