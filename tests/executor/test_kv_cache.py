"""Block manager: exact block ids through allocate, prefix sharing, free, reuse and eviction."""
from __future__ import annotations

from executor_testing import make_seq

from engine.executor.kv_cache import FREED_BLOCK, BlockManager, chain_block_hashes


def computed(manager: BlockManager, seq, num_tokens: int) -> None:
    """Pretend a forward wrote KV for seq's first num_tokens tokens."""
    assert manager.append_slots(seq, num_tokens - seq.num_computed_tokens) is not None
    seq.num_computed_tokens = num_tokens
    manager.register_computed_blocks(seq)


def test_chained_hashes_depend_on_the_whole_prefix():
    a = chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    b = chain_block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and len(b) == 2  # only full blocks are hashed
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different first: different chain
    assert chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, a[:1]) == a  # extends incrementally


def test_allocate_share_prefix_free_and_reuse_after_free():
    manager = BlockManager(num_blocks=8, tokens_per_block=4)
    a = make_seq(list(range(10)))
    assert manager.acquire_cached_prefix(a) == 0
    computed(manager, a, 10)
    assert a.block_ids == [0, 1, 2]
    assert list(manager.free_queue) == [3, 4, 5, 6, 7]

    # B shares A's two full blocks while A still holds them: refs go to 2, no new KV for them.
    b = make_seq(list(range(8)) + [100, 101])
    assert manager.acquire_cached_prefix(b) == 2
    assert b.block_ids == [0, 1] and b.num_computed_tokens == 8
    computed(manager, b, 10)
    assert b.block_ids == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]

    # Freeing goes tail first; unhashed partial blocks go to the front of the free queue.
    manager.release(a)
    assert list(manager.free_queue) == [2, 4, 5, 6, 7]
    manager.release(b)
    assert list(manager.free_queue) == [3, 2, 4, 5, 6, 7, 1, 0]
    assert manager.num_free_blocks == 8
    manager.check_invariants()

    # A prefix hit after everyone freed: blocks 0 and 1 come back from the tail of the queue.
    c = make_seq(list(range(9)))
    assert manager.acquire_cached_prefix(c) == 2
    assert c.block_ids == [0, 1]
    assert list(manager.free_queue) == [3, 2, 4, 5, 6, 7]
    manager.check_invariants()


def test_last_prompt_block_is_never_a_hit():
    manager = BlockManager(num_blocks=4, tokens_per_block=4)
    a = make_seq(list(range(8)))
    manager.acquire_cached_prefix(a)
    computed(manager, a, 8)
    same = make_seq(list(range(8)))
    # Both blocks are cached, but the last token must be recomputed for its logits, so only one is shared.
    assert manager.acquire_cached_prefix(same) == 1
    assert same.block_ids == [0] and same.num_computed_tokens == 4


def test_lru_eviction_drops_hashes_oldest_freed_first():
    manager = BlockManager(num_blocks=4, tokens_per_block=2)
    a = make_seq([1, 2, 3, 4, 5])
    manager.acquire_cached_prefix(a)
    computed(manager, a, 5)  # blocks [0, 1] full and hashed, [2] partial
    manager.release(a)
    assert list(manager.free_queue) == [2, 3, 1, 0]
    # Fresh allocations take unhashed blocks first, then evict block 1 (its hash goes).
    b = make_seq([9, 9, 9, 9, 9, 9])
    manager.acquire_cached_prefix(b)
    assert manager.append_slots(b, 6) == 3
    assert b.block_ids == [2, 3, 1]
    assert set(manager.hash_to_block.values()) == {0}
    # A's first block survived eviction and is still a hit.
    c = make_seq([1, 2, 3, 4, 5])
    assert manager.acquire_cached_prefix(c) == 1 and c.block_ids == [0]
    manager.check_invariants()


def test_pool_exhaustion_is_a_result_not_an_error():
    manager = BlockManager(num_blocks=2, tokens_per_block=4)
    a = make_seq(list(range(12)))
    assert manager.append_slots(a, 12) is None
    assert a.block_ids == [] and manager.num_free_blocks == 2


def test_reuse_disabled_never_shares():
    manager = BlockManager(num_blocks=8, tokens_per_block=4, enable_reuse=False)
    a = make_seq(list(range(10)))
    manager.acquire_cached_prefix(a)
    computed(manager, a, 10)
    b = make_seq(list(range(10)))
    assert manager.acquire_cached_prefix(b) == 0
    assert manager.hash_to_block == {}


def test_blocks_outside_the_window_are_freed_and_entries_marked():
    """Window 6, blocks of 4: at 14 computed tokens the next query (position 14) sees 9..14, so
    blocks 0 and 1 (positions 0..7) go back to the pool; the table keeps its length."""
    manager = BlockManager(num_blocks=8, tokens_per_block=4, enable_reuse=False)
    seq = make_seq(list(range(14)))
    manager.acquire_cached_prefix(seq)
    computed(manager, seq, 14)
    assert seq.block_ids == [0, 1, 2, 3]
    assert manager.free_blocks_outside_window(seq, 6) == 2
    assert seq.block_ids == [FREED_BLOCK, FREED_BLOCK, 2, 3] and seq.num_window_freed_blocks == 2
    assert manager.num_free_blocks == 6
    assert manager.free_blocks_outside_window(seq, 6) == 0  # idempotent
    seq.token_ids.append(14)
    computed(manager, seq, 15)  # position 15 next: sees 10..15, block 2 (8..11) still needed
    assert manager.free_blocks_outside_window(seq, 6) == 0
    manager.release(seq)  # skips the freed entries
    assert manager.num_free_blocks == 8 and seq.num_window_freed_blocks == 0
    manager.check_invariants()


def test_with_reuse_only_registered_blocks_leave_and_stay_findable():
    manager = BlockManager(num_blocks=8, tokens_per_block=4, enable_reuse=True)
    seq = make_seq(list(range(14)))
    manager.acquire_cached_prefix(seq)
    assert manager.append_slots(seq, 14) is not None
    seq.num_computed_tokens = 14  # launched, not yet registered (the overlapped executor's state)
    assert manager.free_blocks_outside_window(seq, 6) == 0
    manager.register_computed_blocks(seq)
    assert manager.free_blocks_outside_window(seq, 6) == 2
    # A later prompt with the same start still finds the freed (cached) blocks.
    other = make_seq(list(range(10)))
    assert manager.acquire_cached_prefix(other) == 2 and other.block_ids == [0, 1]
    manager.release(other)
    manager.release(seq)
    assert manager.num_free_blocks == 8
    manager.check_invariants()
