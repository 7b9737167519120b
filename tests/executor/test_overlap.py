"""Overlapped scheduling (engine/executor/overlap.py): step N+1 launches before step N's tokens
reach the host, so stops that only the host can judge are seen one step late. These tests pin
that the late step changes nothing a client sees: outputs equal the synchronous executor's token
for token (float32), the dropped token is never emitted, and no KV block is left behind.

CPU by default; ``TRITONLLM_TEST_DEVICE=cuda`` runs the same tests on a GPU (decode CUDA graphs
resolving the placeholders, the Triton sampler, pinned-memory token transfers)."""
from __future__ import annotations

import os
import time

import pytest
import torch
from executor_testing import collect, final_tokens

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.overlap import placeholder, resolve_placeholders
from engine.executor.request import FinishReason, OutputConfig, Request, SamplingConfig

PROMPT = [3, 17, 5, 99, 42, 8, 1]
EXCLUDE = OutputConfig(exclude_input_from_output=True)
DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def overlapped(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=2, device=DEVICE)) as ex:
        yield ex


@pytest.fixture(scope="module")
def synchronous(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=2, disable_overlap_scheduler=True,
                                                 device=DEVICE)) as ex:
        yield ex


def run(ex, requests: list[Request]) -> list[list]:
    ids = ex.enqueue_requests(requests)
    responses = collect(ex, ids)
    return [responses[i] for i in ids]


def steps_and_tokens(ex, request: Request) -> tuple[int, list]:
    """(forward steps the request took, its responses) when it runs alone."""
    before = settled_iteration(ex)
    [responses] = run(ex, [request])
    return settled_iteration(ex) - before, responses


def settled_iteration(ex) -> int:
    """The iteration count once the loop is idle: a step launched after the stop was known still
    finishes (and is counted) after the final response went out."""
    last, deadline = -1, time.monotonic() + 2
    while time.monotonic() < deadline:
        current = ex.get_latest_iteration_stats().iter
        if current == last:
            return current
        last = current
        time.sleep(0.05)
    return last


def assert_no_blocks_held(ex) -> None:
    deadline = time.monotonic() + 2
    while ex.get_latest_iteration_stats().kv_cache_stats.used_num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = ex.get_latest_iteration_stats()
    assert stats.kv_cache_stats.used_num_blocks == 0
    assert stats.num_active_requests == 0


def greedy(ex, max_tokens: int = 12) -> list[int]:
    [responses] = run(ex, [Request(PROMPT, max_tokens, output=EXCLUDE)])
    return final_tokens(responses)


def test_resolve_placeholders_reads_the_ring():
    ring = torch.tensor([40, 41, 42, 43])
    ids = torch.tensor([5, placeholder(2), 0, placeholder(0)])
    assert resolve_placeholders(ids, ring).tolist() == [5, 42, 0, 40]


def test_max_tokens_stop_takes_no_extra_step(overlapped, synchronous):
    request = Request(PROMPT, 6, output=EXCLUDE)
    steps_sync, sync = steps_and_tokens(synchronous, request)
    steps_overlap, overlap = steps_and_tokens(overlapped, request)
    assert final_tokens(overlap) == final_tokens(sync) and len(final_tokens(sync)) == 6
    assert steps_sync == steps_overlap == 6  # the length stop is known before the step is scheduled
    assert overlap[-1].result.finish_reasons == [FinishReason.LENGTH]
    assert_no_blocks_held(overlapped)


def test_end_id_seen_one_step_late_drops_that_steps_token(overlapped, synchronous):
    reference = greedy(synchronous)
    end_id = reference[4]
    cut = reference.index(end_id)
    request = Request(PROMPT, 12, end_id=end_id, streaming=True, output=EXCLUDE)
    steps_sync, sync = steps_and_tokens(synchronous, request)
    steps_overlap, overlap = steps_and_tokens(overlapped, request)
    assert final_tokens(overlap) == final_tokens(sync) == reference[:cut]
    assert overlap[-1].result.finish_reasons == [FinishReason.END_ID]
    assert steps_sync == cut + 1 and steps_overlap == cut + 2  # one step late, its token never sent
    assert_no_blocks_held(overlapped)


def test_stop_word_seen_one_step_late_drops_that_steps_token(overlapped, synchronous):
    reference = greedy(synchronous)
    word = reference[3:5]
    request = Request(PROMPT, 12, stop_words=[word], streaming=True, output=EXCLUDE)
    _, sync = steps_and_tokens(synchronous, request)
    _, overlap = steps_and_tokens(overlapped, request)
    assert final_tokens(overlap) == final_tokens(sync) == reference[:5]
    assert overlap[-1].result.finish_reasons == [FinishReason.STOP_WORDS]
    assert_no_blocks_held(overlapped)


def test_cancel_with_a_step_in_flight_sends_no_placeholder(overlapped):
    reference = greedy(overlapped, max_tokens=100)
    [request_id] = overlapped.enqueue_requests([Request(PROMPT, 100, streaming=True, output=EXCLUDE)])
    first = []
    while not first:
        first = overlapped.await_responses(timeout=1.0)
    overlapped.cancel_request(request_id)
    responses = first + collect(overlapped, [request_id])[request_id]
    sent = [t for r in responses for t in r.result.output_token_ids[0]]
    assert responses[-1].result.finish_reasons == [FinishReason.CANCELLED]
    assert 0 < len(sent) < 100 and sent == reference[:len(sent)]  # real tokens only, in order
    assert_no_blocks_held(overlapped)


def test_a_mixed_batch_equals_the_synchronous_executor(overlapped, synchronous):
    """Greedy, seeded sampling, log-probs, stops, streaming, several returned sequences, and requests
    that take the synchronous path (penalties, bad words, beams) in one batch."""
    reference = greedy(synchronous)

    def batch() -> list[Request]:
        return [
            Request(PROMPT, 9, output=EXCLUDE),
            Request(PROMPT[:3], 14, streaming=True, output=OutputConfig(exclude_input_from_output=True,
                                                                        return_log_probs=True)),
            Request(PROMPT, 12, end_id=reference[6], output=EXCLUDE),
            Request(PROMPT[2:], 10, stop_words=[reference[2:4]], streaming=True, output=EXCLUDE),
            Request(PROMPT, 11, sampling=SamplingConfig(temperature=0.8, top_k=20, seed=7), output=EXCLUDE),
            Request(PROMPT[1:], 8, sampling=SamplingConfig(temperature=1.0, seed=3, num_return_sequences=2),
                    output=EXCLUDE),
            Request(PROMPT, 10, sampling=SamplingConfig(repetition_penalty=1.3), output=EXCLUDE),
            Request(PROMPT[:4], 7, bad_words=[[reference[1]]], output=EXCLUDE),
            Request(PROMPT, 6, sampling=SamplingConfig(beam_width=2), output=EXCLUDE),
        ]

    def outputs(ex):
        ids = ex.enqueue_requests(batch())
        responses = collect(ex, ids, streams={ids[5]: 2})
        result = []
        for request_id in ids:
            per_stream: dict[int, list] = {}
            for response in responses[request_id]:
                assert response.error is None, response.error
                r = response.result
                entry = per_stream.setdefault(r.sequence_index, [[], []])
                entry[0] += r.output_token_ids[0]
                entry[1] += (r.log_probs or [[]])[0]
            result.append(sorted((k, v[0], v[1]) for k, v in per_stream.items()))
        return result

    sync, overlap = outputs(synchronous), outputs(overlapped)
    for got, want in zip(overlap, sync):
        assert [(k, tokens) for k, tokens, _ in got] == [(k, tokens) for k, tokens, _ in want]
        for (_, _, lp_got), (_, _, lp_want) in zip(got, want):
            torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), rtol=1e-5, atol=1e-5)
    assert all(t >= 0 for entry in overlap for _, tokens, _ in entry for t in tokens)
    assert_no_blocks_held(overlapped)
