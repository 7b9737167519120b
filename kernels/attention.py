"""Paged attention over a block-table KV cache: the call shape every model uses.

The KV pool of a rank is one tensor ``(num_layers, 2, num_blocks, tokens_per_block,
num_kv_heads, head_dim)``; a layer reads ``pool[layer, 0]`` (K) and ``pool[layer, 1]`` (V),
each ``(num_blocks, tokens_per_block, num_kv_heads, head_dim)``. Every function here reads and
writes it through its strides: the runner's pool is a view whose memory is head-major within a
block (engine/executor/runner.py allocate_kv_cache).

A batch is packed and ragged: sequence i contributes ``q_len_i = cu_seqlens_q[i+1] -
cu_seqlens_q[i]`` new tokens (a prefill chunk, or 1 for decode), and after this step holds
``context_lens[i]`` tokens in the cache. Its new tokens therefore sit at positions
``context_lens[i] - q_len_i ... context_lens[i] - 1``, and attend causally to everything
before them, cached prefix included::

    seq i:  [ cached prefix (context_len - q_len) | new tokens (q_len) ]
              ^ block_table[i][0] ...                 ^ written by write_kv_cache first

Position p of sequence i lives in block ``block_tables[i, p // tokens_per_block]`` at offset
``p % tokens_per_block``; its flat slot is ``block_id * tokens_per_block + offset``.

Per-layer options (one AttentionMetadata serves every layer, so they are arguments, not metadata):

- ``sliding_window`` W (Mistral, Qwen2, Gemma's local layers), with transformers' convention: the
  query at position p sees the keys at positions ``p - W < k <= p`` (its W most recent tokens, itself
  included). Only the blocks holding such keys are read, so a block table entry wholly before
  ``first new position - W + 1`` is never read and may be a freed slot (-1, see
  engine/executor/kv_cache.py).
- ``logit_softcap`` c (Gemma 2): scores become ``c * tanh(scores / c)`` after the softmax scale and
  before the causal/window mask, as transformers' eager Gemma 2 attention does.
- ``sinks`` (gpt-oss): a learned logit per query head, (num_heads,) on this rank, that joins each
  query's softmax denominator as one more column and is then dropped, so a row's weights sum to
  less than 1: ``p_k = exp(s_k) / (sum_j exp(s_j) + exp(sink_h))``. It has no value row.
- ``alibi_slopes`` (BLOOM, MPT): a slope m_h per query head, (num_heads,) float32 on this rank
  (kernels/alibi.py); the score of the query at position p and the key at position k gains
  ``m_h * (k - p)`` (<= 0) after the softmax scale and any soft-cap. transformers adds ``m_h * k``
  (BLOOM) or ``m_h * (k - (L - 1))`` (MPT) instead: both differ from this by a constant of each
  query row, which the softmax cancels. The bias depends only on absolute positions, so a prompt
  in chunks, or after a reused cached prefix, gets exactly the scores of a whole prompt.
- ``meta.tree_mask`` (tree verification, engine/executor/speculative/tree.py): a sequence's new
  tokens are a token tree written to consecutive slots; each sees the cached prefix and only its
  ancestors among the new tokens. Its rotary positions (prefix + depth) are the model's business;
  the mask here replaces the causal one over the new keys (the Triton kernel reads it in its
  masked walk, which takes every new key after the first).
- ``meta.span_ahead`` (Gemma 3's image spans, engine/executor/image_spans.py): the new token at
  position p also sees the next ``span_ahead[t]`` new keys of its sequence (the rest of its image's
  run in this chunk), so its keys are ``k <= p + span_ahead[t]``; a sliding window still hides
  ``k <= p - W`` (transformers' Gemma 3 overlay: OR(causal, same image) AND window). Both the
  reference and the Triton kernel read it.

The public functions dispatch on the tensors' device: OpenAI Triton kernels on CUDA (when
Triton is installed), the plain-torch references (``*_ref``) elsewhere. The test is two
attribute reads; under a captured CUDA graph it costs nothing at all. The references are also
the oracle the kernel tests compare against.
"""
from __future__ import annotations

import torch

from kernels import triton_attention  # the GPU kernels; importable (as stubs) without Triton
from kernels._triton import use_triton
from kernels.attention_metadata import AttentionMetadata


KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = 448.0  # an FP8 pool holds K and V unscaled (scale 1), saturated at E4M3's largest value


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as the pool stores them: cast, and for an FP8 pool clamped first (E4M3 has no
    infinity: an out-of-range value would become NaN)."""
    if cache_dtype == KV_FP8_DTYPE:
        return x.float().clamp(-KV_FP8_MAX, KV_FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def _as_bytes_if_fp8(cache: torch.Tensor) -> torch.Tensor:
    # CPU kernels (index_copy_, gather) have no float8 versions: move FP8 values as raw bytes.
    return cache.view(torch.uint8) if cache.dtype == KV_FP8_DTYPE else cache


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their cache slots.

    k, v: (num_tokens, kv_heads, head_dim); k_cache, v_cache: (num_blocks, block, kv_heads, head_dim),
    any strides (the runner's pool is a head-major view: engine/executor/runner.py allocate_kv_cache).
    """
    block_size = k_cache.shape[1]
    blocks, rows_in_block = slot_mapping // block_size, slot_mapping % block_size
    for new, cache in ((k, k_cache), (v, v_cache)):
        _as_bytes_if_fp8(cache)[blocks, rows_in_block] = _as_bytes_if_fp8(to_cache_dtype(new, cache.dtype))


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks], also for an FP8 pool on CPU."""
    if cache.dtype == KV_FP8_DTYPE:
        return cache.view(torch.uint8)[blocks].view(KV_FP8_DTYPE)
    return cache[blocks]


def first_visible_key(first_query_pos: int, sliding_window: int | None) -> int:
    """The lowest key position any query at ``>= first_query_pos`` can see."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores``; with ``sinks`` (broadcastable to
    ``scores[..., :1]``: each row's head's sink logit) as one more column, dropped afterwards."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None, position_bias=None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV; plain torch, fp32 math.

    q: (num_tokens, num_heads, head_dim) -> out: same shape and dtype as q. With a window, only
    the blocks from the one holding the first visible key on are gathered. ``position_bias``:
    (query positions (q,), key positions (k,)) -> (num_heads, q, k) float32 added to the scaled
    scores (T5's relative bias, kernels/relative_position_bias.py); reference only.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, start, end, context_len in meta.host_sequences():
        q_len = end - start
        first_block = first_visible_key(context_len - q_len, sliding_window) // block_size
        num_blocks = -(-context_len // block_size)
        blocks = meta.block_tables[i, first_block:num_blocks].long()
        first_key = first_block * block_size
        # (context_len - first_key, kv_heads, head_dim), gathered block by block, then trimmed.
        keys = gather_blocks(k_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:context_len - first_key].float()
        values = gather_blocks(v_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:context_len - first_key].float()
        keys = keys.repeat_interleave(group, dim=1)  # (num_keys, num_heads, head_dim)
        values = values.repeat_interleave(group, dim=1)
        query = q[start:end].float()  # (q_len, num_heads, head_dim)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale  # (num_heads, q_len, num_keys)
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        # New token j sits at position context_len - q_len + j and sees keys 0..that position
        # (with a window: its W most recent positions).
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)[:, None]
        k_pos = torch.arange(first_key, context_len, device=q.device)[None, :]
        if alibi_slopes is not None:  # (num_heads, 1, 1) * (q_len, num_keys)
            scores += alibi_slopes.float().view(num_heads, 1, 1) * (k_pos - q_pos).float()
        if position_bias is not None:
            scores += position_bias(q_pos.view(-1), k_pos.view(-1))
        if meta.span_ahead is not None:  # image spans: each row also sees the rest of its span
            hidden = k_pos > q_pos + meta.span_ahead[start:end].to(q.device).long()[:, None]
        else:
            hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        if meta.tree_mask is not None:  # the new tokens are a token tree: each sees its ancestors among them
            # == 0, not ~: the decode graphs stage the mask as int8 (1 = visible), where ~ gives -2 / -1 (all true)
            hidden[:, context_len - q_len - first_key:] = meta.tree_mask[start:end, :q_len] == 0
        scores.masked_fill_(hidden, float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_heads, 1, 1))
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, logit_softcap: float | None = None, sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention_ref``'s math for a batch in which every sequence has exactly one new token
    and no window, in one pass over the batch: the sequences' blocks are gathered side by side
    (padded to the longest context; padding block ids are valid ids) and keys past a sequence's
    context are masked out. The per-sequence loop costs ~15 small torch calls per sequence per
    layer, most of a CPU decode step of SmolLM2 at batch 8 (the CPU path every served test runs).

    q: (num_seqs, num_heads, head_dim) -> out: same shape and dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    ctx = meta.context_lens_host if meta.context_lens_host is not None else meta.context_lens.tolist()
    width = -(-max(ctx) // block_size)
    blocks = meta.block_tables[:num_seqs, :width].long()  # (num_seqs, width)
    shape = (num_seqs, width * block_size, num_kv_heads, head_dim)
    keys = gather_blocks(k_cache, blocks).reshape(shape).float()
    values = gather_blocks(v_cache, blocks).reshape(shape).float()
    # Query head h reads kv head h // group: (num_seqs, kv_heads, group, head_dim).
    query = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", query, keys) * scale  # (num_seqs, kv_heads, group, keys)
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    lengths = torch.tensor(ctx, device=q.device)[:, None]
    key_pos = torch.arange(width * block_size, device=q.device)[None, :]
    if alibi_slopes is not None:  # each sequence's one query sits at position context_len - 1
        distance = (key_pos - (lengths - 1)).float()  # (num_seqs, keys)
        scores += alibi_slopes.float().view(1, num_kv_heads, group, 1) * distance[:, None, None, :]
    hidden = key_pos >= lengths  # (num_seqs, keys)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_kv_heads, group, 1))
    out = torch.einsum("bhgk,bkhd->bhgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _is_plain_decode(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Every sequence has one new token (cu_seqlens_q is 0, 1, ..., n)."""
    cu = meta.cu_seqlens_q_host
    return cu is not None and len(cu) == q.shape[0] + 1 and cu[-1] == q.shape[0] and q.shape[0] > 1


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if use_triton(k):
        return triton_attention.write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sliding_window`` / ``logit_softcap`` / ``sinks`` / ``alibi_slopes``: per layer, None when
    the layer has none (module docstring)."""
    options = {"logit_softcap": logit_softcap, "sinks": sinks}
    if alibi_slopes is not None:  # only ALiBi layers pass it: other callers' kernels stay as they were
        options["alibi_slopes"] = alibi_slopes
    if (meta.tree_mask is not None or meta.span_ahead is not None) and not use_triton(q):
        # token trees, image spans (the Triton kernel reads both too)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, **options)
    if use_triton(q):
        return triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                                       **options)
    if sliding_window is None and _is_plain_decode(q, meta):
        return decode_attention_ref(q, k_cache, v_cache, meta, scale, **options)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, **options)
