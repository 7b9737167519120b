"""The generation side's KV pull (engine/executor/kv_pull.py): byte-exact in chunks; on CUDA it runs on
streams of its own, so it finishes while the source GPU's compute stream is still busy. The shm
transport's file (kv_transfer_shm.py): written by a thread chunk by chunk, a reader waits for it and copies
it into the pool chunk by chunk, one fetch; both through buffers they reuse."""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.executor import kv_pull, kv_transfer_shm
from engine.executor.kv_pull import PullStreams
from engine.executor.kv_transfer_shm import ShmWriter, block_major, read_blocks

SHAPE = (2, 2, 16, 4, 2, 8)  # (layers, 2, blocks, tokens per block, kv heads, head dim)
SRC_IDS, DST_IDS = [3, 5, 6, 7, 12], [1, 2, 9, 0, 15]


def _pools(src_device, dst_device):
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.float16).to(src_device)
    return src, torch.zeros(SHAPE, dtype=torch.float16, device=dst_device)


def test_pull_is_byte_exact_in_chunks(monkeypatch):
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk
    src, dst = _pools("cpu", "cpu")
    pull = PullStreams().pull(src, SRC_IDS, dst, DST_IDS)
    assert pull.done() and pull.elapsed_ms() >= 0
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS]) and not dst[:, :, [4, 5]].any()


class _FakeEvent:
    in_flight = False  # (class-wide: a query says "not yet" while set)

    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return not _FakeEvent.in_flight

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


class _FakeStream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        pass


def test_a_warm_pull_reuses_its_buffers_and_allocates_nothing(monkeypatch):
    """The CUDA path's chunking, staging and id buffers on CPU tensors (streams and events faked, the pools
    "on a GPU" and "on a peer"): byte-exact, and after warm_up no pull allocates a buffer; a new
    pinned ids buffer only while the others' copies are still in flight."""
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk: 3 chunks
    for name, fake in [("Stream", _FakeStream), ("Event", _FakeEvent),
                       ("stream", lambda stream: contextlib.nullcontext()),
                       ("current_stream", lambda device=None: _FakeStream())]:
        monkeypatch.setattr(torch.cuda, name, fake)
    pinned = []
    monkeypatch.setattr(kv_pull, "_on_cuda", lambda tensor: True)
    monkeypatch.setattr(kv_pull, "_pinned_empty", lambda n: pinned.append(n) or torch.empty(n, dtype=torch.long))
    for peer in (True, False):
        monkeypatch.setattr(kv_pull, "_peer", lambda src, dst: peer)
        src, dst = _pools("cpu", "cpu")
        pulls, before = PullStreams(), src.clone()
        pulls.warm_up(src, dst)
        assert torch.equal(src, before) and not dst.any()  # (it loads the kernels reading the pools, writes none)
        buffers = [*pulls._staging.values(), *pulls._ids.values()]
        assert len(buffers) == (4 if peer else 3) and pinned == [2 * 16] * kv_pull.HOST_ID_BUFFERS
        for src_ids, dst_ids in [(SRC_IDS, DST_IDS), (SRC_IDS[::-1], [4, 5, 6, 8, 10]), ([0], [11])]:
            pull = pulls.pull(src, src_ids, dst, dst_ids, ready=_FakeEvent())
            assert pull.done() and torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
        assert [*pulls._staging.values(), *pulls._ids.values()] == buffers and len(pinned) == kv_pull.HOST_ID_BUFFERS
        _FakeEvent.in_flight = True  # no id copy is done: each pull takes an unused pinned buffer, then a new one
        try:
            for _ in range(kv_pull.HOST_ID_BUFFERS):
                pulls.pull(src, SRC_IDS, dst, DST_IDS)
            assert len(pinned) == len(pulls._host_ids) == kv_pull.HOST_ID_BUFFERS + 1
        finally:
            _FakeEvent.in_flight = False
        assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS])
        pinned.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: GPU only")
@pytest.mark.parametrize("warm", ["warm_up", "a first pull"])
def test_a_pull_does_not_wait_for_the_source_gpus_compute_stream(warm):
    """The context side records ``ready`` and then runs a long kernel (the next prefill) on its stream: the pull
    (GPU 0 -> GPU 1, or within GPU 0 on one GPU) is done while that kernel still runs.
    Steady state: the PullStreams' buffers exist and its kernels are loaded before the kernel starts, by
    ``warm_up`` or by a first pull; a pull then allocates and loads nothing. The cold pull (a serving
    executor's first hand-off, which runs warm_up itself) is not asserted: an allocation or a lazy kernel
    load issued while the GPU is busy may serialize with it (the cold variant of this test failed so)."""
    dst_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src, dst = _pools("cuda:0", dst_device)
    pulls = PullStreams()
    if warm == "warm_up":
        pulls.warm_up(src, dst)
    else:
        pulls.pull(src, SRC_IDS[:2], dst, DST_IDS[:2]).wait()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst_device)
    compute, ready = torch.cuda.Stream("cuda:0"), torch.cuda.Event()
    with torch.cuda.stream(compute):
        ready.record(compute)  # the prompt's last chunk is done
        torch.cuda._sleep(int(3e9))  # ~1.5 s of "next prefill"
    pull = pulls.pull(src, SRC_IDS, dst, DST_IDS, ready)
    deadline = time.monotonic() + 1.0
    while not pull.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pull.done() and not compute.query(), "the pull waited for the source's compute stream"
    pull.order_before()
    assert torch.equal(dst[:, :, DST_IDS].cpu(), src[:, :, SRC_IDS].cpu())
    assert 0 < pull.elapsed_ms() < 1000
    compute.synchronize()


class _SyncedStream(_FakeStream):
    def synchronize(self):
        pass


def _cuda_like(buffers):
    """A thread's shm buffers as on CUDA (a stream; staging and ids apart from the host ones), on CPU tensors."""
    buffers.stream, buffers.staging, buffers.ids = _SyncedStream(), torch.empty_like(buffers.host), \
        torch.empty_like(buffers.host_ids)
    return buffers


@pytest.mark.parametrize("path", ["cpu", "the CUDA path on CPU tensors"])
def test_shm_reader_waits_for_a_file_being_written_and_a_fetch_is_one_shot(tmp_path, monkeypatch, path):
    """Writer and reader move the blocks in chunks through buffers each thread makes once: byte-exact (ids as
    given, other blocks untouched), and a second export / import of another size reuses them."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    monkeypatch.setattr(kv_transfer_shm, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk: 3 chunks
    src, dst = _pools("cpu", "cpu")
    gate, write = threading.Event(), kv_transfer_shm._write
    made, cuda = [], path != "cpu"
    if cuda:
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(kv_transfer_shm, "_write", lambda *args: (gate.wait(5), write(*args))[1])
    monkeypatch.setattr(kv_transfer_shm, "_Buffers", lambda by_block, real=kv_transfer_shm._Buffers:
                        made.append(by_block.shape) or (_cuda_like if cuda else lambda b: b)(real(by_block)))
    writer = ShmWriter()
    with ThreadPoolExecutor(1) as readers:
        for handle, (src_ids, dst_ids) in enumerate([(SRC_IDS, DST_IDS), ([0, 15], [4, 3])]):
            path, writing = writer.start_write(src, src_ids, "test", handle)
            reading = readers.submit(read_blocks, path, dst, dst_ids, None, 5.0)
            time.sleep(0.05)
            assert not reading.done()  # the writer has not written it yet: the reader waits
            gate.set()
            assert reading.result(5) is True and writing.result() is None
            gate.clear()
            assert not read_blocks(path, dst, dst_ids, None, 5.0) and not list(tmp_path.iterdir())  # one fetch
    assert torch.equal(dst[:, :, DST_IDS + [4, 3]], src[:, :, SRC_IDS + [0, 15]])
    assert not dst[:, :, [5, 6, 7, 8]].any() and len(made) == 2  # (one writer thread, one reader thread)
    writer.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: GPU only")
def test_shm_export_and_import_on_gpus_do_not_wait_for_the_compute_stream(tmp_path, monkeypatch):
    """The writer gathers after ``ready`` on its own stream and the reader copies in after the loop's step: with a
    long kernel queued on the context GPU's compute stream after ``ready``, a warm export (its thread's buffers
    made by a first one) and its import are done while the kernel runs, byte-exact."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    monkeypatch.setattr(kv_transfer_shm, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk: 3 chunks
    dst_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src, dst = _pools("cuda:0", dst_device)
    writer = ShmWriter()
    with ThreadPoolExecutor(1) as readers:
        path, writing = writer.start_write(src, SRC_IDS[:2], "gpu", 1)  # (warm: each thread's buffers)
        writing.result(30)
        assert readers.submit(read_blocks, path, dst, DST_IDS[:2], None, 5.0).result(30)
        torch.cuda.synchronize("cuda:0")
        compute, ready = torch.cuda.Stream("cuda:0"), torch.cuda.Event()
        with torch.cuda.stream(compute):
            ready.record(compute)  # the prompt's last chunk is done
            torch.cuda._sleep(int(3e9))  # ~1.5 s of "next prefill"
        path, writing = writer.start_write(src, SRC_IDS, "gpu", 2, ready)
        reading = readers.submit(read_blocks, path, dst, DST_IDS, kv_transfer_shm.after_loop(dst.device), 5.0)
        assert reading.result(1.0) and writing.done() and not compute.query(), "the export waited for the compute stream"
    assert torch.equal(dst[:, :, DST_IDS].cpu(), src[:, :, SRC_IDS].cpu())
    compute.synchronize()
    writer.shutdown()


def test_an_export_whose_gather_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """The writer thread's gather raising (here: a block id past the pool) removes the placeholder: nothing else
    would (shm files outlive the process), and a reader waiting for it gives up."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    src, _ = _pools("cpu", "cpu")
    writer = ShmWriter()
    path, writing = writer.start_write(src, [SHAPE[2]], "test", 2)
    assert isinstance(writing.exception(5), IndexError) and not list(tmp_path.iterdir())
    writer.shutdown()
