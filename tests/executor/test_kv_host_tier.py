"""KV cache host tier (engine/executor/kv_host_tier.py): the BlockManager's bookkeeping with the tier
(invariants under random operations, every reused block holding the KV of its hash), the copies
between device and host pools (bit-exact, FP8 pools too), and the executor end to end: a
conversation whose prefix was evicted to host memory gets it back and answers exactly as without reuse."""
from __future__ import annotations

import types

import pytest
import torch
from executor_testing import collect, final_tokens, make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError
from engine.executor.kv_cache import BlockManager
from engine.executor.kv_host_tier import HostKVPool, HostKVTier, _runs, make_host_tier
from engine.executor.request import OutputConfig, Request
from engine.executor.runner import ForwardBatch, ModelRunner
from kernels.attention import KV_FP8_DTYPE
from serving.metrics import KV_BLOCKS_FAMILY, kv_block_counts


class FakeKV:
    """Stands in for both pools: what each GPU block and host slot holds, as the hash of the KV
    written there (a forward writes a block's hash when it computes the block)."""

    def __init__(self):
        self.gpu: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.copied_out = self.copied_in = 0

    def copy_to_host(self, block_ids: list[int], slots: list[int]) -> None:
        assert len(set(slots)) == len(slots), "one batch writes a slot twice"
        for block_id, slot in zip(block_ids, slots):
            self.host[slot] = self.gpu[block_id]
        self.copied_out += len(block_ids)

    def copy_to_device(self, slots: list[int], block_ids: list[int]) -> None:
        assert len(set(block_ids)) == len(block_ids)
        for slot, block_id in zip(slots, block_ids):
            self.gpu[block_id] = self.host[slot]
        self.copied_in += len(slots)


def manager_with_tier(num_blocks: int, num_slots: int, tokens_per_block: int = 4):
    kv = FakeKV()
    return BlockManager(num_blocks, tokens_per_block, host_tier=HostKVTier(num_slots, kv)), kv


def start(manager: BlockManager, kv: FakeKV, tokens: list[int]):
    """Admit a sequence as the scheduler does and 'compute' its whole prompt; None if it did not fit."""
    seq = make_seq(tokens)
    reused = manager.acquire_cached_prefix(seq)
    for i in range(reused):  # every reused block holds the KV of its own prefix
        assert kv.gpu[seq.block_ids[i]] == seq.block_hashes[i]
    if manager.append_slots(seq, len(tokens) - seq.num_computed_tokens) is None:
        manager.release(seq)
        return None
    for i in range(reused, len(seq.block_ids)):
        kv.gpu[seq.block_ids[i]] = seq.block_hashes[i] if i < len(seq.block_hashes) else None
    seq.num_computed_tokens = len(tokens)
    manager.register_computed_blocks(seq)
    return seq


def check_contents(manager: BlockManager, kv: FakeKV) -> None:
    manager.check_invariants()
    for block in manager.blocks:
        if block.block_hash is not None:
            assert kv.gpu[block.block_id] == block.block_hash
    for block_hash, slot in manager.host_tier.entries.items():
        assert kv.host[slot] == block_hash
    assert manager.total_offloaded_blocks == kv.copied_out
    assert manager.total_onboarded_blocks == kv.copied_in


def test_evicted_prefix_goes_to_host_and_comes_back_as_a_hit():
    manager, kv = manager_with_tier(num_blocks=5, num_slots=8)
    a = start(manager, kv, list(range(17)))  # 4 full blocks + 1 partial: 5 blocks
    assert a.block_ids == [0, 1, 2, 3, 4]
    manager.release(a)
    b = start(manager, kv, list(range(100, 117)))  # evicts A's four registered blocks
    assert manager.total_offloaded_blocks == 4 and len(manager.host_tier.entries) == 4
    assert manager.hash_to_block.keys().isdisjoint(manager.host_tier.entries)
    manager.release(b)
    check_contents(manager, kv)

    again = make_seq(list(range(16)) + [999])  # A's 4 full blocks, then a new token
    assert manager.acquire_cached_prefix(again) == 4
    assert manager.total_onboarded_blocks == 4 and manager.total_reused_blocks == 4
    assert manager.total_new_blocks == 10  # onboarding allocations are hits, not new blocks
    assert again.num_computed_tokens == 16 and again.num_registered_blocks == 4
    assert [kv.gpu[b] for b in again.block_ids] == again.block_hashes[:4]
    assert not manager.host_tier.entries.keys() & set(again.block_hashes)  # each hash lives in one tier
    check_contents(manager, kv)


def test_chain_mixes_gpu_hits_and_host_hits_in_order():
    manager, kv = manager_with_tier(num_blocks=8, num_slots=8)
    a = start(manager, kv, list(range(13)))  # blocks of hashes h0 h1 h2 (+ partial)
    manager.release(a)
    # Evict exactly h2's block to host (freed first of A's hashed blocks, so evicted first).
    victim = manager.hash_to_block[a.block_hashes[2]]  # freed first (tail first), evicted first among hashed
    taken = manager.allocate(6)  # 5 unhashed + the block of h2
    assert victim in taken and manager.total_offloaded_blocks == 1
    manager.free(taken)
    seq = make_seq(list(range(13)))
    assert manager.acquire_cached_prefix(seq) == 3  # h0, h1 on the GPU, h2 from host
    assert manager.total_onboarded_blocks == 1
    assert [kv.gpu[b] for b in seq.block_ids] == seq.block_hashes[:3]
    check_contents(manager, kv)


def test_onboarding_stops_where_free_blocks_run_out():
    manager, kv = manager_with_tier(num_blocks=5, num_slots=8)
    a = start(manager, kv, list(range(17)))
    manager.release(a)
    b = start(manager, kv, list(range(100, 117)))  # A's 4 blocks to host; B holds all 5 blocks
    assert manager.num_free_blocks == 0
    blocker = make_seq(list(range(16)) + [1])
    assert manager.acquire_cached_prefix(blocker) == 0  # in host, but no free block to bring it into
    manager.release(blocker)
    manager.free(b.block_ids[-2:])  # two free blocks (unhashed partial + one hashed)
    b.block_ids = b.block_ids[:-2]
    seq = make_seq(list(range(16)) + [1])
    assert manager.acquire_cached_prefix(seq) == 2  # two onboarded, the chain stops there
    assert manager.num_free_blocks == 0
    check_contents(manager, kv)


def test_host_lru_evicts_the_oldest_entries_and_respects_its_slots():
    manager, kv = manager_with_tier(num_blocks=4, num_slots=3, tokens_per_block=2)
    first = start(manager, kv, [1, 2, 3, 4, 5, 6, 7])  # 3 hashed blocks + 1 partial
    manager.release(first)
    second = start(manager, kv, [11, 12, 13, 14, 15, 16, 17])  # first's 3 blocks to host
    manager.release(second)
    third = start(manager, kv, [21, 22, 23, 24, 25, 26, 27])  # second's 3 evict first's 3 from host
    assert manager.host_tier.num_host_evictions == 3
    assert set(manager.host_tier.entries) == set(second.block_hashes)
    manager.release(third)
    check_contents(manager, kv)


def test_more_evicted_blocks_than_slots_never_share_a_slot_in_one_copy():
    manager, kv = manager_with_tier(num_blocks=9, num_slots=2, tokens_per_block=2)
    a = start(manager, kv, list(range(17)))  # 8 hashed blocks + 1 partial
    manager.release(a)
    b = start(manager, kv, list(range(100, 117)))  # evicts 8 at once into 2 slots: 2 kept
    assert manager.total_offloaded_blocks == 2 and len(manager.host_tier.entries) == 2
    manager.release(b)
    check_contents(manager, kv)


def test_recomputed_block_drops_its_host_copy():
    manager, kv = manager_with_tier(num_blocks=6, num_slots=8)
    a = start(manager, kv, list(range(9)))  # blocks 0, 1 hashed, 2 partial
    manager.release(a)
    b = start(manager, kv, list(range(100, 124)))  # all six blocks: A's two hashed ones go to host
    assert set(manager.host_tier.entries) == set(a.block_hashes)
    manager.release(b)
    recompute = make_seq(list(range(9)))
    recompute.can_reuse_prefix = False  # (context logits): computes every block again
    assert manager.acquire_cached_prefix(recompute) == 0
    assert manager.append_slots(recompute, 9) == 3
    for i, block_id in enumerate(recompute.block_ids[:2]):
        kv.gpu[block_id] = recompute.block_hashes[i]
    recompute.num_computed_tokens = 9
    manager.register_computed_blocks(recompute)
    # A's blocks are on the GPU again, so their host copies went (B's, evicted meanwhile, came in).
    assert not set(a.block_hashes) & set(manager.host_tier.entries)
    check_contents(manager, kv)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "finish"]), st.integers(0, 2), st.integers(1, 40)),
                    max_size=50),
       num_blocks=st.integers(12, 24), num_slots=st.integers(1, 12))
def test_random_operations_keep_tiers_consistent_and_contents_right(ops, num_blocks, num_slots):
    """Conversations growing from three shared prefixes: sequences start (reusing what either tier
    holds) and finish in random order; after every step the invariants hold, every registered GPU
    block and every host entry holds the KV of its hash, and nothing leaks."""
    manager, kv = manager_with_tier(num_blocks, num_slots, tokens_per_block=4)
    prefixes = [[p * 1000 + t for t in range(40)] for p in range(3)]
    live = []
    for op, which, length in ops:
        if op == "start" or not live:
            seq = start(manager, kv, prefixes[which][:length])
            if seq is not None:
                live.append(seq)
        else:
            manager.release(live.pop(which % len(live)))
        check_contents(manager, kv)
    for seq in live:
        manager.release(seq)
    check_contents(manager, kv)
    assert manager.num_free_blocks == num_blocks
    assert manager.host_tier.num_used_slots == len(manager.host_tier.entries) <= num_slots


def test_runs_of_consecutive_ids():
    assert _runs([4, 5, 6, 9, 3, 4]) == [(4, 3, 0), (9, 1, 3), (3, 2, 4)]
    assert _runs([]) == []


# ---- the copies ----------------------------------------------------------------------------------

ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, KV_FP8_DTYPE])
def test_pool_copies_are_bit_exact_for_every_kv_dtype(dtype, device):
    shape = (3, 2, 10, 4, 2, 8)  # (layers, K/V, blocks, tokens per block, kv heads, head dim)
    device_pool = torch.randn(shape).to(dtype).to(device)
    original = device_pool.clone()
    pool = HostKVPool(lambda: device_pool, num_slots=6)
    assert pool.block_bytes == 3 * 2 * 4 * 2 * 8 * device_pool.element_size()
    assert pool.nbytes == 6 * pool.block_bytes and pool.host.is_pinned() == (device == "cuda")
    pool.copy_to_host([7, 2, 5], [4, 0, 1])
    device_pool.view(pool.int_dtype).zero_()  # queued after the copy on the same stream
    pool.copy_to_device([0, 4, 1], [9, 3, 6])  # back into other blocks
    same = device_pool.view(pool.int_dtype)
    want = original.view(pool.int_dtype)
    for src, dst in ((2, 9), (7, 3), (5, 6)):
        assert torch.equal(same[:, :, dst], want[:, :, src])
    assert not same[:, :, [0, 1, 2, 4, 5, 7, 8]].any()


def tiny_runner(engine_dir: str, num_blocks: int, device: str = "cpu") -> ModelRunner:
    runner = ModelRunner(engine_dir, device=device)
    runner.allocate_kv_cache(num_blocks)
    return runner


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_onboarded_blocks_give_the_same_logits(tiny_engine, device):
    """Prefill 12 tokens into blocks 0-2, copy them to host, wipe the device pool, bring them back
    into blocks 5-7: a decode step over the onboarded blocks gives bit-identical logits."""
    runner = tiny_runner(tiny_engine, num_blocks=8, device=device)
    size = runner.tokens_per_block
    ids = [(7 * i + 3) % 128 for i in range(12)]
    runner.forward(ForwardBatch(ids, list(range(12)), [12], [12], [[0, 1, 2]], [11]))
    tier = make_host_tier(runner, host_memory_bytes=3 * runner.kv_block_bytes, onboard_blocks=True,
                          enable_reuse=True)
    assert tier.num_slots == 3
    assert tier.offload([(0, 10, (0,) * size), (1, 11, (1,) * size), (2, 12, (2,) * size)]) == 3
    runner.kv_cache.zero_()
    tier.onboard(tier.claim([10, 11, 12]), [5, 6, 7])
    assert runner.kv_cache[:, :, :5].count_nonzero() == 0 and runner.kv_cache[:, :, 5:].count_nonzero() > 0
    onboarded = runner.forward(ForwardBatch([5], [12], [1], [13], [[5, 6, 7, 4]], [0]))
    runner.forward(ForwardBatch(ids, list(range(12)), [12], [12], [[0, 1, 2]], [11]))  # the original KV again
    recomputed = runner.forward(ForwardBatch([5], [12], [1], [13], [[0, 1, 2, 3]], [0]))
    assert torch.equal(onboarded, recomputed)


# ---- configuration ---------------------------------------------------------------------------------

def fake_runner(tp_size: int = 1, block_bytes: int = 1000):
    pool = torch.zeros(1, 2, 4, 5, 5, 5)  # 1000 bytes a block in float32
    calls = []
    return types.SimpleNamespace(build_config=types.SimpleNamespace(tp_size=tp_size), kv_cache=pool,
                                 kv_block_bytes=block_bytes, calls=calls,
                                 call_on_all_ranks=lambda method, *args: calls.append((method, *args)))


def test_byte_budget_and_when_there_is_no_tier():
    tier = make_host_tier(fake_runner(), host_memory_bytes=3500, onboard_blocks=True, enable_reuse=True)
    assert tier.num_slots == 3 and tier.copier.nbytes == 3000 <= 3500
    assert make_host_tier(fake_runner(), host_memory_bytes=999, onboard_blocks=True, enable_reuse=True) is None
    assert make_host_tier(fake_runner(), host_memory_bytes=0, onboard_blocks=True, enable_reuse=True) is None
    assert make_host_tier(fake_runner(), host_memory_bytes=10**6, onboard_blocks=True, enable_reuse=False) is None
    # onboard_blocks False: a host hit could not be used (kernels read the device pool only): no tier.
    assert make_host_tier(fake_runner(), host_memory_bytes=10**6, onboard_blocks=False, enable_reuse=True) is None



def test_leader_mode_sends_every_copy_to_every_rank():
    """tp_size > 1: the host pools are made on every rank at once, and each copy is a call that the
    step plan carries to every rank (ModelRunner.copy_kv_host_blocks on each shard)."""
    runner = fake_runner(tp_size=2)
    tier = make_host_tier(runner, host_memory_bytes=4000, onboard_blocks=True, enable_reuse=True)
    assert tier.num_slots == 4 and tier.copier.nbytes == 4000
    assert runner.calls == [("copy_kv_host_blocks", 4, "", [], [])]
    tier.offload([(7, 70, (1,)), (3, 30, (2,))])
    tier.onboard(tier.claim([30]), [5])
    assert runner.calls[1:] == [("copy_kv_host_blocks", 4, "to_host", [7, 3], [0, 1]),
                                ("copy_kv_host_blocks", 4, "to_device", [5], [1])]


def test_runner_copies_its_shard_through_its_host_pool(tiny_engine):
    runner = tiny_runner(tiny_engine, num_blocks=4)
    runner.kv_cache.normal_()
    block = runner.kv_cache[:, :, 1].clone()
    runner.copy_kv_host_blocks(2, "", [], [])  # the pool is made
    assert runner.kv_host_pool.num_slots == 2
    runner.copy_kv_host_blocks(2, "to_host", [1], [1])
    runner.copy_kv_host_blocks(2, "to_device", [3], [1])
    assert torch.equal(runner.kv_cache[:, :, 3], block)
    with pytest.raises(ValueError, match="direction"):
        runner.copy_kv_host_blocks(2, "sideways", [], [])


@pytest.mark.parametrize("field,value", [("kv_cache_host_memory_bytes", -1), ("kv_cache_host_memory_bytes", 1.5),
                                         ("kv_cache_host_memory_bytes", True), ("kv_cache_onboard_blocks", "yes")])
def test_config_values_are_validated_by_name(field, value):
    with pytest.raises(ExecutorConfigError, match=field):
        ExecutorConfig(**{field: value}).validate()


def test_model_parameters_reach_the_executor_config():
    """config.pbtxt's kv_cache_host_memory_bytes / kv_cache_onboard_blocks (parsed by
    serving/executor_config.py) land in the ExecutorConfig fields of the same names."""
    from serving.executor_config import executor_settings, to_executor_config

    params = {"kv_cache_host_memory_bytes": "1048576", "kv_cache_onboard_blocks": "false"}
    config, ignored = to_executor_config(ExecutorConfig, executor_settings(params, {}))
    config.validate()
    assert config.kv_cache_host_memory_bytes == 1 << 20 and config.kv_cache_onboard_blocks is False
    assert not {"kv_cache_host_memory_bytes", "kv_cache_onboard_blocks"} & set(ignored)


# ---- the executor end to end -------------------------------------------------------------------------

def converse(executor, conversations: list[list[int]], turns: int, user_len: int = 6, output_len: int = 6):
    """Each conversation in turn (one at a time, so the small pool evicts the others' prefixes):
    history + a new user message -> greedy answer appended. Returns the histories, the generation
    logits of every answer and the per-request reused blocks."""
    histories = [list(c) for c in conversations]
    logits, reused = [], 0
    for turn in range(turns):
        for index, history in enumerate(histories):
            history += [(31 * turn + 7 * index + k) % 128 for k in range(user_len)]
            request = Request(list(history), output_len, end_id=-1,
                              output=OutputConfig(return_generation_logits=True, return_perf_metrics=True,
                                                  exclude_input_from_output=True))
            (request_id,) = executor.enqueue_requests([request])
            responses = collect(executor, [request_id])[request_id]
            history += final_tokens(responses)
            logits.append(responses[-1].result.generation_logits)
            reused += responses[-1].result.perf.kv_cache_reused_blocks
    return histories, logits, reused


POOL_TOKENS = 96  # 24 blocks of 4: one conversation's history fits, three do not


@pytest.mark.parametrize("overlap", [True, False])
def test_conversations_evicted_to_host_answer_as_without_reuse(tiny_engine, overlap):
    prompts = [[(k * 13 + 5 * c) % 128 for k in range(30)] for c in range(3)]
    common = dict(max_tokens_in_paged_kv_cache=POOL_TOKENS, disable_overlap_scheduler=not overlap)
    with Executor(tiny_engine, ExecutorConfig(enable_kv_cache_reuse=False, **common), device="cpu") as executor:
        want, want_logits, _ = converse(executor, prompts, turns=3)
    host = ExecutorConfig(kv_cache_host_memory_bytes=1 << 20, **common)
    with Executor(tiny_engine, host, device="cpu") as executor:
        got, got_logits, reused = converse(executor, prompts, turns=3)
        blocks = executor.blocks
        latest = executor.get_latest_iteration_stats()
        stats = latest.kv_cache_stats
        assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
        blocks.check_invariants()
    assert got == want
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert blocks.total_onboarded_blocks > 0 and blocks.total_offloaded_blocks >= blocks.total_onboarded_blocks
    assert reused == blocks.total_reused_blocks  # per-request metrics count an onboarded block as reused
    assert stats.onboarded_blocks == blocks.total_onboarded_blocks
    assert stats.offloaded_blocks == blocks.total_offloaded_blocks
    assert stats.reused_blocks == blocks.total_reused_blocks
    assert stats.max_num_host_blocks == (1 << 20) // blocks.host_tier.copier.block_bytes
    counter = kv_block_counts(latest)  # tritonllm_kv_cache_blocks_total{source=reused|host|new}
    assert counter[(KV_BLOCKS_FAMILY[0], "host")] == blocks.total_onboarded_blocks
    assert counter[(KV_BLOCKS_FAMILY[0], "reused")] + counter[(KV_BLOCKS_FAMILY[0], "host")] == reused


def test_without_onboarding_host_hits_are_misses(tiny_engine):
    prompts = [[(k * 13 + 5 * c) % 128 for k in range(30)] for c in range(3)]
    common = dict(max_tokens_in_paged_kv_cache=POOL_TOKENS)
    with Executor(tiny_engine, ExecutorConfig(**common), device="cpu") as executor:
        want, _, reused_gpu_only = converse(executor, prompts, turns=2)
    config = ExecutorConfig(kv_cache_host_memory_bytes=1 << 20, kv_cache_onboard_blocks=False, **common)
    with Executor(tiny_engine, config, device="cpu") as executor:
        got, _, reused = converse(executor, prompts, turns=2)
        assert executor.blocks.host_tier is None
        assert executor.blocks.total_onboarded_blocks == executor.blocks.total_offloaded_blocks == 0
    assert got == want and reused == reused_gpu_only
