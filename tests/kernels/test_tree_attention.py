"""Token-tree attention (AttentionMetadata.tree_mask, tree verification): the Triton kernel against
the paged reference, on a batch mixing a tree, a prompt chunk (causal rows) and a decode row.
Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (kernel_testing.triton_device)."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from test_kernel_attention import make_batch

from engine.executor.tree_batch import tree_mask
from kernels.attention import paged_attention_ref, write_kv_cache_ref
from kernels.triton_attention import paged_attention_triton
from kernel_testing import triton_device

DEVICE = triton_device()


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(0, j) for j in range(1, n)]


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 64)])
def test_tree_mask_kernel_equals_reference(heads):
    num_heads, num_kv_heads, head_dim = heads
    rng = random.Random(0)
    # (cached, new): a 90-node tree after 45 cached tokens (several query tiles), a causal 7-token chunk, a decode row,
    # and a tree of 5 nodes after an empty prefix
    cases = [(45, 90), (5, 7), (30, 1), (0, 5)]
    parents = [random_parents(90, rng), None, None, random_parents(5, rng)]
    for dtype in low_precision_dtypes(DEVICE):
        k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 8, dtype, DEVICE)
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        meta.tree_mask = tree_mask([n for _, n in cases], parents).to(DEVICE)
        q = torch.randn(meta.cu_seqlens_q_host[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(1))
        q = q.to(dtype).to(DEVICE)
        want = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)
        got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert relative_error(got, want) < TOLERANCE[dtype]
        # the tree changed the answer (a wrong kernel could not pass as a causal one)
        meta.tree_mask = None
        causal = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert relative_error(causal[:90], want[:90]) > 10 * TOLERANCE[dtype]
