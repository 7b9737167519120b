"""A short soak (benchmarks/reliability/soak.py) in CI: 100 streamed requests through its own `make serve`
server with hang-ups, cancellations, stops and every kind of bad input; nothing may be lost or
leaked, and Ctrl-C afterwards must leave nothing in flight."""
import pytest

from benchmarks.reliability.soak import SoakConfig, format_report, run_soak
from benchmarks.reliability.soak_bad_inputs import BAD_INPUTS

pytestmark = pytest.mark.integration


def test_short_soak_loses_and_leaks_nothing(smollm2_engine_dir):
    # 45 of the 100 requests are bad: each of BAD_INPUTS' kinds once (plan() takes them in turn). The
    # long soaks (thousands of requests) are benchmarks/reliability/soak.py's; 100 was 200 until 2026-11-28 (CI time).
    config = SoakConfig(requests=100, concurrency=16, hang_up_share=0.2, stop_share=0.05, bad_share=0.45,
                        deadline_s=180, engine_dir=smollm2_engine_dir, seed=1)
    report = run_soak(config, log=lambda message: None)
    assert report.ok, format_report(report)
    assert len(report.bad_kinds) == len(BAD_INPUTS) >= 25, format_report(report)
    assert report.processes and report.shutdown["seconds"] < 10, format_report(report)
