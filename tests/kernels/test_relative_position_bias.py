"""kernels/relative_position_bias.py: T5's buckets against transformers', and the paged causal
attention with the bias against a dense computation of the same scores."""
import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.relative_position_bias import paged_attention_bias_ref, position_bias, relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16)])
def test_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    distance = torch.arange(-300, 301)
    ours = relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)
    theirs = T5Attention._relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=num_buckets,
                                                   max_distance=max_distance)
    assert torch.equal(ours, theirs)


def test_paged_attention_with_bias_matches_dense():
    """Two sequences on shuffled pages of 4: a 6-token chunk after a 5-token cached prefix, and a
    decode row at position 9; each against softmax(q k^T + bias, causal) v over its whole context."""
    torch.manual_seed(0)
    heads, dim, page, buckets = 3, 8, 4, 8
    table = torch.randn(buckets, heads)
    contexts, new = [11, 10], [6, 1]
    pages = [[5, 2, 7], [0, 6, 3]]
    k_cache, v_cache = torch.randn(8, page, heads, dim), torch.randn(8, page, heads, dim)
    q = torch.randn(sum(new), heads, dim)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=torch.tensor(pages, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 6, 7]), context_lens=torch.tensor(contexts), max_seqlen_q=6,
        max_context_len=11, is_decode_only=False, cu_seqlens_q_host=[0, 6, 7], context_lens_host=contexts)
    out = paged_attention_bias_ref(q, k_cache, v_cache, meta, 1.0, table, max_distance=16)
    start = 0
    for seq, (context, n) in enumerate(zip(contexts, new)):
        keys = k_cache[pages[seq]].reshape(-1, heads, dim)[:context]
        values = v_cache[pages[seq]].reshape(-1, heads, dim)[:context]
        q_pos, k_pos = torch.arange(context - n, context), torch.arange(context)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n], keys)
        scores += position_bias(table, q_pos, k_pos, bidirectional=False, max_distance=16)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        torch.testing.assert_close(out[start:start + n], expected, rtol=1e-5, atol=1e-5)
        start += n
