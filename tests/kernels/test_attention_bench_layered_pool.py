"""attention_kernel_bench.py's engine-sized pool (issue 51, --layers / --pool_gib / --page_order): how many blocks a
pool of N GiB holds, which blocks a batch's pages take, the layered pool's memory order (the engine's), and that a
timed call attends over every layer's own K/V. CPU only: the torch reference stands in for the Triton kernel."""
from __future__ import annotations

import torch

from benchmarks.kernels import attention_kernel_bench as bench
from kernels.attention import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata


def test_pool_blocks_are_the_batch_pages_or_what_the_gib_hold():
    assert bench.pool_num_blocks(100, 1, 0.0, 1) == 101  # the batch's pages and the padding block
    # Llama-8B's FP8 pool: 32 layers x K and V x 32 tokens x 8 heads x 128 dims = 2 MiB a block
    assert bench.pool_num_blocks(100, 32, 123.5, 1) == 63232
    assert bench.pool_num_blocks(70000, 32, 123.5, 1) == 70001  # never fewer than the batch needs
    assert bench.pool_num_blocks(10, 2, 1.0, 2) == 2**30 // (2 * 2 * 32 * 8 * 128 * 2)


def test_shuffled_pages_spread_over_the_whole_pool_and_in_order_ones_are_adjacent():
    gen = torch.Generator().manual_seed(3)
    ids = bench.page_ids(1000, 100_001, "shuffled", gen)
    assert len(set(ids.tolist())) == 1000 and ids.min() >= 1 and ids.max() < 100_001
    assert ids.max() > 90_000 and ids.min() < 10_000  # drawn from all of it, not its first 1,000 blocks
    assert bench.page_ids(5, 100, "in_order").tolist() == [1, 2, 3, 4, 5]
    assert sorted(bench.page_ids(9, 10, "shuffled", gen).tolist()) == list(range(1, 10))  # the default pool: a permutation


def test_page_ids_refuse_a_pool_without_room():
    try:
        bench.page_ids(10, 10, "in_order")
    except AssertionError as error:
        assert "10 pages do not fit 10 blocks" in str(error)
    else:
        raise AssertionError("10 pages taken from 9 usable blocks")


def test_layered_pool_is_the_engines_memory_order_read_through_views():
    blocks, layers = 3, 2
    for layout in ("head_major", "token_major"):
        k, v = bench.layered_pool(blocks, layers, torch.bfloat16, layout, "cpu", torch.Generator().manual_seed(0))
        assert k.shape == v.shape == (layers, blocks, bench.PAGE, bench.NUM_KV_HEADS, bench.HEAD_DIM)
        plane = blocks * bench.PAGE * bench.NUM_KV_HEADS * bench.HEAD_DIM  # one layer's K (or V)
        base = k.data_ptr()
        assert v.data_ptr() - base == plane * 2 and k[1].data_ptr() - base == 2 * plane * 2  # layer, K / V, block
        head_run = k.stride(2) == bench.NUM_KV_HEADS * bench.HEAD_DIM
        assert head_run == (layout == "token_major")  # head_major: a head's page is one run of PAGE x HEAD_DIM
        if layout == "head_major":
            assert k.stride(3) == bench.PAGE * bench.HEAD_DIM and k.stride(2) == bench.HEAD_DIM
        assert not torch.equal(k[0], k[1]) and not torch.equal(k[0], v[0])  # every plane filled on its own


def test_attention_call_attends_over_each_layer_in_turn():
    contexts = [40, 7]
    pages = [-(-c // bench.PAGE) for c in contexts]
    k, v = bench.layered_pool(sum(pages) + 1, 3, torch.float32, "head_major", "cpu", torch.Generator().manual_seed(1))
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((2,), -1, dtype=torch.int64), block_tables=tables,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), context_lens=torch.tensor(contexts, dtype=torch.int32),
        max_seqlen_q=1, max_context_len=max(contexts), is_decode_only=True, cu_seqlens_q_host=[0, 1, 2],
        context_lens_host=contexts)
    q = torch.randn(2, bench.NUM_HEADS, bench.HEAD_DIM, generator=torch.Generator().manual_seed(2))
    seen = []

    def attend(q, k_layer, v_layer, meta, scale):
        seen.append((k_layer.data_ptr(), v_layer.data_ptr()))
        return paged_attention_ref(q, k_layer, v_layer, meta, scale)

    out = bench.attention_call(q, k, v, meta, attend=attend)()
    assert seen == [(k[i].data_ptr(), v[i].data_ptr()) for i in range(3)]
    assert torch.equal(out, paged_attention_ref(q, k[2], v[2], meta, bench.HEAD_DIM**-0.5))
    assert not torch.allclose(out, paged_attention_ref(q, k[0], v[0], meta, bench.HEAD_DIM**-0.5))
