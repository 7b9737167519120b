"""Two long-lived gloo ranks that the engine tests' tensor-parallel checks share.

Starting two ranks costs a torch import, a gloo init and the ranks' imports (~5-8 s on 2 cores)
before any logits are computed; with a fresh pair per test that fixed cost was most of each such
test. ``shared_pair()`` starts one pair per test process (so one per pytest-xdist worker), on its
first use, and every test sends it jobs: ``pair.run(fn, *args)`` calls ``fn(rank, *args)`` on both
ranks at once (fn is pickled by reference, so it lives in an importable helper module, not a test
module) and returns ``[result of rank 0, result of rank 1]``. The ranks share the default process
group (``dist.group.WORLD``, world size 2) from one job to the next; nothing else is kept.

A job that raises on either rank, a rank that dies, or a job that outlives its timeout fails the
calling test with each rank's traceback (or exit code, or "no reply"), and the pair is killed: the
next job starts a fresh pair, so one test's broken collective cannot leak into the next test.
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import time
import traceback

WORLD_SIZE = 2
JOB_TIMEOUT_S = 300.0  # a job's compute on a loaded 2-core machine is seconds; this only bounds a hang
START_TIMEOUT_S = 120.0
GRACE_S = 10.0  # once a rank failed, how long the other may still take to say why (it may sit in a collective)
# What every rank imports first, imported once in the fork server (see GlooPair): torch, and engine_testing, whose
# transformers and engine imports (~6 CPU-s, beyond torch's ~3) every job module needs (pipeline_ranks imports it,
# hybrid_tp_ranks and lora_tp_worker's jobs its engine modules); each rank imported them itself until 2026-11-30.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "engine_testing"]
HERE = os.path.dirname(os.path.abspath(__file__))


class RankFailure(AssertionError):
    """A job failed on a rank (its traceback), a rank died, or a rank did not answer in time."""


def _rank_main(rank: int, init_file: str, conn) -> None:
    """A rank: join the gloo group, then run jobs from the pipe until told to stop or the test
    process goes away."""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
        conn.send_bytes(pickle.dumps(("ok", "ready")))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the test process is gone
            os._exit(0)
        if message == b"stop":
            try:
                dist.barrier()  # both ranks are done
            finally:
                # Leave without tearing gloo down: its pair threads could race the peer's teardown
                # and abort this process at exit ("terminate called without an active exception").
                os._exit(0)
        try:
            fn, args = pickle.loads(message)
            reply = pickle.dumps(("ok", fn(rank, *args)))
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()))
        conn.send_bytes(reply)


class GlooPair:
    """Two gloo ranks (forked from multiprocessing's fork server) fed jobs over pipes; see the module docstring."""

    def __init__(self):
        # Forked from multiprocessing's fork server, which imports torch once for both ranks (and for a
        # pair restarted after a failed job): each spawned rank imported it itself, ~4 CPU-s a rank. The
        # server is a fresh single-threaded process that never ran torch (nothing of this test process is
        # forked), so forking it is as safe as spawning; each rank still sets up like a spawned one
        # (this process's sys.path and working directory, its main module).
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        _start_fork_server()
        self._dir = tempfile.mkdtemp(prefix="gloo_pair_")
        self.conns, self.procs = [], []
        for rank in range(WORLD_SIZE):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_rank_main, args=(rank, f"{self._dir}/init", theirs), daemon=True,
                                   name=f"gloo-rank{rank}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        self._collect("start", START_TIMEOUT_S)

    def run(self, fn, *args, timeout: float = JOB_TIMEOUT_S) -> list:
        """fn(rank, *args) on both ranks together; [rank 0's result, rank 1's result]."""
        message = pickle.dumps((fn, args))
        for conn in self.conns:
            conn.send_bytes(message)
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, job: str, timeout: float) -> list:
        replies: list = [None] * WORLD_SIZE
        deadline = time.monotonic() + timeout
        while any(reply is None for reply in replies):
            waiting = {}
            for rank, reply in enumerate(replies):
                if reply is None:
                    waiting[self.conns[rank]] = rank
                    waiting[self.procs[rank].sentinel] = rank
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ready in multiprocessing.connection.wait(list(waiting), timeout=left):
                rank = waiting[ready]
                if replies[rank] is not None:
                    continue
                conn = self.conns[rank]
                try:
                    if ready is conn or conn.poll():
                        replies[rank] = pickle.loads(conn.recv_bytes())
                        continue
                except (EOFError, OSError):
                    pass
                self.procs[rank].join(5)
                replies[rank] = ("died", f"rank {rank} died, exit code {self.procs[rank].exitcode}")
            if any(reply is not None and reply[0] != "ok" for reply in replies):
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if all(reply is not None and reply[0] == "ok" for reply in replies):
            return [reply[1] for reply in replies]
        self.close(kill=True)
        report = []
        for rank, reply in enumerate(replies):
            if reply is None:
                report.append(f"rank {rank}: no reply within the time allowed (killed)")
            elif reply[0] == "ok":
                report.append(f"rank {rank}: ok")
            else:
                report.append(f"rank {rank}:\n{reply[1]}")
        raise RankFailure(f"gloo job {job} failed:\n" + "\n".join(report))

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill and self.alive():
            for conn in self.conns:
                try:
                    conn.send_bytes(b"stop")
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        global _shared
        if _shared is self:
            _shared = None


def _start_fork_server() -> None:
    """multiprocessing's fork server, started (once a process) with this directory and the repository's
    root on its path: Python 3.11's fork server imports its preload before it takes the parent's
    sys.path (it is told it, and does not use it), so without them engine_testing would not import
    there (an ImportError the server ignores: each rank imported it after the fork, as before)."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(os.path.dirname(HERE)), *filter(None, [saved])])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


_shared: GlooPair | None = None


def shared_pair() -> GlooPair:
    """This process's pair, started on first use (and again after a failed job killed it)."""
    global _shared
    if _shared is None or not _shared.alive():
        if _shared is not None:
            _shared.close(kill=True)
        _shared = GlooPair()
    return _shared


def close_shared() -> None:
    if _shared is not None:
        _shared.close()


atexit.register(close_shared)
