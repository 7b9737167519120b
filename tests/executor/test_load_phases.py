"""engine/executor/load_phases.py: with $TRITONLLM_LOAD_LOG=1 an executor's start prints a timestamped line
per phase (the benchmarks turn it on, so a run cut inside a long load still shows where the time went)."""
import re

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.load_phases import LOAD_LOG_ENV, load_phase

LINE = re.compile(r"^\[load \d\d:\d\d:\d\d\] (.+): (\d+\.\d) s \(total (\d+\.\d) s\)$")


def phases(text: str) -> list[str]:
    return [LINE.match(line).group(1) for line in text.splitlines() if line.startswith("[load ")]


def test_off_by_default_and_a_line_per_phase_when_on(monkeypatch, capsys):
    monkeypatch.delenv(LOAD_LOG_ENV, raising=False)
    with load_phase("quiet"):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(LOAD_LOG_ENV, "1")
    count = []
    with load_phase(lambda: f"counted ({len(count)} things)", "cpu"):  # a name known at the end
        count += [1, 2]
    assert phases(capsys.readouterr().err) == ["counted (2 things)"]


def test_an_executor_start_names_its_phases(monkeypatch, capsys, tiny_engine):
    monkeypatch.setenv(LOAD_LOG_ENV, "1")
    with Executor(tiny_engine, ExecutorConfig(), device="cpu"):
        pass
    names = phases(capsys.readouterr().err)
    # (CPU: no kernel choices or graphs; on CUDA they come between the KV pool and the warm-up)
    assert names == ["weights", "draft model / proposer", "step memory profile and KV pool",
                     "warm-up batch (prefill kernels)"], names
