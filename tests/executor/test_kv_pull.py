"""The generation side's KV pull (engine/executor/kv_pull.py): byte-exact in chunks; on CUDA it runs on
streams of its own, so it finishes while the source GPU's compute stream is still busy. The shm
transport's file (kv_transfer_shm.py): written by a thread, a reader waits for it, one fetch."""
from __future__ import annotations

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: GPU only")
def test_a_pull_does_not_wait_for_the_source_gpus_compute_stream():
    """The context side records ``ready`` and then runs a long kernel (the next prefill) on its stream: the pull
    (GPU 0 -> GPU 1, or within GPU 0 on one GPU) is done while that kernel still runs."""
    dst_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src, dst = _pools("cuda:0", dst_device)
    blocks = src.view(torch.int16).permute(2, 0, 1, 3, 4, 5)[SRC_IDS].cpu()
    torch.cuda.synchronize("cuda:0")
    compute, ready = torch.cuda.Stream("cuda:0"), torch.cuda.Event()
    with torch.cuda.stream(compute):
        ready.record(compute)  # the prompt's last chunk is done
        torch.cuda._sleep(int(3e9))  # ~1.5 s of "next prefill"
    pulls = PullStreams()
    pull = pulls.pull(src, SRC_IDS, dst, DST_IDS, ready)
    again = torch.zeros_like(dst)
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
