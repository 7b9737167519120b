"""Chunked local attention (kernels/chunked_attention.py, Llama 4's rope layers): the torch reference
against dense attention masked to each query's chunk (float64), over prompts in chunks that cross
chunk boundaries on shuffled pages; then the Triton kernel (GPU, or TRITON_INTERPRET=1 on CPU)
against the reference, GQA groups, decode rows and mixed chunks.
"""
from __future__ import annotations

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from kernels.attention import write_kv_cache_ref
from kernels.chunked_attention import chunked_attention_ref, chunked_attention_triton
from test_kernel_attention import make_batch

HEADS, KV_HEADS, HEAD_DIM, PAGE, CHUNK = 6, 2, 16, 4, 8


def dense_chunked(q, keys, values, scale):
    """One sequence whose last len(q) positions are new; keys/values of every position, float64."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).double(), values.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    k_pos = torch.arange(keys.shape[0])[None, :]
    q_pos = torch.arange(keys.shape[0] - q.shape[0], keys.shape[0])[:, None]
    visible = (k_pos <= q_pos) & (k_pos // CHUNK == q_pos // CHUNK)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("cached_and_new", [[(0, 21), (5, 1), (13, 6)], [(16, 1), (7, 9)]])
def test_reference_equals_dense_chunk_masked_attention(cached_and_new):
    k_cache, v_cache, k, v, meta = _batch(cached_and_new, torch.float32, "cpu")
    q = torch.randn(k.shape[0], HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    out = chunked_attention_ref(q, k_cache, v_cache, meta, 0.25, CHUNK)
    for i, start, end, context_len in meta.host_sequences():
        table = meta.block_tables[i].long()
        keys = k_cache[table].reshape(-1, KV_HEADS, HEAD_DIM)[:context_len]
        values = v_cache[table].reshape(-1, KV_HEADS, HEAD_DIM)[:context_len]
        want = dense_chunked(q[start:end], keys, values, 0.25)
        assert (out[start:end].double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("cached_and_new", [[(37, 1), (4, 1), (70, 1)], [(0, 21), (5, 1), (13, 6)]])
def test_triton_kernel_equals_reference(device, cached_and_new):
    for dtype in low_precision_dtypes(device) + ([torch.float32] if device == "cuda" else []):
        k_cache, v_cache, k, _, meta = _batch(cached_and_new, dtype, device)
        q = torch.randn(k.shape[0], HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
        want = chunked_attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), _cpu(meta), 0.25, CHUNK)
        out = chunked_attention_triton(q, k_cache, v_cache, meta, 0.25, CHUNK)
        assert relative_error(out.float(), want.float()) < TOLERANCE[dtype]


def _batch(cached_and_new, dtype, device):
    """kernels/attention.py's test batch with the new tokens' K/V written into the pool."""
    k, v, k_cache, v_cache, meta = make_batch(cached_and_new, KV_HEADS, HEAD_DIM, PAGE, dtype, device)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    write_kv_cache_ref(k.cpu(), v.cpu(), k_cache, v_cache, meta.slot_mapping.cpu())
    return k_cache.to(device), v_cache.to(device), k, v, meta


def _cpu(meta):
    from dataclasses import replace

    return replace(meta, slot_mapping=meta.slot_mapping.cpu(), block_tables=meta.block_tables.cpu(),
                   cu_seqlens_q=meta.cu_seqlens_q.cpu(), context_lens=meta.context_lens.cpu())
