"""serving_bench's diagnostics (benchmarks/serving_diagnostics.py): CPU by role over a timed run,
and the engine's step medians from its iteration log."""
import subprocess
import sys
import time

from benchmarks.serving_diagnostics import RunDiagnostics, describe, engine_step_summary


def test_cores_busy_counts_each_role_over_the_run():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        diagnostics = RunDiagnostics(lambda: [(spinner.pid, "spinner"), (sleeper.pid, "sleeper")], None)
        time.sleep(0.2)  # both interpreters started
        diagnostics.begin()
        time.sleep(1.0)
        row = diagnostics.end()
    finally:
        spinner.wait()
        sleeper.wait()
    assert row["cores_busy"]["spinner"] > 0.5  # a busy loop, on a loaded 2-core CI machine too
    assert row["cores_busy"]["sleeper"] < 0.1
    assert list(row["cores_busy"]) == ["spinner", "sleeper"]  # busiest first
    assert "engine step" not in describe(row) and "spinner" in describe(row)


def test_engine_step_summary_tells_decode_only_from_mixed_steps():
    rows = [{"latency_ms": ms, "num_ctx_tokens": ctx, "num_gen_tokens": 64, "deliver_ms": 0.1 * i}
            for i, (ms, ctx) in enumerate([(7.0, 0), (7.2, 0), (9.0, 128), (7.1, 0)])]
    summary = engine_step_summary(rows)
    assert summary["engine_decode_step_ms_median"] == 7.1
    assert summary["engine_mixed_step_ms_median"] == 9.0
    assert summary["engine_mixed_step_share"] == 0.25
    assert summary["engine_rows_per_step_mean"] == 64.25
    assert engine_step_summary([]) == {}
