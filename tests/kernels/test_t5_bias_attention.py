"""kernels/t5_bias_attention.py: the distance tables against transformers' buckets, and the Triton
kernels (GPU, or TRITON_INTERPRET=1 on CPU) against the torch references: the decoder's paged causal
attention (a prompt chunk after a cached prefix, decode rows, contexts past max_distance) and the
encoder's padded bidirectional attention (inputs of several lengths)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from kernels.attention_metadata import AttentionMetadata
from kernels.t5_bias_attention import (bias_of_distances, distance_bias, t5_dense_attention_ref,
                                       t5_dense_attention_triton, t5_paged_attention_ref, t5_paged_attention_triton)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16)])
def test_distance_table_equals_transformers_buckets(bidirectional, num_buckets, max_distance):
    """Every key-minus-query distance up to +-300 (past max_distance: the clamped ends) gets
    table[transformers' bucket] from the (heads, 2 * max_distance + 1) table."""
    from transformers.models.t5.modeling_t5 import T5Attention

    table = torch.randn(num_buckets, 3)
    distance = torch.arange(-300, 301)
    buckets = T5Attention._relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=num_buckets,
                                                    max_distance=max_distance)
    bias = distance_bias(table, bidirectional=bidirectional, max_distance=max_distance)
    assert torch.equal(bias_of_distances(bias, distance), table[buckets].t())


def paged_batch(device, dtype, *, decode_only: bool):
    """Sequences on shuffled pages of 4, contexts past max_distance 10: a 9-token chunk after a
    14-token prefix, a 1-token prompt and decode rows (decode_only: decode rows only)."""
    torch.manual_seed(0)
    heads, dim, page = 3, 16, 4
    contexts, new = ([25, 10, 1, 17], [1, 1, 1, 1]) if decode_only else ([23, 1, 10, 30], [9, 1, 1, 1])
    width = 8
    k_cache = torch.randn(40, page, heads, dim, device=device).to(dtype)
    v_cache = torch.randn(40, page, heads, dim, device=device).to(dtype)
    tables = torch.randperm(40, device=device)[:len(contexts) * width].view(len(contexts), width)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables.to(torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), max_seqlen_q=max(new),
        max_context_len=max(contexts), is_decode_only=decode_only, cu_seqlens_q_host=cu, context_lens_host=contexts)
    q = torch.randn(cu[-1], heads, dim, device=device).to(dtype)
    return q, k_cache, v_cache, meta, torch.randn(8, heads, device=device)


@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_kernel_equals_reference(device, decode_only):
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = paged_batch(device, dtype, decode_only=decode_only)
        bias = distance_bias(table, bidirectional=False, max_distance=10)
        out = t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias)
        ref = t5_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 1.0, table, 10)
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


@pytest.mark.gpu
def test_paged_kernel_reads_an_fp8_pool(device):
    """An E4M3 KV pool (kv_cache_dtype fp8; scale 1): the kernel widens it as it loads and equals the
    reference over the same FP8 values widened in torch (bf16 under TRITON_INTERPRET is wrong with any
    pool: the interpreter's bf16 dots, kernel_testing.low_precision_dtypes; the CPU checks fp32 queries)."""
    fp8 = torch.float8_e4m3fn
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = paged_batch(device, dtype, decode_only=False)
        k8, v8 = k_cache.float().to(fp8), v_cache.float().to(fp8)
        out = t5_paged_attention_triton(q, k8, v8, meta, 1.0, distance_bias(table, bidirectional=False, max_distance=10))
        ref = t5_paged_attention_ref(q.float(), k8.float(), v8.float(), meta, 1.0, table, 10)
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


def test_dense_kernel_equals_reference(device):
    """Three inputs of 37, 20 and 5 tokens padded to 37 (one partial query and key tile)."""
    torch.manual_seed(1)
    heads, dim = 3, 16
    lengths = torch.tensor([37, 20, 5], dtype=torch.int32, device=device)
    bias = distance_bias(torch.randn(8, heads, device=device), bidirectional=True, max_distance=10)
    for dtype in low_precision_dtypes(device):
        q, k, v = (torch.randn(3, 37, heads, dim, device=device).to(dtype) for _ in range(3))
        out = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias)
        ref = t5_dense_attention_ref(q.float(), k.float(), v.float(), lengths, 1.0, bias)
        for row, length in enumerate(lengths.tolist()):
            assert relative_error(out[row, :length], ref[row, :length]) < TOLERANCE[dtype], (dtype, row)
