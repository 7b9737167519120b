"""A Python-backend stub must not outlive its tritonserver (no Triton import).

When tritonserver dies (killed, or its exit timeout expired with requests in flight) its stubs are
not told. A stub with a thread inside the backend's IPC at that moment (waiting for a BLS response,
publishing a metric) blocks there holding the GIL, so no Python thread of it runs again, its own
parent check included: it would stay forever, and the `tensorrt_llm` stub's engine process would
keep generating for nobody.

The watchdog is a separate shell process, not a thread, for that reason. It kills the stub once
the stub's parent changes (and a stub whose server is already gone when it starts, adopted by
init, kills itself at once); it ends by itself when the stub exits normally (its /proc entry goes
away, or the pid now names another process, told apart by the start time) and kills nothing then.

A stub that dies of a fatal signal while serving (a crash inside the backend's C++ under one of
its calls) writes every thread's Python stack to the log too, until ``stop_crash_dumps``.

The same call makes the stub dump every thread's Python stack to its stderr (the server's log) on
SIGUSR1 (``faulthandler``: it runs in the signal handler, so it works while a thread blocks in the
backend's IPC holding the GIL). That is how a stalled stub is read without a debugger:
benchmarks/serving/serving_bench.py sends it to the server's stubs when a stream stalls.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys

STACK_DUMP_SIGNAL = signal.SIGUSR1  # (the Python backend's stub does not use it)
ORPHAN_PARENT_PID = 1  # init: the parent of a process whose parent exited (no subreaper set)
BASH = "/bin/bash"
_watchdogs: list[subprocess.Popen] = []  # this stub's watchdog (its stdin's write end stays open here)


def start_server_watchdog() -> None:
    """Call once from a stub (a model's `initialize`)."""
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.__stderr__, all_threads=True)
        # A stub that dies of a fatal signal (a crash in the backend's C++ under one of its calls)
        # leaves every thread's Python stack in the log instead of vanishing without a word.
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no stderr file descriptor: no dumps, nothing else lost
        pass
    stub, server = os.getpid(), os.getppid()
    if server == ORPHAN_PARENT_PID:
        # The server died before this model's initialize ran (a stub is always tritonserver's
        # child; init adopted it). Watching init as "the server" would keep this stub forever.
        os.kill(stub, signal.SIGKILL)
    with open("/proc/self/stat") as stat:
        started = stat.read().rsplit(")", 1)[1].split()[19]  # field 22: start time, tells pid reuse apart
    # /proc/<stub>/stat fields 4 and 22, "<parent> <start time>", read by the shell's own builtins
    # (`read`, and `set` on the fields after the name's closing parenthesis: field 3 is $1), so a
    # second's check forks no subshell and no `cut`. bash waits its second in `read -t 1` on a pipe
    # this stub holds open and never writes (no process at all: ~2 ms of CPU a second per stub less
    # than forking `sleep 1` under load); once the stub is gone the pipe ends (read fails at once) and
    # `sleep 1` paces the last checks. Without bash, /bin/sh with `sleep 1`.
    bash = os.path.exists(BASH)
    wait = "read -t 1 _ || [ $? -gt 128 ] || sleep 1" if bash else "sleep 1"
    script = (f"while read -r s < /proc/{stub}/stat; do set -- ${{s##*) }}; case \"$2 ${{20}}\" in "
              f"'{server} {started}') {wait} ;; "
              f"*' {started}') kill -9 {stub}; exit 0 ;; "
              f"*) exit 0 ;; esac; done")
    watchdog = subprocess.Popen([BASH if bash else "/bin/sh", "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _watchdogs.append(watchdog)  # keeps the pipe's write end open as long as this stub lives


def stop_crash_dumps() -> None:
    """Call at the end of a model's ``finalize``: the stub's own teardown after it (the backend
    destroys its objects and collects garbage while exiting) has crashed with a fatal signal that
    Triton ignores, and a stack dump there would only alarm whoever reads the log."""
    faulthandler.disable()
