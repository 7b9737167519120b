"""In-flight batching changes nothing about greedy outputs: 16 mixed requests together == each alone.

Checked under both scheduler policies, with and without chunked context and KV reuse, and with a
KV pool so small that max_utilization must preempt (and recompute) running requests.
"""
from __future__ import annotations

import random

import pytest
import torch
from executor_testing import collect, final_tokens

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import Request

NUM_REQUESTS = 16


def workload(seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(12)]  # a common prefix, so KV reuse has something to find
    requests = []
    for i in range(NUM_REQUESTS):
        own = [rng.randrange(128) for _ in range(rng.randrange(1, 28))]
        prompt = shared[:rng.choice([0, 5, 8, 12])] + own
        requests.append(Request(prompt, max_tokens=rng.randrange(2, 12), streaming=i % 3 == 0,
                                output=_exclude()))
    return requests


def _exclude():
    from engine.executor.request import OutputConfig

    return OutputConfig(exclude_input_from_output=True)


@pytest.fixture(scope="module")
def alone(tiny_engine) -> list[list[int]]:
    """Each request run by itself, one after another, no reuse: the reference."""
    outputs = []
    with Executor(tiny_engine, ExecutorConfig(enable_kv_cache_reuse=False)) as executor:
        for request in workload():
            [request_id] = executor.enqueue_requests([request])
            outputs.append(final_tokens(collect(executor, [request_id])[request_id]))
    return outputs


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
def test_greedy_batched_equals_alone(tiny_engine, alone, policy, chunked, reuse):
    config = ExecutorConfig(batch_scheduler_policy=policy, enable_chunked_context=chunked, enable_kv_cache_reuse=reuse,
                            max_num_tokens=48 if chunked else 64)
    with Executor(tiny_engine, config) as executor:
        ids = executor.enqueue_requests(workload())
        responses = collect(executor, ids)
        stats = executor.get_iteration_stats_history()
    assert [final_tokens(responses[i]) for i in ids] == alone
    assert max(s.num_scheduled_requests for s in stats) > 4  # really ran together
    if chunked:
        assert any(s.num_context_requests and s.num_gen_requests for s in stats)  # prefill chunks beside decodes
    if reuse:
        assert stats[-1].kv_cache_stats.reused_blocks > 0


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_tiny_pool_preempts_under_max_utilization_and_outputs_stay_equal(tiny_engine, alone, policy):
    # 13 blocks of 4 tokens: room for the largest request (<= 51 tokens), far from all 16 at once.
    config = ExecutorConfig(batch_scheduler_policy=policy, max_tokens_in_paged_kv_cache=52)
    with Executor(tiny_engine, config) as executor:
        ids = executor.enqueue_requests(workload())
        responses = collect(executor, ids)
        stats = executor.get_latest_iteration_stats()
    assert [final_tokens(responses[i]) for i in ids] == alone
    assert stats.kv_cache_stats.max_num_blocks == 13
    assert stats.kv_cache_stats.free_num_blocks == 13  # everything freed at the end
    if policy == "max_utilization":
        assert stats.num_preempted_requests > 0
    else:
        assert stats.num_preempted_requests == 0


def test_greedy_matches_transformers_generate(tiny_engine, tiny_hf):
    prompts = [[3, 17, 5, 99, 42], [7] * 9]
    with Executor(tiny_engine) as executor:
        ids = executor.enqueue_requests([Request(p, 10, output=_exclude()) for p in prompts])
        responses = collect(executor, ids)
    for prompt, request_id in zip(prompts, ids):
        expected = tiny_hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert final_tokens(responses[request_id]) == expected.tolist()


def test_beam_search_survives_preemption_beside_other_requests(tiny_engine):
    from engine.executor.request import SamplingConfig

    def beam_request(prompt):
        return Request(prompt, 8, output=_exclude(), sampling=SamplingConfig(beam_width=3))

    prompts = [[5, 9, 2, 7, 1, 3], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=3, enable_kv_cache_reuse=False)) as executor:
        alone = []
        for prompt in prompts:
            [request_id] = executor.enqueue_requests([beam_request(prompt)])
            alone.append(collect(executor, [request_id])[request_id][-1].result.output_token_ids)
    # 16 blocks of 4 tokens: room for the widest request's 3 beams, not for all at once: something is preempted.
    config = ExecutorConfig(max_beam_width=3, batch_scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=64)
    with Executor(tiny_engine, config) as executor:
        mixed = [beam_request(p) for p in prompts] + workload()[:4]
        ids = executor.enqueue_requests(mixed)
        responses = collect(executor, ids)
        stats = executor.get_latest_iteration_stats()
    assert [responses[i][-1].result.output_token_ids for i in ids[:3]] == alone
    assert stats.num_preempted_requests > 0
    assert stats.kv_cache_stats.free_num_blocks == 16


def test_static_batching_runs_each_batch_to_completion(tiny_engine, alone):
    config = ExecutorConfig(batching_type="v1", max_batch_size=4)
    with Executor(tiny_engine, config) as executor:
        ids = executor.enqueue_requests(workload())
        responses = collect(executor, ids)
        stats = executor.get_iteration_stats_history()
    assert [final_tokens(responses[i]) for i in ids] == alone
    # a new batch's prompts never run beside an older batch's decodes
    assert not any(s.num_context_requests and s.num_gen_requests for s in stats)
    assert max(s.num_scheduled_requests for s in stats) == 4


def test_beams_that_exactly_fill_the_pool_still_run_under_max_utilization(tiny_engine):
    from engine.executor.request import SamplingConfig

    # 17 + 3 = 20 tokens = 5 blocks per beam, 3 beams = the whole 15-block pool.
    request = Request(list(range(30, 47)), 3, output=_exclude(), sampling=SamplingConfig(beam_width=3))
    config = ExecutorConfig(max_beam_width=3, batch_scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=60,
                            enable_kv_cache_reuse=False)
    with Executor(tiny_engine, config) as executor:
        [request_id] = executor.enqueue_requests([request])
        result = collect(executor, [request_id], timeout=20)[request_id][-1].result
    assert len(result.output_token_ids) == 3 and all(len(beam) == 3 for beam in result.output_token_ids)
