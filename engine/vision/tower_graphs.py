"""CUDA graphs of a Qwen tower's forward for the encode queue (engine/vision/encode_queue.py), one per
batch of image grids seen before.

Why: a tower forward is ~400 kernel launches (32 blocks of ~9, the merger, the layout's gathers), all
made by the queue's worker thread while the executor's loop thread launches its steps. The two share
the GIL, so under load the worker launched at the device's pace: in 6 of 27 H200 runs of vlm_bench's
offline section (2026-11-30) one forward's launches took 531-645 ms, where the device needed ~93 ms,
and the executor waited for those tables. A replayed graph is one launch and a few microseconds of
host time, whatever the other thread does.

Policy: the grids of a forward (each image's (t, h, w), in order) are its key. A key's first forward
runs eagerly (it compiles the Triton kernels and builds the attention plans for its shapes); its
second is captured and then replayed, and so is every later one. Servers see the same few image sizes
again and again (clients resize to fixed sizes; a burst of one size makes forwards of 8, 32, 32, ...
images), and a size seen once costs only the eager forward it would have cost anyway. At most
``max_graphs`` graphs are kept, least recently used dropped first; they share one memory pool (their
replays are serialized on the queue's stream, and each forward's table is copied out, on that stream,
before the next replay), so the pool holds about one forward's activations (~1.3 GB for 32 images of
448 x 448 at the 7B tower's width), not one per graph.

Static buffers: one input buffer (patches, patch_dim) float32 shared by every graph, grown (and the
graphs dropped) only when a forward has more patches than it holds; each graph's output is its
table (rows, out width) float16 in the pool, read before the next replay. What a graph reads outside the
pool stays alive as long as it: the tower's weights, the input buffer, and the layout's kept grid pieces
(engine/vision/tower_layout.py), which the graph holds itself, since their LRU may drop them meanwhile.

Capture runs on the queue's stream without torch.cuda.graph's device-wide synchronize and cache
emptying (they would stall the executor and free its cached blocks), in thread-local mode (the
executor's thread may do anything meanwhile) and with Python's GC held off (kernels/linear.py
graph_capture says why). A forward that cannot be captured (a tower doing host work per forward)
stays eager for that key, and the error is kept in ``failures``.
"""
from __future__ import annotations

import gc
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.vision.tower_layout import GridPiece, pieces_read

# TRITONLLM_TOWER_GRAPHS: how many graphs a queue keeps; 0 (the default) turns them off (every forward eager).
# Off by default because they have not paid: in the H200 offline A/Bs of 2026-11-30 (vlm_bench, 128 requests with a
# 448 x 448 image each; benchmarks/results/engine.md session 22) the runs with graphs gave 0.83x text-only speed
# against 0.83-0.84x eager in the same processes (planless attention; 0.79x against 0.84x while the towers' attention
# was cuDNN). The replays cut a forward's host launch from 13-45 ms to ~1 ms, but the device time (the tower beside
# the executor's prefills) is unchanged, and the slow launches that stalled runs came from image counts never seen
# before, which run eagerly either way (cuDNN's per-shape planning: 115-657 ms to launch).
GRAPHS_ENV = "TRITONLLM_TOWER_GRAPHS"
DEFAULT_GRAPHS = 0
SEEN_KEYS_KEPT = 256  # grids remembered for "seen before" (least recently seen forgotten first)


def graphs_from_env() -> int:
    value = os.environ.get(GRAPHS_ENV, str(DEFAULT_GRAPHS))
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{GRAPHS_ENV}={value!r}: give how many tower graphs to keep (0 turns them off)")
    return count


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    table: torch.Tensor  # (rows, width) float16 in the pool: the forward's output, valid until the next replay
    image_rows: list[int]  # each image's rows in the table
    patches: int
    pieces: list[GridPiece]  # the kept layout pieces its kernels read by address: held while the graph lives


class TowerGraphs:
    """``forward(patches, grids)`` -> (table (rows, width) float16 on the device, each image's row count):
    the tower's rows of every image, concatenated. Call on ``stream`` (the queue's; None on the CPU: always
    eager), one call at a time; the table of a replayed graph is valid until the next call."""

    def __init__(self, encoder: torch.nn.Module, stream: torch.cuda.Stream | None, max_graphs: int | None = None):
        self.encoder = encoder
        self.stream = stream
        self.max_graphs = graphs_from_env() if max_graphs is None else max_graphs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._input: torch.Tensor | None = None
        self._pool = None
        self.captured = self.replays = 0
        self.failures: dict[tuple, str] = {}  # key -> why its capture failed (it stays eager)

    def forward(self, patches: torch.Tensor, grids: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        grids = [[int(v) for v in grid] for grid in grids]
        # The key holds what a graph's static input fixes: the grids, each patch's width and the dtype. Patches that
        # do not match their grids go eager, where the tower refuses them by name (never into a capture or replay)
        key = (tuple(map(tuple, grids)), tuple(patches.shape[1:]), patches.dtype)
        if self.stream is None or self.max_graphs == 0 or key in self.failures \
                or patches.shape[0] != sum(t * h * w for t, h, w in grids):
            return self._eager(patches, grids)
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen:  # first sight: compiles and plans this shape's kernels
                result = self._eager(patches, grids)
                self._remember(key)  # (only a forward that ran: bad inputs never reach a capture)
                return result
            captured = self._capture(key, patches, grids)
            if captured is None:
                return self._eager(patches, grids)
        else:
            self._graphs.move_to_end(key)
            self._input[:captured.patches].copy_(patches)
        captured.graph.replay()
        self.replays += 1
        return captured.table, captured.image_rows

    def _eager(self, patches: torch.Tensor, grids) -> tuple[torch.Tensor, list[int]]:
        rows = self.encoder.image_features(patches, grids)  # one (rows, width) per image
        return torch.cat(rows).to(torch.float16), [len(r) for r in rows]

    def _remember(self, key: tuple) -> None:
        self._seen[key] = None
        while len(self._seen) > SEEN_KEYS_KEPT:
            self._seen.popitem(last=False)

    def _capture(self, key: tuple, patches: torch.Tensor, grids) -> _Captured | None:
        n = patches.shape[0]
        if self._input is None or self._input.shape[0] < n or self._input.shape[1:] != patches.shape[1:] \
                or self._input.dtype != patches.dtype:
            self._graphs.clear()  # they read the old buffer
            self._input = None  # (freed before the larger one is allocated)
            self._input = torch.empty(patches.shape, dtype=patches.dtype, device=patches.device)
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # (destroyed here, outside any capture)
        static = self._input[:n]
        static.copy_(patches)
        if not self._graphs:  # a new pool: one whose graphs were all dropped is released, and torch refuses a
            self._pool = torch.cuda.graph_pool_handle()  # capture into it (an internal assert: use_count > 0)
        graph = torch.cuda.CUDAGraph()
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    with pieces_read() as pieces:
                        table, image_rows = self._eager(static, grids)
                finally:
                    graph.capture_end()
        except Exception as error:  # this key stays eager; the queue's forward goes on
            self.failures[key] = repr(error)[:300]
            while len(self.failures) > SEEN_KEYS_KEPT:
                self.failures.pop(next(iter(self.failures)))
            return None
        finally:
            if enabled:
                gc.enable()
        captured = self._graphs[key] = _Captured(graph, table, image_rows, n, pieces)
        self.captured += 1
        return captured
