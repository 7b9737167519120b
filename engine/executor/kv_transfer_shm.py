"""The ``shm`` transport of disaggregated serving: a context_only request's KV as one file in host
shared memory, for a generation executor in another process of the same host (two Triton models,
each with its own engine process). engine/executor/disaggregated.py decides when it is used.

Life of one file (``<dir>/tritonllm-kv-<exporter>-<handle>.kv``, dir = TRITONLLM_KV_TRANSFER_DIR,
else /dev/shm, else the temp dir):
- export (the context loop, ``ShmWriter.start_write``): an empty ``<path>.partial`` is created at once (a
  reader that comes early waits for it); the prompt's blocks stay pinned in the pool (the caller acquires
  them) until the writer thread has copied them out. The writer thread gathers them chunk by chunk into
  its staging buffer (on a stream of its own, after the prompt's ready event: not behind the step in
  flight, and no stream of the loop waits for it), copies each chunk to its pinned host buffer and
  appends it to the file, then renames the file into place (readers never see a partial file); if it
  fails, the partial file goes too. Its future done, the context loop frees the blocks;
- a generation side claims it by renaming it to a name of its own (atomic: one fetch per blob); its
  reader thread (``read_blocks``) reads it chunk by chunk into its pinned host buffer and copies each
  chunk into the blocks allocated for it (on a stream of its own, after the generation loop's step in
  flight), then deletes it;
- the context loop deletes it at the timeout if nobody claimed it (``expire``), once written.
Both threads reuse their buffers (``_Buffers``: one chunk of staging on the device and in pinned host
memory, block ids on both): an export or an import allocates nothing on the GPU nor in pinned memory once
a thread has made them. A device or page-locked allocation may wait for the work queued on the GPU (CUDA's
implicit synchronization), and a whole prompt's gather was 537 MB on the context GPU at 8,192 tokens
(Llama-8B FP8), the reader's pinned buffer as much per file.
Content: the blocks' raw bytes, (num_blocks, L, 2, T, H, D) integers of the pool's element width (float8
included); the shape comes from the blob (its layout and num_blocks), equal on both sides.
Neither loop waits for the file: the writer and reader threads do (file I/O and stream syncs release the GIL).
"""
from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
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


CHUNK_BYTES = 32 << 20  # one chunk of a thread's staging (on the device and pinned on the host)


def chunk_blocks(by_block: torch.Tensor, chunk_bytes: int) -> int:
    """Blocks a staging chunk of ``by_block`` (a pool's (num_blocks, ...) view) holds: as many as fit in
    ``chunk_bytes``, at least one, at most the pool's (the shm files' threads and kv_pull's streams)."""
    block_bytes = by_block[0].numel() * by_block.element_size() if by_block.shape[0] else 0
    return max(1, min(chunk_bytes // max(1, block_bytes), by_block.shape[0]))


class _Buffers:
    """One thread's reused buffers for the pools of one shape: ``host`` (step, L, 2, T, H, D) integers of the
    pool's width (pinned on CUDA), ``staging`` the same on the pool's device (``host`` itself off CUDA), ``ids``
    and ``host_ids`` room for every block id of the pool, and the thread's ``stream`` (None off CUDA).
    Reuse is race-free: one thread uses them, and it synchronizes its stream before it touches ``host`` or
    ``host_ids`` again."""

    def __init__(self, by_block: torch.Tensor):
        shape, dtype, device = tuple(by_block.shape[1:]), by_block.dtype, by_block.device
        self.step = chunk_blocks(by_block, CHUNK_BYTES)
        count = max(1, by_block.shape[0])
        if device.type != "cuda":
            self.stream = None
            self.host = self.staging = torch.empty((self.step, *shape), dtype=dtype)
            self.host_ids = self.ids = torch.empty(count, dtype=torch.long)
            return
        with torch.cuda.device(device):  # (pinned memory belongs to the current device's context)
            self.stream = torch.cuda.Stream(device)
            self.host = torch.empty((self.step, *shape), dtype=dtype, pin_memory=True)
            self.host_ids = torch.empty(count, dtype=torch.long, pin_memory=True)
            self.staging = torch.empty((self.step, *shape), dtype=dtype, device=device)
            self.ids = torch.empty(count, dtype=torch.long, device=device)

    def load_ids(self, block_ids: list[int], after) -> torch.Tensor:
        """The ids on the pool's device, on the thread's stream after ``after`` (an event; CUDA)."""
        n = len(block_ids)
        self.host_ids[:n] = torch.tensor(block_ids, dtype=torch.long)
        if self.stream is not None:
            if after is not None:
                self.stream.wait_event(after)
            self.ids[:n].copy_(self.host_ids[:n], non_blocking=True)
        return self.ids[:n]

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


_THREAD = threading.local()  # each writer / reader thread's buffers: {(device, shape, dtype, blocks): _Buffers}


def _buffers(by_block: torch.Tensor) -> _Buffers:
    if not hasattr(_THREAD, "buffers"):
        _THREAD.buffers = {}
    key = (by_block.device, tuple(by_block.shape), by_block.dtype)
    if key not in _THREAD.buffers:
        _THREAD.buffers[key] = _Buffers(by_block)
    return _THREAD.buffers[key]


def _stream(buffers: _Buffers):
    return contextlib.nullcontext() if buffers.stream is None else torch.cuda.stream(buffers.stream)


def after_loop(device) -> object | None:
    """CUDA: an event after the calling loop's work so far on its stream (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class ShmWriter:
    """The context side's exports: one writer thread, made on first use."""

    def __init__(self):
        self._threads: ThreadPoolExecutor | None = None

    def start_write(self, pool: torch.Tensor, block_ids: list[int], exporter: str, handle: int,
                    ready=None) -> tuple[str, Future]:
        """Write the blocks to a file on the writer thread; they must stay pinned until the returned future (done
        once the file is in place, or failed) is done. ``ready``: the event after the prompt's last prefill chunk
        (CUDA; None: the loop's stream as of now). Returns the file's path and the future."""
        directory = transfer_dir()
        by_block = block_major(pool)
        need, disk = len(block_ids) * by_block[0].numel() * by_block.element_size(), os.statvfs(directory)
        if need > disk.f_bavail * disk.f_frsize:  # (here, the request fails by name; the writer's ENOSPC would not)
            raise OSError(errno.ENOSPC, f"{directory} has {disk.f_bavail * disk.f_frsize} bytes free, the KV file "
                                        f"needs {need}")
        path = os.path.join(directory, f"tritonllm-kv-{exporter}-{handle}.kv")
        open(f"{path}.partial", "wb").close()  # (a reader that comes before the writer waits for it)
        try:
            if ready is None:
                ready = after_loop(pool.device)
            if self._threads is None:
                self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-shm-write")
            return path, self._threads.submit(_write, pool, list(block_ids), ready, path)
        except BaseException:
            expire(f"{path}.partial")  # (no writer will rename or remove it; a reader waiting for it gives up)
            raise

    def shutdown(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)


def _write(pool: torch.Tensor, block_ids: list[int], ready, path: str) -> None:
    """The writer thread: the blocks chunk by chunk, device -> staging -> pinned host -> file."""
    partial = f"{path}.partial"
    by_block = block_major(pool)
    buffers = _buffers(by_block)
    try:
        with open(partial, "wb") as f, _stream(buffers):
            try:
                ids = buffers.load_ids(block_ids, ready)
                for first in range(0, len(block_ids), buffers.step):
                    n = min(buffers.step, len(block_ids) - first)
                    torch.index_select(by_block, 0, ids[first:first + n], out=buffers.staging[:n])
                    if buffers.stream is not None:
                        buffers.host[:n].copy_(buffers.staging[:n], non_blocking=True)
                        buffers.sync()
                    f.write(memoryview(buffers.host[:n].numpy()).cast("B"))
            finally:
                buffers.sync()  # (nothing of this export still reads the pool once its future is done)
        os.replace(partial, path)
    except BaseException:
        expire(partial)  # a reader waiting for it gives up at once
        raise


def read_blocks(path: str, pool: torch.Tensor, dst_ids: list[int], after, wait_s: float,
                peer: dict | None = None) -> bool:
    """Take the file (False: fetched already, expired, or still unwritten after ``wait_s``) and copy its blocks
    into ``pool``'s blocks ``dst_ids`` (chunk by chunk: file -> pinned host -> staging -> pool, on the thread's
    stream after ``after``, the generation loop's step in flight), then delete it; True once they are in place.
    A reader's thread. ``peer``: the context process (kv_peer.identity); if it dies while its file is being
    written, kv_peer.PeerGone at once (and its partial file, which nobody would remove, goes)."""
    mine = f"{path}.claimed-{os.getpid()}"
    deadline, watch = time.monotonic() + wait_s, kv_peer.Watch(peer)
    while True:
        try:
            os.rename(path, mine)
            break
        except FileNotFoundError:
            if not os.path.exists(f"{path}.partial") and not os.path.exists(path) or time.monotonic() > deadline:
                if os.path.exists(path):
                    continue  # renamed into place between the two checks
                return False
            if (dead := watch.gone()) is not None and not os.path.exists(path):
                expire(f"{path}.partial")
                raise kv_peer.PeerGone(dead)
            time.sleep(WAIT_POLL_S)  # the context side is still writing it
    try:
        by_block = block_major(pool)
        block_bytes = by_block[0].numel() * by_block.element_size()
        if os.path.getsize(mine) != len(dst_ids) * block_bytes:
            return False  # (a file of another layout; the blob's checks make this unreachable)
        buffers = _buffers(by_block)
        with open(mine, "rb") as f, _stream(buffers):
            try:
                ids = buffers.load_ids(dst_ids, after)
                for first in range(0, len(dst_ids), buffers.step):
                    n = min(buffers.step, len(dst_ids) - first)
                    buffers.sync()  # (the previous chunk's copy out of ``host`` is done)
                    if f.readinto(memoryview(buffers.host[:n].numpy()).cast("B")) != n * block_bytes:
                        return False
                    if buffers.stream is not None:
                        buffers.staging[:n].copy_(buffers.host[:n], non_blocking=True)
                    by_block.index_copy_(0, ids[first:first + n], buffers.staging[:n])
            finally:
                buffers.sync()  # (nothing of this import still writes the pool once its future is done)
        return True
    finally:
        os.remove(mine)


def expire(path: str) -> bool:
    """Delete an unclaimed file; True if it was still there (nobody fetched it in time)."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False
