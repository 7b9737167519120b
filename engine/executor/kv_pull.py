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
- The copy: gather of the source blocks on the source GPU, one contiguous peer copy, scatter into the
  destination blocks; chunked to ``CHUNK_BYTES`` so the staging buffers stay small on both GPUs. torch
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
Invariant: a Pull holds references to its source and destination tensors until it is done, and every
staging tensor is allocated and used on one pull stream (the caching allocator reuses a freed block
only for later work of that stream).
"""
from __future__ import annotations

import time

import torch

from engine.executor.kv_transfer_shm import block_major

CHUNK_BYTES = 64 << 20  # staging per chunk, per device (an 8,192-token Llama-8B FP8 prompt: 537 MB in 9 chunks)


def _step(block_bytes: int) -> int:
    return max(1, CHUNK_BYTES // max(1, block_bytes))


def _chunks(ids_a: list[int], ids_b: list[int], block_bytes: int):
    step = _step(block_bytes)
    for start in range(0, len(ids_a), step):
        yield ids_a[start:start + step], ids_b[start:start + step]


def _block_bytes(by_block: torch.Tensor) -> int:
    return by_block[0].numel() * by_block.element_size() if by_block.shape[0] else 0


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
    """The pull streams of one generation executor: one per CUDA device a pull touches (created lazily)."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pull(self, src_pool: torch.Tensor, src_ids: list[int], dst_pool: torch.Tensor, dst_ids: list[int],
             ready=None) -> Pull:
        """dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]] (pools (L, 2, num_blocks, T, H, D), same
        layout and element width); ``ready``: the context side's event (None: the blocks are final already)."""
        src, dst = block_major(src_pool), block_major(dst_pool)
        if dst.device.type != "cuda":
            started = time.perf_counter()
            for src_chunk, dst_chunk in _chunks(src_ids, dst_ids, _block_bytes(src)):
                staged = src.index_select(0, torch.tensor(src_chunk, device=src.device)).to(dst.device)
                dst.index_copy_(0, torch.tensor(dst_chunk, device=dst.device), staged)
            return Pull(host_ms=(time.perf_counter() - started) * 1e3)
        start, end = self._begin(dst.device)
        dst_stream = self.stream(dst.device)
        peer = src.device.type == "cuda" and src.device != dst.device
        src_stream = self.stream(src.device) if peer else dst_stream
        with torch.cuda.stream(dst_stream):
            if ready is not None:
                src_stream.wait_event(ready)
            for src_chunk, dst_chunk in _chunks(src_ids, dst_ids, _block_bytes(src)):
                if peer:
                    with torch.cuda.stream(src_stream):  # gather + peer copy: the source GPU's pull stream
                        gathered = src.index_select(0, _index(src_chunk, src.device))
                        staged = gathered.to(dst.device)  # dst_stream waits for it (torch's cross-device barrier)
                else:  # one GPU: everything on dst_stream
                    staged = src.index_select(0, _index(src_chunk, src.device))
                dst.index_copy_(0, _index(dst_chunk, dst.device), staged)
            end.record(dst_stream)
        return Pull(end, start, keep=(src_pool, dst_pool), device=dst.device)

    def scatter(self, blocks: torch.Tensor, dst_pool: torch.Tensor, dst_ids: list[int]) -> Pull:
        """dst_pool[:, :, dst_ids[i]] = blocks[i] from host blocks (the shm transport's file, (n, L, 2, T, H, D))."""
        dst = block_major(dst_pool)
        if dst.device.type != "cuda":
            started = time.perf_counter()
            dst.index_copy_(0, torch.tensor(dst_ids, device=dst.device), blocks.to(dst.device))
            return Pull(host_ms=(time.perf_counter() - started) * 1e3)
        start, end = self._begin(dst.device)
        stream = self.stream(dst.device)
        with torch.cuda.stream(stream):
            step = _step(_block_bytes(blocks))
            for first in range(0, len(dst_ids), step):
                chunk = dst_ids[first:first + step]
                # pinned staging: a pageable source would make the driver wait for the stream (the step in flight)
                staged = blocks[first:first + len(chunk)].pin_memory().to(dst.device, non_blocking=True)
                dst.index_copy_(0, _index(chunk, dst.device), staged)
            end.record(stream)
        return Pull(end, start, keep=(dst_pool,), device=dst.device)

    def _begin(self, device: torch.device):
        """(start, end) timing events; the pull stream first waits for the loop's step in flight."""
        stream = self.stream(device)
        after_step = torch.cuda.Event()
        after_step.record(torch.cuda.current_stream(device))
        stream.wait_event(after_step)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, end


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on ``device`` without a host wait: torch.tensor(..., device=cuda) copies from pageable
    memory and synchronizes the current stream (here: a pull stream behind the step in flight)."""
    return torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)


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
