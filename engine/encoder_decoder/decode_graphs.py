"""CUDA graphs of an encoder-decoder's decode steps: one per batch-size bucket, captured at engine load.

The decoder-only runner's graphs (engine/executor/cuda_graphs.py) hold a step's ids, positions,
slots, context lengths and self-attention block tables in static buffers. A decoder step also
reads each row's cross K/V from the cross pool, so here two more static buffers ride along: each
row's cross block table (``max_cross_blocks`` = ceil(max_encoder_input_len / tokens_per_block)
columns) and its encoder length, and the captured cross-attention metadata views them. Rows past
the batch are padding: slot -1 (no self KV write), self context 1 over block 0, cross length 1
over cross block 0 (harmless reads); their outputs are ignored.

Each bucket's forward is ``decoder(ids, positions, kv_cache, meta, cross=...)`` over views of
those buffers (``bucket_forward``). On CUDA it is captured once (``capture``) and replayed; on
any device ``run`` without a capture calls it eagerly over the same buffers (the step's own rows,
no padding), which is how the CPU tests check the static-buffer bookkeeping (tables, slots,
placeholders, rows left from a larger step) against the packed eager step.

Invariants: neither pool is reallocated after capture (the graphs hold their addresses); the
self metadata is captured at ``max_context_len = max_seq_len`` and the cross metadata at
``max_encoder_input_len``, so the attention grids (their key splits) are valid for every step;
the split counts a replay uses are written by the host before it (decode_active_splits), for the
self and the cross attention apart.
"""
from __future__ import annotations

import bisect

import numpy as np
import torch

from engine.encoder_decoder.model import CrossAttentionBatch
from engine.executor.cuda_graphs import (capture_forward, default_buckets, fill_decode_inputs, set_staging_views,
                                         staging_offsets)
from engine.executor.overlap import resolve_placeholders
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_attention import MAX_DECODE_SPLITS, decode_active_splits


def fill_cross_rows(tables: np.ndarray, lengths: np.ndarray, block_tables: list[list[int]],
                    encoder_lengths: list[int], bucket: int) -> None:
    """Rows [0, bs) of the host cross buffers from the step's cross tables and encoder lengths;
    rows [bs, bucket) become padding (length 1, block 0). Columns past a row's table keep stale
    ids the kernel never reads (it stops at the row's length)."""
    bs = len(block_tables)
    for row, table in enumerate(block_tables):
        tables[row, :len(table)] = table
    lengths[:bs] = encoder_lengths
    lengths[bs:bucket] = 1
    tables[bs:bucket, 0] = 0


class EncDecDecodeGraphs:
    """Decode steps of ``decoder`` (engine/encoder_decoder/model.py Decoder) over the self pool
    ``kv_cache`` and the cross pool ``cross_pool``, both (layers, 2, blocks, block, heads, dim)."""

    def __init__(self, decoder: torch.nn.Module, kv_cache: torch.Tensor, cross_pool: torch.Tensor, *,
                 tokens_per_block: int, max_seq_len: int, max_encoder_len: int, max_batch_size: int,
                 sampled_tokens: torch.Tensor, buckets: list[int] | None = None):
        self.decoder, self.kv_cache, self.cross_pool = decoder, kv_cache, cross_pool
        self.sampled_tokens = sampled_tokens
        self.device = kv_cache.device
        self.tokens_per_block = tokens_per_block
        self.max_seq_len, self.max_encoder_len = max_seq_len, max_encoder_len
        self.buckets = sorted(buckets or default_buckets(max_batch_size))
        self.max_batch_size = self.buckets[-1]
        self.max_blocks = -(-max_seq_len // tokens_per_block)
        self.max_cross_blocks = -(-max_encoder_len // tokens_per_block)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.metas: dict[int, tuple[AttentionMetadata, AttentionMetadata]] = {}
        self._allocate_buffers()

    def _allocate_buffers(self) -> None:
        """One int32 staging buffer on the host (pinned on CUDA) and its device twin hold every input of a step,
        each input a view at its own offset (16-byte aligned): the rows' ids, positions and self slots (int64,
        3 x n), the self context lengths and block tables, the key splits of the self and the cross attention,
        the cross lengths, then the cross block tables (last: a step copies up to its bucket's rows of them).
        So a step's inputs go over in ONE copy: six copies (each a cudaMemcpyAsync and a pinned-block event
        record from Python) and two tensor item writes took ~0.2 ms of host time before each batch-1 replay, the
        GPU idle meanwhile (Whisper large-v3 on an H200, 2026-11-30: 210 us of a 1.94 ms step)."""
        n, dev, cuda = self.max_batch_size, self.device, self.device.type == "cuda"
        shapes = {"i64": (6 * n,), "ctx": (n,), "tables": (n, self.max_blocks), "splits": (2,),
                  "cross_lens": (n,), "cross_tables": (n, self.max_cross_blocks)}
        offsets, end = staging_offsets(shapes)
        self.host_staging = torch.zeros(end, dtype=torch.int32)
        if cuda:  # pinned: the copy does not block
            self.host_staging = self.host_staging.pin_memory()
        self.dev_staging = self.host_staging.to(dev)  # (on CPU: the same tensor)
        self._cross_tables_at = offsets["cross_tables"]
        set_staging_views(self, self.host_staging, "host", shapes, offsets)
        set_staging_views(self, self.dev_staging, "dev", shapes, offsets)
        # Rows past a step: padding (slot -1, context and cross length 1); splits: the most until a step says.
        self.host_i64[2].fill_(-1)
        self.host_ctx.fill_(1)
        self.host_cross_lens.fill_(1)
        self.host_splits.fill_(MAX_DECODE_SPLITS)
        self.dev_staging.copy_(self.host_staging)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._np = {name: getattr(self, f"host_{name}").numpy()
                    for name in ("i64", "ctx", "tables", "splits", "cross_lens", "cross_tables")}
        self._copied = torch.cuda.Event() if cuda else None
        if cuda:
            self._copied.record()

    def _metas(self, bs: int) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(self, cross) metadata of bucket ``bs``: views of the static buffers."""
        if bs not in self.metas:
            common = dict(cu_seqlens_q=self.cu_seqlens[:bs + 1], max_seqlen_q=1, is_decode_only=True)
            self_meta = AttentionMetadata(slot_mapping=self.dev_i64[2, :bs], block_tables=self.dev_tables[:bs],
                                          context_lens=self.dev_ctx[:bs], max_context_len=self.max_seq_len,
                                          decode_splits=self.dev_splits[0:1], **common)
            cross_meta = AttentionMetadata(slot_mapping=self.dev_i64[2, :0], block_tables=self.dev_cross_tables[:bs],
                                           context_lens=self.dev_cross_lens[:bs], max_context_len=self.max_encoder_len,
                                           decode_splits=self.dev_splits[1:2], **common)
            self.metas[bs] = (self_meta, cross_meta)
        return self.metas[bs]

    def bucket_forward(self, bs: int):
        """(forward, args) of bucket ``bs``: forward(*args) is the decoder over the static buffers,
        args as capture_forward takes them (ids first: placeholders resolved inside the graph)."""
        self_meta, cross_meta = self._metas(bs)
        cross = CrossAttentionBatch(self.cross_pool, cross_meta)

        def forward(ids, positions, kv_cache, meta):
            return self.decoder(ids, positions, kv_cache, meta, cross=cross)

        return forward, (self.dev_i64[0, :bs], self.dev_i64[1, :bs], self.kv_cache, self_meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool. CUDA only."""
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            forward, args = self.bucket_forward(bs)
            self.graphs[bs], self.hidden[bs] = capture_forward(forward, args, self.sampled_tokens, pool)
        torch.cuda.synchronize(self.device)

    def bucket_for(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def try_run(self, batch) -> torch.Tensor | None:
        """A runner ForwardBatch -> hidden rows of its logits_indices (a view the next call
        overwrites), or None when it is not a decode-only batch these buffers hold (the caller
        then runs it eagerly)."""
        bs = len(batch.seq_lens_q)
        if not (0 < bs <= self.max_batch_size and len(batch.token_ids) == bs and all(n == 1 for n in batch.seq_lens_q)
                and batch.cross_lengths is not None and batch.lora_slots is None):
            return None
        if (max(map(len, batch.block_tables)) > self.max_blocks
                or max(map(len, batch.cross_block_tables)) > self.max_cross_blocks):
            return None
        hidden = self.run(batch.token_ids, batch.positions, batch.context_lens, batch.block_tables,
                          batch.cross_block_tables, batch.cross_lengths)
        if batch.logits_indices != list(range(bs)):
            hidden = hidden[torch.tensor(batch.logits_indices, device=hidden.device)]
        return hidden

    def run(self, token_ids: list[int], positions: list[int], context_lens: list[int], block_tables: list[list[int]],
            cross_tables: list[list[int]], cross_lengths: list[int]) -> torch.Tensor:
        """One decode step of len(token_ids) rows -> hidden (rows, d_model): replayed from its
        bucket's graph when captured, else the bucket's forward run eagerly over the buffers."""
        bs = len(token_ids)
        # Eagerly (nothing captured) the step runs its own rows only: the torch reference's KV write
        # does not skip a padding row's slot -1 as the Triton kernel does.
        bucket = self.bucket_for(bs) if self.graphs else bs
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        np_ = self._np
        fill_decode_inputs(np_["i64"], np_["ctx"], np_["tables"], token_ids, positions, context_lens, block_tables,
                           self.tokens_per_block, bucket)
        fill_cross_rows(np_["cross_tables"], np_["cross_lens"], cross_tables, cross_lengths, bucket)
        self_meta, cross_meta = self._metas(bucket)
        for index, (meta, longest) in enumerate(((self_meta, max(context_lens)), (cross_meta, max(cross_lengths)))):
            plan = meta.decode_split_plan
            np_["splits"][index] = MAX_DECODE_SPLITS if plan is None else decode_active_splits(plan, bs, longest)
        # One copy (_allocate_buffers): everything up to the bucket's last cross table row, a contiguous span (a
        # strided pinned source would make torch stage it synchronously).
        end = self._cross_tables_at + bucket * self.max_cross_blocks
        self.dev_staging[:end].copy_(self.host_staging[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.hidden[bucket][:bs]
        forward, args = self.bucket_forward(bucket)
        with torch.inference_mode():
            return forward(resolve_placeholders(args[0], self.sampled_tokens), *args[1:])[:bs]
