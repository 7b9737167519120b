"""The generation side's KV pull (engine/executor/kv_pull.py): byte-exact in chunks; on CUDA it runs on
streams of its own, so it finishes while the source GPU's compute stream is still busy. The shm
transport's file (kv_transfer_shm.py): written by a thread, a reader waits for it, one fetch."""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.executor import kv_pull, kv_transfer_shm
from engine.executor.kv_pull import PullStreams
from engine.executor.kv_transfer_shm import ShmWriter, block_major, claim_blocks

SHAPE = (2, 2, 16, 4, 2, 8)  # (layers, 2, blocks, tokens per block, kv heads, head dim)
SRC_IDS, DST_IDS = [3, 5, 6, 7, 12], [1, 2, 9, 0, 15]


def _pools(src_device, dst_device):
    src = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.float16).to(src_device)
    return src, torch.zeros(SHAPE, dtype=torch.float16, device=dst_device)


def test_pull_and_scatter_are_byte_exact_in_chunks(monkeypatch):
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk
    src, dst = _pools("cpu", "cpu")
    pull = PullStreams().pull(src, SRC_IDS, dst, DST_IDS)
    assert pull.done() and pull.elapsed_ms() >= 0
    assert torch.equal(dst[:, :, DST_IDS], src[:, :, SRC_IDS]) and not dst[:, :, [4, 5]].any()
    blocks = src.view(torch.int16).permute(2, 0, 1, 3, 4, 5)[SRC_IDS].contiguous()  # the shm file's layout
    again = torch.zeros_like(dst)
    assert PullStreams().scatter(blocks, again, DST_IDS).done() and torch.equal(again, dst)


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
    "on a GPU" and "on a peer"): byte-exact, and after warm_up no pull or scatter allocates a buffer; a new
    pinned ids buffer only while the others' copies are still in flight."""
    monkeypatch.setattr(kv_pull, "CHUNK_BYTES", 2 * 2 * 4 * 2 * 8 * 2 * 2)  # two blocks per chunk: 3 chunks
    for name, fake in [("Stream", _FakeStream), ("Event", _FakeEvent),
                       ("stream", lambda stream: contextlib.nullcontext()),
                       ("current_stream", lambda device=None: _FakeStream())]:
        monkeypatch.setattr(torch.cuda, name, fake)
    pinned = []
    monkeypatch.setattr(kv_pull, "_on_cuda", lambda tensor: True)
    monkeypatch.setattr(kv_pull, "_pin", lambda blocks: blocks)
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
        blocks = block_major(src)[SRC_IDS].contiguous()  # the shm file's layout
        again = torch.zeros_like(dst)
        assert pulls.scatter(blocks, again, DST_IDS).done()
        assert torch.equal(again[:, :, DST_IDS], src[:, :, SRC_IDS]) and not again[:, :, [3, 4]].any()
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
    (GPU 0 -> GPU 1, or within GPU 0 on one GPU) and an shm scatter are done while that kernel still runs.
    Steady state: the PullStreams' buffers exist and its kernels are loaded before the kernel starts, by
    ``warm_up`` or by a first pull; a pull then allocates and loads nothing. The cold pull (a serving
    executor's first hand-off, which runs warm_up itself) is not asserted: an allocation or a lazy kernel
    load issued while the GPU is busy may serialize with it (the cold variant of this test failed so)."""
    dst_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src, dst = _pools("cuda:0", dst_device)
    blocks = block_major(src)[SRC_IDS].contiguous().cpu().pin_memory()  # (dense and pinned, as a reader makes it)
    again = torch.zeros_like(dst)
    pulls = PullStreams()
    if warm == "warm_up":
        pulls.warm_up(src, dst)
    else:
        pulls.pull(src, SRC_IDS[:2], dst, DST_IDS[:2]).wait()
        pulls.scatter(blocks[:2], again, DST_IDS[:2]).wait()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst_device)
    compute, ready = torch.cuda.Stream("cuda:0"), torch.cuda.Event()
    with torch.cuda.stream(compute):
        ready.record(compute)  # the prompt's last chunk is done
        torch.cuda._sleep(int(3e9))  # ~1.5 s of "next prefill"
    pull = pulls.pull(src, SRC_IDS, dst, DST_IDS, ready)
    scatter = pulls.scatter(blocks, again, DST_IDS)
    deadline = time.monotonic() + 1.0
    while not (pull.done() and scatter.done()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pull.done() and scatter.done() and not compute.query(), "the pull waited for the source's compute stream"
    pull.order_before()
    assert torch.equal(dst[:, :, DST_IDS].cpu(), src[:, :, SRC_IDS].cpu()) and torch.equal(again.cpu(), dst.cpu())
    assert 0 < pull.elapsed_ms() < 1000
    compute.synchronize()


def test_shm_reader_waits_for_a_file_being_written_and_a_fetch_is_one_shot(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    src, _ = _pools("cpu", "cpu")
    gate, write = threading.Event(), kv_transfer_shm._write
    monkeypatch.setattr(kv_transfer_shm, "_write", lambda *args: (gate.wait(5), write(*args))[1])
    writer = ShmWriter()
    path, writing = writer.start_write(src, SRC_IDS, "test", 1)
    shape = (len(SRC_IDS), *block_major(src).shape[1:])
    with ThreadPoolExecutor(1) as readers:
        reading = readers.submit(claim_blocks, path, shape, 2, None, 5.0)
        time.sleep(0.05)
        assert not reading.done()  # the writer has not written it yet: the reader waits
        gate.set()
        assert torch.equal(reading.result(5), block_major(src)[SRC_IDS]) and writing.result() is None
    assert claim_blocks(path, shape, 2, "cpu", 5.0) is None and not list(tmp_path.iterdir())
    writer.shutdown()


def test_an_export_whose_gather_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """No writer runs for it, so nothing else would remove the placeholder (shm files outlive the process)."""
    monkeypatch.setenv("TRITONLLM_KV_TRANSFER_DIR", str(tmp_path))
    src, _ = _pools("cpu", "cpu")
    with pytest.raises(IndexError):
        ShmWriter().start_write(src, [SHAPE[2]], "test", 2)  # (a block id past the pool)
    assert not list(tmp_path.iterdir())
