"""The integration tests' server stop (triton_helpers.stop) leaves nothing of the server running, also
below a parent that does not pass a SIGTERM on in time: mpirun waits a second before it signals its
ranks, which sit in process groups of their own, so a SIGKILLed mpirun once left a tritonserver
running with parent 1 for 21 minutes after its pytest run."""
import os
import signal
import subprocess
import sys

from triton_helpers import ROOT, processes_naming, stop, wait_for


def test_stop_kills_what_a_parent_ignoring_sigterm_started_in_its_own_session(tmp_path):
    repo = str(tmp_path / "repo")  # what a server's processes name on their command lines
    # bash as mpirun: SIGTERM ignored for now, its child ("the rank") in a session of its own
    parent = subprocess.Popen(["bash", "-c", 'trap "" TERM; setsid "$0" -c "import time; time.sleep(300)" "$1" & wait',
                               sys.executable, repo])
    try:
        assert wait_for(lambda: len(processes_naming(repo)) >= 2, timeout=10, interval=0.05), processes_naming(repo)
        stop(parent)
        assert parent.returncode == -signal.SIGKILL
        assert wait_for(lambda: not processes_naming(repo), timeout=5, interval=0.05), processes_naming(repo)
    finally:
        for pid in processes_naming(repo):
            os.kill(pid, signal.SIGKILL)


def test_a_server_still_running_when_the_interpreter_exits_is_stopped(tmp_path):
    """A fixture whose finally never runs (a pytest-xdist worker ending mid-session) leaves its server
    in triton_helpers.running_servers: stopped at exit."""
    repo = str(tmp_path / "repo")
    code = ("import subprocess, sys, triton_helpers\n"
            "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', sys.argv[1]],\n"
            "                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # run's pipes close\n"
            "triton_helpers.running_servers.add(server)  # as serving_repository registers it\n")
    try:
        run = subprocess.run([sys.executable, "-c", code, repo], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
        assert run.returncode == 0, run.stderr
        assert wait_for(lambda: not processes_naming(repo), timeout=5, interval=0.05), processes_naming(repo)
    finally:
        for pid in processes_naming(repo):
            os.kill(pid, signal.SIGKILL)
