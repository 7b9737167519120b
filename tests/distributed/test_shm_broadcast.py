"""The shared-memory plan channel (engine/tensor_parallel/shm_broadcast.py): order, acknowledgement, deadlines."""
from __future__ import annotations

import os
import threading

import pytest

from engine.tensor_parallel import shm_broadcast
from engine.tensor_parallel.shm_broadcast import ShmBroadcast

pytestmark = pytest.mark.skipif(not shm_broadcast.supported(), reason="x86-64 only (store ordering)")


@pytest.fixture
def channel():
    name = f"tritonllm_test_{os.getpid()}_{threading.get_ident()}"
    writer = ShmBroadcast(name, writer=True, num_readers=2, capacity=1 << 16)
    readers = [ShmBroadcast(name, writer=False, num_readers=2, reader_index=i) for i in range(2)]
    yield writer, readers
    for reader in readers:
        reader.close()
    writer.close()


def test_every_reader_gets_every_message_in_order(channel):
    writer, readers = channel
    messages = [os.urandom(n) for n in (0, 1, 7, 4096, 65536, 3) * 20]
    received = [[] for _ in readers]

    def read(index):
        for _ in messages:
            received[index].append(readers[index].recv(timeout_s=10))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(readers))]
    for thread in threads:
        thread.start()
    for message in messages:
        writer.send(message, timeout_s=10)  # waits for both acknowledgements of the previous one
    for thread in threads:
        thread.join(10)
    assert received == [messages, messages]


def test_the_writer_waits_for_a_slow_reader_and_gives_up_at_its_deadline(channel):
    writer, readers = channel
    writer.send(b"first", timeout_s=1)
    assert readers[0].recv(timeout_s=1) == b"first"
    with pytest.raises(TimeoutError, match="did not take the previous plan"):
        writer.send(b"second", timeout_s=0.2)  # reader 1 never took "first"
    assert readers[1].recv(timeout_s=1) == b"first"
    writer.send(b"second", timeout_s=1)
    assert [r.recv(timeout_s=1) for r in readers] == [b"second", b"second"]


def test_a_reader_gives_up_at_its_deadline_and_too_big_a_message_is_refused(channel):
    writer, readers = channel
    with pytest.raises(TimeoutError, match="no plan from the leader"):
        readers[0].recv(timeout_s=0.1)
    with pytest.raises(ValueError, match="exceeds"):
        writer.send(bytes(writer.capacity + 1), timeout_s=1)


def test_a_wait_ends_at_once_when_the_peer_process_is_gone(channel):
    import subprocess
    import sys
    import time

    writer, readers = channel
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    readers[0].peer_pids = [gone.pid]
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="has exited"):
        readers[0].recv(timeout_s=30)
    assert time.monotonic() - started < 5
