from types import SimpleNamespace

import pytest

from collections import Counter

from serving.metrics import (GAUGES, GaugeChanges, RequestLatency, TOKEN_LEN_BUCKETS, cumulative_counts, gauge_values,
                             generated_token_count, kv_block_counts, lora_counts, timestamp_seconds)


def stats(**overrides):
    kv = SimpleNamespace(max_num_blocks=100, free_num_blocks=75, used_num_blocks=25,
                         tokens_per_block=16, reused_blocks=0)
    base = dict(timestamp=1715988519.0, iter=42, num_active_requests=5, max_num_active_requests=64,
                num_queued_requests=1, num_scheduled_requests=3, num_context_requests=1,
                num_gen_requests=2, num_ctx_tokens=30, num_paused_requests=0, cpu_mem_usage=1000,
                gpu_mem_usage=0, pinned_mem_usage=0, kv_cache_stats=kv, num_kv_transfers_total=2,
                kv_cache_transfer_ms_total=1.5,
                cross_kv_cache_stats=SimpleNamespace(max_num_blocks=8, free_num_blocks=6, used_num_blocks=2,
                                                     tokens_per_block=32),
                lora_cache_stats=SimpleNamespace(adapters_in_gpu=2, adapters_in_host=3, gpu_loads=4, gpu_evictions=1,
                                                 gpu_hits=7, host_loads=3, host_evictions=0,
                                                 requests=Counter({"sql": 5, "lora_task_id 3": 6})))
    base.update(overrides)
    return SimpleNamespace(**base)


def test_a_gauge_is_set_again_only_when_its_value_changed():
    """GaugeChanges (the tensorrt_llm model's gauge updates, each a round trip to the server): all gauges
    the first time, none while the stats stay put (an idle engine), then only those that moved; a gauge
    whose stat was missing for a while and comes back with the value set last is not set again."""
    changes = GaugeChanges()
    first = gauge_values(stats())
    assert changes.changed(first) == first
    assert changes.changed(gauge_values(stats())) == {}
    moved = changes.changed(gauge_values(stats(num_active_requests=6, iter=43)))
    assert moved == {("nv_trt_llm_request_metrics", "active"): 6.0, ("nv_trt_llm_request_metrics", "waiting"): 3.0,
                     ("nv_trt_llm_general_metrics", "iteration_counter"): 43.0}
    assert changes.changed(gauge_values(stats(num_active_requests=6, iter=43, cross_kv_cache_stats=None))) == {}
    assert changes.changed(gauge_values(stats(num_active_requests=6, iter=43))) == {}
    assert changes.changed(gauge_values(stats())) == {key: first[key] for key in moved}


def test_gauge_values_follow_the_reference_mapping():
    values = gauge_values(stats())
    assert values[("nv_trt_llm_request_metrics", "waiting")] == 2  # active - scheduled
    assert values[("nv_trt_llm_request_metrics", "max")] == 64
    assert values[("nv_trt_llm_kv_cache_block_metrics", "fraction")] == 0.25
    assert values[("nv_trt_llm_kv_cache_block_metrics", "tokens_per")] == 16
    assert values[("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens")] == 30
    assert values[("nv_trt_llm_general_metrics", "iteration_counter")] == 42
    assert values[("tritonllm_lora_adapters", "gpu")] == 2 and values[("tritonllm_lora_adapters", "host")] == 3
    assert values[("nv_trt_llm_disaggregated_serving_metrics", "kv_cache_transfer_ms")] == 1.5
    assert values[("nv_trt_llm_disaggregated_serving_metrics", "request_count")] == 2
    assert values[("tritonllm_cross_kv_cache_block_metrics", "free")] == 6
    assert values[("tritonllm_cross_kv_cache_block_metrics", "used")] == 2
    expected = sum(len(getters) for *_, getters in GAUGES)
    assert len(values) == expected
    # a decoder-only engine reports no cross pool: those gauges are skipped
    assert ("tritonllm_cross_kv_cache_block_metrics", "max") not in gauge_values(stats(cross_kv_cache_stats=None))


def test_lora_counters_come_from_the_cache_stats_and_are_absent_while_lora_is_off():
    counts = lora_counts(stats())
    assert counts[("tritonllm_lora_cache_events_total", "gpu_load")] == 4
    assert counts[("tritonllm_lora_cache_events_total", "gpu_eviction")] == 1
    assert counts[("tritonllm_lora_cache_events_total", "gpu_hit")] == 7
    assert counts[("tritonllm_lora_requests_total", "sql")] == 5
    assert counts[("tritonllm_lora_requests_total", "lora_task_id 3")] == 6
    assert lora_counts(stats(lora_cache_stats=None)) == {}
    assert ("tritonllm_lora_adapters", "gpu") not in gauge_values(stats(lora_cache_stats=None))


def test_kv_block_counters_count_reused_and_new_blocks():
    kv = SimpleNamespace(max_num_blocks=100, free_num_blocks=75, used_num_blocks=25, tokens_per_block=16,
                         reused_blocks=12, alloc_new_blocks=30)
    counts = kv_block_counts(stats(kv_cache_stats=kv))
    assert counts == {("tritonllm_kv_cache_blocks_total", "reused"): 12, ("tritonllm_kv_cache_blocks_total", "host"): 0,
                      ("tritonllm_kv_cache_blocks_total", "new"): 30}
    assert counts.items() <= cumulative_counts(stats(kv_cache_stats=kv)).items()
    assert kv_block_counts(stats()) == {}  # stats without the cumulative counts publish none


def test_kv_block_counter_splits_blocks_brought_back_from_host_memory_off_reused():
    """With the KV host tier, reused_blocks include the onboarded ones: the sources partition them."""
    kv = SimpleNamespace(max_num_blocks=100, free_num_blocks=75, used_num_blocks=25, tokens_per_block=16,
                         reused_blocks=12, alloc_new_blocks=30, onboarded_blocks=5)
    assert kv_block_counts(stats(kv_cache_stats=kv)) == {
        ("tritonllm_kv_cache_blocks_total", "reused"): 7, ("tritonllm_kv_cache_blocks_total", "host"): 5,
        ("tritonllm_kv_cache_blocks_total", "new"): 30}


def test_missing_stats_are_skipped_and_empty_pool_fraction_is_zero():
    kv = SimpleNamespace(max_num_blocks=0, free_num_blocks=0, used_num_blocks=0, tokens_per_block=16)
    values = gauge_values(SimpleNamespace(kv_cache_stats=kv))
    assert values[("nv_trt_llm_kv_cache_block_metrics", "fraction")] == 0.0
    assert ("nv_trt_llm_request_metrics", "active") not in values


def test_timestamps():
    assert timestamp_seconds("05-17-2024 23:28:39.000000") == 1715988519
    assert timestamp_seconds("01-01-1970 00:00:00.000000") == 0
    assert timestamp_seconds(1715988519_000_000_000) == pytest.approx(1715988519)


def test_token_counts_and_buckets():
    assert TOKEN_LEN_BUCKETS == [10, 50, 100, 500, 1000]
    assert generated_token_count([13], prompt_len=10, prompt_included=True) == 3
    assert generated_token_count([3, 3], prompt_len=10, prompt_included=False) == 6


def test_latency_from_wall_clock_and_from_executor_perf():
    latency = RequestLatency(arrival=10.0)
    latency.on_tokens(10.5, 1)
    latency.on_tokens(10.7, 2)
    latency.on_tokens(11.0, 0)  # an empty final response adds nothing
    assert latency.time_to_first_token() == pytest.approx(0.5)
    assert latency.inter_token_latency() == pytest.approx(0.1)
    perf = SimpleNamespace(arrival_time_ns=1_000_000_000, first_token_time_ns=1_200_000_000,
                           last_token_time_ns=1_600_000_000)
    latency.use_perf(perf)
    assert latency.time_to_first_token() == pytest.approx(0.2)
    assert latency.inter_token_latency() == pytest.approx(0.2)
    assert RequestLatency(arrival=0.0).inter_token_latency() is None


def test_static_batching_publishes_v1_metrics_instead():
    values = gauge_values(stats(num_gen_tokens=7), static_batching=True)
    assert values[("nv_trt_llm_v1_metrics", "total_generation_tokens")] == 7
    assert values[("nv_trt_llm_v1_metrics", "total_context_tokens")] == 30
    assert not any(family == "nv_trt_llm_inflight_batcher_metrics" for family, _ in values)


def test_speculative_counters_come_from_the_iteration_stats_without_a_label():
    from serving.metrics import COUNTER_FAMILIES, speculative_counts

    counts = speculative_counts(stats(num_draft_tokens_total=40, num_accepted_draft_tokens_total=31))
    assert counts == {("tritonllm_speculative_draft_tokens_total", ""): 40,
                      ("tritonllm_speculative_accepted_draft_tokens_total", ""): 31}
    assert counts.items() <= cumulative_counts(stats(num_draft_tokens_total=40,
                                                     num_accepted_draft_tokens_total=31)).items()
    assert speculative_counts(stats()) == {}  # stats without the counts publish none
    labels = {name: label for name, _, label in COUNTER_FAMILIES}
    assert labels["tritonllm_speculative_draft_tokens_total"] is None
    assert labels["tritonllm_speculative_accepted_draft_tokens_total"] is None


def test_speculative_counters_read_the_executors_stats():
    from engine.executor.stats import IterationStats
    from serving.metrics import speculative_counts

    assert set(speculative_counts(IterationStats(num_draft_tokens_total=3, num_accepted_draft_tokens_total=2)).values()) == {3, 2}
