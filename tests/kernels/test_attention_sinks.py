"""Attention sinks (gpt-oss): a learned logit per query head joins each query's softmax denominator.

The torch references (CPU path) against dense attention that softmaxes over [scores..., sink] and
drops the sink's column, as transformers' eager gpt-oss attention does; then the Triton kernel
(GPU, or TRITON_INTERPRET=1 on CPU) against the references: prefill chunks over cached prefixes,
a sliding window, split-K decode (the sink must count once over the splits) and the decode path
that rotates and appends K/V itself.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from kernels.attention import decode_attention_ref, paged_attention, paged_attention_ref, write_kv_cache_ref
from test_kernel_attention import PREFILL_BATCH, free_out_of_window_entries, make_batch, one_sequence_chunk


def dense_attention_with_sinks(q, k, v, scale, sinks, sliding_window=None):
    """One sequence, every key in hand, float64: softmax over [masked scores..., sink], sink dropped."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    sink_column = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, values).float()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunks", [[29], [9, 1, 1, 13, 5]])
def test_reference_equals_dense_softmax_with_the_sink_column(window, chunks):
    """A 29-token sequence in chunks through shuffled pages of 4; sinks of both signs and sizes
    (one far above every score, so that head's output nearly vanishes)."""
    num_heads, num_kv_heads, head_dim, page = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    total = sum(chunks)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    sinks = torch.tensor([0.0, 1.5, -2.0, 3.0, -8.0, 12.0])
    dense = dense_attention_with_sinks(q, k, v, 0.3, sinks, window)
    table = random.Random(0).sample(range(16), -(-total // page))
    k_cache, v_cache = torch.randn(16, page, num_kv_heads, head_dim), torch.randn(16, page, num_kv_heads, head_dim)
    start = 0
    for n in chunks:
        end = start + n
        meta = one_sequence_chunk(start, end, table, page)
        write_kv_cache_ref(k[start:end], v[start:end], k_cache, v_cache, meta.slot_mapping)
        out = paged_attention_ref(q[start:end], k_cache, v_cache, meta, 0.3, sliding_window=window, sinks=sinks)
        assert relative_error(out, dense[start:end]) < 1e-5, (start, end)
        start = end
    assert dense[:, 5].abs().max() < 1e-3 < dense[:, 4].abs().max()  # the sink of 12 takes nearly all


def test_batched_decode_reference_takes_the_sinks_too():
    """The CPU decode path (one pass over the batch; paged_attention's choice for such a batch)
    equals the per-sequence reference with sinks, GQA groups of 3."""
    k, v, k_cache, v_cache, meta = make_batch([(0, 1), (15, 1), (16, 1), (40, 1)], 3, 64, 16, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(1))
    sinks = torch.linspace(-3, 3, 9)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, sinks=sinks)
    torch.testing.assert_close(decode_attention_ref(q, k_cache, v_cache, meta, 0.125, sinks=sinks), expected,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.125, sinks=sinks), expected,
                               rtol=1e-5, atol=1e-6)
    assert relative_error(paged_attention_ref(q, k_cache, v_cache, meta, 0.125), expected) > 0.05  # sinks matter


# ---- Triton kernel (GPU; or TRITON_INTERPRET=1 on CPU) ---------------------------------------

def run_sinks_case(device, dtype, heads, batch, *, num_splits=None, sliding_window=None, seed=0):
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    num_heads, num_kv_heads, head_dim = heads
    k, v, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, dtype, device, seed)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    if sliding_window is not None:
        free_out_of_window_entries(meta, sliding_window, 16)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=gen).to(dtype).to(device)
    sinks = (2.0 * torch.randn(num_heads, generator=gen)).to(dtype).to(device)  # a model parameter's dtype
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, sinks=sinks)
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits,
                                 sliding_window=sliding_window, sinks=sinks)
    error = relative_error(out, ref)
    assert error < TOLERANCE[dtype], f"{dtype} {heads} splits={num_splits} window={sliding_window}: {error:.2e}"
    without = paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window)
    assert relative_error(without, ref) > 10 * TOLERANCE[dtype]  # the case would catch ignored sinks


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1, 64), (9, 3, 64)])  # gpt-oss's group of 8 and head_dim 64; a group of 3
@pytest.mark.parametrize("window", [None, 8])
def test_prefill_with_sinks_matches_reference(device, heads, window):
    for dtype in low_precision_dtypes(device):
        run_sinks_case(device, dtype, heads, PREFILL_BATCH, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("window", [None, 8])
def test_decode_with_sinks_counts_the_sink_once_over_the_splits(device, num_splits, window):
    for dtype in low_precision_dtypes(device):
        run_sinks_case(device, dtype, (8, 1, 64), [(0, 1), (15, 1), (16, 1), (299, 1)], num_splits=num_splits,
                       sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_with_rotary_append_and_sinks_matches_the_two_step_path(device, num_splits):
    """The decode kernel that rotates q/k and appends K/V itself (kernels/rope_attention.py) with
    sinks: equal to rotary_and_write_kv + paged attention with the same sinks."""
    from kernels.rotary import build_cos_sin_cache, rotary_and_write_kv_triton
    from kernels.triton_attention import paged_attention_triton

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k, v, k_cache, v_cache, meta = make_batch([(0, 1), (16, 1), (299, 1)], 2, 64, 16, dtype, device, seed=5)
    positions = (meta.context_lens - 1).long()
    cos_sin = build_cos_sin_cache(512, 64, 150000.0, device=device)
    q = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    sinks = torch.linspace(-2, 4, 16).to(device)
    k_split, v_split = k_cache.clone(), v_cache.clone()
    rotated = rotary_and_write_kv_triton(q.clone(), k, v, positions, cos_sin, k_split, v_split, meta.slot_mapping)
    expected = paged_attention_ref(rotated, k_split, v_split, meta, 0.125, sinks=sinks)
    out = paged_attention_triton(q, k_cache, v_cache, meta, 0.125, num_splits=num_splits,
                                 new_kv=(k, v, positions, cos_sin), sinks=sinks)
    assert relative_error(out, expected) < TOLERANCE[dtype]
