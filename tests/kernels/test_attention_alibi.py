"""ALiBi (BLOOM, MPT) inside the paged attention kernels.

The slopes (kernels/alibi.py) against transformers' own BLOOM and MPT bias tensors for head counts
that are and are not powers of two; the torch references (CPU path) against dense attention with
transformers' form of the bias (``m_h * k``), which differs from the kernels' ``m_h * (k - q)`` by a
constant of each query row; then the Triton kernel (GPU, or TRITON_INTERPRET=1 on CPU) against the
references: prompt chunks over cached prefixes (what chunked prefill and prefix reuse give it),
split-K decode, a sliding window beside ALiBi, and GQA groups.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from kernels.alibi import alibi_slopes
from kernels.attention import decode_attention_ref, paged_attention, paged_attention_ref, write_kv_cache_ref
from test_kernel_attention import PREFILL_BATCH, make_batch, one_sequence_chunk

HEAD_COUNTS = [1, 2, 5, 6, 8, 12, 16, 20, 32, 40]


@pytest.mark.parametrize("num_heads", HEAD_COUNTS)
def test_bloom_slopes_equal_transformers(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 3), num_heads, torch.float32)  # (heads, 1, 3): slope * [0, 1, 2]
    torch.testing.assert_close(alibi_slopes(num_heads, "bloom"), bias[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bias_max", [8.0, 16.0])
@pytest.mark.parametrize("num_heads", HEAD_COUNTS)
def test_mpt_slopes_equal_transformers(num_heads, bias_max):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(num_heads, 2, bias_max)  # (heads, 1, 2): slope * [-1, 0]
    torch.testing.assert_close(alibi_slopes(num_heads, "mpt", bias_max), -bias[:, 0, 0].float(), rtol=1e-6, atol=0)


def dense_alibi_attention(q, k, v, scale, slopes, sliding_window=None):
    """One sequence, every key in hand, float64, the bias as transformers' BLOOM adds it: m_h * k."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    pos = torch.arange(q.shape[0])
    scores = scores + slopes.double()[:, None, None] * pos[None, None, :]
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values).float()


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("chunks", [[41], [9, 1, 1, 17, 13]])
def test_reference_equals_dense_attention_with_transformers_bias(window, chunks):
    """A 41-token sequence in chunks (each after the cached prefix of the ones before it) through
    shuffled pages of 4; 6 query heads over 2 KV heads, BLOOM's slopes for 6 heads."""
    num_heads, num_kv_heads, head_dim, page = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    total = sum(chunks)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    slopes = alibi_slopes(num_heads, "bloom")
    dense = dense_alibi_attention(q, k, v, 0.25, slopes, window)
    table = random.Random(0).sample(range(16), -(-total // page))
    k_cache, v_cache = torch.randn(16, page, num_kv_heads, head_dim), torch.randn(16, page, num_kv_heads, head_dim)
    start = 0
    for n in chunks:
        end = start + n
        meta = one_sequence_chunk(start, end, table, page)
        write_kv_cache_ref(k[start:end], v[start:end], k_cache, v_cache, meta.slot_mapping)
        out = paged_attention_ref(q[start:end], k_cache, v_cache, meta, 0.25, sliding_window=window,
                                  alibi_slopes=slopes)
        assert relative_error(out, dense[start:end]) < 1e-5, (start, end)
        start = end
    without = dense_alibi_attention(q, k, v, 0.25, torch.zeros(num_heads), window)
    assert relative_error(without, dense) > 0.05  # the bias matters in this case


def test_batched_decode_reference_takes_the_bias_too():
    """The CPU decode path (one pass over the batch; paged_attention's choice for such a batch)
    equals the per-sequence reference with ALiBi, GQA groups of 3, contexts of different lengths."""
    k, v, k_cache, v_cache, meta = make_batch([(0, 1), (15, 1), (16, 1), (40, 1)], 3, 64, 16, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(1))
    slopes = alibi_slopes(9, "mpt")
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, alibi_slopes=slopes)
    torch.testing.assert_close(decode_attention_ref(q, k_cache, v_cache, meta, 0.125, alibi_slopes=slopes), expected,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.125, alibi_slopes=slopes), expected,
                               rtol=1e-5, atol=1e-6)
    assert relative_error(paged_attention_ref(q, k_cache, v_cache, meta, 0.125), expected) > 0.05


# ---- Triton kernel (GPU; or TRITON_INTERPRET=1 on CPU) ---------------------------------------

def run_alibi_case(device, dtype, heads, batch, *, num_splits=None, sliding_window=None, seed=0):
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    num_heads, num_kv_heads, head_dim = heads
    k, v, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, dtype, device, seed)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=gen).to(dtype).to(device)
    slopes = alibi_slopes(num_heads, "bloom").to(device)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, alibi_slopes=slopes)
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits,
                                 sliding_window=sliding_window, alibi_slopes=slopes)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"{dtype} {heads} splits={num_splits} window={sliding_window}: {error:.2e}"
    without = paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window)
    assert relative_error(without, ref) > 10 * TOLERANCE[dtype]  # the case would catch an ignored bias


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(6, 6, 64), (12, 4, 64)])  # BLOOM's MHA (6 heads: both slope series); GQA 3
@pytest.mark.parametrize("window", [None, 8])
def test_prefill_over_cached_prefixes_with_alibi_matches_reference(device, heads, window):
    for dtype in low_precision_dtypes(device):
        run_alibi_case(device, dtype, heads, PREFILL_BATCH, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_with_alibi_over_the_splits_matches_reference(device, num_splits):
    for dtype in low_precision_dtypes(device):
        run_alibi_case(device, dtype, (5, 5, 64), [(0, 1), (15, 1), (16, 1), (299, 1)], num_splits=num_splits)


@pytest.mark.gpu
def test_mixed_batch_with_alibi_matches_reference(device):
    """Prompt chunks and decode rows in one batch: the kernel's two launches both add the bias."""
    for dtype in low_precision_dtypes(device):
        run_alibi_case(device, dtype, (6, 2, 64), [(0, 23), (40, 1), (17, 9), (70, 1)], num_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_appending_the_new_kv_with_alibi_equals_the_two_step_path(device, num_splits):
    """append_paged_attention at decode (BLOOM, MPT, OPT: nothing to rotate): the kernel writes the
    new token's k and v into its slot and attends in one launch, equal to write_kv_cache then the
    reference, and the pool holds the same rows afterwards."""
    from kernels.rope_attention import append_paged_attention

    for dtype in low_precision_dtypes(device):
        k, v, k_cache, v_cache, meta = make_batch([(0, 1), (15, 1), (16, 1), (299, 1)], 5, 64, 16, dtype, device)
        q = torch.randn(4, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
        slopes = alibi_slopes(5, "bloom").to(device)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        write_kv_cache_ref(k, v, ref_k, ref_v, meta.slot_mapping)
        ref = paged_attention_ref(q, ref_k, ref_v, meta, 0.125, alibi_slopes=slopes)
        from kernels.triton_attention import paged_attention_triton

        out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits,
                                     new_kv=(k, v, None, None), alibi_slopes=slopes)
        assert relative_error(out, ref) < TOLERANCE[dtype]
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        assert meta.is_decode_only and relative_error(append_paged_attention(
            q, k, v, k_cache, v_cache, meta, 0.125, alibi_slopes=slopes), ref) < TOLERANCE[dtype]
