"""Bidirectional image spans in prefill (Gemma 3): the tokens of one image see each other both ways.

transformers' Gemma 3 masks prefill attention with OR(causal, same image block), where a block is a
maximal run of image tokens (token_type_ids == 1), and AND the sliding window on top in the sliding
layers. Here an image's tokens are a run of prompt-table placeholder ids (>= vocab_size,
engine/executor/prompt_table.py) in a model with ``bidirectional_prompt_tables``, so the spans come
from the prompt itself:

- ``chunk_end``: the scheduler's hook (chunked context): a prompt chunk never ends inside a span, so
  every query of a span runs in the step that writes the span's last key. A chunk that would cut a
  span ends before it; a chunk that starts a span the step's budget cannot hold waits (-n: the n
  tokens it needs), and the scheduler lets the requests behind it go on while they leave it room in
  the next step (engine/executor/scheduler.py _Budget). A span the whole token budget cannot hold
  (longer than max_num_tokens) is cut anyway (its halves then see each other causally) rather than
  never scheduled. A chunk may start inside a span after a reused prefix (whose KV saw the whole
  span) or a cut; the rest of the span is then one chunk, as a whole one.
- ``step_span_ahead``: the step's (num_tokens,) int32 AttentionMetadata.span_ahead: how many later
  new tokens each token also sees (the rest of its span; 0 outside spans), which the Triton kernel
  and the torch reference both read (kernels/attention.py). None when no chunk holds a span of more
  than one row, so plain steps (and their CUDA graphs) are untouched. Cached keys (earlier chunks, a
  reused prefix) stay visible as always; a reused prefix that ends inside a span holds KV computed
  from the same image rows, so the rest of the span attending to it is exact.
- ``step_mask``: the same as a dense (num_tokens, max q_len) bool mask over each sequence's new tokens
  (causal rows plus every pair inside one span): transformers' token_type_ids mask restricted to the
  step, for tests.
"""
from __future__ import annotations

import torch


def spans_in(token_ids: list[int], vocab_size: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of placeholder ids (>= vocab_size) in ``token_ids``."""
    spans, start = [], None
    for i, token in enumerate(token_ids):
        if token >= vocab_size and start is None:
            start = i
        elif token < vocab_size and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans


def chunk_end(token_ids: list[int], num_prompt_tokens: int, start: int, num_new: int, vocab_size: int,
              max_num_tokens: int) -> int:
    """How many of the ``num_new`` tokens from ``start`` to schedule so the chunk does not end inside
    a span of the prompt; -n: none, the span starting at ``start`` needs n (wait for a step with more budget)."""
    end = start + num_new
    if end >= num_prompt_tokens or token_ids[end - 1] < vocab_size or token_ids[end] < vocab_size:
        return num_new  # the chunk ends at the prompt's end, or not between two image rows
    span_start = end - 1
    while span_start > 0 and token_ids[span_start - 1] >= vocab_size:
        span_start -= 1
    if span_start > start:
        return span_start - start  # the chunk stops before the span; the next one takes it whole
    span_end = end
    while span_end < num_prompt_tokens and token_ids[span_end] >= vocab_size:
        span_end += 1
    if span_end - start > max_num_tokens:
        return num_new  # no step could hold the rest of the span: cut it (module docstring)
    return start - span_end


def step_span_ahead(chunks: list[tuple[int, list[int]]], vocab_size: int) -> torch.Tensor | None:
    """``chunks``: each scheduled sequence's (new tokens this step, the prompt ids among them, which come
    first), in the step's packing order -> (num_tokens,) int32 span_ahead (module docstring), or None."""
    per_chunk = [spans_in(prompt_ids, vocab_size) for _, prompt_ids in chunks]
    if not any(end - start > 1 for spans in per_chunk for start, end in spans):
        return None
    ahead = torch.zeros(sum(n for n, _ in chunks), dtype=torch.int32)
    offset = 0
    for (n, _), spans in zip(chunks, per_chunk):
        for start, end in spans:  # token j of [start, end) sees on to end - 1
            ahead[offset + start:offset + end] = torch.arange(end - start - 1, -1, -1, dtype=torch.int32)
        offset += n
    return ahead


def ahead_mask(ahead: torch.Tensor, seq_lens: list[int], width: int) -> torch.Tensor:
    """span_ahead as bits of a (num_tokens, width) mask in AttentionMetadata.tree_mask's layout: row t
    (new token j of its sequence) gets the new tokens j + 1 .. j + ahead[t] of its sequence."""
    mask = torch.zeros(len(ahead), width, dtype=torch.bool)
    offset = 0
    for n in seq_lens:
        j = torch.arange(n)
        later = j[None, :] - j[:, None]  # (n, n): how far key j' lies past query j
        mask[offset:offset + n, :n] = (later > 0) & (later <= ahead[offset:offset + n, None].long())
        offset += n
    return mask


def step_mask(chunks: list[tuple[int, list[int]]], vocab_size: int) -> torch.Tensor | None:
    """step_span_ahead as a dense (num_tokens, max q_len) bool mask in AttentionMetadata.tree_mask's
    layout (row t: which of its sequence's new tokens token t sees: causal, plus its span), or None."""
    ahead = step_span_ahead(chunks, vocab_size)
    if ahead is None:
        return None
    seq_lens = [n for n, _ in chunks]
    mask = ahead_mask(ahead, seq_lens, max(seq_lens))
    offset = 0
    for n in seq_lens:
        mask[offset:offset + n, :n] |= torch.ones(n, n, dtype=torch.bool).tril()
        offset += n
    return mask


def chunk_limit(vocab_size: int, max_num_tokens: int):
    """The scheduler's ``chunk_limit`` hook: (sequence, tokens the budget allows) -> chunk_end's answer."""
    def limit(seq, num_new: int) -> int:
        return chunk_end(seq.token_ids, seq.num_prompt_tokens, seq.num_computed_tokens, num_new, vocab_size,
                         max_num_tokens)
    return limit


def step_span_ahead_of(scheduled, vocab_size: int) -> torch.Tensor | None:
    """step_span_ahead of a plan's scheduled chunks (the executor's packing order: plan.scheduled)."""
    chunks = []
    for item in scheduled:
        seq, start, n = item.seq, item.start, item.num_new_tokens
        chunks.append((n, seq.token_ids[start:min(start + n, seq.num_prompt_tokens)]))
    return step_span_ahead(chunks, vocab_size)
