"""Tree verification (engine/executor/speculative/tree.py, tree_step.py): one target forward over a
token tree with the tree attention mask, greedy acceptance of the longest matching path, the path's
KV compacted into place. Greedy ids equal transformers' greedy decoding whatever the tree; trees
holding the true continuation are accepted to their depth; no block outlives a sequence.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine.executor.runner import ModelRunner
from engine.executor.speculative.tree import (
    TreeChoicesError, accept_greedy_tree, ancestor_mask, parse_choices, shape_from_choices,
)
from engine.executor.speculative.tree_step import TreeDecoder
from kernels.attention import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata

NEW_TOKENS = 16
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [100, 7, 7, 7, 7, 120, 33, 9, 14, 2, 88]]
MC_SIM_LIKE = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [2, 0], [0, 0, 1], [0, 1, 0], [1, 1]]


@pytest.fixture(scope="module")
def reference(tiny_hf) -> list[list[int]]:
    """transformers' greedy ids of every prompt."""
    out = []
    for prompt in PROMPTS:
        ids = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def decoder(tiny_engine) -> TreeDecoder:
    return TreeDecoder(ModelRunner(tiny_engine), num_blocks=64)


def oracle_tree(reference: list[int], prompt_len: int, rng: random.Random, *, correct: bool, nodes: int = 10):
    """A proposer: a random tree (random parents, random tokens) below the last token; with
    ``correct``, one branch of depth 4 holds the true continuation; without, each node's token is
    the true one at its depth with probability 1/2 (so paths match for a while, then stop)."""
    def propose(tokens, hidden):
        pos = len(tokens) - prompt_len  # reference[pos] is the true token after tokens[-1]
        truth = reference[pos:] + [0] * 8
        parents, drafts, depth = [], [], []
        if correct:
            for d in range(4):
                parents.append(d - 1)
                drafts.append(truth[d])
                depth.append(d + 1)
        while len(drafts) < nodes:
            p = rng.randrange(-1, len(drafts))
            d = 1 if p < 0 else depth[p] + 1
            token = truth[d - 1] if not correct and rng.random() < 0.5 else rng.randrange(128)
            parents.append(p)
            drafts.append(token)
            depth.append(d)
        return parents, drafts
    return propose


def test_plain_steps_equal_transformers(decoder, reference):
    got, stats = decoder.generate(PROMPTS[0], NEW_TOKENS)  # trees of the root alone: plain decode steps
    assert got == reference[0]
    assert stats.steps == NEW_TOKENS - 1 and not stats.accepted
    assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks


@pytest.mark.parametrize("correct", [False, True], ids=["random", "correct"])
def test_tree_greedy_ids_equal_transformers(decoder, reference, correct):
    rng = random.Random(0)
    lengths = []
    for prompt, want in zip(PROMPTS, reference):
        got, stats = decoder.generate(prompt, NEW_TOKENS, oracle_tree(want, len(prompt), rng, correct=correct))
        assert got == want
        assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks, "a rejected node kept a block"
        assert all(0 <= a <= size for a, size in zip(stats.accepted, stats.tree_sizes))
        lengths.append(stats.mean_acceptance_length)
        if correct:  # every step but the last ones (cut short by max_new_tokens) keeps the whole branch
            assert stats.accepted[:-1] == [4] * (len(stats.accepted) - 1)
            assert stats.steps == -(-(NEW_TOKENS - 1) // 5)
    if correct:
        assert min(lengths) > 4.0
    else:  # half the nodes hold the true token: paths match about one node deep, never all of a tree
        assert 1.2 < sum(lengths) / len(lengths) < 4.0


def test_tree_mask_of_a_chain_is_causal_attention():
    """A chain's ancestor mask gives exactly the causal reference's output."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8).unbind(0)
    q = torch.randn(7, 4, 8)
    meta = AttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.int64),
                             block_tables=torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32),
                             context_lens=torch.tensor([10, 7], dtype=torch.int32), max_seqlen_q=4,
                             max_context_len=10, is_decode_only=False)
    causal = paged_attention_ref(q, k_cache, v_cache, meta, 0.3)
    chain = torch.zeros(7, 4, dtype=torch.bool)
    chain[:4, :4], chain[4:, :3] = ancestor_mask([-1, 0, 1, 2]), ancestor_mask([-1, 0, 1])
    meta.tree_mask = chain
    torch.testing.assert_close(paged_attention_ref(q, k_cache, v_cache, meta, 0.3), causal)
    meta.tree_mask = chain.clone()
    meta.tree_mask[3] = torch.tensor([True, False, False, True])  # node 3 now hangs off the root
    other = paged_attention_ref(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(other[:3], causal[:3])
    assert not torch.allclose(other[3], causal[3])


def test_greedy_tree_acceptance_and_choices():
    #            root  a   b   c(a) d(c)   target argmax at each node
    parents = [-1, 0, 0, 1, 3]
    tokens = [9, 5, 6, 7, 8]
    assert accept_greedy_tree(parents, tokens, [6, 0, 7, 1, 1]) == ([0, 2], [6, 7])
    assert accept_greedy_tree(parents, tokens, [5, 7, 0, 8, 4]) == ([0, 1, 3, 4], [5, 7, 8, 4])
    assert accept_greedy_tree(parents, tokens, [1, 0, 0, 0, 0]) == ([0], [1])
    shape = shape_from_choices(MC_SIM_LIKE)
    assert shape.num_nodes == 13 and shape.max_depth == 3
    assert shape.parents[:5] == (-1, 0, 0, 0, 1) and shape.ranks[:5] == (0, 0, 1, 2, 0)
    assert parse_choices("{0}, {0, 0}, {1}") == [[0], [0, 0], [1]]
    assert parse_choices("[[0], [0, 1]]") == [[0], [0, 1]]
    for bad in ("{0}, {0, 0", "{a}", "0, 1"):
        with pytest.raises(TreeChoicesError, match="Invalid format for medusa_choices"):
            parse_choices(bad)
    with pytest.raises(TreeChoicesError, match=r"medusa_choices: path \[1, 0\] has no parent path \[1\]"):
        shape_from_choices([[0], [1, 0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_steps_on_cuda_equal_transformers(tiny_engine, reference):
    """On CUDA the tree mask runs through the reference attention beside the Triton rotary/KV-write
    kernels, and the path's KV moves on the device."""
    decoder = TreeDecoder(ModelRunner(tiny_engine, device="cuda"), num_blocks=64)
    for correct in (False, True):
        rng = random.Random(1)
        for prompt, want in zip(PROMPTS, reference):
            got, _ = decoder.generate(prompt, NEW_TOKENS, oracle_tree(want, len(prompt), rng, correct=correct))
            assert got == want
    assert decoder.blocks.num_free_blocks == decoder.blocks.num_blocks
