"""Images encoded as requests arrive, off the executor's critical path: one worker thread with a CUDA
stream of its own runs the tower over every image pending at once.

Why: run on the executor's stream, a tower forward (~170 ms for 32 images at 448 x 448 on an H200)
queues the executor's next steps behind it, and requests that arrive together were encoded one
request at a time (the OpenAI path's single worker). Here each caller ``submit``s its request's
images and gets a Future of its table; the worker takes everything pending (up to ``max_images``
images), runs one forward on its stream (the executor's steps run beside it on theirs), copies the
rows to the host as float16 (the tables' wire dtype) and completes the futures, so a request's table
is ready before the request is enqueued and scheduled.

Qwen-style towers (engine/vision/qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py): an item is (patches
(n, patch_dim) float, its images' grids [[t, h, w], ...]); its table is the images' rows in order,
(rows, table width) float16 on the CPU.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future

import torch


class ImageEncodeQueue:
    def __init__(self, encoder: torch.nn.Module, device: str | torch.device, max_images: int = 32):
        self.encoder = encoder
        self.device = torch.device(device)
        self.max_images = max_images
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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

    def _take(self) -> list[tuple[torch.Tensor, list[list[int]], Future]]:
        """The pending items, oldest first, up to max_images images (at least one item); [] once closed."""
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            taken, images = [], 0
            while self._pending and (not taken or images + len(self._pending[0][1]) <= self.max_images):
                item = self._pending.pop(0)
                taken.append(item)
                images += len(item[1])
            return taken

    def _run(self) -> None:
        while True:
            items = self._take()
            if not items:
                return
            try:
                tables = self._forward(items)
            except Exception as error:  # every waiting caller gets it; the worker goes on
                for _, _, future in items:
                    future.set_exception(error)
                continue
            for (_, _, future), table in zip(items, tables):
                future.set_result(table)

    @torch.inference_mode()
    def _forward(self, items) -> list[torch.Tensor]:
        grids = [grid for _, item_grids, _ in items for grid in item_grids]
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            patches = torch.cat([p for p, _, _ in items]).to(self.device, torch.float32)
            rows = self.encoder.image_features(patches, grids)  # one (rows, width) per image
            host = torch.cat(rows).to(torch.float16).cpu()  # waits for this stream only
        counts, image = [], 0
        for _, item_grids, _ in items:  # each item's rows: those of its images
            counts.append(sum(len(r) for r in rows[image:image + len(item_grids)]))
            image += len(item_grids)
        return list(host.split(counts))
