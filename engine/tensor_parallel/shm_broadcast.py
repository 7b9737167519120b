"""One writer, N readers, one message at a time, through a shared-memory segment on one node.

Leader mode sends every step's plan from rank 0 to the other ranks before they can launch their
half of the step. Over the gloo control group that costs ~240 us per plan on 2x H200 (two
broadcasts, TCP on loopback: benchmarks/engine/step_protocol_latency.py), all on the step's critical
path. Here a plan is a memcpy and two 8-byte stores; a waiting reader sees it within
microseconds while it polls.

Layout (little-endian int64 words at the segment's start, data from DATA_OFFSET):
    [0] sequence number of the message in the segment (written last by the writer)
    [1] its length in bytes
    [8 + r] reader r's acknowledged sequence number (written by reader r after copying it out)

Invariants: the writer overwrites the data only after every reader acknowledged the previous
message, so a reader never sees a torn message; sequence numbers only grow. Stores become visible
in program order to other cores on x86-64 (TSO), which is what makes "data, then sequence" safe
without fences; on other architectures use the gloo channel (``SHM_PLANS=0``).

Waiting polls: it spins briefly (a plan usually follows within microseconds during generation),
then sleeps in short naps so an idle worker does not burn a core. Every wait has a deadline and
raises ``TimeoutError`` past it, and ``ConnectionError`` as soon as a process it waits for has
exited (gloo would see the closed socket); the caller turns either into a rank failure.
"""
from __future__ import annotations

import os
import platform
import struct
import time
from multiprocessing import shared_memory

DATA_OFFSET = 4096
SPIN_S = 0.002        # poll without sleeping this long, then nap
NAP_S = 0.00005
IDLE_S = 0.05         # after this long without a message, nap longer
LONG_NAP_S = 0.0005
PEER_CHECK_S = 0.1    # how often a wait checks that the processes it waits for still exist
_WORD = struct.Struct("<q")
_CREATED_HERE: set[str] = set()  # segments this process created (and its resource tracker owns)


def supported() -> bool:
    """Only where stores are seen in program order (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmBroadcast:
    """``writer=True`` on the sending rank (it creates the segment), readers attach by name."""

    def __init__(self, name: str, *, writer: bool, num_readers: int, reader_index: int = -1,
                 capacity: int = 8 << 20):
        self.writer = writer
        self.peer_pids: list[int] = []  # processes this side waits for; a dead one ends a wait at once
        self.num_readers = num_readers
        self.reader_index = reader_index
        size = DATA_OFFSET + capacity
        if writer:
            self.segment = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.segment.buf[:DATA_OFFSET] = bytes(DATA_OFFSET)
            _CREATED_HERE.add(self.segment.name)
        else:
            self.segment = shared_memory.SharedMemory(name=name, create=False)
            if self.segment.name not in _CREATED_HERE:
                _untrack(self.segment)  # the writer owns it; a reader's exit must not unlink it
        self.name = self.segment.name
        self.capacity = self.segment.size - DATA_OFFSET
        self.buf = self.segment.buf
        self.sequence = self._load(0)  # last message sent (writer) or taken (reader)

    def _load(self, word: int) -> int:
        return _WORD.unpack_from(self.buf, word * 8)[0]

    def _store(self, word: int, value: int) -> None:
        _WORD.pack_into(self.buf, word * 8, value)

    def fits(self, data: bytes) -> bool:
        return len(data) <= self.capacity

    def send(self, data: bytes, timeout_s: float) -> None:
        """Publish ``data`` once every reader took the previous message."""
        if not self.fits(data):
            raise ValueError(f"message of {len(data)} bytes exceeds the segment's {self.capacity}")
        _wait(lambda: all(self._load(8 + r) == self.sequence for r in range(self.num_readers)), timeout_s,
              "a rank did not take the previous plan", self.peer_pids)
        self.buf[DATA_OFFSET:DATA_OFFSET + len(data)] = data
        self._store(1, len(data))
        self.sequence += 1
        self._store(0, self.sequence)  # last: readers look at this word only

    def recv(self, timeout_s: float) -> bytes:
        """The next message (blocks up to ``timeout_s``)."""
        _wait(lambda: self._load(0) > self.sequence, timeout_s, "no plan from the leader", self.peer_pids)
        self.sequence += 1
        length = self._load(1)
        data = bytes(self.buf[DATA_OFFSET:DATA_OFFSET + length])
        self._store(8 + self.reader_index, self.sequence)
        return data

    def close(self) -> None:
        self.buf = None
        try:
            self.segment.close()
            if self.writer:
                self.segment.unlink()
        except (FileNotFoundError, BufferError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # a zombie (exited, not yet reaped by its parent) has exited too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Python < 3.13 registers attached segments with its resource tracker, which unlinks them
    when this process exits; only the creator should."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 (no public way before 3.13)
    except Exception:  # tracking differs between versions; at worst a warning at exit
        pass


def _wait(ready, timeout_s: float, what: str, peer_pids: list[int] = ()) -> None:
    if ready():
        return
    started = time.monotonic()
    deadline = started + timeout_s
    next_check = started + PEER_CHECK_S
    while not ready():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        if now > next_check:
            next_check = now + PEER_CHECK_S
            dead = [pid for pid in peer_pids if not _alive(pid)]
            if dead:
                raise ConnectionError(f"{what}: process {dead[0]} of the job has exited")
        idle = now - started
        if idle > SPIN_S:  # nap; longer once clearly idle (the first plan after a pause pays <= LONG_NAP_S)
            time.sleep(NAP_S if idle < IDLE_S else LONG_NAP_S)
