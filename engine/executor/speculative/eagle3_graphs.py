"""A static EAGLE-3 tree's proposal as one CUDA graph replay (decoding_mode eagle,
speculative/eagle3.py ``Eagle3DraftProposer``, static trees).

Why: eagerly, a proposal of the bench's 16-node tree (eagle3_drafter.py ``draft_static``: the root
row, then one forward of the draft layer per depth) is ~510 torch calls from Python (counted with
torch.profiler on the tiny model, 2026-11-29): the H200 spent ~10 ms a step drafting (EAGLE-3 loop
steps of 15-17 ms against ~5-6 ms for the same tree verify steps without drafting), while the
layer's weight reads for 5 forwards are ~1 ms. Here the commit of the rows the last verify step
kept (DraftCache.commit) and the proposal are recorded once per capacity bucket and replayed: per
proposal the host copies the pending rows and the cached rows the window lacks, fills three
scalars, replays, hands the new rows to the cache and reads the tokens once (~37 torch calls).

How (a ``Window`` per capacity bucket C, a power of two >= MIN_CAPACITY, holding length + P):
- ``k``, ``v`` (C + R, kv_heads, d): rows [0, length) a copy of the sequence's cached rows (the
  draft cache's, eagle3_drafter.py ``DraftCache``), rows [length, length + P) the pending rows'
  (P = the tree's depth + 1: a verify step's root and accepted drafts; the first ``count`` are real,
  the rest padding hidden by the length mask), rows [C, C + R) the R tree rows (the plan's expanded
  nodes but the root), all written by the replay;
- ``pending`` / ``pending_ids``: the pending rows' input streams g and next tokens;
- ``length``, ``count`` and ``first`` (the first pending row's position; the last one's, + count - 1,
  is the root's parent's: a node of depth d sits there + d) live in device tensors, so one recording
  serves every length up to C - P; rotary rows come from the head's table by index (sized at start
  to the engine's longest sequence; never regrown under a recording: the window holds its own
  reference);
- ``last_q``: the last pending row's query (the root's children attend with it; the cache keeps it);
- ``tokens``: the drafted target-vocab ids of nodes 1.. (the output, outside the graph's pool).
More pending rows than P (after a prompt) are committed eagerly first, all but the last P.
The recorded body (``draft_window``) is commit's and draft_static's arithmetic: the same rows,
masks and rankings (the cached rows seen through the length mask instead of a slice; P rows in the
commit's product), so the drafted tokens and cached rows are the same up to rounding order; it also
runs eagerly (the CPU, or $TRITONLLM_EAGLE_GRAPHS=0), which is what the CPU tests check against
commit + draft_static.

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

    def __init__(self, head, plan, capacity: int, table: torch.Tensor, device: torch.device, pending_rows: int):
        hidden = head.w["fc.weight"].shape[0]
        self.capacity, self.table = capacity, table
        rows = capacity + plan.num_expanded - 1
        self.k = torch.zeros(rows, head.num_kv_heads, head.head_dim, dtype=head.dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.index = torch.arange(capacity, device=device)
        self.pad = torch.arange(pending_rows, device=device)
        self.length = torch.zeros(1, dtype=torch.int64, device=device)  # cached rows before the commit
        self.first = torch.zeros(1, dtype=torch.int64, device=device)  # the first pending row's position
        self.count = torch.ones(1, dtype=torch.int64, device=device)  # pending rows (1..pending_rows)
        self.pending = torch.zeros(pending_rows, hidden, dtype=head.dtype, device=device)
        self.pending_ids = torch.zeros(pending_rows, dtype=torch.int64, device=device)
        self.last_q = torch.zeros(1, head.num_heads, head.head_dim, dtype=head.dtype, device=device)
        self.hidden = torch.zeros(plan.num_expanded, hidden, dtype=head.dtype, device=device)
        self.ranked = torch.zeros(plan.num_expanded, plan.width, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(len(plan.parents), dtype=torch.int64, device=device)
        self.serial, self.copied = -1, 0  # rows [0, copied) are those of the cache with this serial
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, cache, ids: torch.Tensor) -> None:
        """Make the window the draft cache's: the cached rows it lacks, the pending rows (1 to
        pending_rows of them) with their next tokens ``ids`` (host tensor), lengths and positions."""
        n, length = cache.pending.shape[0], cache.length
        if cache.serial != self.serial:
            self.serial, self.copied = cache.serial, 0
        if length > self.copied:
            self.k[self.copied:length].copy_(cache.k[self.copied:length])
            self.v[self.copied:length].copy_(cache.v[self.copied:length])
        self.length.fill_(length)
        self.first.fill_(cache.start + length)
        self.count.fill_(n)
        self.pending[:n].copy_(cache.pending)
        self.pending_ids[:n].copy_(ids, non_blocking=True)

    def store(self, cache) -> None:
        """After a proposal: the pending rows' k and v (computed in the window) join the cache."""
        length, n = cache.length, cache.pending.shape[0]
        cache.add_rows(self.k[length:length + n], self.v[length:length + n], self.last_q.clone())
        self.copied = length + n


@torch.inference_mode()
def draft_window(head, plan, w: Window, embed) -> None:
    """The pending rows' commit (DraftCache.commit), then draft_static (eagle3_drafter.py), over a
    window: writes the pending rows' k, v at rows length.., w.last_q and w.tokens (nodes 1.. in plan
    order). Shapes depend on the plan, the capacity and pending_rows only, values on w's tensors
    only: recordable. Padding rows past count write k, v that the length mask hides."""
    C = w.capacity
    q, k, v = head.qkv_rotated(embed(w.pending_ids), w.pending, w.table.index_select(0, w.first + w.pad))
    slots = w.length + w.pad  # < C: the bucket holds length + pending_rows
    w.k.index_copy_(0, slots, k)
    w.v.index_copy_(0, slots, v)
    last = w.count - 1
    w.last_q.copy_(q.index_select(0, last))
    last_g = w.pending.index_select(0, last)
    position = w.first + last  # the last cached row's: a node of depth d sits at position + d
    cached = (w.index < w.length + w.count)[None]  # (1, C): the cache's rows
    h_root = head.finish(last_g, head.attend(w.last_q, w.k[:C], w.v[:C], cached))
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
        cos_sin = w.table.index_select(0, position + depth).expand(n, -1)
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
    CUDA (at start), eager on the CPU or with graphs off."""

    def __init__(self, head, plan, embed, *, max_positions: int, device: torch.device, use_graphs: bool):
        self.head, self.plan, self.embed, self.device = head, plan, embed, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.max_depth = len(plan.levels)
        # a verify step's features: its root and accepted drafts (more after a prompt: committed eagerly first)
        self.pending_rows = self.max_depth + 1
        self.table = head.cos_sin(0, max_positions + self.pending_rows + self.max_depth + 1)  # rows 0.. of positions
        self.windows: dict[int, Window] = {}
        self.pool = None
        self.replays = 0

    def fits(self, cache) -> bool:
        """The window path serves the cache: rows pending, at most MAX_CAPACITY rows with the
        padding, positions inside the rotary table."""
        total = cache.length + cache.pending.shape[0] + self.pending_rows
        return (cache.pending.shape[0] > 0 and total <= MAX_CAPACITY
                and cache.start + total + self.max_depth <= self.table.shape[0])

    def window(self, capacity: int) -> Window:
        if capacity not in self.windows:
            self.windows[capacity] = Window(self.head, self.plan, capacity, self.table, self.device,
                                            self.pending_rows)
        return self.windows[capacity]

    @torch.inference_mode()
    def record_all(self, max_rows: int) -> None:
        """Record every bucket a cache of up to ``max_rows`` rows reaches (at engine start, before the
        KV pool takes the free memory: the windows and the graphs' pool are counted as used)."""
        capacity = MIN_CAPACITY
        while self.use_graphs and capacity <= min(capacity_for(max_rows + self.pending_rows), MAX_CAPACITY):
            w = self.window(capacity)
            if w.graph is None:
                self._record(w)
            capacity *= 2

    @torch.inference_mode()
    def run(self, cache, tokens: list[int]) -> torch.Tensor:
        """Commit the cache's pending rows (``fits``; their next tokens in ``tokens``, the sequence's)
        and draft after its root: (nodes,) device tensor of target ids (w.tokens: the next run
        overwrites it, so a caller keeping it across runs clones it)."""
        extra = cache.pending.shape[0] - self.pending_rows
        if extra > 0:  # after a prompt: all but the last pending_rows rows eagerly
            cache.commit(self.head, tokens, self.embed, rows=extra)
        first, n = cache.start + cache.length, cache.pending.shape[0]
        w = self.window(capacity_for(cache.length + self.pending_rows))
        w.load(cache, torch.tensor(tokens[first + 1:first + 1 + n]))
        if self.use_graphs and w.graph is None:
            self._record(w)
        if self.use_graphs:
            w.graph.replay()
            self.replays += 1
        else:
            draft_window(self.head, self.plan, w, self.embed)
        w.store(cache)
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
