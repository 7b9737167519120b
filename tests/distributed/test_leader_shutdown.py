"""LeaderRunner.shutdown joins its heartbeat thread before the last plan (no processes, no groups):
no plan follows SHUTDOWN, and no daemon thread is left inside a gloo call when the interpreter
finalizes (one killed there as it takes the GIL back aborts a clean exit: "terminate called
without an active exception")."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from engine.tensor_parallel import distributed
from engine.tensor_parallel.step_protocol import Op


class RecordingChannel:
    """StepChannel's interface, recording the ops the leader sends."""

    def __init__(self, ctx):
        self.ops: list[Op] = []

    def send(self, op: Op, **_) -> None:
        self.ops.append(op)

    def all_reduce_min(self, value: int) -> int:
        return value

    def close(self) -> None:
        pass


def test_shutdown_joins_a_heartbeat_woken_just_before_it(monkeypatch):
    monkeypatch.setattr(distributed, "StepChannel", RecordingChannel)
    settings = distributed.DistSettings("127.0.0.1", 0, step_timeout_s=5.0, heartbeat_s=0.05)
    woke = threading.Event()
    check = distributed.LeaderRunner._check_stuck_step

    def paused(self) -> None:
        # The heartbeat has woken (not stopped) and, before it takes the lock, shutdown begins.
        woke.set()
        self._stopped.wait(2.0)
        time.sleep(0.05)
        check(self)

    monkeypatch.setattr(distributed.LeaderRunner, "_check_stuck_step", paused)
    leader = distributed.LeaderRunner(SimpleNamespace(), SimpleNamespace(settings=settings, world_size=2))
    assert woke.wait(2.0)
    leader.shutdown()
    assert not leader._heartbeat.is_alive()
    time.sleep(0.1)  # a heartbeat left running would send after SHUTDOWN about now
    assert leader.channel.ops == [Op.SHUTDOWN]
