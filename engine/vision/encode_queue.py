"""Images encoded as requests arrive, off the executor's critical path: one worker thread with a CUDA
stream of its own runs the tower over every image pending at once.

Why: run on the executor's stream, a tower forward (~93 ms for 32 images at 448 x 448 on an H200)
queues the executor's next steps behind it, and requests that arrive together were encoded one
request at a time (the OpenAI path's single worker). Here each caller ``submit``s its request's
images and gets a Future of its table; the worker takes everything pending (up to ``max_images``
images; ``first_images`` when the tower is idle), runs one forward on its stream (the executor's
steps run beside it on theirs), copies the rows to the host as float16 (the tables' wire dtype) and
completes the futures, so a request's table is ready before the request is enqueued and scheduled.

The worker is a two-stage pipeline (CUDA): forward k's rows go to pinned host memory by an
asynchronous copy, then the worker launches forward k + 1 (whatever is pending by then) and only
then waits for copy k and completes its futures. So the tower's stream always has the next batch
queued while the host completes the last one (callers' done-callbacks run on this thread), and no
copy of a table waits for anything but its own forward. On the CPU each forward completes at once.

Pinned memory: the worker's own, two staging areas per pipeline slot (the rows coming back, host
patches going out), kept and grown only when a forward needs more (to its size + 1/4, never past
``max_staging_bytes`` each: a forward that needs more copies through ordinary host memory instead, slower
but never failing a request, so a burst of large images cannot pin gigabytes for the process's life).
Nothing pinned is allocated per forward or per request, and the tables handed out are ordinary (pageable) host memory, copied out of
the staging area once its copy is done. Why: a pinned allocation that the caching host allocator cannot
serve from its cache is a cudaHostAlloc, which CUDA orders against every stream of the device (an
implicit synchronization: the executor's next kernels waited for the tower's queued forward), and that
cache serves a freed block only once every older freed block's copy is done (its event queue is
processed oldest first), so misses are common while the tower and the executor both copy. The
executor stages a step's rows in pinned buffers of its own (engine/executor/table_graphs.py). The
tower's stream has the lowest priority, the executor's a higher one (engine/executor/device_stream.py).

Qwen-style towers (engine/vision/qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py): an item is (patches
(n, patch_dim) float, its images' grids [[t, h, w], ...]); its table is the images' rows in order,
(rows, table width) float16 on the CPU.
"""
from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.executor.device_stream import TOWER_PRIORITY
from engine.vision.tower_graphs import TowerGraphs


@dataclass
class _Launched:
    """A forward whose rows are on their way to the host: ``tables`` each item's (rows, width) float16,
    views of the slot's staging area (copied out by _complete), ``copied`` the event after their copy
    (None on the CPU)."""

    items: list
    tables: list[torch.Tensor]
    copied: torch.cuda.Event | None


class ImageEncodeQueue:
    def __init__(self, encoder: torch.nn.Module, device: str | torch.device, max_images: int = 32,
                 first_images: int = 8, priority: int = TOWER_PRIORITY,
                 max_staging_bytes: int = 256 << 20, max_graphs: int | None = None):
        self.encoder = encoder
        # Cap of each staging buffer (4 per queue): 256 MiB holds ~32 images of 448 x 448 (patches float32)
        self.max_staging_bytes = max_staging_bytes
        self.device = torch.device(device)
        self.max_images = max_images
        # A forward started while the tower is idle takes at most this many: under a burst the first tables
        # are ready after a small forward (~28 ms for 8 images at 448 x 448 on an H200, against ~93 ms for 32),
        # so the executor starts on them while the next, full forwards run
        self.first_images = min(first_images, max_images)
        # (by default the lowest priority: the executor's steps get free SMs first, engine/executor/device_stream.py)
        self.stream = torch.cuda.Stream(self.device, priority=priority) if self.device.type == "cuda" else None
        # The forwards, replayed from CUDA graphs of the grids seen before when TRITONLLM_TOWER_GRAPHS (or
        # max_graphs) asks for them (engine/vision/tower_graphs.py: off by default, it says why); eager on the CPU
        self.graphs = TowerGraphs(encoder, self.stream, max_graphs)
        # Per pipeline slot (forward k uses slot k % 2; slot k % 2 is reused only after _complete(k)):
        # {"rows" | "patches" (CUDA): a flat buffer, pinned on CUDA}, grown on demand
        self._staging: list[dict[str, torch.Tensor]] = [{}, {}]
        self._slot = 0
        self._pending: list[tuple[torch.Tensor, list[list[int]], Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="image_encode_queue", daemon=True)
        self._thread.start()

    def submit(self, patches, grids) -> Future:
        """One request's images -> Future of its table (rows, width) float16 on the CPU."""
        future: Future = Future()
        grids = [[int(v) for v in grid] for grid in grids]
        with self._cv:
            if self._closed:
                raise RuntimeError("the image encode queue is closed")
            self._pending.append((torch.as_tensor(patches), grids, future))
            self._cv.notify()
        return future

    def encode(self, patches, grids) -> torch.Tensor:
        """``submit`` and wait."""
        return self.submit(patches, grids).result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _take(self, idle: bool) -> list[tuple[torch.Tensor, list[list[int]], Future]]:
        """The pending items, oldest first, up to ``first_images`` images when ``idle`` (the tower has nothing
        in flight; read once there is an item, so a change between bursts applies to the next one), else
        ``max_images`` (at least one item). ``idle``: block until there is one; [] once closed and drained
        (or, not idle, when none is pending)."""
        with self._cv:
            while True:
                while idle and not self._pending and not self._closed:
                    self._cv.wait()
                limit = self.first_images if idle else self.max_images
                taken, images = [], 0
                while self._pending and (not taken or images + len(self._pending[0][1]) <= limit):
                    item = self._pending.pop(0)
                    if not item[2].set_running_or_notify_cancel():
                        continue  # cancelled while pending (its caller went away: asyncio.wrap_future): skipped
                    taken.append(item)
                    images += len(item[1])
                if taken or not idle or self._closed:  # (waiting, and every pending item was cancelled: wait on)
                    return taken

    def _run(self) -> None:
        launched = None  # the forward whose copy is in flight
        while True:
            idle = launched is None
            items = self._take(idle)
            if not items and launched is None:
                return  # closed, nothing pending, nothing in flight
            following = None
            if items:
                following = self._launch(items, self._slot)  # queued behind `launched` on the stream
                self._slot ^= 1
            if launched is not None:
                self._complete(launched)
            launched = following

    @staticmethod
    def _fail(items, error: BaseException) -> None:
        for _, _, future in items:  # every waiting caller gets it; the worker goes on
            future.set_exception(error)

    @torch.inference_mode()
    def _launch(self, items, slot: int) -> _Launched | None:
        """Queue the items' forward and their rows' copy to the host (into ``slot``'s staging). On an error:
        None, each item's future failed or (several items) completed by a forward of its own."""
        grids = [grid for _, item_grids, _ in items for grid in item_grids]
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                patches = self._patches_on_device([p for p, _, _ in items], slot)
                # (rows, width) float16, replayed from a graph when these grids were seen before: valid until
                # the next forward, which the copy below precedes on this stream
                table, image_rows = self.graphs.forward(patches, grids)
                counts, image = [], 0
                for _, item_grids, _ in items:  # each item's rows: those of its images
                    counts.append(sum(image_rows[image:image + len(item_grids)]))
                    image += len(item_grids)
                staged = self._staged(slot, "rows", table.numel(), table.dtype)
                if staged is None:  # over the cap: a pageable copy (this thread waits for the forward)
                    host = table.to("cpu")
                else:
                    host = staged[:table.numel()].view(table.shape)
                    host.copy_(table, non_blocking=self.stream is not None)
                copied = None
                if self.stream is not None:
                    copied = torch.cuda.Event()
                    copied.record(self.stream)
                return _Launched(items, list(host.split(counts)), copied)
        except Exception as error:
            if len(items) == 1:
                self._fail(items, error)
            else:  # one bad item (its patches do not match its grids, ...) must not fail the others: each alone
                for item in items:  # (each completed before the next reuses the slot)
                    alone = self._launch([item], slot)
                    if alone is not None:
                        self._complete(alone)
            return None

    def _patches_on_device(self, parts: list[torch.Tensor], slot: int) -> torch.Tensor:
        """The items' patches as one (n, patch_dim) float32 tensor on the device. Host patches (the served
        paths': the image processor's output) go through the slot's pinned staging, so their copy does not
        make this thread wait for the forward in flight (a pageable copy synchronizes the stream)."""
        if self.stream is None or any(p.device.type != "cpu" for p in parts):
            return torch.cat([p.to(self.device) for p in parts]).to(torch.float32)
        shape = (sum(len(p) for p in parts), *parts[0].shape[1:])
        numel = math.prod(shape)
        staged = self._staged(slot, "patches", numel, parts[0].dtype)
        if staged is None:  # over the cap: a pageable copy (waits for the forward in flight; rare)
            return torch.cat(parts).to(self.device).to(torch.float32)
        staged = staged[:numel].view(shape)
        torch.cat(parts, out=staged)
        return staged.to(self.device, non_blocking=True).to(torch.float32)

    def _staged(self, slot: int, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``slot``'s flat buffer ``name`` (pinned on CUDA) of at least ``numel`` elements of ``dtype``: the one kept,
        or (first use, a larger forward, another dtype) a new one of numel + 1/4 (room for a somewhat larger
        next forward), at most ``max_staging_bytes``. None when ``numel`` alone is over that cap: the caller
        copies through ordinary memory, and the buffer kept stays as it is."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > self.max_staging_bytes:
            return None
        buffer = self._staging[slot].get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            size = min(numel + numel // 4, self.max_staging_bytes // itemsize)
            self._staging[slot].pop(name, None)  # the old one freed before the new one is pinned
            buffer = self._staging[slot][name] = torch.empty(size, dtype=dtype, pin_memory=self.stream is not None)
        return buffer

    def _complete(self, launched: _Launched) -> None:
        try:
            if launched.copied is not None:
                launched.copied.synchronize()  # this forward's copy only, not the executor's work
        except Exception as error:
            self._fail(launched.items, error)
            return
        # Memory of its own for each table (the slot's staging is written again two forwards on), all copied before
        # any future completes: a forward's tables are ready together, so callers woken by the first find the rest
        # done too (vlm_bench's enqueuing thread then sends the forward's requests in one call, and the executor's
        # first step prefills them all instead of the first alone, then one decode row beside the rest).
        tables = [torch.empty(table.shape, dtype=table.dtype).copy_(table) for table in launched.tables]
        for (_, _, future), table in zip(launched.items, tables):
            future.set_result(table)
