"""Prometheus metrics consistent with the requests sent; 16 concurrent clients, no leaked blocks."""
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from triton_helpers import chat, wait_for

pytestmark = pytest.mark.integration


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of every sample on the metrics endpoint."""
    samples = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            labels = dict(sample.labels)
            if "le" in labels:  # "10" and "10.0" name the same bucket
                labels["le"] = str(float(labels["le"]))
            samples[(sample.name, frozenset(labels.items()))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


LLM = {"model": "tensorrt_llm", "version": "1"}


def kv_and_requests(samples):
    """(used KV blocks, active requests) as the tensorrt_llm gauges report them."""
    return (value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used", **LLM),
            value(samples, "nv_trt_llm_request_metrics", request_type="active", **LLM))


def test_gauge_families_have_the_reference_labels(triton_server):
    samples = wait_for(lambda: (s := scrape(triton_server)) and
                       value(s, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max", **LLM) and s)
    assert value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per", **LLM) == 16
    for family, label, values in [
        ("nv_trt_llm_request_metrics", "request_type", ["active", "max", "scheduled", "context", "waiting"]),
        ("nv_trt_llm_runtime_memory_metrics", "memory_type", ["cpu", "gpu", "pinned"]),
        ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", ["max", "free", "used", "tokens_per", "fraction"]),
        ("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric",
         ["total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"]),
        ("nv_trt_llm_general_metrics", "general_type", ["timestamp", "iteration_counter"]),
    ]:
        for label_value in values:
            assert value(samples, family, **{label: label_value}, **LLM) is not None, (family, label_value)


def test_token_histograms_match_the_requests_sent(triton_server, smollm2_engine_dir):
    from transformers import AutoTokenizer

    prompt = chat("Name a colour.")
    prompt_len = len(AutoTokenizer.from_pretrained(smollm2_engine_dir).encode(prompt))
    before = scrape(triton_server)
    n, max_tokens = 3, 5
    # end_id -1: never stops early, so exactly max_tokens come out. The n requests at once (one decode).
    body = {"text_input": prompt, "max_tokens": max_tokens, "end_id": -1, "exclude_input_in_output": True}
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda _: triton_server.generate("ensemble", body), range(n)))
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses]
    inputs = {"response_metric_type": "total_input_tokens", **LLM}
    outputs = {"response_metric_type": "total_output_tokens", **LLM}
    # tensorrt_llm observes a request's histograms just after sending its final response, so the
    # last one may come a moment after the client has every answer (seen once in make test)
    count = ("nv_llm_inter_token_latency_seconds_count", LLM)
    assert wait_for(lambda: (value(scrape(triton_server), count[0], **count[1]) or 0)
                    - (value(before, count[0], **count[1]) or 0) >= n)
    after = scrape(triton_server)

    def delta(name, **labels):
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert delta("nv_llm_input_token_len_count", **inputs) == n
    assert delta("nv_llm_input_token_len_sum", **inputs) == n * prompt_len
    assert delta("nv_llm_output_token_len_count", **outputs) == n
    assert delta("nv_llm_output_token_len_sum", **outputs) == n * max_tokens
    assert delta("nv_llm_output_token_len_bucket", le="10.0", **outputs) == n
    assert delta("nv_llm_time_to_first_token_seconds_count", **LLM) == n
    assert delta("nv_llm_inter_token_latency_seconds_count", **LLM) == n
    for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing"):
        # Triton counts a request once its FINAL flag is processed, just after the reply.
        def counted(model=model):
            now = scrape(triton_server)
            key = ("nv_inference_request_success_total", frozenset({"model": model, "version": "1"}.items()))
            return now.get(key, 0) - before.get(key, 0) >= n
        assert wait_for(counted), model
    assert wait_for(lambda: kv_and_requests(scrape(triton_server)) == (0.0, 0.0))


CLIENTS = 16


def test_16_concurrent_clients_all_answered_and_no_blocks_leaked(triton_server):
    # 2 tokens each (a context step and a decode step): 16 requests still queue for the engine's 8 batch
    # slots and overlap in every step (4 until 2026-11-30: two more decode steps a wave, nothing more checked).
    # (32 clients until 2026-11-30: four waves of prefills where two queue as well; 9.7 s of CI's fresh clone.)
    def ask(i):
        body = {"text_input": chat(f"What is {i} plus {i}?"), "max_tokens": 2, "exclude_input_in_output": True}
        return triton_server.generate("ensemble", body, timeout=300)

    before = scrape(triton_server)
    with ThreadPoolExecutor(CLIENTS) as pool:
        responses = list(pool.map(ask, range(CLIENTS)))
    assert [r.status_code for r in responses] == [200] * CLIENTS, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["text_output"] for r in responses)
    success = ("nv_inference_request_success_total", frozenset({"model": "ensemble", "version": "1"}.items()))
    assert wait_for(lambda: scrape(triton_server)[success] - before.get(success, 0) == CLIENTS)
    assert wait_for(lambda: kv_and_requests(scrape(triton_server)) == (0.0, 0.0))
    samples = scrape(triton_server)
    total = value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max", **LLM)
    free = value(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free", **LLM)
    assert free == total


def test_prefix_cache_hits_are_counted(triton_server):
    """tritonllm_kv_cache_blocks_total: a prompt sent twice takes its full blocks from the prefix
    cache the second time (reused), fresh ones the first (new)."""
    body = {"text_input": chat("Say something about caches. " * 6), "max_tokens": 2}

    def counts():
        samples = scrape(triton_server)
        return tuple(value(samples, "tritonllm_kv_cache_blocks_total", source=source, **LLM) or 0.0
                     for source in ("reused", "new"))

    reused_before, new_before = counts()
    for _ in range(2):
        assert triton_server.generate("ensemble", body, timeout=120).status_code == 200
    assert wait_for(lambda: counts()[0] - reused_before >= 2 and counts()[1] > new_before)
