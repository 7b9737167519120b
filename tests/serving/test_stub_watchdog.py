"""A stub never outlives its server (serving/stub_watchdog.py), with real processes: a stand-in
stub (a Python process that calls start_server_watchdog as a model's initialize does) under a shell
standing in for tritonserver."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# Writes its pid, waits `delay` s (long enough for its "server" to die first, when asked), then
# registers like a model's initialize and idles.
STUB = """
import os, sys, time
sys.path.insert(0, {root!r})
open({pid_file!r}, "w").write(str(os.getpid()))
time.sleep({delay})
from serving.stub_watchdog import start_server_watchdog
start_server_watchdog()
time.sleep(60)
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def start_server_with_stub(tmp_path, *, delay: float, server_lives: bool) -> tuple[subprocess.Popen, int]:
    """A shell "server" with the stub as its child; the shell waits for it, or (``server_lives``
    false) exits at once, so the stub is adopted before it registers. Returns (shell, stub pid)."""
    pid_file = tmp_path / "stub.pid"
    code = STUB.format(root=str(REPO_ROOT), pid_file=str(pid_file), delay=delay)
    tail = "wait" if server_lives else "exit 0"
    server = subprocess.Popen(["/bin/bash", "-c", f'"$0" -c "$1" & {tail}', sys.executable, code])
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return server, int(pid_file.read_text())


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether the process ended (gone, or a zombie nobody reaped) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_stub_dies_when_its_server_dies(tmp_path):
    server, stub = start_server_with_stub(tmp_path, delay=0, server_lives=True)
    try:
        time.sleep(0.5)  # registered
        assert parent_of(stub) == server.pid
        server.kill()
        server.wait()
        assert gone_within(stub, 5), "the stub outlived its server"
    finally:
        kill_quietly(stub)


def test_a_stub_whose_server_died_before_it_registered_does_not_stay(tmp_path):
    server, stub = start_server_with_stub(tmp_path, delay=1.0, server_lives=False)
    try:
        server.wait()
        time.sleep(0.2)
        if parent_of(stub) != 1:
            pytest.skip(f"orphans here are adopted by pid {parent_of(stub)} (a subreaper), not init")
        assert gone_within(stub, 5), "an orphaned stub stayed (it watched init as its server)"
    finally:
        kill_quietly(stub)


def watchdogs_of(stub: int) -> list[int]:
    """Pids of the watchdog shells watching ``stub`` (their command line names its /proc stat file)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"/proc/{stub}/stat".encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_the_watchdog_of_a_stub_that_ends_ends_too_and_kills_nothing(tmp_path):
    """A stub that exits while its server lives (a model unloaded): its watchdog, which reads the stub's
    /proc stat file with the shell's builtins, sees it gone and ends within its second, and the server lives on."""
    server, stub = start_server_with_stub(tmp_path, delay=0, server_lives=True)
    try:
        deadline = time.monotonic() + 5
        while not watchdogs_of(stub) and time.monotonic() < deadline:
            time.sleep(0.05)
        watchdog, = watchdogs_of(stub)
        time.sleep(1.5)  # a check or two while the stub lives: it stays
        assert not gone_within(watchdog, 0) and not gone_within(stub, 0)
        os.kill(stub, signal.SIGTERM)
        server.wait(timeout=5)  # the "server" reaps its stub and exits 0: nothing killed it
        assert server.returncode == 0
        assert gone_within(watchdog, 3), "the watchdog stayed after its stub ended"
    finally:
        kill_quietly(stub)
        server.kill()
