"""Image spans (AttentionMetadata.span_ahead, Gemma 3): each new token of an image's run also sees the
run's later new tokens. The reference against a dense mask (a plain causal mask with the spans'
pairs added, as transformers' token_type_ids mask), and the Triton kernel against the reference on a
batch mixing spans across query tiles, a span that ends the chunk, a plain chunk, a decode row and a
token tree, with and without a sliding window / soft-cap. The kernel runs on CUDA, or on CPU with
TRITON_INTERPRET=1 (kernel_testing.triton_device)."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error, triton_device
from test_kernel_attention import make_batch
from test_tree_attention import random_parents

from engine.executor.image_spans import ahead_mask, step_mask, step_span_ahead
from engine.executor.tree_batch import tree_mask
from kernels.attention import paged_attention_ref, write_kv_cache_ref
from kernels.triton_attention import paged_attention_triton

DEVICE = triton_device()
V = 1000  # placeholder ids are >= V


def prompt(n: int, spans: list[tuple[int, int]]) -> list[int]:
    ids = list(range(n))
    for start, end in spans:
        ids[start:end] = range(V + start, V + end)
    return ids


# (cached, new, spans among the new tokens): a span across query tiles after a cached prefix, a
# second span ending the chunk; a plain chunk; a decode row; a span at the very start of a prompt
CASES = [(5, 70, [(3, 40), (52, 70)]), (9, 7, []), (30, 1, []), (0, 12, [(0, 6)])]


def chunks_of(cases) -> list[tuple[int, list[int]]]:
    return [(n, prompt(n, spans)) for _, n, spans in cases]


def dense_reference(q, k_cache, v_cache, meta, scale, window):
    """Attention with an explicit (query position, key position) mask per sequence: causal, plus a
    query inside a span seeing the span's later keys, AND the window -- transformers' Gemma 3 mask."""
    outs = []
    for (i, start, end, ctx), (cached, n, spans) in zip(meta.host_sequences(), CASES):
        keys = k_cache[meta.block_tables[i].long()].reshape(-1, *k_cache.shape[2:])[:ctx].float()
        values = v_cache[meta.block_tables[i].long()].reshape(-1, *v_cache.shape[2:])[:ctx].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        q_pos = torch.arange(cached, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        for s, e in spans:
            inside = lambda p: (p >= cached + s) & (p < cached + e)  # noqa: E731
            visible |= inside(q_pos) & inside(k_pos)
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 16])
def test_span_reference_equals_dense_mask(window):
    k, v, k_cache, v_cache, meta = make_batch([(c, n) for c, n, _ in CASES], 2, 16, 8, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(meta.cu_seqlens_q_host[-1], 4, 16, generator=torch.Generator().manual_seed(1))
    meta.span_ahead = step_span_ahead(chunks_of(CASES), V)
    got = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, sliding_window=window)
    torch.testing.assert_close(got, dense_reference(q, k_cache, v_cache, meta, 0.25, window), atol=1e-5, rtol=1e-5)
    if window is None:  # the same as the dense mask in the tree-mask layout
        meta.span_ahead, meta.tree_mask = None, step_mask(chunks_of(CASES), V)
        torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, meta, 0.25), got, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads", [(4, 2, 16), (8, 1, 64)])
@pytest.mark.parametrize("window,softcap", [(None, None), (16, None), (None, 30.0)])
def test_span_kernel_equals_reference(heads, window, softcap):
    num_heads, num_kv_heads, head_dim = heads
    for dtype in low_precision_dtypes(DEVICE):
        k, v, k_cache, v_cache, meta = make_batch([(c, n) for c, n, _ in CASES], num_kv_heads, head_dim, 8,
                                                  dtype, DEVICE)
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        meta.span_ahead = step_span_ahead(chunks_of(CASES), V).to(DEVICE)
        q = torch.randn(meta.cu_seqlens_q_host[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(1))
        q = q.to(dtype).to(DEVICE)
        options = {"sliding_window": window, "logit_softcap": softcap}
        want = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5, **options)
        got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5, **options)
        assert relative_error(got, want) < TOLERANCE[dtype]
        meta.span_ahead = None  # the spans changed the answer: a kernel ignoring them could not pass
        causal = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5, **options)
        assert relative_error(causal, want) > 10 * TOLERANCE[dtype]


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
def test_span_and_tree_in_one_step():
    """A token tree (speculative verification) beside an image chunk: the runner ORs the spans into the
    tree mask's plain rows (ahead_mask) and keeps span_ahead; kernel = reference = each alone."""
    rng = random.Random(0)
    cases = [(20, 9), (5, 70)]
    parents = [random_parents(9, rng), None]
    for dtype in low_precision_dtypes(DEVICE):
        k, v, k_cache, v_cache, meta = make_batch(cases, 2, 16, 8, dtype, DEVICE)
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        q = torch.randn(79, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
        ahead = step_span_ahead([(9, []), (70, prompt(70, [(3, 40), (52, 70)]))], V)
        meta.tree_mask = (tree_mask([9, 70], parents) | ahead_mask(ahead, [9, 70], 70)).to(DEVICE)
        meta.span_ahead = ahead.to(DEVICE)
        want = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
        got = paged_attention_triton(q, k_cache, v_cache, meta, 0.25)
        assert relative_error(got, want) < TOLERANCE[dtype]
        meta.tree_mask = tree_mask([9, 70], parents).to(DEVICE)  # the tree alone: its rows unchanged
        meta.span_ahead = None
        torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, meta, 0.25)[:9], want[:9])
        meta.tree_mask = None  # the spans alone: the image rows unchanged
        meta.span_ahead = ahead.to(DEVICE)
        torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, meta, 0.25)[9:], want[9:])
