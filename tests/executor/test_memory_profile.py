"""The KV pool leaves room for a step's temporaries (engine/executor/memory_profile.py): the profile
batch's shape (CPU), and on a GPU the measured reserve, the pool that leaves it free, and an
executor whose pool takes all the free memory (fraction 1.0) still serving the largest step with
top-p sampling."""
from __future__ import annotations

import pytest
import torch
from executor_testing import collect, final_tokens

from engine.executor.device_memory import (MEMORY_FRACTION_ENV, apply_memory_fraction_from_env, free_device_bytes,
                                           is_capped)
from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.memory_profile import measure_step_memory, profile_batch, reserve_bytes
from engine.executor.request import OutputConfig, Request, SamplingConfig
from engine.executor.runner import ModelRunner


@pytest.mark.parametrize("max_num_tokens,max_batch_size,max_seq_len", [(8192, 1024, 4096), (256, 16, 128),
                                                                       (8192, 8, 512), (100, 7, 128)])
def test_profile_batch_spreads_the_tokens_over_every_sequence(max_num_tokens, max_batch_size, max_seq_len):
    batch = profile_batch(max_num_tokens, max_batch_size, max_seq_len, tokens_per_block=32)
    assert len(batch.seq_lens_q) == len(batch.logits_indices) == max_batch_size  # a logits row each
    assert sum(batch.seq_lens_q) == len(batch.token_ids) == len(batch.positions)
    assert sum(batch.seq_lens_q) == min(max_num_tokens, max_batch_size * max_seq_len)
    assert all(1 <= n <= max_seq_len for n in batch.seq_lens_q) and batch.context_lens == batch.seq_lens_q
    blocks = [b for table in batch.block_tables for b in table]
    assert len(blocks) == len(set(blocks))  # fresh sequences, blocks of their own
    assert all(len(t) == -(-n // 32) for t, n in zip(batch.block_tables, batch.seq_lens_q))
    assert batch.logits_indices[-1] == len(batch.token_ids) - 1
    small_vocab = profile_batch(max_num_tokens, max_batch_size, max_seq_len, 32, vocab_size=50)
    assert max(small_vocab.token_ids) < 50  # a tiny model's embedding takes every id


def test_profile_batch_scores_the_last_tokens_for_verify_steps():
    batch = profile_batch(256, 16, 128, tokens_per_block=4, logits_rows=16 * 5)
    assert batch.logits_indices == list(range(256 - 80, 256))
    assert profile_batch(256, 16, 128, 4, logits_rows=8).logits_indices == profile_batch(256, 16, 128, 4).logits_indices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory: GPU only")
def test_pool_leaves_the_measured_reserve_free(tiny_engine):
    runner = ModelRunner(tiny_engine, device="cuda")
    build = runner.build_config
    memory = measure_step_memory(runner, max_num_tokens=build.max_num_tokens, max_batch_size=build.max_batch_size,
                                 kv_cache_dtype=None)
    assert runner.kv_cache is None
    assert memory.step >= memory.forward > memory.logits == build.max_batch_size * runner.vocab_size * 4
    # as step_memory_reserve sizes it: under the GPU suite's per-process cap the driver's memory beside the
    # allocator is not counted (measured through the device's free memory, it also took in other test
    # processes' allocations on the shared GPU: a 6.98-GB reserve over a 5.7-GB cap failed the 23:30 suite)
    outside = not is_capped(runner.device)
    reserve = reserve_bytes(memory, cuda_graphs=True, count_outside=outside)
    assert reserve > reserve_bytes(memory, cuda_graphs=False, count_outside=outside) > memory.step
    blocks = runner.num_kv_blocks_for(free_mem_fraction=1.0, reserve_bytes=reserve)
    runner.allocate_kv_cache(blocks)
    assert free_device_bytes(runner.device) >= reserve - (64 << 20)  # the allocator rounds the pool up to whole segments


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory: GPU only")
def test_a_pool_of_all_free_memory_still_serves_the_largest_step(tiny_engine):
    """Fraction 1.0 took every free byte before the reserve; a full-size prefill with top-p
    sampling then had nothing left for its activations."""
    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=1.0)
    with Executor(tiny_engine, config, device="cuda") as ex:
        prompts = [[(7 * i + j) % 120 + 1 for j in range(100)] for i in range(8)]
        requests = [Request(p, 8, output=OutputConfig(exclude_input_from_output=True),
                            sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=i)) for i, p in enumerate(prompts)]
        ids = ex.enqueue_requests(requests)
        responses = collect(ex, ids)
        assert all(len(final_tokens(responses[i])) == 8 for i in ids)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "half"])
def test_a_bad_memory_fraction_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(MEMORY_FRACTION_ENV, value)
    with pytest.raises(ValueError, match=rf"\${MEMORY_FRACTION_ENV} must be a number in \(0, 1\], got '{value}'"):
        apply_memory_fraction_from_env(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory: GPU only")
def test_a_capped_process_sizes_its_pool_under_its_cap(tiny_engine, monkeypatch):
    """$TRITONLLM_GPU_MEMORY_FRACTION caps the caching allocator: a pool of all the free memory
    (fraction 1.0) takes what the cap leaves, not the device's free memory, which the allocator would
    refuse, and still serves its largest step."""
    device = torch.device("cuda", torch.cuda.current_device())  # torch's fraction calls need an index
    previous = torch.cuda.get_per_process_memory_fraction(device)
    _, total = torch.cuda.mem_get_info(device)
    cap = min(previous, (torch.cuda.memory_reserved(device) + (3 << 30)) / total)
    monkeypatch.setenv(MEMORY_FRACTION_ENV, str(cap))
    try:
        with Executor(tiny_engine, ExecutorConfig(kv_cache_free_gpu_mem_fraction=1.0), device="cuda") as ex:
            pool_bytes = ex.runner.kv_cache.numel() * ex.runner.kv_cache.element_size()
            assert torch.cuda.get_per_process_memory_fraction(device) == pytest.approx(cap)
            assert pool_bytes <= cap * total - (256 << 20) and free_device_bytes(device) <= cap * total
            prompts = [[(5 * i + j) % 120 + 1 for j in range(100)] for i in range(8)]
            ids = ex.enqueue_requests([Request(p, 8, output=OutputConfig(exclude_input_from_output=True))
                                       for p in prompts])
            responses = collect(ex, ids)
            assert all(len(final_tokens(responses[i])) == 8 for i in ids)
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory: GPU only")
def test_a_dropped_executors_pool_is_free_for_the_next_one(tiny_engine):
    """A dropped executor's pool is free for the next one at once: with the collector off, a second pool of
    all the free memory is as large as the first (it got one block on the H200 while the executor sat in a
    reference cycle, 2026-11-30's GPU suite; the next executor's sizing also collects first)."""
    import gc

    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=1.0)
    gc.disable()
    try:
        with Executor(tiny_engine, config, device="cuda") as first:
            first_blocks = first.runner.kv_cache.shape[2]
        del first
        with Executor(tiny_engine, config, device="cuda") as second:
            second_blocks = second.runner.kv_cache.shape[2]
    finally:
        gc.enable()
    assert second_blocks >= 0.9 * first_blocks > 1
