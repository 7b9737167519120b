"""T5's relative position bias: bucketed key-minus-query distances, a learned logit per bucket and head.

T5 adds to every attention score a learned scalar ``table[bucket(k - q), head]`` (``table``:
(num_buckets, num_heads)) instead of using absolute positions; it does not scale the scores. The
bucket of a distance d (key position minus query position):

- bidirectional (the encoder): half the buckets are for d > 0 (offset by num_buckets / 2), the
  other half for d <= 0; then |d| is bucketed in the remaining n buckets;
- causal (the decoder): only d <= 0 occurs; -d is bucketed in all n = num_buckets buckets;

and within n buckets, distances below n / 2 get a bucket each, larger ones share logarithmically
sized buckets up to ``max_distance``, beyond which everything lands in bucket n - 1.

Plain torch: the bias depends only on the two positions, so one (heads, q, k) float32 block per
sequence is computed and added to the scores; ``paged_attention_bias_ref`` is the decoder's
causal attention over the paged KV pool with it (kernels/attention.py's reference, which adds
it); ``decode_attention_bias`` (steps whose every sequence has one new token) runs the same math
batched, reading only device tensors at shapes fixed by the metadata's block-table width, so a CUDA
graph can capture it. On CUDA the Triton kernels of kernels/t5_bias_attention.py run instead
(engine/encoder_decoder/t5_attention.py; these stay the CPU path and the kernels' oracle).
"""
from __future__ import annotations

import math

import torch

from kernels.attention import gather_blocks, paged_attention_ref
from kernels.attention_metadata import AttentionMetadata


def relative_position_bucket(distance: torch.Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """int64 bucket of each key-minus-query ``distance`` (any shape), as described above."""
    distance = distance.long()
    buckets = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        buckets += (distance > 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = (-distance).clamp(min=0)
    exact = num_buckets // 2
    # log-spaced buckets from `exact` up to max_distance (distance 0 is guarded: it is exact anyway)
    far = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


def position_bias(table: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, *,
                  bidirectional: bool, max_distance: int) -> torch.Tensor:
    """(num_heads, num_queries, num_keys) float32 bias of ``table`` (num_buckets, num_heads)."""
    distance = key_positions.view(1, -1) - query_positions.view(-1, 1)
    buckets = relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=table.shape[0],
                                       max_distance=max_distance)
    return table.float()[buckets].permute(2, 0, 1)


def paged_attention_bias_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                             scale: float, table: torch.Tensor, max_distance: int) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV (kernels/attention.py's
    layout and reference), with the causal relative position bias of ``table``; fp32 math.
    q: (num_tokens, num_heads, head_dim) -> out: same shape and dtype."""
    def bias(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        return position_bias(table, query_positions, key_positions, bidirectional=False, max_distance=max_distance)

    return paged_attention_ref(q, k_cache, v_cache, meta, scale, position_bias=bias)


def decode_attention_bias(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, table: torch.Tensor, max_distance: int) -> torch.Tensor:
    """``paged_attention_bias_ref`` for a step whose every sequence has one new token (at position
    context_len - 1), in one pass over the batch: each row's blocks (all block_tables columns,
    so the shapes depend only on the table's width: CUDA-graph safe) are gathered side by side and
    keys at or past the row's context length are masked. Scores and the weighted sum in the
    cache's dtype (transformers' T5 attention multiplies in the model dtype too), bias, mask and
    softmax in float32. Heads == KV heads (T5). q: (num_seqs, heads, head_dim) -> same shape and dtype."""
    num_seqs, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    blocks = meta.block_tables[:num_seqs].long()  # (num_seqs, width)
    keys_per_row = blocks.shape[1] * block_size
    shape = (num_seqs, keys_per_row, num_heads, head_dim)
    keys = gather_blocks(k_cache, blocks).reshape(shape).to(q.dtype).permute(0, 2, 3, 1)  # (n, heads, dim, keys)
    values = gather_blocks(v_cache, blocks).reshape(shape).to(q.dtype).transpose(1, 2)  # (n, heads, keys, dim)
    scores = torch.matmul(q.unsqueeze(2), keys).float().squeeze(2) * scale  # (n, heads, keys)
    lengths = meta.context_lens[:num_seqs].long().view(-1, 1)
    key_pos = torch.arange(keys_per_row, device=q.device).view(1, -1)
    buckets = relative_position_bucket(key_pos - (lengths - 1), bidirectional=False, num_buckets=table.shape[0],
                                       max_distance=max_distance)  # (n, keys)
    scores = scores + table.float()[buckets].permute(0, 2, 1)
    scores = scores.masked_fill((key_pos >= lengths).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs.unsqueeze(2), values).squeeze(2)
