"""A static EAGLE-3 tree's proposal as one CUDA graph replay (decoding_mode eagle,
speculative/eagle3.py ``Eagle3DraftProposer``, static trees).

Why: eagerly, a proposal of the bench's 16-node tree (eagle3_drafter.py ``draft_static``: the root
row, then one forward of the draft layer per depth) is ~510 torch calls from Python (counted with
torch.profiler on the tiny model, 2026-11-29): the H200 spent ~10 ms a step drafting (EAGLE-3 loop
steps of 15-17 ms against ~5-6 ms for the same tree verify steps without drafting), while the
layer's weight reads for 5 forwards are ~1 ms. Here the commit of the rows the last verify step
kept (DraftCache.commit) and the proposal are recorded once per capacity bucket and replayed: per
proposal the host copies the pending rows and the cached rows the window lacks, sends the
lengths, positions and next tokens in one copy, replays, hands the new rows to the cache and reads
the tokens once (~39 torch calls at batch 1).
A step's sequences draft together: one replay of a batched window (``slots`` sequences, each in a
slot of its own) for all of them, so batch B costs about one proposal's launches and weight reads
(each depth's products read the layer's weights once for all B), not B replays.

How (a ``Window`` per (slots, capacity) bucket: slots a power of two, capacity C a power of two >=
MIN_CAPACITY holding every slot's length + P; every tensor below has a leading slots dimension):
- ``k``, ``v`` (C + R, kv_heads, d): rows [0, length) a copy of the sequence's cached rows (the
  draft cache's, eagle3_drafter.py ``DraftCache``), rows [length, length + P) the pending rows'
  (P = the tree's depth + 1: a verify step's root and accepted drafts; the first ``count`` are real,
  the rest padding hidden by the length mask), rows [C, C + R) the R tree rows (the plan's expanded
  nodes but the root), all written by the replay;
- ``pending`` / ``pending_ids``: the pending rows' input streams g and next tokens;
- ``length``, ``count`` and ``first`` (the first pending row's position; the last one's, + count - 1,
  is the root's parent's: a node of depth d sits there + d) live in device tensors, so one recording
  serves every length up to C - P; rotary rows come from the head's table by position (sized at start
  to the engine's longest sequence; never regrown under a recording: the window holds its own
  reference);
- ``last_q``: the last pending row's query (the root's children attend with it; the cache keeps it);
- ``tokens``: the drafted target-vocab ids of nodes 1.. (the output, outside the graph's pool).
One-slot windows have rows of their own; batched ones view one shared buffer of BATCH_ROWS rows
(a bucket holds slots x (C + R) <= BATCH_ROWS: a batch of longer caches drafts in groups, at most
MAX_SLOTS a group), so all (slots, capacity) buckets together hold what one does.
More pending rows than P (after a prompt) are committed eagerly first, all but the last P.
The recorded body (``draft_window``) is commit's and draft_static's arithmetic: the same rows,
masks and rankings (the cached rows seen through the length mask instead of a slice; P rows in the
commit's product), so the drafted tokens and cached rows are the same up to rounding order; it also
runs eagerly (the CPU, or $TRITONLLM_EAGLE_GRAPHS=0), which is what the CPU tests check against
commit + draft_static.

Invariants: a window's slot keeps for one cache (DraftCache.serial) the rows it already copied
(cached rows are final, so only new ones are copied; a cache keeps its slot while it stays in the
batch, and a batched window that finds the shared rows written by another forgets every slot's);
unused slots draft from one padding row, read by nobody; recordings share one memory pool, and each
proposal reads its tokens before the next replay overwrites them (Eagle3DraftProposer.propose
clones them). Caches past MAX_CAPACITY rows draft eagerly.
"""
from __future__ import annotations

import os
import sys

import torch

from kernels._triton import power_of_2_floor
from kernels.draft_topk import draft_top_ids

MIN_CAPACITY = 64
# Windows stop here (all buckets together: ~2 x this many rows of k and v, 64 MiB for 8 KV heads of
# 128 in bf16); a longer cache drafts eagerly (draft_static: the same tokens, ~10 ms of launches).
MAX_CAPACITY = 8192
# Rows of the one buffer every batched window (slots >= 2) views: slots x (capacity + tree rows) fit
# in it (128 MiB of k and v for 8 KV heads of 128 in bf16). A batch whose caches need more drafts in
# several groups (a bucket of half the slots each, ...), one sequence a window at the least.
BATCH_ROWS = 4 * MAX_CAPACITY
# Slots of a batched window at most (larger batches draft in groups of this many): each (slots,
# capacity) bucket is one more recording at start; a group's logits are slots x nodes x draft_vocab.
MAX_SLOTS = 64
EAGLE_GRAPHS_ENV = "TRITONLLM_EAGLE_GRAPHS"


def eagle_graphs_enabled() -> bool:
    return os.environ.get(EAGLE_GRAPHS_ENV, "1") != "0"


def capacity_for(rows: int) -> int:
    """The window bucket of a cache of ``rows`` rows: the next power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(rows - 1, 0).bit_length())


def slots_for(count: int) -> int:
    """The batch bucket of ``count`` sequences: the next power of two."""
    return 1 << max(count - 1, 0).bit_length()


class Window:
    """One (slots, capacity) bucket's static buffers (module docstring; slot b holds one sequence,
    every tensor below has a leading slots dimension) and, on CUDA, its recording. ``storage``:
    (rows, kv_heads, d) k and v buffers the window views (batched windows share one: the
    StaticDraftGraphs' ``_Rows``), or None for buffers of its own."""

    def __init__(self, head, plan, capacity: int, table: torch.Tensor, device: torch.device, pending_rows: int,
                 slots: int = 1, storage=None):
        hidden = head.hidden_size
        self.capacity, self.table, self.slots, self.storage = capacity, table, slots, storage
        rows = capacity + plan.num_expanded - 1
        if storage is None:
            self.k = torch.zeros(slots, rows, head.num_kv_heads, head.head_dim, dtype=head.dtype, device=device)
            self.v = torch.zeros_like(self.k)
        else:  # a view of the shared rows: slot b's rows at [b * rows, (b + 1) * rows)
            self.k = storage.k[:slots * rows].view(slots, rows, head.num_kv_heads, head.head_dim)
            self.v = storage.v[:slots * rows].view(slots, rows, head.num_kv_heads, head.head_dim)
        self.index = torch.arange(capacity, device=device)
        self.slot_rows = torch.arange(slots, device=device) * rows  # slot b's first row, flat
        self.pad = torch.arange(pending_rows, device=device)
        self.base = torch.arange(slots, device=device) * pending_rows  # slot b's first pending row, flat
        # per slot: cached rows before the commit, the first pending row's position, pending rows
        # (1..pending_rows), then the pending rows' next tokens: one host-to-device copy a proposal
        self.meta = torch.zeros(slots, 3 + pending_rows, dtype=torch.int64, device=device)
        self.length, self.first, self.count = self.meta[:, 0], self.meta[:, 1], self.meta[:, 2]
        self.count.fill_(1)
        self.pending_ids = self.meta[:, 3:]
        self.pending = torch.zeros(slots, pending_rows, hidden, dtype=head.dtype, device=device)
        self.last_q = torch.zeros(slots, 1, head.num_heads, head.head_dim, dtype=head.dtype, device=device)
        self.hidden = torch.zeros(slots, plan.num_expanded, hidden, dtype=head.dtype, device=device)
        self.ranked = torch.zeros(slots, plan.num_expanded, plan.width, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(slots, len(plan.parents), dtype=torch.int64, device=device)
        # slot b's rows [0, copied[b]) are those of the cache with serial serials[b]
        self.serials, self.copied = [-1] * slots, [0] * slots
        self.graph: torch.cuda.CUDAGraph | None = None

    def assign(self, caches: list) -> list[int]:
        """A slot per cache, keeping a cache in the slot that already holds its rows (a stable batch
        copies only new rows) -> slots in the caches' order."""
        if self.storage is not None and self.storage.owner is not self:  # another window wrote the rows
            self.storage.owner, self.serials, self.copied = self, [-1] * self.slots, [0] * self.slots
        wanted = {cache.serial for cache in caches}
        held = {serial: b for b, serial in enumerate(self.serials) if serial in wanted}
        free = [b for b, serial in enumerate(self.serials) if serial not in wanted]
        return [held[cache.serial] if cache.serial in held else free.pop(0) for cache in caches]

    def load(self, caches: list, token_lists: list, slots: list[int]) -> None:
        """Make slot slots[i] caches[i]'s: the cached rows it lacks, the pending rows (1 to pending_rows
        of them) with their next tokens (from token_lists[i], the sequence's), lengths and positions.
        Slots without a cache draft from one padding row (their output is not read)."""
        P = self.pad.shape[0]
        meta = [[0, 0, 1] + [0] * P for _ in range(self.slots)]
        for b in set(range(self.slots)) - set(slots):  # a padding slot's replay writes its rows [0, P): forget them
            self.serials[b], self.copied[b] = -1, 0
        for cache, tokens, b in zip(caches, token_lists, slots):
            n, length = cache.pending.shape[0], cache.length
            if cache.serial != self.serials[b]:
                self.serials[b], self.copied[b] = cache.serial, 0
            if length > self.copied[b]:
                self.k[b, self.copied[b]:length].copy_(cache.k[self.copied[b]:length])
                self.v[b, self.copied[b]:length].copy_(cache.v[self.copied[b]:length])
            first = cache.start + length
            ids = tokens[first + 1:first + 1 + n]
            meta[b] = [length, first, n] + ids + [0] * (P - n)
            self.pending[b, :n].copy_(cache.pending)
        self.meta.copy_(torch.tensor(meta), non_blocking=True)

    def store(self, caches: list, slots: list[int]) -> None:
        """After a proposal: the pending rows' k and v (computed in the window) join each cache."""
        last_q = self.last_q.clone()  # (the next replay overwrites the window's)
        for cache, b in zip(caches, slots):
            length, n = cache.length, cache.pending.shape[0]
            cache.add_rows(self.k[b, length:length + n], self.v[b, length:length + n], last_q[b])
            self.copied[b] = length + n


class _Rows:
    """The k and v rows the batched windows share (BATCH_ROWS rows), and which window wrote them last."""

    def __init__(self, head, device: torch.device):
        self.k = torch.zeros(BATCH_ROWS, head.num_kv_heads, head.head_dim, dtype=head.dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.owner = None


@torch.inference_mode()
def draft_window(head, plan, w: Window, embed) -> None:
    """Per slot: the pending rows' commit (DraftCache.commit), then draft_static (eagle3_drafter.py),
    over a window: writes the pending rows' k, v at rows length.., w.last_q and w.tokens (nodes 1..
    in plan order). All slots in one batched forward per depth. Shapes depend on the plan, the
    capacity, slots and pending_rows only, values on w's tensors only: recordable. Padding rows past
    count write k, v that the length mask hides."""
    C, S, P = w.capacity, w.slots, w.pad.shape[0]
    H = w.pending.shape[-1]
    positions = (w.first[:, None] + w.pad).reshape(-1)  # (S * P,)
    q, k, v = head.qkv_at(embed(w.pending_ids.reshape(-1)), w.pending.reshape(S * P, H), positions, w.table)
    rows = w.k.shape[1]
    slots = ((w.slot_rows + w.length)[:, None] + w.pad).reshape(-1)  # flat rows, each < its slot's C
    w.k.view(S * rows, *w.k.shape[2:]).index_copy_(0, slots, k)
    w.v.view(S * rows, *w.v.shape[2:]).index_copy_(0, slots, v)
    last = w.base + w.count - 1  # each slot's last pending row, flat
    w.last_q.copy_(q.index_select(0, last)[:, None])
    last_g = w.pending.reshape(S * P, H).index_select(0, last)[:, None]  # (S, 1, H)
    position = w.first + w.count - 1  # each slot's last cached row's: a node of depth d sits at position + d
    cached = w.index[None] < (w.length + w.count)[:, None]  # (S, C): each cache's rows
    h_root = head.finish(last_g, head.attend(w.last_q, w.k[:, :C], w.v[:, :C], cached[:, None]))[:, 0]
    w.hidden[:, 0] = h_root
    # ranked (S, E, width): each expanded node's width best children as target ids (draft_topk.py:
    # one launch for topk + d2t); ``flat`` views it (S, E * width), what the plan's grow_flat_at and
    # node_flat index
    draft_top_ids(head.logits(h_root), head.d2t, plan.width, out=w.ranked[:, 0])  # (S, width): as draft_static
    flat = w.ranked.view(S, -1)
    for depth, level in enumerate(plan.levels, start=1):
        # (the plan's *_at: slices where the indices are a run: views and copies, not index kernels)
        if level["seen"] is None:
            continue
        row = level["row"]
        g = w.hidden[:, level["grow_parent_at"]]  # (S, n, H)
        n = g.shape[1]
        at = (position + depth)[:, None].expand(S, n).reshape(S * n)
        q, k, v = head.qkv_at(embed(flat[:, level["grow_flat_at"]].reshape(-1)), g.reshape(S * n, H), at, w.table)
        end = C + row + n
        w.k[:, C + row:end] = k.view(S, n, *k.shape[1:])
        w.v[:, C + row:end] = v.view(S, n, *v.shape[1:])
        mask = torch.cat([cached[:, None].expand(S, n, C), level["seen"].expand(S, n, -1)], dim=2)  # (S, n, end)
        h = head.finish(g, head.attend(q.view(S, n, *q.shape[1:]), w.k[:, :end], w.v[:, :end], mask))
        grown = level["expand_e_at"]
        w.hidden[:, grown] = h
        if isinstance(grown, slice):  # a view: written in place (by the kernel itself where it is contiguous)
            draft_top_ids(head.logits(h), head.d2t, plan.width, out=w.ranked[:, grown])
        else:
            w.ranked[:, grown] = draft_top_ids(head.logits(h), head.d2t, plan.width)
    w.tokens.copy_(flat[:, plan.node_flat])  # every node's token at once (nodes 1.. in plan order)


class StaticDraftGraphs:
    """Static-tree proposals through windows (module docstring): recorded per (slots, capacity)
    bucket on CUDA (at start), eager on the CPU or with graphs off. One sequence: ``windows``
    (capacity -> a one-slot window of its own buffers); a batch: ``batch_windows`` ((slots,
    capacity) -> a window over the shared rows), one replay for all its sequences."""

    def __init__(self, head, plan, embed, *, max_positions: int, device: torch.device, use_graphs: bool):
        self.head, self.plan, self.embed, self.device = head, plan, embed, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.max_depth = len(plan.levels)
        # a verify step's features: its root and accepted drafts (more after a prompt: committed eagerly first)
        self.pending_rows = self.max_depth + 1
        self.table = head.cos_sin(0, max_positions + self.pending_rows + self.max_depth + 1)  # rows 0.. of positions
        self.windows: dict[int, Window] = {}
        self.batch_windows: dict[tuple[int, int], Window] = {}
        self.rows = None  # _Rows, made with the first batched window
        self.pool = None
        self.replays = 0

    def fits(self, cache) -> bool:
        """The window path serves the cache: rows pending, at most MAX_CAPACITY rows with the
        padding, positions inside the rotary table."""
        total = cache.length + cache.pending.shape[0] + self.pending_rows
        return (cache.pending.shape[0] > 0 and total <= MAX_CAPACITY
                and cache.start + total + self.max_depth <= self.table.shape[0])

    def max_slots(self, capacity: int) -> int:
        """The most sequences one batched window of ``capacity`` rows each holds (a power of two)."""
        fit = min(BATCH_ROWS // (capacity + self.plan.num_expanded - 1), MAX_SLOTS)
        return power_of_2_floor(fit)

    def window(self, capacity: int, slots: int = 1) -> Window:
        if slots == 1:
            if capacity not in self.windows:
                self.windows[capacity] = Window(self.head, self.plan, capacity, self.table, self.device,
                                                self.pending_rows)
            return self.windows[capacity]
        if (slots, capacity) not in self.batch_windows:
            if self.rows is None:
                self.rows = _Rows(self.head, self.device)
            self.batch_windows[slots, capacity] = Window(self.head, self.plan, capacity, self.table, self.device,
                                                         self.pending_rows, slots, self.rows)
        return self.batch_windows[slots, capacity]

    @torch.inference_mode()
    def record_all(self, max_rows: int, max_batch: int = 1) -> None:
        """Record every bucket a cache of up to ``max_rows`` rows reaches, one sequence and batches of
        up to ``max_batch`` (at engine start, before the KV pool takes the free memory: the windows
        and the graphs' pool are counted as used)."""
        top = min(capacity_for(max_rows + self.pending_rows), MAX_CAPACITY)
        slots = 1
        while self.use_graphs and slots <= min(slots_for(max_batch), MAX_SLOTS):
            capacity = MIN_CAPACITY
            while self.use_graphs and capacity <= top and (slots == 1 or self.max_slots(capacity) >= slots):
                w = self.window(capacity, slots)
                if w.graph is None:
                    self._record(w)
                capacity *= 2
            slots *= 2

    @torch.inference_mode()
    def run(self, cache, tokens: list[int]) -> torch.Tensor:
        """Commit the cache's pending rows (``fits``; their next tokens in ``tokens``, the sequence's)
        and draft after its root: (nodes,) device tensor of target ids (w.tokens: the next run
        overwrites it, so a caller keeping it across runs clones it)."""
        self._commit_extra(cache, tokens)
        w = self.window(capacity_for(cache.length + self.pending_rows))
        self._replay(w, [cache], [tokens], [0])
        return w.tokens[0]

    @torch.inference_mode()
    def run_batch(self, caches: list, token_lists: list) -> torch.Tensor:
        """``run`` for several sequences (each ``fits``): one replay per group of them (all of them
        where the shared rows hold every cache's bucket) -> (len(caches), nodes), a new tensor."""
        if len(caches) == 1:
            return self.run(caches[0], token_lists[0])[None].clone()
        for cache, tokens in zip(caches, token_lists):
            self._commit_extra(cache, tokens)
        capacity = capacity_for(max(cache.length for cache in caches) + self.pending_rows)
        group = self.max_slots(capacity)
        out = []
        for i in range(0, len(caches), group):
            part, lists = caches[i:i + group], token_lists[i:i + group]
            if len(part) == 1:
                out.append(self.run(part[0], lists[0])[None].clone())
                continue
            w = self.window(capacity, slots_for(len(part)))
            slots = w.assign(part)
            self._replay(w, part, lists, slots)
            if slots == list(range(len(part))):  # (a copy: the next group may replay this same window)
                out.append(w.tokens[:len(part)].clone())
            else:
                out.append(w.tokens.index_select(0, torch.tensor(slots).to(w.tokens.device, non_blocking=True)))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _commit_extra(self, cache, tokens: list[int]) -> None:
        extra = cache.pending.shape[0] - self.pending_rows
        if extra > 0:  # after a prompt: all but the last pending_rows rows eagerly
            cache.commit(self.head, tokens, self.embed, rows=extra)

    def _replay(self, w: Window, caches: list, token_lists: list, slots: list[int]) -> None:
        w.load(caches, token_lists, slots)
        if self.use_graphs and w.graph is None:
            self._record(w)
        if self.use_graphs:
            w.graph.replay()
            self.replays += 1
        else:
            draft_window(self.head, self.plan, w, self.embed)
        w.store(caches, slots)

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
