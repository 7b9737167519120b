"""Executor API on a tiny random-weight engine: sampling, stop/end handling, outputs, errors, cancellation."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from executor_testing import collect, final_tokens

from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError
from engine.executor.request import FinishReason, OutputConfig, Request, SamplingConfig

PROMPT = [3, 17, 5, 99, 42, 8, 1]
EXCLUDE = OutputConfig(exclude_input_from_output=True)


@pytest.fixture(scope="module")
def executor(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=3, max_queue_size=0)) as ex:
        yield ex


def run(executor, *requests, streams=None):
    ids = executor.enqueue_requests(list(requests))
    responses = collect(executor, ids, streams=streams)
    return [responses[i] for i in ids]


def tokens(executor, **kwargs):
    request = Request(PROMPT, kwargs.pop("max_tokens", 12), output=kwargs.pop("output", EXCLUDE), **kwargs)
    return final_tokens(run(executor, request)[0])


def sampled(executor, **sampling):
    return tokens(executor, sampling=SamplingConfig(**sampling))


def test_seed_reproducible_and_seeds_differ(executor):
    a = sampled(executor, temperature=3.0, top_k=0, top_p=1.0, seed=11)
    assert a == sampled(executor, temperature=3.0, top_k=0, top_p=1.0, seed=11)
    assert a != sampled(executor, temperature=3.0, top_k=0, top_p=1.0, seed=12)
    assert a != sampled(executor)  # and it is not greedy


def test_top_k_1_and_tiny_top_p_equal_greedy(executor):
    greedy = tokens(executor)
    assert sampled(executor, top_k=1, temperature=2.0, seed=3) == greedy
    assert sampled(executor, top_p=1e-6, temperature=2.0, seed=3) == greedy
    assert sampled(executor, temperature=0.0, top_k=50, seed=3) == greedy


def test_stop_word_stops_and_stays_in_the_output(executor):
    greedy = tokens(executor)
    stop = greedy[3:5]
    [responses] = run(executor, Request(PROMPT, 12, output=EXCLUDE, stop_words=[[127, 126], stop]))
    result = responses[-1].result
    assert result.output_token_ids == [greedy[:5]]
    assert result.finish_reasons == [FinishReason.STOP_WORDS]


def test_end_id_ends_without_being_emitted_and_min_tokens_suppresses_it(executor):
    greedy = tokens(executor)
    end_id = greedy[2]
    first = greedy.index(end_id)
    [responses] = run(executor, Request(PROMPT, 12, end_id=end_id, output=EXCLUDE))
    assert responses[-1].result.output_token_ids == [greedy[:first]]
    assert responses[-1].result.finish_reasons == [FinishReason.END_ID]
    out = tokens(executor, end_id=end_id, sampling=SamplingConfig(min_tokens=first + 2))
    assert len(out) >= first + 2 and end_id not in out[:first + 2]


def test_streaming_deltas_add_up_to_the_non_streaming_output(executor):
    full = run(executor, Request(PROMPT, 10))[0]
    assert len(full) == 1 and full[0].result.output_token_ids[0][:len(PROMPT)] == PROMPT  # prompt included
    streamed = run(executor, Request(PROMPT, 10, streaming=True))[0]
    assert [t for r in streamed for t in r.result.output_token_ids[0]] == full[0].result.output_token_ids[0][len(PROMPT):]
    assert all(not r.result.is_final for r in streamed[:-1]) and streamed[-1].result.finish_reasons == [FinishReason.LENGTH]


def test_log_probs_logits_and_perf_metrics(executor, tiny_hf):
    out = OutputConfig(return_log_probs=True, return_context_logits=True, return_generation_logits=True,
                       return_perf_metrics=True, exclude_input_from_output=True)
    [responses] = run(executor, Request(PROMPT, 4, output=out))
    result = responses[-1].result
    generated = result.output_token_ids[0]
    with torch.no_grad():
        hf = tiny_hf(torch.tensor([PROMPT + generated])).logits[0]
    torch.testing.assert_close(result.context_logits, hf[:len(PROMPT)], atol=1e-4, rtol=1e-4)
    assert result.generation_logits.shape == (1, 4, 128)
    torch.testing.assert_close(result.generation_logits[0], hf[len(PROMPT) - 1:-1], atol=1e-4, rtol=1e-4)
    expected_lp = hf[len(PROMPT) - 1:-1].log_softmax(-1).gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(result.log_probs[0]), expected_lp, atol=1e-4, rtol=1e-4)
    assert result.cum_log_probs[0] == pytest.approx(sum(result.log_probs[0]), abs=1e-5)
    perf = result.perf
    assert 0 < perf.arrival_time_ns <= perf.first_scheduled_time_ns <= perf.first_token_time_ns <= perf.last_token_time_ns
    assert perf.kv_cache_alloc_total_blocks == perf.kv_cache_alloc_new_blocks + perf.kv_cache_reused_blocks == 3


def test_num_return_sequences_gives_independent_streams(executor):
    request = Request(PROMPT, 8, output=EXCLUDE, sampling=SamplingConfig(num_return_sequences=3, temperature=3.0,
                                                                         top_p=1.0, seed=5))
    ids = executor.enqueue_requests([request])
    responses = collect(executor, ids, streams={ids[0]: 3})[ids[0]]
    by_index = {r.result.sequence_index: r.result.output_token_ids[0] for r in responses}
    assert sorted(by_index) == [0, 1, 2] and all(len(t) == 8 for t in by_index.values())
    assert len({tuple(t) for t in by_index.values()}) == 3


def test_returned_sequences_share_the_prompt_kv_and_stay_exact(executor):
    prompt = list(range(60, 79))  # 19 tokens, new to the cache: four full blocks of 4 to share
    out = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    request = Request(prompt, 6, output=out, sampling=SamplingConfig(num_return_sequences=3))
    [request_id] = executor.enqueue_requests([request])
    responses = collect(executor, [request_id], streams={request_id: 3})[request_id]
    perf = responses[-1].result.perf
    single = final_tokens(run(executor, Request(prompt, 6, output=EXCLUDE))[0])
    assert sorted(r.result.sequence_index for r in responses) == [0, 1, 2]
    assert all(r.result.output_token_ids == [single] for r in responses)  # greedy: three exact copies
    # KV for 24 tokens = 6 blocks per sequence, 18 unshared; the two forks take sequence 0's 4 prompt blocks
    assert perf.kv_cache_alloc_new_blocks == 18 - 2 * 4 and perf.kv_cache_reused_blocks == 0


def test_beam_search_matches_transformers(executor, tiny_hf):
    request = Request(PROMPT, 6, output=OutputConfig(exclude_input_from_output=True, return_log_probs=True),
                      sampling=SamplingConfig(beam_width=3, length_penalty=1.0))
    [responses] = run(executor, request)
    result = responses[-1].result
    assert len(result.output_token_ids) == 3 and result.cum_log_probs == sorted(result.cum_log_probs, reverse=True)
    hf = tiny_hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, num_beams=3, num_return_sequences=3,
                          do_sample=False, early_stopping=True, length_penalty=1.0, output_scores=True,
                          return_dict_in_generate=True)
    assert result.output_token_ids == hf.sequences[:, len(PROMPT):].tolist()
    torch.testing.assert_close(torch.tensor(result.cum_log_probs), hf.sequences_scores * 6, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(input_token_ids=[]), "input_token_ids is empty"),
    (dict(max_tokens=0), "max_tokens must be a positive integer, got 0"),
    (dict(max_tokens=200), "exceeds max_seq_len (128)"),
    (dict(input_token_ids=[1, 128]), "token id 128 outside the vocabulary; allowed ids are 0..127"),
    (dict(sampling=SamplingConfig(top_p=1.5)), "top_p must be in (0, 1], got 1.5"),
    (dict(sampling=SamplingConfig(top_p=0.0)), "top_p must be in (0, 1], got 0.0"),
    (dict(sampling=SamplingConfig(temperature=-0.5)), "temperature must be >= 0, got -0.5"),
    (dict(sampling=SamplingConfig(top_k=-1)), "top_k must be >= 0, got -1"),
    (dict(sampling=SamplingConfig(beam_width=4)), "beam_width 4 is not allowed; allowed: 1..3"),
    (dict(embedding_bias=[0.0] * 5), "embedding_bias has 5 values; it must have vocab_size (128)"),
    (dict(sampling=SamplingConfig(temperature=float("nan"))), "temperature must be a finite number, got nan"),
    (dict(sampling=SamplingConfig(frequency_penalty=float("inf"))), "frequency_penalty must be a finite number"),
    (dict(end_id=128), "end_id must be -1 (none) or a token id 0..127, got 128"),
    (dict(end_id=-7), "end_id must be -1 (none) or a token id 0..127, got -7"),
    (dict(pad_id=-3), "pad_id must be -1 (none) or a token id 0..127, got -3"),
])
def test_bad_request_gets_a_clear_error_and_others_complete(executor, request_kwargs, message):
    bad = Request(**{"input_token_ids": PROMPT, "max_tokens": 4, **request_kwargs})
    good = Request(PROMPT, 4)
    bad_responses, good_responses = run(executor, bad, good)
    assert len(bad_responses) == 1 and message in bad_responses[0].error
    assert good_responses[-1].error is None and len(good_responses[-1].result.output_token_ids[0]) == len(PROMPT) + 4


def test_requests_that_cannot_fit_the_kv_cache_are_refused(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=3, max_tokens_in_paged_kv_cache=40)) as ex:
        too_long, beams_too_wide, fits = run(
            ex, Request(PROMPT, 40), Request(PROMPT, 10, sampling=SamplingConfig(beam_width=3)), Request(PROMPT, 10))
    assert "needs 12 KV cache blocks but the cache holds only 10" in too_long[0].error
    assert "x beam_width 3 needs 15 KV cache blocks" in beams_too_wide[0].error
    assert fits[-1].error is None


def test_queue_full_rejects_with_the_reference_message(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_queue_size=2)) as ex:
        ids = ex.enqueue_requests([Request(PROMPT, 4) for _ in range(6)])
        responses = collect(ex, ids)
    errors = [responses[i][0].error for i in ids if responses[i][0].error]
    assert errors and all("Maximum queue size of 2 has been reached, rejecting request" in e for e in errors)
    assert sum(responses[i][-1].error is None for i in ids) >= 2


def test_cancel_ends_within_an_iteration_and_frees_blocks(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        [request_id] = ex.enqueue_requests([Request(PROMPT, 100, streaming=True)])
        first = []
        while not first:
            first = ex.await_responses(timeout=1.0)
        iteration = ex.get_latest_iteration_stats().iter
        ex.cancel_request(request_id)
        responses = collect(ex, [request_id])[request_id]
        final = responses[-1].result
        assert final.is_final and final.finish_reasons == [FinishReason.CANCELLED]
        generated = sum(len(r.result.output_token_ids[0]) for r in first + responses)
        assert generated < 100
        time.sleep(0.05)
        stats = ex.get_latest_iteration_stats()
        assert stats.kv_cache_stats.free_num_blocks == stats.kv_cache_stats.max_num_blocks
        assert stats.num_active_requests == 0
        assert iteration > 0


def test_forward_failure_fails_its_requests_and_the_loop_keeps_serving(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        real_forward, calls = ex.runner.forward, []

        def fail_once(batch, **kwargs):  # fault injection: the first forward raises
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected device fault")
            return real_forward(batch, **kwargs)

        ex.runner.forward = fail_once
        [failed] = run(ex, Request(PROMPT, 4))
        assert "injected device fault" in failed[-1].error
        [ok] = run(ex, Request(PROMPT, 4))
        assert ok[-1].error is None
        assert ex.get_latest_iteration_stats().kv_cache_stats.used_num_blocks == 0


def test_response_callback_receives_everything(tiny_engine):
    got, done = [], threading.Event()

    def callback(responses):
        got.extend(responses)
        if any(r.is_final for r in responses):
            done.set()

    with Executor(tiny_engine, ExecutorConfig(), response_callback=callback) as ex:
        ex.enqueue_request(Request(PROMPT, 5, streaming=True))
        assert done.wait(30)
    assert sum(len(r.result.output_token_ids[0]) for r in got) == 5


@pytest.mark.parametrize("overlap", [True, False])
def test_stream_interval_sends_the_first_token_at_once_then_every_n(tiny_engine, overlap):
    """stream_interval=4 over 14 tokens: 1 at once (time to first token unchanged), then 4, 4, 4,
    and the final response carries the last 1. The callback sees every response as the loop
    delivers it, so nothing coalesces on the way."""
    got, done = [], threading.Event()

    def callback(responses):
        got.extend(responses)
        if any(r.is_final for r in responses):
            done.set()

    config = ExecutorConfig(stream_interval=4, disable_overlap_scheduler=not overlap)
    with Executor(tiny_engine, config, response_callback=callback) as ex:
        ex.enqueue_request(Request(PROMPT, 14, streaming=True, output=OutputConfig(return_log_probs=True)))
        assert done.wait(30)
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        unary = final_tokens(run(ex, Request(PROMPT, 14, output=EXCLUDE))[0])
    results = [r.result for r in got]
    assert [len(r.output_token_ids[0]) for r in results] == [1, 4, 4, 4, 1]
    assert [len(r.log_probs[0]) for r in results] == [1, 4, 4, 4, 1]
    assert [t for r in results for t in r.output_token_ids[0]] == unary
    assert [r.is_final for r in results] == [False] * 4 + [True]


def test_stream_interval_still_ends_a_stream_stopped_between_sends(tiny_engine):
    """An end_id that arrives while tokens are held back: the final response carries them."""
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        greedy = final_tokens(run(ex, Request(PROMPT, 12, output=EXCLUDE))[0])
    end_id = greedy[6]
    first = greedy.index(end_id)
    with Executor(tiny_engine, ExecutorConfig(stream_interval=5)) as ex:
        [responses] = run(ex, Request(PROMPT, 12, end_id=end_id, streaming=True))
    assert [t for r in responses for t in r.result.output_token_ids[0]] == greedy[:first]
    assert responses[-1].result.is_final and responses[-1].result.finish_reasons == [FinishReason.END_ID]


@pytest.mark.parametrize("field, value, message", [
    ("batch_scheduler_policy", "fifo", "batch_scheduler_policy value of 'fifo' is not supported"),
    ("max_batch_size", 0, "max_batch_size must be a positive integer"),
    ("kv_cache_free_gpu_mem_fraction", 1.5, "kv_cache_free_gpu_mem_fraction must be in (0, 1]"),
    ("max_beam_width", 0, "max_beam_width must be an integer >= 1"),
    ("batching_type", "v2", "batching_type value of 'v2' is not supported"),
    ("stream_interval", 0, "stream_interval must be an integer >= 1 (tokens per streamed response)"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ExecutorConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ExecutorConfig(**{field: value}).validate()


def test_policy_names_are_case_insensitive():
    assert ExecutorConfig(batch_scheduler_policy="MAX_UTILIZATION").validate().batch_scheduler_policy == "max_utilization"


def test_slow_streaming_consumer_gets_coalesced_responses(executor):
    start = executor.get_latest_iteration_stats().iter
    [request_id] = executor.enqueue_requests([Request(PROMPT, 10, streaming=True, output=OutputConfig(return_log_probs=True))])
    deadline = time.monotonic() + 30
    while True:  # do not poll responses until the request has run all its iterations
        stats = executor.get_latest_iteration_stats()
        if stats.iter >= start + 10 and stats.num_active_requests == 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    responses = [r for r in executor.await_responses(timeout=1.0) if r.request_id == request_id]
    assert len(responses) == 1  # ten iterations' worth of tokens in one response
    result = responses[0].result
    assert result.is_final and len(result.output_token_ids[0]) == 10 and len(result.log_probs[0]) == 10
    assert result.output_token_ids[0] == tokens(executor, max_tokens=10)


def test_numpy_ids_and_triton_style_defaults_are_accepted(executor):
    import numpy as np

    request = Request(np.array(PROMPT, dtype=np.int32), np.int64(6), end_id=-1, output=EXCLUDE,
                      sampling=SamplingConfig(beam_width=0, num_return_sequences=None))
    assert final_tokens(run(executor, request)[0]) == tokens(executor, max_tokens=6)


def test_request_gauges_never_go_negative_and_read_zero_when_idle(tiny_engine):
    """Metrics publish `waiting = active - scheduled` from the latest stats: every iteration counts
    as active the requests in flight in it (those finishing in it too), and once the executor
    drains, the latest stats say nothing is active or scheduled (the history keeps the iteration)."""
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        run(ex, Request(PROMPT, 6, output=EXCLUDE), Request(PROMPT[:3], 2, output=EXCLUDE))
        history = ex.get_iteration_stats_history()
        assert history and all(s.num_active_requests >= s.num_scheduled_requests for s in history)
        assert history[-1].num_scheduled_requests == 1 and history[-1].num_active_requests == 1
        time.sleep(0.05)
        latest = ex.get_latest_iteration_stats()
        assert (latest.num_active_requests, latest.num_scheduled_requests, latest.num_gen_requests) == (0, 0, 0)
        assert latest.iter == history[-1].iter


def test_iteration_log_has_a_line_per_iteration_matching_the_history(tiny_engine, tmp_path, monkeypatch):
    """$TRITONLLM_ITERATION_LOG (serving_bench's diagnostics): one line per iteration with its
    period, prefill and decode tokens, and the time spent handing responses on."""
    from engine.executor.stats import ITERATION_LOG_ENV, read_iteration_log

    log = tmp_path / "iterations.log"
    monkeypatch.setenv(ITERATION_LOG_ENV, str(log))
    started_ns = time.time_ns()
    with Executor(tiny_engine, ExecutorConfig()) as ex:
        run(ex, Request(PROMPT, 6, output=EXCLUDE, streaming=True), Request(PROMPT[:3], 2, output=EXCLUDE))
        history = ex.get_iteration_stats_history()
    rows = read_iteration_log(str(log), started_ns)
    assert [r["iter"] for r in rows] == [s.iter for s in history]
    assert [(r["num_ctx_tokens"], r["num_gen_tokens"]) for r in rows] == \
        [(s.num_ctx_tokens, s.num_gen_tokens) for s in history]
    assert rows[0]["num_ctx_tokens"] == len(PROMPT) + 3 and sum(r["num_gen_tokens"] for r in rows) == 5 + 1
    assert all(r["latency_ms"] > 0 and 0 <= r["deliver_ms"] <= r["latency_ms"] for r in rows)
    assert read_iteration_log(str(log), time.time_ns()) == []  # nothing after the window's start
