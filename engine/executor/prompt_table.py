"""Prompt-embedding tables: rows of a request's own embeddings that stand in for some prompt tokens.

The convention is TensorRT-LLM's (its PromptTuningConfig, and the multimodal models' "fake prompt
ids"): a prompt token id ``t >= vocab_size`` is no token; its position takes row
``t - vocab_size`` of the request's table (an image's features, a soft prompt) instead of the token
embedding. Everything else about the position (rotary position, KV, attention) is an ordinary
token's. The table travels with the request, so chunked prefill (a chunk may end inside an image)
and preemption (recompute) read the same rows again.

Prefix caching keys blocks by token ids; a fake id alone says nothing about the row behind it. So
a sequence with a table hashes its prompt through ``prompt_cache_keys``: each fake id becomes
(span digest, extra id, fake id), where a span is a maximal run of fake ids (one image, or images
with no text between them) and its digest covers exactly the rows that run names. So the same image
re-sent hits the cache and another misses, and an image is reused per image, not per table: a
request with images (A, B) reuses the blocks through A of an earlier (A, C) or (A), and rows no id
names do not matter. Block hashes chain (kv_cache.chain_block_hashes), so a block's key also
covers everything before it.
``extra_ids`` (the reference's prompt_table_extra_ids, one per prompt token, 0 at ordinary
tokens) go into the key too, as TensorRT-LLM's KV reuse does.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch where tables are read: requests.py's checks (the BLS's) import this without it
    import torch

    from engine.models.prompt_embeds import PromptEmbeds


@dataclass
class PromptTable:
    """A request's table: ``embeddings`` (rows, hidden) float (torch or numpy); ``extra_ids``:
    None, or one non-negative int per prompt token (0 at ordinary tokens)."""

    embeddings: Any
    extra_ids: list[int] | None = None


def normalize_prompt_table(table: PromptTable) -> PromptTable:
    """A copy with the embeddings as a contiguous float torch tensor on the CPU (Triton's numpy
    buffers are read-only) and the extra ids as plain ints."""
    import torch

    if not isinstance(table, PromptTable):
        raise TypeError(f"prompt_table must be a PromptTable, got {type(table).__name__}")
    embeddings = torch.as_tensor(np.array(table.embeddings) if isinstance(table.embeddings, np.ndarray)
                                 else table.embeddings)
    if not embeddings.dtype.is_floating_point:
        raise TypeError(f"prompt_embedding_table must hold floats, got {embeddings.dtype}")
    extra = None if table.extra_ids is None else [int(v) for v in np.asarray(table.extra_ids).reshape(-1)]
    return PromptTable(embeddings.detach().cpu().contiguous(), extra)


def prompt_table_error(prompt: list[int], table: PromptTable | None, vocab_size: int, hidden_size: int,
                       supported: bool = True, why_unsupported: str = "") -> str | None:
    """Why the prompt's fake ids and the table do not fit together (naming the Triton inputs), or None.
    Ordinary ids (negative ones included) are validate_request's. ``why_unsupported``: what refuses tables when
    not ``supported`` (default: the model's architecture)."""
    fake = [t for t in prompt if t >= vocab_size]
    if table is None:
        if fake:
            return (f"input_token_ids contains token id {fake[0]} outside the vocabulary; allowed ids are "
                    f"0..{vocab_size - 1} (ids from vocab_size on name rows of a prompt_embedding_table, "
                    "and the request sent none)")
        return None
    if not supported:
        why = why_unsupported or "for this model's architecture yet"
        return f"prompt_embedding_table is not supported {why}; send the request without it"
    shape = tuple(table.embeddings.shape)
    if len(shape) != 2 or shape[0] == 0:
        return f"prompt_embedding_table has shape {shape}; send (rows, hidden_size) with at least one row"
    if shape[1] != hidden_size:
        return (f"prompt_embedding_table has rows of width {shape[1]}; they must have the model's table width "
                f"({hidden_size}: its hidden size, times 1 + its DeepStack levels for Qwen3-VL)")
    if not fake:
        return (f"prompt_embedding_table was sent but input_ids hold no id >= vocab_size ({vocab_size}); mark the "
                "positions that take table rows with ids vocab_size + row")
    beyond = [t for t in fake if t - vocab_size >= shape[0]]
    if beyond:
        return (f"input_ids contains id {beyond[0]}, which names row {beyond[0] - vocab_size} of a "
                f"prompt_embedding_table of {shape[0]} rows; allowed: ids {vocab_size}..{vocab_size + shape[0] - 1}")
    if table.extra_ids is not None:
        if len(table.extra_ids) != len(prompt):
            return (f"prompt_table_extra_ids has {len(table.extra_ids)} values for {len(prompt)} prompt tokens; "
                    "send one per prompt token")
        if any(v < 0 for v in table.extra_ids):
            return "prompt_table_extra_ids must be non-negative"
    return None


def table_digest(embeddings: torch.Tensor) -> bytes:
    """A digest of the table's content (its dtype and shape included): equal tables, equal digests."""
    import torch

    digest = hashlib.sha256(f"{embeddings.dtype}:{tuple(embeddings.shape)}".encode())
    if embeddings.numel():  # the rows' bytes in place (no copy); SHA-256 runs on the CPU's SHA instructions:
        # 2.7 ms for a 448 x 448 image's 256 rows of 3,584 fp16 against 5.4 for BLAKE2b over a copy (x86, 2026-11-29)
        digest.update(memoryview(embeddings.contiguous().view(torch.uint8).numpy()))
    return digest.digest()[:16]


def prompt_cache_keys(prompt: list[int], table: PromptTable, vocab_size: int) -> list:
    """The prompt as the prefix cache should see it: ordinary ids as they are, each fake id as
    (digest of its span's rows, extra id, fake id). Hashable, and equal only for equal rows at
    equal places. One digest per span (image), not per row: hashing cost is one pass over the rows."""
    from engine.executor.image_spans import spans_in

    keys: list = list(prompt)
    extra = table.extra_ids or [0] * len(prompt)
    for start, end in spans_in(prompt, vocab_size):
        rows = [t - vocab_size for t in prompt[start:end]]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))  # the usual layout: a slice, no copy
        digest = table_digest(table.embeddings[rows[0]:rows[-1] + 1] if contiguous else table.embeddings[rows])
        for i in range(start, end):
            keys[i] = (digest, extra[i], prompt[i])
    return keys


def gather_prompt_embeds(pieces: list[tuple[int, list[int], PromptTable]], vocab_size: int) -> PromptEmbeds | None:
    """The rows one step splices: ``pieces`` holds, per scheduled chunk that has fake ids,
    (offset of the chunk in the packed batch, the chunk's token ids, its request's table)."""
    import torch

    from engine.models.prompt_embeds import PromptEmbeds

    token_indices, rows = [], []
    for offset, chunk, table in pieces:
        ids = np.asarray(chunk, dtype=np.int64)
        places = np.flatnonzero(ids >= vocab_size)
        if not len(places):
            continue
        picked = ids[places] - vocab_size
        token_indices += (places + offset).tolist()
        first, last = int(picked[0]), int(picked[-1])
        if last - first == len(picked) - 1 and (len(picked) < 3 or bool((np.diff(picked) == 1).all())):
            rows.append(table.embeddings[first:last + 1])  # the usual layout, rows in order: a view, no gather
        else:
            rows.append(table.embeddings[torch.from_numpy(picked)])
    if not token_indices:
        return None
    # (ordinary host memory: a graphed step stages its rows in pinned buffers of its own, engine/executor/table_graphs.py)
    return PromptEmbeds(token_indices, rows[0] if len(rows) == 1 else torch.cat(rows))
