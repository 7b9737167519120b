"""Paged KV write and attention: Triton kernels against the torch references.

Awkward sizes on purpose: odd token counts, prefixes ending exactly on and one past a page
boundary, GQA groups that are not powers of two (SmolLM2's 9/3 heads), a head_dim that is not
a power of two, shuffled block tables, and decode contexts long enough to be split.
The pool is filled with random values (never zeros) so a wrong gather cannot pass.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention import paged_attention_ref, write_kv_cache_ref
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

# (num_heads, num_kv_heads, head_dim): Llama-3-8B, SmolLM2-135M, plain MHA with an odd head_dim.
HEAD_SHAPES = [(32, 8, 128), (9, 3, 64), (6, 6, 96)]


def make_batch(cached_and_new: list[tuple[int, int]], num_kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, device: str, seed: int = 0):
    """A pool holding each sequence's cached prefix, plus the new tokens' K/V and metadata.

    cached_and_new: per sequence (cached tokens, new tokens). Blocks are handed out shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + n) // page_size) for c, n in cached_and_new]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(1, num_blocks))  # block 0 stays unused: it is the table's padding value
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in blocks_needed]
    max_blocks = max(blocks_needed)
    pool_shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(pool_shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(pool_shape, generator=gen).to(dtype).to(device)
    slots, cu, ctx = [], [0], []
    for (cached, new), table in zip(cached_and_new, tables):
        slots += [table[p // page_size] * page_size + p % page_size for p in range(cached, cached + new)]
        cu.append(cu[-1] + new)
        ctx.append(cached + new)
    num_tokens = cu[-1]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        max_seqlen_q=max(n for _, n in cached_and_new),
        max_context_len=max(ctx),
        is_decode_only=all(n == 1 for _, n in cached_and_new),
        cu_seqlens_q_host=cu,
        context_lens_host=ctx,
    )
    return k, v, k_cache, v_cache, meta


def test_reference_matches_dense_causal_attention():
    """The oracle itself, on CPU: one sequence in one contiguous page run equals dense SDPA."""
    k, v, k_cache, v_cache, meta = make_batch([(0, 37)], 2, 16, 8, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(37, 4, 16)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True, scale=0.25,
    ).transpose(0, 1)
    assert relative_error(out, dense) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32])
def test_write_kv_cache_matches_reference(device, page_size):
    from kernels.triton_attention import write_kv_cache_triton

    for dtype in low_precision_dtypes(device):
        k, v, k_cache, v_cache, meta = make_batch([(5, 27), (0, 1), (31, 33)], 8, 128, page_size, dtype, device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_cache_ref(k, v, k_ref, v_ref, meta.slot_mapping)
        write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
def test_write_kv_cache_reads_strided_views_and_skips_negative_slots(device):
    """K/V arrive as column views of the fused qkv output; slot -1 (graph padding) writes nothing."""
    from kernels.triton_attention import write_kv_cache_triton

    k, v, k_cache, v_cache, meta = make_batch([(3, 9)], 2, 64, 16, torch.float32, device)
    qkv = torch.randn(9, (4 + 2 + 2) * 64, device=device)
    k, v = qkv[:, 256:384].view(9, 2, 64), qkv[:, 384:].view(9, 2, 64)
    slots = meta.slot_mapping.clone()
    slots[4] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache_ref(k[keep], v[keep], k_ref, v_ref, slots[keep])
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def run_attention_case(device, dtype, heads, page_size, cached_and_new, num_splits=None, seed=0):
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    num_heads, num_kv_heads, head_dim = heads
    k, v, k_cache, v_cache, meta = make_batch(cached_and_new, num_kv_heads, head_dim, page_size, dtype, device, seed)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], f"{dtype} {heads} page={page_size} splits={num_splits}: rel err {err:.2e}"


# Prefill chunks over cached prefixes: empty prefix, prefix ending on a page boundary (32) and
# one past it (33), odd chunk lengths, and a decode row riding in the same batch.
PREFILL_BATCH = [(0, 37), (32, 17), (33, 1), (15, 64), (0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_prefill_with_cached_prefix_matches_reference(device, heads, page_size):
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, page_size, PREFILL_BATCH)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_matches_reference(device, heads, num_splits):
    """Contexts 1, 16, 17 and 300 tokens; forced splits exercise the merge with empty splits."""
    batch = [(0, 1), (15, 1), (16, 1), (299, 1)]
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, 16, batch, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="long contexts are too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_decode_and_prefill(dtype):
    """8k-token decode contexts (split path chosen automatically) and a 2k-token prefill chunk."""
    run_attention_case("cuda", dtype, (32, 8, 128), 16, [(8190, 1), (4097, 1), (1, 1)])
    run_attention_case("cuda", dtype, (32, 8, 128), 16, [(1000, 2047), (0, 129)])


def test_decode_split_count_is_a_bounded_power_of_two():
    pytest.importorskip("triton")
    from kernels.triton_attention import _decode_num_splits

    assert _decode_num_splits(1, 8, 8192, 132, 64) == 32  # batch 1, long context: fill the GPU
    assert _decode_num_splits(1, 8, 100, 132, 64) == 1  # too short to split
    assert _decode_num_splits(256, 8, 8192, 132, 64) == 1  # the batch fills the GPU already
    for n in (1, 3, 17, 64):
        splits = _decode_num_splits(n, 8, 2000, 132, 64)
        assert splits & (splits - 1) == 0 and 1 <= splits <= 32
