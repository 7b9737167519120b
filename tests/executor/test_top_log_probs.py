"""Top log-probs (OutputConfig.num_top_log_probs): the k most likely tokens of every generated
position, from the same distribution as the chosen token's log-prob, on the overlapped and the
synchronous loop, streamed and unary, through the engine process, and refused where not offered."""
from __future__ import annotations

import math

import pytest
import torch
from executor_testing import collect, final_tokens

from engine.executor.engine_process import EngineProcess
from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import MAX_TOP_LOG_PROBS, OutputConfig, Request, SamplingConfig
from engine.executor.sampler import build_sampling_metadata, sample
from executor_testing import make_seq

PROMPT = [3, 17, 5, 99, 42, 8, 1]
GREEDY = SamplingConfig(temperature=0.0)


def top_output(k: int, **kwargs) -> OutputConfig:
    return OutputConfig(num_top_log_probs=k, exclude_input_from_output=True, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["overlapped", "synchronous"])
def executor(request, tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=2, disable_overlap_scheduler=request.param)) as ex:
        yield ex


def run(executor, *requests):
    ids = executor.enqueue_requests(list(requests))
    responses = collect(executor, ids)
    return [responses[i] for i in ids]


def same_log_probs(got, want):
    """Per-position log-prob lists equal up to float32 rounding: the two requests compared sit in
    different rows of one batch, and on some CPUs (seen on an AMD EPYC, not on the CI's Xeon) the
    float32 matmul rounds a row differently depending on its place in the batch."""
    assert len(got) == len(want)
    for got_row, want_row in zip(got, want):
        assert got_row == pytest.approx(want_row, rel=1e-5, abs=1e-5)


def joined(responses, name):
    """A single-stream request's per-token field, streamed deltas concatenated."""
    return [entry for r in responses for entry in getattr(r.result, name)[0]]


def test_greedy_tokens_are_the_top_1_and_top_log_probs_are_the_models(executor, tiny_hf):
    [responses] = run(executor, Request(PROMPT, 6, sampling=GREEDY, output=top_output(5)))
    result = responses[-1].result
    generated = result.output_token_ids[0]
    ids, values = result.top_log_prob_ids[0], result.top_log_probs[0]
    assert len(ids) == len(values) == len(result.log_probs[0]) == len(generated) == 6
    with torch.no_grad():  # the reference: transformers' logits at each generated position
        expected = tiny_hf(torch.tensor([PROMPT + generated])).logits[0, len(PROMPT) - 1:-1].log_softmax(-1)
    want_values, want_ids = expected.topk(5, dim=-1)
    assert ids == want_ids.tolist()
    torch.testing.assert_close(torch.tensor(values), want_values, atol=1e-4, rtol=1e-4)
    for token, chosen, row_ids, row_values in zip(generated, result.log_probs[0], ids, values):
        assert row_ids[0] == token and chosen == pytest.approx(row_values[0], abs=1e-6)
        assert row_values == sorted(row_values, reverse=True)
        assert sum(math.exp(v) for v in row_values) <= 1 + 1e-5


def test_sampled_tokens_keep_chosen_and_top_consistent(executor):
    """At a temperature, both come from log_softmax(logits / t): the chosen token's log-prob is
    the one listed for it among the alternatives whenever it is among them."""
    sampling = SamplingConfig(temperature=1.7, top_k=0, top_p=1.0, seed=5)
    [responses] = run(executor, Request(PROMPT, 8, sampling=sampling, output=top_output(MAX_TOP_LOG_PROBS)))
    result = responses[-1].result
    found = 0
    for token, chosen, row_ids, row_values in zip(result.output_token_ids[0], result.log_probs[0],
                                                  result.top_log_prob_ids[0], result.top_log_probs[0]):
        assert len(row_ids) == MAX_TOP_LOG_PROBS and row_values == sorted(row_values, reverse=True)
        if token in row_ids:
            found += 1
            assert chosen == pytest.approx(row_values[row_ids.index(token)], abs=1e-6)
        else:
            assert chosen <= row_values[-1] + 1e-6
    assert found  # 20 of 128 tokens: the draw lands among them


def test_k_0_leaves_the_outputs_as_they_were(executor):
    plain, with_zero = run(executor, Request(PROMPT, 5, sampling=GREEDY, output=OutputConfig(return_log_probs=True)),
                           Request(PROMPT, 5, sampling=GREEDY, output=OutputConfig(return_log_probs=True,
                                                                                   num_top_log_probs=0)))
    a, b = plain[-1].result, with_zero[-1].result
    assert a.output_token_ids == b.output_token_ids
    same_log_probs(a.log_probs, b.log_probs)
    assert a.top_log_prob_ids is None and b.top_log_prob_ids is None and b.top_log_probs is None


def test_streamed_entries_concatenate_to_the_unary_ones(executor):
    unary, streamed = run(executor, Request(PROMPT, 9, sampling=GREEDY, output=top_output(3)),
                          Request(PROMPT, 9, sampling=GREEDY, output=top_output(3), streaming=True))
    # How many responses carry the 9 tokens depends on timing: the response queue coalesces the
    # chunks of a stream whose reader lags (output.py), so a loaded machine may see one. The
    # entries must concatenate to the unary ones however the stream was split.
    assert streamed[-1].result.is_final
    assert final_tokens(streamed) == final_tokens(unary)
    assert joined(streamed, "top_log_prob_ids") == unary[-1].result.top_log_prob_ids[0]
    same_log_probs([joined(streamed, "log_probs")], [unary[-1].result.log_probs[0]])
    same_log_probs(joined(streamed, "top_log_probs"), unary[-1].result.top_log_probs[0])
    for response in streamed:  # each response carries its own tokens' entries only
        assert len(response.result.top_log_prob_ids[0]) == len(response.result.output_token_ids[0])


def test_rows_with_different_k_share_a_batch(executor):
    """One batch, k = 1, 0 and 7: every row gets its own k (or none), from one topk launch."""
    requests = [Request(PROMPT, 4, sampling=GREEDY, output=top_output(1)),
                Request(PROMPT[:3], 4, sampling=GREEDY, output=OutputConfig(exclude_input_from_output=True)),
                Request(PROMPT[2:], 4, sampling=GREEDY, output=top_output(7))]
    one, none, seven = (r[-1].result for r in run(executor, *requests))
    assert [len(row) for row in one.top_log_prob_ids[0]] == [1] * 4
    assert none.top_log_prob_ids is None and none.log_probs is None
    assert [len(row) for row in seven.top_log_probs[0]] == [7] * 4
    assert [row[0] for row in seven.top_log_prob_ids[0]] == seven.output_token_ids[0]


@pytest.mark.parametrize("k, sampling, message", [
    (MAX_TOP_LOG_PROBS + 1, SamplingConfig(), "num_top_log_probs must be an integer in 0..20"),
    (-1, SamplingConfig(), "num_top_log_probs must be an integer in 0..20"),
    (2, SamplingConfig(beam_width=2), "num_top_log_probs (2) is not supported with beam search"),
])
def test_bad_k_gets_an_error_naming_it(executor, k, sampling, message):
    [responses] = run(executor, Request(PROMPT, 3, sampling=sampling, output=OutputConfig(num_top_log_probs=k)))
    assert message in responses[-1].error


def test_beam_search_is_unaffected(executor):
    [responses] = run(executor, Request(PROMPT, 4, sampling=SamplingConfig(beam_width=2),
                                        output=OutputConfig(return_log_probs=True, num_top_log_probs=0)))
    assert responses[-1].error is None and responses[-1].result.top_log_prob_ids is None


def test_sampler_picks_the_best_scores_of_the_asking_rows_only():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    seqs = [make_seq([0]), make_seq([1]), make_seq([2])]
    seqs[0].state.request.output = OutputConfig(num_top_log_probs=2)
    seqs[2].state.request.output = OutputConfig(num_top_log_probs=3)
    md = build_sampling_metadata(seqs, 4, "cpu", False)
    assert md.return_log_probs and md.top_log_prob_rows == (0, 2) and md.max_top_log_probs == 3
    out = sample(logits, md)
    scores = logits.log_softmax(-1)
    assert out.top_log_prob_ids.tolist() == [[1, 3, 2], [3, 2, 1]]
    torch.testing.assert_close(out.top_log_probs, scores[[0, 2]].topk(3).values)
    torch.testing.assert_close(out.log_probs, scores.max(-1).values)


def test_engine_process_carries_top_log_probs(tiny_engine):
    process = EngineProcess(tiny_engine, ExecutorConfig())
    try:
        with Executor(tiny_engine, ExecutorConfig()) as local:
            request = Request(PROMPT, 5, sampling=GREEDY, output=top_output(4), streaming=True)
            [remote] = [collect(process, [i])[i] for i in process.enqueue_requests([request])]
            [here] = [collect(local, [i])[i] for i in local.enqueue_requests([request])]
        for name in ("top_log_prob_ids", "top_log_probs"):
            assert joined(remote, name) == joined(here, name)
    finally:
        process.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-buffer transfer needs a CUDA device")
def test_cuda_overlapped_loop_returns_what_the_cpu_does(tiny_engine):
    """On CUDA the top log-probs come home through the pinned buffers of the overlapped loop
    (rows of several k in one batch); they must match the CPU run."""
    requests = [Request(PROMPT, 8, sampling=GREEDY, output=top_output(k), streaming=k % 2 == 1)
                for k in (1, MAX_TOP_LOG_PROBS, 0, 5)]
    results = {}
    for device in ("cpu", "cuda"):
        with Executor(tiny_engine, ExecutorConfig(device=device)) as ex:
            results[device] = run(ex, *requests)
    for cpu, cuda, request in zip(results["cpu"], results["cuda"], requests):
        assert final_tokens(cuda) == final_tokens(cpu)
        if request.output.num_top_log_probs:
            # ids of the best alternative exactly; lower ones may swap on float rounding of near-ties
            assert [row[0] for row in joined(cuda, "top_log_prob_ids")] == final_tokens(cpu)
            torch.testing.assert_close(torch.tensor(joined(cuda, "top_log_probs")),
                                       torch.tensor(joined(cpu, "top_log_probs")), atol=1e-4, rtol=1e-4)
