"""serving_bench's diagnostics (benchmarks/serving/serving_diagnostics.py): CPU by role over a timed run,
and the engine's step medians from its iteration log."""
import os
import subprocess
import sys
import time

from benchmarks.serving.serving_diagnostics import RunDiagnostics, describe, engine_step_summary, histogram_totals


def _reap_with_cpu_seconds(process: subprocess.Popen) -> float:
    """Waits for the child and returns the CPU seconds it used over its whole life (rusage)."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def test_cores_busy_counts_each_role_over_the_run():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        diagnostics = RunDiagnostics(lambda: [(spinner.pid, "spinner"), (sleeper.pid, "sleeper")], None)
        time.sleep(0.2)  # both interpreters started
        window_start = time.perf_counter()
        diagnostics.begin()
        time.sleep(1.0)
        row = diagnostics.end()
        window_s = time.perf_counter() - window_start
    finally:
        spinner_cpu_s = _reap_with_cpu_seconds(spinner)
        sleeper.wait()
    # The spinner's share depends on what else the machine runs (0.26 of a core was seen beside another
    # xdist worker on 2 cores), so it is bounded from both sides instead of held to a fixed share: it
    # cannot exceed the CPU the child used over its whole life, and a busy loop gets some of a core.
    busy = row["cores_busy"]
    assert 0.1 < busy["spinner"] <= spinner_cpu_s / window_s + 0.03  # +0.03: rounding and clock ticks
    assert busy["sleeper"] < 0.1
    assert list(busy) == ["spinner", "sleeper"]  # busiest first
    assert "engine step" not in describe(row) and "spinner" in describe(row)


def test_engine_step_summary_tells_decode_only_from_mixed_steps():
    rows = [{"latency_ms": ms, "num_ctx_tokens": ctx, "num_gen_tokens": 64, "deliver_ms": 0.1 * i}
            for i, (ms, ctx) in enumerate([(7.0, 0), (7.2, 0), (9.0, 128), (7.1, 0), (7.0, 0), (11.0, 384)])]
    summary = engine_step_summary(rows)
    assert summary["engine_decode_step_ms_median"] == 7.05
    assert summary["engine_mixed_step_ms_median"] == 10.0
    assert summary["engine_mixed_step_share"] == 2 / 6
    assert summary["engine_prefill_tokens_per_mixed_step"] == 256
    assert summary["engine_rows_per_step_mean"] == 64 + 2 / 6
    assert engine_step_summary([]) == {}


def test_histogram_totals_add_every_label_set_of_one_histogram():
    """Read from a real /metrics page: the TTFT histogram's _sum and _count over both model
    versions; another histogram whose name starts the same is not counted."""
    import http.server
    import threading

    page = (b"# TYPE nv_llm_time_to_first_token_seconds histogram\n"
            b'nv_llm_time_to_first_token_seconds_bucket{model="tensorrt_llm",version="1",le="0.1"} 3\n'
            b'nv_llm_time_to_first_token_seconds_sum{model="tensorrt_llm",version="1"} 0.25\n'
            b'nv_llm_time_to_first_token_seconds_count{model="tensorrt_llm",version="1"} 4\n'
            b'nv_llm_time_to_first_token_seconds_sum{model="tensorrt_llm",version="2"} 0.05\n'
            b'nv_llm_time_to_first_token_seconds_count{model="tensorrt_llm",version="2"} 1\n'
            b'nv_llm_time_to_first_token_seconds_total_sum{model="x"} 99\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        total_s, count = histogram_totals(f"http://127.0.0.1:{server.server_port}",
                                          "nv_llm_time_to_first_token_seconds")
    finally:
        server.shutdown()
    assert (round(total_s, 6), count) == (0.3, 5.0)
