"""CUDA graphs of the decode step, one per batch-size bucket, captured once at engine load.

A decode step of an 8B model is ~300 small kernel launches; launched from Python they cost
more than the GPU work at small batches. Captured once per bucket and replayed, a step is one
graph launch plus one small host-to-device copy.

How a step runs (``run``): the batch's ids, positions, slots, context lengths and block tables
are written into views of one pinned host staging buffer, copied in one span without blocking
into its device twin (whose views the graphs read), and the graph of the smallest bucket >=
batch size is replayed. Rows past the batch are padding:
slot -1 (the KV write skips it), context length 1 over block 0 (a harmless read), and their
outputs are ignored. Token ids may be placeholders for tokens the previous step sampled and the
host has not seen yet: the graph itself replaces them from the ``sampled_tokens`` ring
(engine/executor/overlap.py), so the next step needs no host round trip. The graph returns the final hidden states.

Small buckets (up to HEAD_GRAPH_MAX_ROWS rows) also get a *head graph* when the runner hands a ``head``
(its LM head: hidden -> float32 logits): the logits and their greedy pick (kernels/sampling.greedy_tokens)
replayed right after the step's graph (``replay_head``), where launched from Python they cost the host
~0.3 ms a step on the H200 (session 29, V2-Lite: LM head 0.18 ms, pick 0.13 ms of host). Its outputs are
static buffers that the next step overwrites: a caller asks for them only where it consumes a step's logits
before its next forward (ModelRunner.forward's ``graph_logits``). Larger buckets keep the eager LM head:
their (bucket, vocab) float32 logits would hold hundreds of MB beside the KV pool.

Invariants: the KV pool tensor is never reallocated after capture (the graphs hold its
address); capture uses ``max_context_len = max_seq_len`` so the attention kernel's grid (its
split count) is valid for every context the engine allows; block tables are at most
``ceil(max_seq_len / tokens_per_block)`` wide.
"""
from __future__ import annotations

import bisect
import collections
import glob
import hashlib
import itertools
import os
import sys

import numpy as np
import torch

import kernels
from engine.executor.overlap import resolve_placeholders
from kernels import choice_cache
from kernels._triton import PDL_ALLOWED, PDL_ENV, pdl_supported, set_pdl
from kernels.attention_metadata import AttentionMetadata
from kernels.linear import graph_capture, replay_time_ms, side_stream
from kernels.lora import LoraBatchBuffers
from kernels.sampling import greedy_tokens
from kernels.triton_attention import MAX_DECODE_SPLITS, decode_active_splits


# "0": DecodeGraphs copy a step's inputs one by one as before their staging buffer (a benchmark's A/B switch)
DECODE_ONE_COPY_ENV = "TRITONLLM_DECODE_ONE_COPY"
# "0": no head graphs (the LM head and the greedy pick launched eagerly after the replay, as before them)
DECODE_HEAD_GRAPH_ENV = "TRITONLLM_DECODE_HEAD_GRAPH"
# Buckets up to this many rows get a head graph: (8, 152k) float32 logits are 4.9 MB.
HEAD_GRAPH_MAX_ROWS = 8


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond: padding stays under ~12%."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 4097, 32))
    return [s for s in sizes if s < max_batch_size] + [max_batch_size]


class DecodeGraphs:
    """Replays captured decode steps of ``model`` over ``kv_cache``.

    model(input_ids, positions, kv_cache, meta) -> hidden (num_tokens, hidden) is the engine's
    model forward; ``kv_cache`` is the runner's pool (num_layers, 2, blocks, block, kv_heads, dim).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, *, tokens_per_block: int,
                 max_seq_len: int, max_batch_size: int, buckets: list[int] | None = None,
                 sampled_tokens: torch.Tensor | None = None, lora_slots: int = 0, taps=None, head=None):
        self.model = model
        # ``head``: hidden (n, hidden) -> float32 logits (n, vocab), captured with the greedy pick for the
        # buckets up to HEAD_GRAPH_MAX_ROWS (module docstring); None: no head graphs.
        self.head = head if os.environ.get(DECODE_HEAD_GRAPH_ENV, "1") != "0" else None
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> (bucket, vocab) float32, the head graph's output
        self.greedy: dict[int, torch.Tensor] = {}  # bucket -> (bucket,) int64, greedy_tokens of those logits
        self.use_head_graphs = True  # (a benchmark's A/B switch: False launches the head eagerly)
        self._last_plain = None  # bucket of the last replay when it was the plain graph (a head graph reads it)
        # engine/executor/layer_taps.py: each graph's tapped streams (its static outputs), by bucket
        self.taps, self.tapped, self.lora_tapped = taps, {}, {}
        # Models with Mamba layers: each row's state slot rides in a static buffer too (-1 on padding
        # rows: the state kernels skip them); engine/executor/state_cache.py.
        self.state_slots = getattr(model, "uses_state_cache", False)
        # LoRA (``lora_slots`` adapter slots): a second graph per bucket runs the adapters, over
        # static segment buffers (kernels/lora.py); steps without adapter rows keep the plain one.
        self.lora_slots = lora_slots
        # The runner's ring of sampled tokens that placeholder ids name; its address is captured.
        self.sampled_tokens = (sampled_tokens if sampled_tokens is not None
                               else torch.zeros(1, dtype=torch.int64, device=kv_cache.device))
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.tokens_per_block = tokens_per_block
        self.max_seq_len = max_seq_len
        self.buckets = sorted(buckets or default_buckets(max_batch_size))
        self.max_batch_size = self.buckets[-1]
        self.max_blocks = -(-max_seq_len // tokens_per_block)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_hidden: dict[int, torch.Tensor] = {}
        self.lora_buffers = (LoraBatchBuffers(self.max_batch_size, min(self.max_batch_size, lora_slots),
                                              kv_cache.device, decode=True) if lora_slots else None)
        # Replays per bucket since load (benchmarks compare them with the decode steps they timed: a step
        # that missed its graph ran eagerly, ~300 launches from Python).
        self.replays: collections.Counter = collections.Counter()
        # $TRITONLLM_DECODE_ONE_COPY=0: a step's inputs go over as before the staging buffer, one copy each
        # (_copy_separately), so that a benchmark can time both ways in one lease; the same values either way.
        self.separate_copies = os.environ.get(DECODE_ONE_COPY_ENV, "1") == "0"
        self._allocate_buffers()

    def _allocate_buffers(self) -> None:
        """One int32 staging buffer on the host (pinned) and its device twin hold every input of a step, each
        input a view of it at its own offset (16-byte aligned), ``host_NAME`` / ``dev_NAME``: the rows' ids,
        positions and slots (``i64``: int64, 3 x n), the context lengths (``ctx``, n), the key splits of decode
        attention (``splits``, 1: kernels/triton_attention.py decode_active_splits; the warm-ups and captures see
        the most, each launch clamps it to its grid's splits), the Mamba state slots (``state_slots``, n: -1
        skips a row) and last the block tables (``tables``, n x max_blocks), so that a step copies one
        contiguous span, up to its bucket's last table row. Why one copy: each copy is a cudaMemcpyAsync and a
        pinned-block event record from Python, and a tensor item write costs as much; at batch 1 the host does
        them while the GPU waits for the step (the encoder-decoder graphs' six copies and two item writes:
        ~0.2 ms of a Whisper step on an H200, engine/encoder_decoder/decode_graphs.py). Rows past a step are
        padding: slot -1 (the KV write skips it), context 1 over block 0, state slot -1."""
        n, dev = self.max_batch_size, self.device
        shapes = {"i64": (6 * n,), "ctx": (n,), "splits": (1,), "state_slots": (n,), "tables": (n, self.max_blocks)}
        offsets, end = staging_offsets(shapes)
        self.host_staging = torch.zeros(end, dtype=torch.int32).pin_memory()  # pinned: the copy does not block
        set_staging_views(self, self.host_staging, "host", shapes, offsets)
        self._tables_at = offsets["tables"]
        self.host_i64[2].fill_(-1)
        self.host_ctx.fill_(1)
        self.host_splits.fill_(MAX_DECODE_SPLITS)
        self.host_state_slots.fill_(-1)
        self.dev_staging = torch.zeros(end, dtype=torch.int32, device=dev)
        self.dev_staging.copy_(self.host_staging)
        set_staging_views(self, self.dev_staging, "dev", shapes, offsets)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.metas: dict[int, AttentionMetadata] = {}
        self._np_i64, self._np_ctx, self._np_tables = self.host_i64.numpy(), self.host_ctx.numpy(), self.host_tables.numpy()
        self._np_splits, self._np_state_slots = self.host_splits.numpy(), self.host_state_slots.numpy()
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _copy_separately(self, bucket: int, splits: int) -> None:
        """A step's inputs as they went before the staging buffer: the key splits by a tensor item write, then
        one copy each of the ids, positions and slots, the bucket's context lengths and tables, the splits and
        (Mamba) the bucket's state slots."""
        self.host_splits[0] = splits
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        for name in ("ctx", "tables") + (("state_slots",) if self.state_slots else ()):
            getattr(self, f"dev_{name}")[:bucket].copy_(getattr(self, f"host_{name}")[:bucket], non_blocking=True)
        self.dev_splits.copy_(self.host_splits, non_blocking=True)

    def _meta(self, bs: int, lora: bool = False) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.dev_i64[2, :bs], block_tables=self.dev_tables[:bs],
            cu_seqlens_q=self.cu_seqlens[:bs + 1], context_lens=self.dev_ctx[:bs],
            max_seqlen_q=1, max_context_len=self.max_seq_len, is_decode_only=True,
            lora=self.lora_buffers.batch(bs) if lora else None,  # this bucket's view: kernels/lora.py
            decode_splits=self.dev_splits,
            state_slots=self.dev_state_slots[:bs] if self.state_slots else None,
        )
        self.metas[bs] = meta  # its decode_split_plan is set when the capture launches attention
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (activations are reused)."""
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            args = (self.dev_i64[0, :bs], self.dev_i64[1, :bs], self.kv_cache, self._meta(bs))
            self.graphs[bs], self.hidden[bs] = capture_forward(self.model, args, self.sampled_tokens, pool)
            if self.taps is not None:
                self.tapped[bs] = self.taps.captured()
            if self.lora_buffers is not None:
                args = args[:3] + (self._meta(bs, lora=True),)
                self.lora_graphs[bs], self.lora_hidden[bs] = capture_forward(self.model, args, self.sampled_tokens, pool)
                if self.taps is not None:
                    self.lora_tapped[bs] = self.taps.captured()
        if self.head is not None:
            try:
                for bs in (b for b in self.buckets if b <= HEAD_GRAPH_MAX_ROWS):
                    self.head_graphs[bs], self.logits[bs], self.greedy[bs] = capture_head(self.head, self.hidden[bs],
                                                                                          pool)
            except Exception as error:  # noqa: BLE001  (a head that cannot be captured stays eager: same logits)
                self.head_graphs, self.logits, self.greedy = {}, {}, {}
                print(f"engine: the decode graphs' LM head stays eager ({type(error).__name__}: {error})",
                      file=sys.stderr, flush=True)
        torch.cuda.synchronize()

    def replay_head(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits (num_seqs, vocab) float32, greedy ids (num_seqs,) int64) of the step just replayed, from its
        bucket's head graph; None where there is none (a larger bucket, a LoRA step, the switch off). Both are
        views of static buffers: the next step overwrites them."""
        bucket = self._last_plain
        if not self.use_head_graphs or bucket not in self.head_graphs or self.bucket_for(num_seqs) != bucket:
            return None
        self.head_graphs[bucket].replay()
        return self.logits[bucket][:num_seqs], self.greedy[bucket][:num_seqs]

    def try_run(self, batch, rotary_positions: list[int] | None = None) -> torch.Tensor | None:
        """A runner ForwardBatch -> hidden rows of its logits_indices, or None when the batch is not
        decode-only or does not fit a bucket (the caller then runs it eagerly). ``rotary_positions``:
        each row's rotary position where it is not its KV position (M-RoPE, engine/executor/mrope_rotary.py);
        the models that take them read positions for rotary only."""
        if not self.fits(batch):
            return None
        num_seqs = len(batch.seq_lens_q)
        hidden = self.run(batch.token_ids, batch.positions, batch.context_lens, batch.block_tables,
                          batch.lora_slots, batch.state_slots, rotary_positions)
        if hidden is None:
            return None
        if len(batch.logits_indices) != num_seqs or batch.logits_indices != list(range(num_seqs)):
            hidden = hidden[torch.tensor(batch.logits_indices, device=hidden.device)]
        return hidden

    def fits(self, batch) -> bool:
        """Whether a runner ForwardBatch replays a graph: decode-only (one token a sequence), at most
        max_batch_size sequences, block tables within the graphs' width, adapters only where LoRA
        graphs were captured. Decided from the plan alone, so every rank that sees it decides alike."""
        num_seqs = len(batch.seq_lens_q)
        if not (0 < num_seqs <= self.max_batch_size and len(batch.token_ids) == num_seqs == len(batch.positions)
                and all(n == 1 for n in batch.seq_lens_q)):
            return False
        if batch.lora_slots is not None and self.lora_buffers is None:
            return False
        if self.state_slots and (batch.state_slots is None or 0 in batch.positions):
            return False  # a 1-token prompt starts from a zero state: the eager path knows it, the graph does not
        return max(map(len, batch.block_tables)) <= self.max_blocks

    def bucket_for(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def run(self, token_ids: list[int], positions: list[int], context_lens: list[int],
            block_tables: list[list[int]], lora_slots: list[int] | None = None,
            state_slots: list[int] | None = None, rotary_positions: list[int] | None = None) -> torch.Tensor | None:
        """One decode step of len(token_ids) sequences -> hidden (num_seqs, hidden), a view that the
        next ``run`` overwrites (consume it, e.g. compute logits, before the next step); None when a
        block table is wider than the graphs allow. ``lora_slots``: each row's adapter slot (-1:
        none), replayed through the LoRA graphs."""
        bs = len(token_ids)
        if max(map(len, block_tables)) > self.max_blocks:
            return None
        bucket = self.bucket_for(bs)
        self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        fill_decode_inputs(self._np_i64, self._np_ctx, self._np_tables, token_ids, positions, context_lens,
                           block_tables, self.tokens_per_block, bucket)
        if rotary_positions is not None:  # after the slots, which the true positions gave
            self._np_i64[1, :bs] = rotary_positions
        plan = self.metas[bucket].decode_split_plan
        splits = MAX_DECODE_SPLITS if plan is None else decode_active_splits(plan, bs, max(context_lens))
        if self.state_slots:
            self._np_state_slots[:bs] = state_slots if state_slots is not None else -1
            self._np_state_slots[bs:bucket] = -1
        if self.separate_copies:
            self._copy_separately(bucket, splits)
        else:  # one contiguous span (a strided pinned source would make torch stage it synchronously)
            self._np_splits[0] = splits
            end = self._tables_at + bucket * self.max_blocks
            self.dev_staging[:end].copy_(self.host_staging[:end], non_blocking=True)
        self._copied.record()
        self.replays[bucket] += 1
        self._last_plain = None if lora_slots is not None else bucket
        if lora_slots is not None:
            self.lora_buffers.fill(lora_slots, [1] * bs)
            self.lora_graphs[bucket].replay()
            if self.taps is not None:
                self.taps.replayed(self.lora_tapped[bucket], bs)
            return self.lora_hidden[bucket][:bs]
        self.graphs[bucket].replay()
        if self.taps is not None:
            self.taps.replayed(self.tapped[bucket], bs)
        return self.hidden[bucket][:bs]


@torch.inference_mode()
def choose_programmatic_launch(model: torch.nn.Module, kv_cache: torch.Tensor, *, tokens_per_block: int,
                               max_seq_len: int, sampled_tokens: torch.Tensor, rounds: int = 3) -> dict:
    """Whether the Triton kernels launch with PDL (kernels/_triton.py), decided by timing: a batch-1
    decode graph captured each way, replayed in turns; PDL stays on when it is at least 1% faster.
    Runs before the engine's graphs are captured (they keep the launch mode they were captured
    with). The timing runs write one token's K/V into block 0 (nothing is cached yet at load).
    Returns the timings (ms per step) and the choice (the runner keeps it as ``launch_choice``)."""
    if not PDL_ALLOWED:
        return {"pdl": False, "reason": f"{PDL_ENV}=0"}
    if not pdl_supported(kv_cache):
        return {"pdl": False, "reason": "not supported here"}
    # The whole decode step is timed: the model's weights (names, shapes, dtypes), the KV pool and every
    # kernel source are in the cache key (kernels/choice_cache.py).
    shapes = hashlib.sha256(repr([type(model).__name__] + [(name, tuple(p.shape), str(p.dtype))
                                                           for name, p in model.named_parameters()]).encode())
    sources = tuple(glob.glob(os.path.join(os.path.dirname(kernels.__file__), "*.py"))) + (__file__,)
    report = choice_cache.timed_report(
        "pdl", (shapes.hexdigest()[:32], tuple(kv_cache.shape), str(kv_cache.dtype), tokens_per_block, max_seq_len,
                rounds), kv_cache.device,
        lambda: _time_programmatic_launch(model, kv_cache, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                                          sampled_tokens=sampled_tokens, rounds=rounds),
        sources=sources, valid=lambda r: isinstance(r["pdl"], bool))
    set_pdl(report["pdl"])
    return report


def _time_programmatic_launch(model: torch.nn.Module, kv_cache: torch.Tensor, *, tokens_per_block: int,
                              max_seq_len: int, sampled_tokens: torch.Tensor, rounds: int) -> dict:
    graphs = {}
    for enabled in (False, True):
        set_pdl(enabled)
        graphs[enabled] = DecodeGraphs(model, kv_cache, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                                       max_batch_size=1, buckets=[1], sampled_tokens=sampled_tokens)
        graphs[enabled].capture()
        graphs[enabled].run([0], [0], [1], [[0]])
    times = {False: [], True: []}
    for _ in range(rounds):
        for enabled, graph in graphs.items():
            times[enabled].append(replay_time_ms(graph.graphs[1], replays=10))
    best = {enabled: min(values) for enabled, values in times.items()}
    chosen = best[True] < 0.99 * best[False]
    set_pdl(chosen)
    del graphs
    return {"pdl": chosen, "step_ms_without": best[False], "step_ms_with": best[True]}


def staging_offsets(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, int], int]:
    """(each input's offset, the total) in int32 elements of a step's staging buffer holding inputs of ``shapes``
    (in int32 elements, in order), each starting 16-byte aligned."""
    offsets, end = {}, 0
    for name, shape in shapes.items():
        offsets[name] = end
        end += -(-int(np.prod(shape)) // 4) * 4
    return offsets, end


def set_staging_views(owner, staging: torch.Tensor, prefix: str, shapes: dict[str, tuple[int, ...]],
                      offsets: dict[str, int]) -> None:
    """owner.PREFIX_NAME: each input's view of the int32 ``staging`` at its offset (staging_offsets), ``i64`` as
    int64 (3, n) (the rows' ids, positions and slots), the others as their shapes."""
    for name, shape in shapes.items():
        view = staging[offsets[name]:offsets[name] + int(np.prod(shape))]
        setattr(owner, f"{prefix}_{name}", view.view(torch.int64).view(3, -1) if name == "i64" else view.view(shape))


def capture_head(head, hidden: torch.Tensor, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A head graph over a decode graph's static ``hidden`` (bucket, hidden): (graph, its float32 logits
    (bucket, vocab), their greedy ids (bucket,) int64), captured into ``pool`` after two warm-up runs on the
    side stream, as capture_forward does."""
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            greedy_tokens(head(hidden))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool=pool, capture_error_mode="thread_local"):
        logits = head(hidden)
        greedy = greedy_tokens(logits)
    return graph, logits, greedy


def capture_forward(model: torch.nn.Module, args: tuple, sampled_tokens: torch.Tensor,
                    pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One forward ``model(input_ids, positions, kv_cache, meta)`` over static buffers, captured
    into ``pool`` after two warm-up runs on a side stream (they compile the Triton kernels for the
    shape and settle the allocator). The graph resolves placeholder ids from ``sampled_tokens``
    itself. Returns (graph, its output hidden states)."""
    stream = side_stream()  # one for every capture (kernels/linear.py says why)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a capture is invalidated only by this thread's unsafe calls, not by another
    # thread of the process (an adapter copy, a kernel loaded, pinned memory freed) in the meantime:
    # a LoRA executor's prefill capture failed so on the H200 (cudaErrorStreamCaptureInvalidated)
    # right after another executor of the same process had closed. graph_capture keeps this thread's
    # GC from destroying dead graphs inside the capture (kernels/linear.py says why).
    with graph_capture(graph, pool=pool, capture_error_mode="thread_local"):
        hidden = model(resolve_placeholders(args[0], sampled_tokens), *args[1:])
    return graph, hidden


# Up to this many rows a plain Python loop packs faster than numpy's vector ops (each numpy call
# costs microseconds; at batch 1 the loop takes ~7 us against ~100 us). Measured on x86, 2026-11-22.
PYTHON_PACKING_MAX_ROWS = 32


def fill_decode_inputs(i64: np.ndarray, ctx: np.ndarray, tables: np.ndarray, token_ids: list[int],
                       positions: list[int], context_lens: list[int], block_tables: list[list[int]],
                       page: int, bucket: int) -> None:
    """Write one decode step into the graphs' host buffers: i64 rows (ids, positions, slots),
    ctx (context lengths), tables (row i's first len(block_tables[i]) columns); rows [bs, bucket)
    become padding (slot -1, context 1, block 0). Columns past a row's length keep stale ids
    that the kernel never reads (it stops at the row's context length)."""
    bs = len(token_ids)
    if bs <= PYTHON_PACKING_MAX_ROWS:
        _fill_rows_python(i64, ctx, tables, token_ids, positions, context_lens, block_tables, page)
    else:
        _fill_rows_numpy(i64, ctx, tables, token_ids, positions, context_lens, block_tables, page)
    i64[2, bs:bucket] = -1
    ctx[bs:bucket] = 1
    tables[bs:bucket, 0] = 0


def _fill_rows_python(i64, ctx, tables, token_ids, positions, context_lens, block_tables, page) -> None:
    ids, pos, slots = i64[0], i64[1], i64[2]
    for row, (token, p, context, table) in enumerate(zip(token_ids, positions, context_lens, block_tables)):
        ids[row], pos[row], ctx[row] = token, p, context
        slots[row] = table[p // page] * page + p % page
        tables[row, :len(table)] = table


def _fill_rows_numpy(i64, ctx, tables, token_ids, positions, context_lens, block_tables, page) -> None:
    bs = len(token_ids)
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=bs)
    width = int(lengths.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    tables[:bs, :width][np.arange(width) < lengths[:, None]] = flat
    ids, pos, slots = i64[0], i64[1], i64[2]
    ids[:bs] = token_ids
    pos[:bs] = positions
    # Slot of each new token: its block (row start + position // page) * page + offset.
    row_starts = np.cumsum(lengths) - lengths
    slots[:bs] = flat[row_starts + pos[:bs] // page].astype(np.int64) * page + pos[:bs] % page
    ctx[:bs] = context_lens


# The warm-up batch's shape where the engine's limits allow it: a WARMUP_CHUNK-token prompt chunk
# over a WARMUP_PREFIX-token cached prefix, and one decode row at position WARMUP_DECODE_POSITION.
WARMUP_PREFIX, WARMUP_CHUNK, WARMUP_DECODE_POSITION = 5, 37, 8


def warmup_batch_shape(max_seq_len: int, max_num_tokens: int) -> tuple[int, int, int] | None:
    """(prefix, chunk, decode position) of run_warmup_batch's batch within an engine's limits, or None
    where no mixed batch fits (max_seq_len < 2 or max_num_tokens < 3).

    Invariants: every position < max_seq_len (the rotary table and learned position tables have
    max_seq_len rows: a position past them is an out-of-bounds read on CUDA, the illegal memory access
    of a draft engine built with max_seq_len 32), chunk + 1 <= max_num_tokens (the most tokens a step
    of this engine holds), chunk >= 2 (a prompt chunk, so the prefill tiles run)."""
    prefix = min(WARMUP_PREFIX, max_seq_len - 2)
    chunk = min(WARMUP_CHUNK, max_seq_len - prefix, max_num_tokens - 1)
    if prefix < 0 or chunk < 2:
        return None
    return prefix, chunk, min(WARMUP_DECODE_POSITION, max_seq_len - 1)


@torch.inference_mode()
def run_warmup_batch(model: torch.nn.Module, kv_cache: torch.Tensor, tokens_per_block: int, *,
                     max_seq_len: int, max_num_tokens: int) -> None:
    """One eager mixed batch through ``model`` so its prefill-path Triton kernels compile now:
    a prompt chunk over a cached prefix and one decode row (warmup_batch_shape: within the engine's
    max_seq_len and max_num_tokens); every KV write is skipped (slot -1) and the reads stay in
    block 0, so the pool's contents do not matter."""
    shape = warmup_batch_shape(max_seq_len, max_num_tokens)
    if shape is None:
        return
    prefix, chunk, decode_position = shape
    device = kv_cache.device
    num_tokens = chunk + 1
    contexts = [prefix + chunk, decode_position + 1]
    width = -(-max(contexts) // tokens_per_block)  # both rows' tables cover their contexts (all block 0)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(2, width, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, chunk, num_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        max_seqlen_q=chunk, max_context_len=max(contexts), is_decode_only=False,
        cu_seqlens_q_host=[0, chunk, num_tokens], context_lens_host=contexts,
    )
    positions = torch.tensor(list(range(prefix, prefix + chunk)) + [decode_position], dtype=torch.int64, device=device)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, kv_cache, meta)
    model.compute_logits(hidden[-2:])
    if device.type == "cuda":  # (CPU: tests run the batch through the torch references)
        torch.cuda.synchronize(device)

