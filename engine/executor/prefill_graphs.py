"""CUDA graphs of mixed steps (prompt tokens, with or without decode rows), one per token bucket.

Why: a step that carries prompt tokens used to run eagerly, ~12 kernel launches per layer from
Python. On the H100 host that cost 15-25 ms of CPU per step for SmolLM2 (30 layers), whatever
the number of tokens, while the GPU work of a few hundred prompt tokens is a few milliseconds;
every decoding stream of the batch waits for that step, and so does each new request's first
token. Captured once per token-count bucket and replayed, such a step costs a graph launch and two
host-to-device copies (its bucket's inputs, its table rows: _allocate_buffers).

How a step runs (``try_run``): the batch is padded to the smallest bucket >= its token count.
Padding tokens have id 0, position 0 and slot -1 (the KV write skips them); their outputs are
ignored. The sequence arrays (cu_seqlens, context lengths, block tables) always have
``max_batch_size`` rows, and the attention grid is fixed by a tile map (kernels/triton_attention.py):
program p runs the query tile the map names, built on the host from the batch's real sequences,
and programs past them return at once. Token ids may be placeholders for tokens the previous step
sampled; the graph resolves them itself, as the decode graphs do (engine/executor/overlap.py).

Token trees (tree verification, engine/executor/tree_batch.py): with ``tree_width`` W > 0 (the
executor runs a tree method whose rows carry at most W tokens; the buckets then include W, 2W, 3W and 4W
tokens: tree_step_buckets), every bucket up to max_batch_size x W
tokens has a twin graph whose attention reads a static (tokens, W) int8 ancestor mask
(AttentionMetadata.tree_mask); a tree step replays it when no sequence of the step has more than W
new tokens, its positions being the nodes' rotary positions and its KV slots consecutive. So a tree
verify step of a bucket's tokens costs what a chain verify step of as many tokens costs.

Prompt tables and M-RoPE (vision-language engines): with ``table`` (engine/executor/table_graphs.py),
every bucket has a twin graph whose forward splices the step's table rows from static buffers and
rotates at each token's row of a static rotary table; a step with image rows, M-RoPE prompt rows or
M-RoPE decode rows (position + delta) replays it. Steps whose images attend both ways (Gemma 3's
span_ahead) stay eager.

LoRA: with ``lora_slots`` adapter slots, every bucket has a twin graph that runs the adapters over
static segment buffers (kernels/lora.py LoraBatchBuffers, at most min(max_batch_size, slots)
segments); a step with adapter rows replays the twin.

Invariants: the KV pool tensor is never reallocated after capture; block tables are at most
``ceil(max_seq_len / tokens_per_block)`` wide; a bucket of T tokens has ``cdiv(T,
tokens_per_tile) + min(max_batch_size, T)`` tile-map entries, enough for any batch of at most T tokens in
at most max_batch_size sequences (each sequence wastes at most one partial tile; at most T have tokens).
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from engine.executor import tree_batch
from engine.executor.cuda_graphs import capture_forward
from kernels.attention_metadata import AttentionMetadata, pack_tree_mask_numpy
from kernels.lora import LoraBatchBuffers


def token_buckets(max_num_tokens: int) -> list[int]:
    """16, 32, 64, 128, 192, then eight steps per doubling from 256 (256, 288, ..., 480, 512, 576,
    ...): a step pads at most an eighth of its tokens. Padding is paid in GPU time, which decides a
    large model's big prefill steps (an 8B model's padding tokens cost as much as Python's launches);
    the largest bucket is max_num_tokens. The 16- and 32-token buckets are for speculative verify
    steps (k + 1 tokens a drafted row): up to 16 rows the linear layers take the skinny decode
    kernels, which at batch 1 read an FP8 8B model's weights in ~3.5 ms where the 64-row bucket's
    cuBLASLt GEMMs took ~5.6 (H100, benchmarks/results/speculative.md "Speculative decoding")."""
    sizes, power = [16, 32, 64, 128, 192], 256
    while power < max_num_tokens:
        sizes += [power + i * power // 8 for i in range(8)]
        power *= 2
    return [size for size in sizes if size < max_num_tokens] + [max_num_tokens]


# Tree verify steps of up to this many rows get buckets of exactly rows x tree width tokens (tree_step_buckets)
EXACT_TREE_ROWS = 4


def tree_step_buckets(buckets: list[int], tree_width: int) -> list[int]:
    """``buckets`` and, for a tree method whose rows carry ``tree_width`` W tokens, W, 2W, ... EXACT_TREE_ROWS x W
    (those under the largest bucket). Why: below 256 the buckets double, so a 64-node tree's 65 tokens at batch 1
    padded to 128 and its verify step cost 1.50x a decode step instead of 1.28x (Llama-3.1-8B shape, H200,
    2026-11-30: tree_bench's 1.28x had max_num_tokens 65, a bucket of its own). From 256 up the buckets are at
    most an eighth apart, which bounds the padding of larger tree steps."""
    if not tree_width:
        return list(buckets)
    exact = {tree_width * rows for rows in range(1, EXACT_TREE_ROWS + 1) if tree_width * rows < buckets[-1]}
    return sorted(set(buckets) | exact)


def model_token_buckets(model, max_num_tokens: int) -> list[int]:
    """token_buckets, cut at the model's ``prefill_graph_max_tokens`` where it has one (DeepSeek: the
    steps whose attention would take the absorbed form eagerly too); [] when none is left."""
    cap = getattr(model, "prefill_graph_max_tokens", None)
    return [b for b in token_buckets(max_num_tokens) if cap is None or b <= cap]


def tile_map(seq_lens_q: list[int], tokens_per_tile: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_m), each (length,) int32: one entry per query tile of each sequence with new
    tokens, in order; the rest tile_seq -1 (no work)."""
    q_lens = np.asarray(seq_lens_q, dtype=np.int64)
    tiles = -(-q_lens // tokens_per_tile)
    total = int(tiles.sum())
    if total > length:
        raise ValueError(f"{total} query tiles do not fit a tile map of {length}")
    tile_seq = np.full(length, -1, dtype=np.int32)
    tile_m = np.zeros(length, dtype=np.int32)
    tile_seq[:total] = np.repeat(np.arange(len(q_lens)), tiles)
    tile_m[:total] = np.arange(total) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    return tile_seq, tile_m


class PrefillGraphs:
    """Replays captured mixed steps of ``model`` over ``kv_cache`` (DecodeGraphs' model contract)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, *, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, max_num_tokens: int, tokens_per_tile: int,
                 sampled_tokens: torch.Tensor | None = None, buckets: list[int] | None = None, lora_slots: int = 0,
                 taps=None, tree_width: int = 0, table=None):
        self.model = model
        self.table = table  # TableStepBuffers, or None: steps with table / M-RoPE rows run eagerly
        self.table_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.table_hidden: dict[int, torch.Tensor] = {}
        self.taps = taps  # engine/executor/layer_taps.py: each graph's tapped streams, by graph key
        self.tapped: dict[tuple, list[torch.Tensor]] = {}
        self.lora_slots = lora_slots
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sampled_tokens = (sampled_tokens if sampled_tokens is not None
                               else torch.zeros(1, dtype=torch.int64, device=kv_cache.device))
        self.tokens_per_block = tokens_per_block
        self.tokens_per_tile = tokens_per_tile
        self.max_seq_len = max_seq_len
        self.max_seqs = max_batch_size
        self.max_blocks = -(-max_seq_len // tokens_per_block)
        self.buckets = tree_step_buckets(sorted(buckets or token_buckets(max_num_tokens)), tree_width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_hidden: dict[int, torch.Tensor] = {}
        self.lora_buffers = (LoraBatchBuffers(self.buckets[-1], min(max_batch_size, lora_slots), kv_cache.device,
                                              decode=True) if lora_slots else None)
        self.tree_width = tree_width
        tree_tokens = min(max_batch_size * tree_width, self.buckets[-1])
        self.tree_buckets = [b for b in self.buckets if tree_width and b <= self.bucket_for(tree_tokens)]
        self.tree_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tree_hidden: dict[int, torch.Tensor] = {}
        self._allocate_buffers()

    def num_tiles(self, bucket: int) -> int:
        # A bucket of T tokens holds at most T sequences with new tokens, each wasting at most one partial tile.
        return -(-bucket // self.tokens_per_tile) + min(self.max_seqs, bucket)

    def _allocate_buffers(self) -> None:
        """The graphs' static inputs: views of one pinned host staging buffer (bytes) and of its device twin, at
        16-byte-aligned offsets. Each bucket of T tokens has a region of its own (``BucketInputs``): the sequence
        rows ``seq`` (2, max_batch_size + 1) int32 (cu_seqlens, context lengths), ``i64`` (3, T) int64 (ids,
        positions, slots; rows 16-byte aligned), the tile map ``tiles`` (2, num_tiles(T)) int32 (tile_seq,
        tile_m), the scored rows ``rows`` (T,) int64 (the gather after the replay) and, for a tree bucket, the
        ancestor mask ``tree`` (T, W) int8 and its bits ``tree_bits`` (T, cdiv(W, 32)) int32; after every region,
        the block tables ``tables`` (max_batch_size, max_blocks) int32 that all buckets share. So a step copies
        two contiguous spans: its bucket's region and its sequences' table rows. Why: it made four to seven
        copies, two of them strided (i64[:, :T] and the tile map's two rows), which torch stages through a
        pageable temporary copied synchronously, each copy a cudaMemcpyAsync and a pinned-block event record from
        Python (the decode graphs' copies: engine/executor/cuda_graphs.py). A region holds only its bucket's
        steps, as the shared buffers did every step's: whatever a step leaves unwritten (columns past a table or
        mask width, sequence rows past the batch) is what an earlier step of the bucket wrote there, or the
        initial values (slots and tiles -1: no KV write, no tile of work; zeros elsewhere). Extra memory: the
        regions of ~45 token buckets to 8,192 tokens hold ~100k tokens' rows, ~3.6 MB pinned and as much on the
        device."""
        seqs, dev = self.max_seqs, self.device
        width, words = max(self.tree_width, 1), -(-max(self.tree_width, 1) // 32)
        layouts, end = {}, 0

        def place(shape: tuple, dtype: torch.dtype) -> tuple:
            nonlocal end
            at = end
            end += -(-int(np.prod(shape)) * dtype.itemsize // 16) * 16
            return at, shape, dtype

        for bucket in self.buckets:
            start, tree_rows = end, bucket if bucket in self.tree_buckets else 0
            layouts[bucket] = start, {
                "seq": place((2, seqs + 1), torch.int32), "i64": place((3, -(-bucket // 2) * 2), torch.int64),
                "tiles": place((2, self.num_tiles(bucket)), torch.int32), "rows": place((bucket,), torch.int64),
                "tree": place((tree_rows, width), torch.int8), "tree_bits": place((tree_rows, words), torch.int32)}
            layouts[bucket] += (end,)
        tables = place((seqs, self.max_blocks), torch.int32)
        self.host_staging = torch.zeros(end, dtype=torch.uint8).pin_memory()  # pinned: the copies do not block
        self.dev_staging = torch.zeros(end, dtype=torch.uint8, device=dev)
        self.inputs = {bucket: BucketInputs(self.host_staging, self.dev_staging, start, stop, views, bucket)
                       for bucket, (start, views, stop) in layouts.items()}
        self.host_tables, self.dev_tables = (_view(staging, *tables)
                                             for staging in (self.host_staging, self.dev_staging))
        self._np_tables = self.host_tables.numpy()
        self._tables_at, self._table_row_bytes = tables[0], self.max_blocks * 4
        for inputs in self.inputs.values():  # idle until a step: no KV write (slot -1), no tile of work (-1)
            inputs.host_i64[2].fill_(-1)
            inputs.host_tiles.fill_(-1)
        self.dev_staging.copy_(self.host_staging)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _meta(self, bucket: int, lora: bool = False, tree: bool = False) -> AttentionMetadata:
        inputs = self.inputs[bucket]
        meta = AttentionMetadata(
            slot_mapping=inputs.dev_i64[2], block_tables=self.dev_tables,
            cu_seqlens_q=inputs.dev_seq[0], context_lens=inputs.dev_seq[1, :self.max_seqs],
            max_seqlen_q=bucket, max_context_len=self.max_seq_len, is_decode_only=False,
            tile_seq=inputs.dev_tiles[0], tile_m=inputs.dev_tiles[1], tile_tokens=self.tokens_per_tile,
            lora=self.lora_buffers.batch(bucket) if lora else None,  # this bucket's view: kernels/lora.py
        )
        if tree:  # int8 already, so the kernel wrapper's .to(torch.int8) is this buffer itself
            meta.tree_mask = inputs.dev_tree
            meta.tree_bits = inputs.dev_tree_bits
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. While capturing, the tile
        map is empty and every slot -1, so the warm-up runs neither read nor write the pool."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            inputs = self.inputs[bucket]
            args = (inputs.dev_i64[0], inputs.dev_i64[1], self.kv_cache, self._meta(bucket))
            self.graphs[bucket], self.hidden[bucket] = capture_forward(self.model, args, self.sampled_tokens, pool)
            self._keep_taps("plain", bucket)
            if self.lora_buffers is not None:
                args = args[:3] + (self._meta(bucket, lora=True),)
                self.lora_graphs[bucket], self.lora_hidden[bucket] = capture_forward(
                    self.model, args, self.sampled_tokens, pool)
                self._keep_taps("lora", bucket)
            if self.table is not None:
                self.table_graphs[bucket], self.table_hidden[bucket] = capture_forward(
                    self.table.forward(self.model, bucket), args[:3] + (self._meta(bucket),), self.sampled_tokens, pool)
                self._keep_taps("table", bucket)
            if bucket in self.tree_buckets:
                args = args[:3] + (self._meta(bucket, tree=True),)
                self.tree_graphs[bucket], self.tree_hidden[bucket] = capture_forward(
                    self.model, args, self.sampled_tokens, pool)
                self._keep_taps("tree", bucket)
        torch.cuda.synchronize()

    def _keep_taps(self, kind: str, bucket: int) -> None:
        if self.taps is not None:
            self.tapped[kind, bucket] = self.taps.captured()

    def bucket_for(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def fits(self, batch, prompt_embeds=None, rotary=None) -> bool:
        """Whether try_run replays a graph for this batch: it has prompt tokens, fits a token bucket,
        max_batch_size sequences and the graphs' block-table width, and has the twin its adapters, table
        rows or token trees need. Decided before any buffer is touched."""
        num_tokens, num_seqs = len(batch.token_ids), len(batch.seq_lens_q)
        if (num_tokens == 0 or num_tokens > self.buckets[-1] or num_seqs > self.max_seqs
                or num_tokens == num_seqs or max(map(len, batch.block_tables)) > self.max_blocks
                or (batch.lora_slots is not None and self.lora_buffers is None)):
            return False
        if (prompt_embeds is not None or rotary is not None) and (
                self.table is None or not self.table.fits(rotary) or batch.lora_slots is not None
                or batch.tree_parents is not None):
            return False
        if batch.tree_parents is not None and (
                batch.lora_slots is not None or not self.tree_buckets or num_tokens > self.tree_buckets[-1]
                or max(batch.seq_lens_q) > self.tree_width):
            return False  # (eager: the reference or the Triton kernel with a mask of this step's width)
        return True

    def try_run(self, batch, prompt_embeds=None, rotary=None) -> torch.Tensor | None:
        """A runner ForwardBatch with prompt tokens -> hidden rows of its logits_indices; None when
        the batch is decode-only (the decode graphs' job) or does not fit (the caller runs it eagerly).
        ``prompt_embeds`` (indexed PromptEmbeds), ``rotary`` (mrope_rotary.StepRotary): the step's table
        and M-RoPE rows, for the table twins."""
        if not self.fits(batch, prompt_embeds, rotary):
            return None
        num_tokens, num_seqs = len(batch.token_ids), len(batch.seq_lens_q)
        tabled = prompt_embeds is not None or rotary is not None
        tree = batch.tree_parents is not None
        bucket = self.bucket_for(num_tokens)
        inputs = self.inputs[bucket]
        self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        self._fill(batch, inputs, bucket)
        if tabled:
            self.table.fill_host(inputs.np_i64[0, :num_tokens], inputs.np_i64[1, :num_tokens], rotary)
        num_rows = len(batch.logits_indices)  # (<= num_tokens: one row per scored token)
        inputs.np_rows[:num_rows] = batch.logits_indices
        # Two contiguous spans (_allocate_buffers): the bucket's region, the step's table rows.
        self.dev_staging[inputs.start:inputs.end].copy_(self.host_staging[inputs.start:inputs.end], non_blocking=True)
        tables_end = self._tables_at + num_seqs * self._table_row_bytes
        self.dev_staging[self._tables_at:tables_end].copy_(self.host_staging[self._tables_at:tables_end],
                                                          non_blocking=True)
        if tabled:  # (its pinned staging is covered by the event too)
            self.table.fill_device(prompt_embeds, rotary, bucket)
        self._copied.record()
        if tabled:
            kind, graph, hidden = "table", self.table_graphs[bucket], self.table_hidden[bucket]
        elif tree:
            kind, graph, hidden = "tree", self.tree_graphs[bucket], self.tree_hidden[bucket]
        elif batch.lora_slots is not None:
            self.lora_buffers.fill(batch.lora_slots, batch.seq_lens_q)
            kind, graph, hidden = "lora", self.lora_graphs[bucket], self.lora_hidden[bucket]
        else:
            kind, graph, hidden = "plain", self.graphs[bucket], self.hidden[bucket]
        graph.replay()
        if self.taps is not None:
            self.taps.replayed(self.tapped[kind, bucket], num_tokens)
        return hidden[inputs.dev_rows[:num_rows]]  # (read in stream order, before the next step's copy)

    def _fill(self, batch, inputs: "BucketInputs", bucket: int) -> None:
        """The batch into the host views of its bucket's ``inputs`` and the shared tables; tokens [n, bucket)
        become padding (slot -1)."""
        n, page = len(batch.token_ids), self.tokens_per_block
        i64, tables = inputs.np_i64, self._np_tables
        for row, table in enumerate(batch.block_tables):
            tables[row, :len(table)] = table
        q_lens = np.asarray(batch.seq_lens_q, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.asarray(batch.positions, dtype=np.int64)
        slots = positions  # a tree's tokens: rotary positions by depth, KV slots consecutive (tree_batch.py)
        if batch.tree_parents is not None:
            slots = np.asarray(tree_batch.slot_positions(batch.positions, batch.seq_lens_q, batch.context_lens,
                                                         batch.tree_parents), dtype=np.int64)
            mask = tree_batch.tree_mask(batch.seq_lens_q, batch.tree_parents)
            inputs.host_tree[:n, :mask.shape[1]] = mask.to(torch.int8)
            bits = pack_tree_mask_numpy(mask.numpy())
            inputs.np_tree_bits[:n, :bits.shape[1]] = bits
        i64[0, :n] = batch.token_ids
        i64[1, :n] = positions
        i64[2, :n] = tables[seq_of_token, slots // page].astype(np.int64) * page + slots % page
        i64[0, n:bucket] = 0
        i64[1, n:bucket] = 0
        i64[2, n:bucket] = -1
        cu = inputs.np_seq[0]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:len(q_lens) + 1])
        cu[len(q_lens) + 1:] = cu[len(q_lens)]  # sequences past the batch: no new tokens
        inputs.np_seq[1, :len(q_lens)] = batch.context_lens
        tile_seq, tile_m = tile_map(batch.seq_lens_q, self.tokens_per_tile, self.num_tiles(bucket))
        inputs.np_tiles[0, :len(tile_seq)] = tile_seq
        inputs.np_tiles[1, :len(tile_m)] = tile_m


def _view(staging: torch.Tensor, at: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` tensor of ``dtype`` at byte ``at`` of a uint8 staging buffer (``at`` 16-byte aligned)."""
    return staging[at:at + int(np.prod(shape)) * dtype.itemsize].view(dtype).view(shape)


class BucketInputs:
    """One token bucket's region of PrefillGraphs' staging: bytes [start, end) of the host and device buffers,
    and in it ``host_NAME`` / ``dev_NAME`` views (``np_NAME``: the host view as numpy) of seq, i64, tiles, rows,
    tree and tree_bits (shapes in PrefillGraphs._allocate_buffers). i64's rows are ``bucket`` long in a row stride
    rounded up to even, so that each row (the graph's ids, positions and slots) starts 16-byte aligned, as in the
    shared buffers of before, also for the odd tree buckets (9, 27 tokens)."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor, start: int, end: int, views: dict, bucket: int):
        self.start, self.end = start, end
        for name, placed in views.items():
            for prefix, staging in (("host", host), ("dev", dev)):
                view = _view(staging, *placed)
                setattr(self, f"{prefix}_{name}", view[:, :bucket] if name == "i64" else view)
            setattr(self, f"np_{name}", getattr(self, f"host_{name}").numpy())
