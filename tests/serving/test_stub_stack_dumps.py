"""A stalled stub can be read: start_server_watchdog makes a process dump every thread's Python
stack on STACK_DUMP_SIGNAL, and serving_bench's dump_server_stacks finds and signals the stubs
under a server pid (real processes; the "stub" here is a Python process named like one)."""
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.stub_watchdog import STACK_DUMP_SIGNAL

REPO_ROOT = Path(__file__).resolve().parents[2]

# A stand-in stub: registers like a model's initialize, then one thread blocks in a named function.
STUB = """
import sys, threading, time
sys.path.insert(0, {root!r})
from serving.stub_watchdog import start_server_watchdog
start_server_watchdog()
def waiting_for_a_bls_response():
    time.sleep(60)
threading.Thread(target=waiting_for_a_bls_response, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def load_serving_bench():
    spec = importlib.util.spec_from_file_location("serving_bench_under_test", REPO_ROOT / "benchmarks" / "serving" / "serving_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def start_stub(tmp_path, name: str, *, own_server: bool = False) -> subprocess.Popen:
    """The stand-in stub, or with ``own_server`` a shell (the "server") whose one child it is."""
    stderr = open(tmp_path / f"{name}.err", "w")
    # exec -a: the process's argv[0] (its /proc cmdline) names it as the stub binary does.
    script = f'exec -a {name} "$0" -c "$1"'
    if own_server:
        script = f"({script}) & wait"
    process = subprocess.Popen(["/bin/bash", "-c", script, sys.executable, STUB.format(root=str(REPO_ROOT))],
                               stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def wait_for_text(path: Path, text: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_stack_dump_signal_writes_every_thread_and_leaves_the_stub_running(tmp_path):
    stub = start_stub(tmp_path, "triton_python_backend_stub")
    try:
        os.kill(stub.pid, STACK_DUMP_SIGNAL)
        err = tmp_path / "triton_python_backend_stub.err"
        dump = wait_for_text(err, "waiting_for_a_bls_response")
        assert "waiting_for_a_bls_response" in dump  # the blocked side thread, not only the main one
        # The dump is written thread by thread: the side thread's part may land before the main one's.
        deadline = time.monotonic() + 10.0
        while dump.count("Thread 0x") + dump.count("Current thread 0x") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            dump = err.read_text()
        assert dump.count("Thread 0x") + dump.count("Current thread 0x") >= 2
        time.sleep(0.2)
        assert stub.poll() is None  # a dump, not the signal's default (terminate)
    finally:
        stub.kill()
        stub.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize("name", ["triton_python_backend_stub", "engine.executor.engine_process"])
def test_dump_server_stacks_signals_only_stubs_and_engine_processes_below_the_server(tmp_path, name):
    bench = load_serving_bench()
    # A "server": a shell whose children are one stub and one other process (which has no
    # handler: were it signalled, it would die).
    server = subprocess.Popen(["/bin/bash", "-c", "sleep 60 & wait"])
    # The stub's own "server" (a shell): counting below this test process instead would also
    # count the stubs of servers other test modules left running in the same session.
    stub_server = start_stub(tmp_path, name, own_server=True)
    # The stub, its watchdog shell and that shell's short-lived `cut`/`sleep` children.
    other, stubs = [], bench.descendant_pids(stub_server.pid)
    try:
        deadline = time.monotonic() + 10
        while not bench.descendant_pids(server.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        other = bench.descendant_pids(server.pid)
        assert len(other) == 1
        assert bench.dump_server_stacks(server.pid, settle_s=0) == 0  # the sleep is no stub: untouched
        os.kill(other[0], 0)  # still alive
        assert bench.dump_server_stacks(stub_server.pid, settle_s=0) == 1  # the stub below its server
        assert "waiting_for_a_bls_response" in wait_for_text(tmp_path / f"{name}.err", "waiting_for_a_bls_response")
    finally:
        for pid in other + stubs:
            with contextlib.suppress(ProcessLookupError):  # a watchdog's `cut` or `sleep` has ended meanwhile
                os.kill(pid, signal.SIGKILL)
        for process in (stub_server, server):
            process.kill()
            process.wait()
