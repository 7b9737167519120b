"""The generation side's KV pull (disaggregated serving): a context_only request's blocks copied into this
executor's pool on streams of the pull's own, so the generation loop never waits for the context GPU.

Why: a copy queued on the context GPU's compute stream (or followed by a device-wide synchronize) waits for
the prefill the context executor is running by then (8,192-token chunks take ~170 ms on an H200), and a
generation loop that waits for it stalls every stream it decodes (2x H200, Llama-8B shape, rate 6: ITL p99
158 ms disaggregated against 72 ms aggregated, hand-off p99 570 ms for a 4.9-ms copy).

How one pull is ordered (CUDA):
- ``ready``: an event the context executor recorded on its compute stream right after launching the
  request's last prefill chunk (``ReadyEvents``): every KV write of the prompt comes before it. The copy
  waits on it on the GPU (``wait_event``), never on the host.
- ``after_step``: recorded on the generation loop's stream when the pull starts. The destination blocks
  were free, but a step still in flight may write into blocks freed under it (a finished sequence's
  overlapped decode); the scatter comes after that step.
- The copy: gather of the source blocks on the source GPU into a staging buffer, one contiguous peer copy
  into the generation GPU's staging buffer, scatter into the destination blocks; chunked to ``CHUNK_BYTES``
  so the staging buffers (made once, reused) stay small on both GPUs. torch
  runs a cross-device copy on the *source* device's current stream, so the pull keeps one stream per
  device it touches (``PullStreams``): the source GPU's compute stream never carries it, and no
  stream of either executor waits for it.
- ``end``: recorded on the generation GPU's pull stream after the scatter. The generation loop polls it
  (``Pull.done``, a query, not a sync) and only then schedules the sequence, after a stream wait on
  ``end`` (free by then, and the formal ordering of the first step that reads the blocks). Decode steps
  of other streams never wait for a copy.
- ``elapsed_ms``: start -> end on the generation GPU's pull stream (events): the copy itself, not the
  wait for the step in flight or for the hand-off.
The source blocks stay pinned until ``done``; the caller then releases them to the context side.

Off CUDA (CPU tests, gloo): the copy runs at once on the calling thread and the pull is done when it returns.
Invariant: a Pull holds references to its source and destination tensors and the staging it used until it
is done; in steady state a pull allocates nothing on either GPU nor in pinned host memory (``PullStreams``:
buffers made once, reused in stream order), and no call on its path waits for the host.
"""
from __future__ import annotations

import time

import torch

from engine.executor.kv_transfer_shm import block_major, chunk_blocks

HOST_ID_BUFFERS = 4  # pinned id buffers made by warm_up: pulls whose id copies may be in flight at once
CHUNK_BYTES = 64 << 20  # staging per chunk, per device (an 8,192-token Llama-8B FP8 prompt: 537 MB in 9 chunks)


class Pull:
    """One copy into the destination pool; ``done()`` polls it, ``elapsed_ms()`` (once done) times it."""

    def __init__(self, end=None, start=None, keep=(), host_ms: float = 0.0, device=None):
        self._end, self._start, self._keep, self._host_ms = end, start, keep, host_ms
        self._device = device  # the generation GPU (CUDA pulls)

    def done(self) -> bool:
        if self._end is None or self._end.query():
            self._keep = ()  # (the tensors it read and wrote may go now)
            return True
        return False

    def wait(self) -> None:
        """Host wait (benchmarks, shutdown): never on a serving loop."""
        if self._end is not None:
            self._end.synchronize()
        self._keep = ()

    def order_before(self) -> None:
        """The calling (generation loop) thread's stream waits on the GPU for the copy: before its first step
        that reads the blocks. (Done on the host already when the loop calls it; the order stays explicit.)"""
        if self._end is not None:
            torch.cuda.current_stream(self._device).wait_event(self._end)

    def elapsed_ms(self) -> float:
        if self._end is None:
            return self._host_ms
        return self._start.elapsed_time(self._end)


class PullStreams:
    """The pull streams of one generation executor: one per CUDA device a pull touches, and the buffers a pull
    reuses on each (made by ``warm_up``, or at the first pull), so that a pull in steady state allocates nothing.

    Why allocation-free: CUDA's implicit synchronization (programming guide): commands of two streams cannot
    run concurrently if a page-locked host allocation, a device allocation or a device memset is issued between
    them. A pull's copies issued after its own allocations waited on the GPU for the kernel the context GPU ran
    (its next prefill chunk, ~170 ms at 8,192 tokens): the GPU test saw the pull not done 1 s into a 1.5-s kernel
    recorded after ``ready``, the host not blocked. And an allocation that fails on a GPU nearly filled by its
    KV pool makes the caching allocator free its cached blocks (cudaFree synchronizes the device) with the
    generation loop blocked inside (2x H200, rate 6: kv_transfer_ms_mean 29 ms for a 1.4-3.5 ms copy, hand-off
    p99 462 ms). Buffers, per device and role (CUDA; allocated under that device's pull stream):
    - ``_staging``: (step, L, 2, T, H, D) integers, one chunk (``chunk_blocks``, <= CHUNK_BYTES): the gather's
      output on the source GPU, the peer copy's target and the scatter's input on the generation GPU;
    - ``_ids``: int64 block ids, sized for the pool's block count (never more ids in one pull);
    - ``_host_ids``: pinned int64 buffers the ids of one pull are written into for one H2D per device
      (reused once that copy is done, an event query; a new one only while every buffer is still in flight).
    Reuse is race-free because every use of a device buffer is ordered on one stream, and the host enqueues the
    pulls of one PullStreams from one thread (the generation loop), in order:
    - the source buffers (staging, ids) are only written and read on the source's pull stream (index_select
      into it, then the peer copy reading it: torch runs a cross-device copy_ on the source device's current
      stream, aten/src/ATen/native/cuda/Copy.cu copy_device_to_device), so a later chunk's gather into it comes
      after the earlier chunk's copy out of it;
    - the destination staging is written by that peer copy and read by index_copy_ on the generation GPU's pull
      stream. copy_ makes it a two-way barrier: it records an event on the destination's current stream (our
      pull stream) and the copy waits for it (so the previous chunk's index_copy_ has read the buffer before
      it is overwritten), then the destination's current stream waits for the copy (so index_copy_ reads the
      new bytes);
    - the destination ids are written (H2D) and read on the generation GPU's pull stream only.
    """

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: dict[tuple, torch.Tensor] = {}  # (device, role, block shape, dtype) -> (step, *shape)
        self._ids: dict[tuple, torch.Tensor] = {}  # (device, "src" | "dst") -> (capacity,) int64
        self._host_ids: list[list] = []  # [pinned (capacity,) int64, events of its last H2Ds]
        self._peers: set[tuple] = set()  # (src, dst) device pairs whose peer access torch enabled (warm_up)
        self._warm: set[tuple] = set()  # the (src, dst) pools (device, shape, dtype) warm_up has seen

    def stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def warm_up(self, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
        """Make every buffer a pull from ``src_pool`` into ``dst_pool`` uses, and a first peer copy (torch enables
        peer access then), so the first hand-off is not the slow one. Idempotent; a no-op off CUDA. Called at
        the first pull (or before, by whoever knows both pools); it may wait once."""
        src, dst = block_major(src_pool), block_major(dst_pool)
        if _on_cuda(dst):
            self._warm_buffers(src, dst)

    def _warm_buffers(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``warm_up`` of the pools' (num_blocks, ...) views (``dst`` on CUDA); returns the pull's (source staging:
        None on one GPU, destination staging)."""
        if not _on_cuda(src):
            raise ValueError(f"a KV pull from a pool on {src.device} into one on {dst.device} is not supported "
                             f"(both pools on CUDA devices, or both off CUDA)")
        dst_buf = self._buffers(dst, "dst")
        src_buf = self._buffers(src, "src", staging=_peer(src, dst))
        key = tuple((pool.device, pool.shape, pool.dtype) for pool in (src, dst))
        if key in self._warm:
            return src_buf, dst_buf
        self._warm.add(key)
        self._host_buffers([(src.device, "src"), (dst.device, "dst")])
        self._load_kernels(src, src_buf if _peer(src, dst) else dst_buf, dst, dst_buf)
        if _peer(src, dst) and (src.device, dst.device) not in self._peers:
            src_stream, dst_stream = self.stream(src.device), self.stream(dst.device)
            with torch.cuda.stream(dst_stream), torch.cuda.stream(src_stream):
                dst_buf[:1].copy_(src_buf[:1], non_blocking=True)  # (stream-ordered like a pull's chunk)
            self._peers.add((src.device, dst.device))
        return src_buf, dst_buf

    def _load_kernels(self, src, gather_buf, dst, dst_buf) -> None:
        """Launch the pull's gather and scatter kernels once, reading the pools into the staging (nothing in a
        pool is written): CUDA loads a kernel at its first launch (torch sets CUDA_MODULE_LOADING=LAZY), and
        loading may synchronize the context, which a pull must not do. index_select picks its kernel by the
        index count (16 and under, or more), hence the counts."""
        limit = min(dst_buf.shape[0] // 2, gather_buf.shape[0], src.shape[0])
        counts = [k for k in (1, 2, 17) if k <= limit]
        ids = self._ids[src.device, "src"]
        with torch.cuda.stream(self.stream(src.device)):
            for k in counts:
                torch.arange(k, out=ids[:k])
                torch.index_select(src, 0, ids[:k], out=gather_buf[:k])
        ids = self._ids[dst.device, "dst"]
        with torch.cuda.stream(self.stream(dst.device)):
            for k in counts:
                torch.arange(k, out=ids[:k])
                dst_buf[:k].index_copy_(0, ids[:k], dst_buf[k:2 * k])

    def _buffers(self, by_block: torch.Tensor, role: str, staging: bool = True) -> torch.Tensor | None:
        """``by_block``'s (a pool's (num_blocks, ...) view) id buffer and staging (one chunk, at most the pool's
        blocks) for ``role``: "dst", or "src" (its staging only for a peer copy); returns the staging."""
        device = by_block.device
        key, ids_key = (device, role, tuple(by_block.shape[1:]), by_block.dtype), (device, role)
        with torch.cuda.stream(self.stream(device)):  # (a buffer replaced here goes back to this stream only)
            step = chunk_blocks(by_block, CHUNK_BYTES)
            if staging and (key not in self._staging or self._staging[key].shape[0] < step):
                self._staging[key] = torch.empty((step, *by_block.shape[1:]), dtype=by_block.dtype, device=device)
            if ids_key not in self._ids or self._ids[ids_key].numel() < by_block.shape[0]:
                self._ids[ids_key] = torch.empty(max(1, by_block.shape[0]), dtype=torch.long, device=device)
        return self._staging.get(key)

    def _host_buffers(self, keys) -> None:
        """HOST_ID_BUFFERS pinned id buffers, each sized for the id buffers of ``keys`` (warm_up)."""
        capacity = sum(self._ids[key].numel() for key in keys)
        for entry in self._host_ids:
            if entry[0].numel() < capacity:  # (a larger pool came: its buffers replace them)
                entry[0] = _pinned_empty(capacity)
        while len(self._host_ids) < HOST_ID_BUFFERS:
            self._host_ids.append([_pinned_empty(capacity), []])

    def _host_buffer(self, total: int, keys) -> list:
        """A pinned ids buffer of at least ``total`` whose last H2Ds are done (event queries); a new one (kept)
        only while every buffer is still in flight, or the first: sized for the id buffers of ``keys``."""
        host = next((entry for entry in self._host_ids
                     if entry[0].numel() >= total and all(event.query() for event in entry[1])), None)
        if host is None:
            host = [_pinned_empty(max(total, sum(self._ids[key].numel() for key in keys))), []]
            self._host_ids.append(host)
        return host

    def _load_ids(self, *pairs) -> list[torch.Tensor]:
        """Block ids on their devices without a host wait or an allocation: ``pairs`` of (ids, device); one
        pinned buffer holds them all, one non_blocking H2D per device on its pull stream (torch.tensor(...,
        device=cuda) would copy from pageable memory and synchronize the stream). ``pairs``: (ids, device, role).
        Returns device views."""
        host = self._host_buffer(sum(len(ids) for ids, _, _ in pairs), [(device, role) for _, device, role in pairs])
        out, offset, events = [], 0, []
        for ids, device, role in pairs:
            n = len(ids)
            host[0][offset:offset + n] = torch.tensor(ids, dtype=torch.long)  # (host memcpy; the buffer is free)
            stream = self.stream(device)
            with torch.cuda.stream(stream):
                view = self._ids[device, role][:n]
                view.copy_(host[0][offset:offset + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
            out.append(view)
            offset += n
        host[1] = events
        return out

    def pull(self, src_pool: torch.Tensor, src_ids: list[int], dst_pool: torch.Tensor, dst_ids: list[int],
             ready=None) -> Pull:
        """dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]] (pools (L, 2, num_blocks, T, H, D), same
        layout and element width); ``ready``: the context side's event (None: the blocks are final already)."""
        src, dst = block_major(src_pool), block_major(dst_pool)
        if not _on_cuda(dst):
            started = time.perf_counter()
            step = chunk_blocks(src, CHUNK_BYTES)
            for first in range(0, len(src_ids), step):
                src_chunk, dst_chunk = src_ids[first:first + step], dst_ids[first:first + step]
                staged = src.index_select(0, torch.tensor(src_chunk, device=src.device)).to(dst.device)
                dst.index_copy_(0, torch.tensor(dst_chunk, device=dst.device), staged)
            return Pull(host_ms=(time.perf_counter() - started) * 1e3)
        src_buf, dst_buf = self._warm_buffers(src, dst)
        peer = _peer(src, dst)
        dst_stream = self.stream(dst.device)
        src_stream = self.stream(src.device) if peer else dst_stream
        src_index, dst_index = self._load_ids((src_ids, src.device, "src"), (dst_ids, dst.device, "dst"))
        start, end = self._begin(dst.device)
        with torch.cuda.stream(dst_stream):
            if ready is not None:
                src_stream.wait_event(ready)
            step = min(dst_buf.shape[0], src_buf.shape[0]) if peer else dst_buf.shape[0]  # (>= 1 chunk each)
            for first in range(0, len(src_ids), step):
                n = min(step, len(src_ids) - first)
                if peer:
                    with torch.cuda.stream(src_stream):  # gather + peer copy: the source GPU's pull stream
                        torch.index_select(src, 0, src_index[first:first + n], out=src_buf[:n])
                        dst_buf[:n].copy_(src_buf[:n], non_blocking=True)  # (torch's two-way barrier, see above)
                else:  # one GPU: everything on dst_stream
                    torch.index_select(src, 0, src_index[first:first + n], out=dst_buf[:n])
                dst.index_copy_(0, dst_index[first:first + n], dst_buf[:n])
            end.record(dst_stream)
        return Pull(end, start, keep=(src_pool, dst_pool, src_buf, dst_buf), device=dst.device)

    def _begin(self, device: torch.device):
        """(start, end) timing events; the pull stream first waits for the loop's step in flight."""
        stream = self.stream(device)
        after_step = torch.cuda.Event()
        after_step.record(torch.cuda.current_stream(device))
        stream.wait_event(after_step)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, end


def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def _peer(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Pools on two GPUs: the gather stages on the source GPU, a peer copy moves it."""
    return src.device != dst.device


def _pinned_empty(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.long, pin_memory=True)


class ReadyEvents:
    """Context side: per context_only request, an event recorded on the loop's stream right after the step
    that computes its prompt's last chunk is launched (CUDA only; None elsewhere). ``take`` hands it to the
    export, ``forget`` drops those of requests that ended without one."""

    def __init__(self, device):
        self._cuda = torch.device(device).type == "cuda"
        self._events: dict[int, object] = {}
        self.enabled = False  # set at the first context_only request: until then a launch costs nothing

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def launched(self, scheduled) -> None:
        """After a step's launch (``scheduled``: the plan's items, num_computed_tokens already advanced)."""
        if not self.enabled:
            return
        done = [item.seq.request_id for item in scheduled  # (a recompute after preemption records it anew)
                if item.seq.state.request.request_type == "context_only"
                and item.seq.num_computed_tokens - item.num_new_tokens < item.seq.num_prompt_tokens
                <= item.seq.num_computed_tokens]
        if not done:
            return
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()  # the loop thread's current stream on its current device (the runner's)
        for request_id in done:
            self._events[request_id] = event

    def take(self, request_id: int):
        return self._events.pop(request_id, None)

    def forget(self, live_ids) -> None:
        for request_id in [r for r in self._events if r not in live_ids]:
            del self._events[request_id]
