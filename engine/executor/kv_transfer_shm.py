"""The ``shm`` transport of disaggregated serving: a context_only request's KV as one file in host
shared memory, for a generation executor in another process of the same host (two Triton models,
each with its own engine process). engine/executor/disaggregated.py decides when it is used.

Life of one file (``<dir>/tritonllm-kv-<exporter>-<handle>.kv``, dir = TRITONLLM_KV_TRANSFER_DIR,
else /dev/shm, else the temp dir):
- export (the context loop, ``start_write``): an empty ``<path>.partial`` is created at once (a reader
  that comes early waits for it) and the blocks are gathered on the device, on a stream of the
  export's own after the prompt's ready event (not behind the step in flight); the loop's stream
  waits on the GPU for the gather only, so the blocks are freed in the pool at once. A writer thread
  copies the gathered blocks to pinned host memory (on a copy stream: a later export's gather does not
  queue behind this host copy), writes the bytes and renames the file into place (readers never see a
  partial file); if it fails, the partial file goes too;
- a generation side claims it by renaming it to a name of its own (atomic: one fetch per blob), reads
  it into (pinned) host memory on a reader thread (``claim_blocks``), deletes it, and scatters the
  blocks into its pool (kv_pull.PullStreams.scatter);
- the context loop deletes it at the timeout if nobody claimed it (``expire``), once written.
Content: the blocks' raw bytes, (num_blocks, L, 2, T, H, D) integers of the pool's element width (float8
included); the shape comes from the blob (its layout and num_blocks), equal on both sides.
Neither loop waits for the file: the writer and reader threads do (file I/O releases the GIL).
"""
from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.executor import kv_peer
from engine.executor.kv_host_tier import _SAME_WIDTH_INT

WAIT_POLL_S = 0.001  # a reader's poll while the file is still being written


def transfer_dir() -> str:
    configured = os.environ.get("TRITONLLM_KV_TRANSFER_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def block_major(pool: torch.Tensor) -> torch.Tensor:
    """(num_blocks, L, 2, T, H, D) integer view of a (L, 2, num_blocks, T, H, D) pool: a view, no copy."""
    return pool.view(_SAME_WIDTH_INT[pool.element_size()]).permute(2, 0, 1, 3, 4, 5)


class ShmWriter:
    """The context side's exports: a stream per device (CUDA) and one writer thread, made on first use."""

    def __init__(self):
        self._threads: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, tuple] = {}  # device -> (gather stream, host-copy stream)

    def start_write(self, pool: torch.Tensor, block_ids: list[int], exporter: str, handle: int,
                    ready=None) -> tuple[str, Future]:
        """Copy the blocks out (the pool's blocks may be freed on return); returns the file's path and the
        writer's future (done once the file is in place)."""
        path = os.path.join(transfer_dir(), f"tritonllm-kv-{exporter}-{handle}.kv")
        open(f"{path}.partial", "wb").close()  # (a reader that comes before the writer waits for it)
        by_block = block_major(pool)
        copy_stream = None
        try:
            if by_block.device.type != "cuda":
                gathered = by_block.index_select(0, torch.tensor(block_ids)).contiguous()
            else:
                gathered, copy_stream = self._gather(by_block, block_ids, ready)
        except BaseException:
            expire(f"{path}.partial")  # (no writer will rename or remove it; a reader waiting for it gives up)
            raise
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-shm-write")
        return path, self._threads.submit(_write, gathered, copy_stream, path)

    def _gather(self, by_block: torch.Tensor, block_ids: list[int], ready):
        """The blocks gathered on a stream of our own after ``ready``; the loop's stream waits for the gather
        (its next steps may write the freed blocks after it), not for the host copy; the copy stream too."""
        device = by_block.device
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        (stream, copy_stream), loop_stream = self._streams[device], torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            else:
                stream.wait_stream(loop_stream)
            index = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)
            gathered = by_block.index_select(0, index)
        loop_stream.wait_stream(stream)
        copy_stream.wait_stream(stream)  # (queued now, in gather order; the writer thread copies behind it)
        gathered.record_stream(copy_stream)  # read there: its memory is not reused by a later gather before
        return gathered, copy_stream

    def shutdown(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)


def _write(gathered: torch.Tensor, stream, path: str) -> None:
    """The writer thread: (CUDA) host copy on the copy stream, then the file."""
    partial = f"{path}.partial"
    try:
        if stream is None:
            host = gathered
        else:
            with torch.cuda.stream(stream):  # after the gather (the stream waits for it)
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                stream.synchronize()
        with open(partial, "wb") as f:
            f.write(memoryview(host.numpy()).cast("B"))
        os.replace(partial, path)
    except BaseException:
        expire(partial)  # a reader waiting for it gives up at once
        raise


def claim_blocks(path: str, shape: tuple, element_size: int, pin_for, wait_s: float,
                 peer: dict | None = None) -> torch.Tensor | None:
    """Take the file (None: fetched already, expired, or still unwritten after ``wait_s``), read its blocks
    (``shape``: (num_blocks, L, 2, T, H, D)) into host memory, pinned when ``pin_for`` is a CUDA device (the
    pool's: the reader thread's current device is not), and delete it. A reader's thread. ``peer``: the context
    process (kv_peer.identity); if it dies while its file is being written, kv_peer.PeerGone at once (and its
    partial file, which nobody would remove, goes)."""
    mine = f"{path}.claimed-{os.getpid()}"
    deadline = time.monotonic() + wait_s
    next_check = 0.0
    while True:
        try:
            os.rename(path, mine)
            break
        except FileNotFoundError:
            if not os.path.exists(f"{path}.partial") and not os.path.exists(path) or time.monotonic() > deadline:
                if os.path.exists(path):
                    continue  # renamed into place between the two checks
                return None
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + kv_peer.CHECK_S
                if (dead := kv_peer.gone(peer)) is not None and not os.path.exists(path):
                    expire(f"{path}.partial")
                    raise kv_peer.PeerGone(dead)
            time.sleep(WAIT_POLL_S)  # the context side is still writing it
    try:
        if pin_for is not None and torch.device(pin_for).type == "cuda":
            with torch.cuda.device(pin_for):
                blocks = torch.empty(shape, dtype=_SAME_WIDTH_INT[element_size], pin_memory=True)
        else:
            blocks = torch.empty(shape, dtype=_SAME_WIDTH_INT[element_size])
        with open(mine, "rb") as f:
            if f.readinto(memoryview(blocks.numpy()).cast("B")) != blocks.numel() * element_size:
                return None  # (a file of another layout; the blob's checks make this unreachable)
        return blocks
    finally:
        os.remove(mine)


def expire(path: str) -> bool:
    """Delete an unclaimed file; True if it was still there (nobody fetched it in time)."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False
