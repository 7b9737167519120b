"""A static EAGLE-3 tree's proposal as one CUDA graph replay (decoding_mode eagle,
speculative/eagle3.py ``Eagle3DraftProposer``, static trees).

Why: eagerly, a proposal of the bench's 16-node tree (eagle3_drafter.py ``draft_static``: the root
row, then one forward of the draft layer per depth) is ~510 torch calls from Python (counted with
torch.profiler on the tiny model, 2026-11-29): the H200 spent ~10 ms a step drafting (EAGLE-3 loop
steps of 15-17 ms against ~5-6 ms for the same tree verify steps without drafting), while the
layer's weight reads for 5 forwards are ~1 ms. Here the same proposal is recorded once per
capacity bucket and replayed: per proposal the host fills two scalars, copies the rows the window
lacks, replays and reads the tokens once.

How (a ``Window`` per capacity bucket C, a power of two >= MIN_CAPACITY):
- ``k``, ``v`` (C + R, kv_heads, d): rows [0, C) a copy of the sequence's cached rows (the draft
  cache's, eagle3_drafter.py ``DraftCache``; rows past its length are masked off), rows [C, C + R)
  the R tree rows (the plan's expanded nodes but the root), written by the proposal itself;
- ``length`` (cached rows) and ``position`` (the last cached row's: the token before the root; a
  node of depth d sits at position + d) live in device tensors, so one recording serves every
  length up to C; rotary rows come from the head's table by index (sized at start to the engine's
  longest sequence; never regrown under a recording: the window holds its own reference);
- ``last_q`` / ``last_g``: the last cached row's query and input stream (the root's children);
- ``tokens``: the drafted target-vocab ids of nodes 1.. (the output, outside the graph's pool).
The recorded body (``draft_window``) is draft_static's arithmetic: the same rows, masks and
rankings (the cached rows seen through the length mask instead of a slice), so the drafted tokens
are the same up to the order of the attention's sums; it also runs eagerly (the CPU, or
$TRITONLLM_EAGLE_GRAPHS=0), which is what the CPU tests check against draft_static.

Invariants: a window keeps for one cache (DraftCache.serial) the rows it already copied (cached
rows are final, so only new ones are copied); recordings share one memory pool, and each
proposal reads its tokens before the next replay overwrites them (Eagle3DraftProposer.propose
clones them). Caches past MAX_CAPACITY rows draft eagerly.
"""
from __future__ import annotations

import os
import sys

import torch

MIN_CAPACITY = 64
# Windows stop here (all buckets together: ~2 x this many rows of k and v, 64 MiB for 8 KV heads of
# 128 in bf16); a longer cache drafts eagerly (draft_static: the same tokens, ~10 ms of launches).
MAX_CAPACITY = 8192
EAGLE_GRAPHS_ENV = "TRITONLLM_EAGLE_GRAPHS"


def eagle_graphs_enabled() -> bool:
    return os.environ.get(EAGLE_GRAPHS_ENV, "1") != "0"


def capacity_for(rows: int) -> int:
    """The window bucket of a cache of ``rows`` rows: the next power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(rows - 1, 0).bit_length())


class Window:
    """One capacity bucket's static buffers (module docstring) and, on CUDA, its recording."""

    def __init__(self, head, plan, capacity: int, table: torch.Tensor, device: torch.device):
        hidden = head.w["fc.weight"].shape[0]
        self.capacity, self.table = capacity, table
        rows = capacity + plan.num_expanded - 1
        self.k = torch.zeros(rows, head.num_kv_heads, head.head_dim, dtype=head.dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.index = torch.arange(capacity, device=device)
        self.length = torch.ones(1, dtype=torch.int64, device=device)  # (a recording's warm-up sees one row)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.last_q = torch.zeros(1, head.num_heads, head.head_dim, dtype=head.dtype, device=device)
        self.last_g = torch.zeros(1, hidden, dtype=head.dtype, device=device)
        self.hidden = torch.zeros(plan.num_expanded, hidden, dtype=head.dtype, device=device)
        self.ranked = torch.zeros(plan.num_expanded, plan.width, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(len(plan.parents), dtype=torch.int64, device=device)
        self.serial, self.copied = -1, 0  # the cache whose rows [0, copied) rows [0, copied) hold
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, cache) -> None:
        """Make the window the draft cache's: rows it lacks, its length, position and last row."""
        n = cache.length
        if cache.serial != self.serial:
            self.serial, self.copied = cache.serial, 0
        if n > self.copied:
            self.k[self.copied:n].copy_(cache.k[self.copied:n])
            self.v[self.copied:n].copy_(cache.v[self.copied:n])
            self.copied = n
        self.length.fill_(n)
        self.position.fill_(cache.start + n - 1)
        self.last_q.copy_(cache.last_q)
        self.last_g.copy_(cache.last_g)


@torch.inference_mode()
def draft_window(head, plan, w: Window, embed) -> None:
    """draft_static (eagle3_drafter.py) over a window: writes w.tokens (nodes 1.. in plan order).
    Shapes depend on the plan and the capacity only, values on w's tensors only: recordable."""
    C = w.capacity
    cached = (w.index < w.length)[None]  # (1, C): the cache's rows
    h_root = head.finish(w.last_g, head.attend(w.last_q, w.k[:C], w.v[:C], cached))
    w.hidden[0] = h_root[0]
    ids = torch.log_softmax(head.logits(h_root), dim=-1).topk(plan.width, dim=-1).indices
    w.ranked[0] = ids[0] + head.d2t[ids[0]]
    for depth, level in enumerate(plan.levels, start=1):
        level_tokens = w.ranked[level["parent_e"], level["ranks"]]
        w.tokens[level["nodes"]] = level_tokens
        if level["seen"] is None:
            continue
        grow_e, row = level["expand_e"], level["row"]
        g = w.hidden[level["parent_e"][level["expand"]]]
        n = g.shape[0]
        cos_sin = w.table.index_select(0, w.position + depth).expand(n, -1)
        q, k, v = head.qkv_rotated(embed(level_tokens[level["expand"]]), g, cos_sin)
        end = C + row + n
        w.k[C + row:end] = k
        w.v[C + row:end] = v
        mask = torch.cat([cached.expand(n, C), level["seen"]], dim=1)  # (n, C + row + n)
        h = head.finish(g, head.attend(q, w.k[:end], w.v[:end], mask))
        w.hidden[grow_e] = h
        ids = torch.log_softmax(head.logits(h), dim=-1).topk(plan.width, dim=-1).indices
        w.ranked[grow_e] = ids + head.d2t[ids]


class StaticDraftGraphs:
    """Static-tree proposals through windows (module docstring): recorded per capacity bucket on
    CUDA (lazily, at a bucket's first proposal), eager on the CPU or with graphs off."""

    def __init__(self, head, plan, embed, *, max_positions: int, device: torch.device, use_graphs: bool):
        self.head, self.plan, self.embed, self.device = head, plan, embed, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.max_depth = len(plan.levels)
        self.table = head.cos_sin(0, max_positions + self.max_depth + 1)  # rows 0.. of positions
        self.windows: dict[int, Window] = {}
        self.pool = None
        self.replays = 0

    def fits(self, cache) -> bool:
        """The window path serves the cache: at most MAX_CAPACITY rows, positions inside the rotary table."""
        return cache.length <= MAX_CAPACITY and cache.start + cache.length + self.max_depth <= self.table.shape[0]

    def window(self, capacity: int) -> Window:
        if capacity not in self.windows:
            self.windows[capacity] = Window(self.head, self.plan, capacity, self.table, self.device)
        return self.windows[capacity]

    @torch.inference_mode()
    def record_all(self, max_rows: int) -> None:
        """Record every bucket a cache of up to ``max_rows`` rows reaches (at engine start, before the
        KV pool takes the free memory: the windows and the graphs' pool are counted as used)."""
        capacity = MIN_CAPACITY
        while self.use_graphs and capacity <= min(capacity_for(max_rows), MAX_CAPACITY):
            w = self.window(capacity)
            if w.graph is None:
                self._record(w)
            capacity *= 2

    @torch.inference_mode()
    def run(self, cache) -> torch.Tensor:
        """Draft after the cache's root: (nodes,) device tensor of target ids (w.tokens: the next
        run overwrites it, so a caller keeping it across runs clones it)."""
        w = self.window(capacity_for(cache.length))
        w.load(cache)
        if self.use_graphs and w.graph is None:
            self._record(w)
        if not self.use_graphs:
            draft_window(self.head, self.plan, w, self.embed)
            return w.tokens
        w.graph.replay()
        self.replays += 1
        return w.tokens

    def _record(self, w: Window) -> None:
        try:
            self._capture(w)
        except RuntimeError as err:  # e.g. a kernel that synchronises; drafting stays right, eagerly
            self.use_graphs = False
            print(f"eagle3: drafting runs eagerly: recording the static tree's proposal failed ({err})",
                  file=sys.stderr, flush=True)

    def _capture(self, w: Window) -> None:
        from kernels.linear import graph_capture, side_stream

        stream = side_stream()  # warm-up off the capture (cuBLAS handles, SDPA's choice)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                draft_window(self.head, self.plan, w, self.embed)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph, pool=self.pool, capture_error_mode="thread_local"):
            draft_window(self.head, self.plan, w, self.embed)
        w.graph = graph
