"""Speculative decoding in the executor: greedy ids identical to plain decoding, KV rolled back, bad drafts refused.

Real weights (the embedded SmolLM2) on 8 prompts of benchmarks/speculative/speculative_acceptance.py
(each article summarised, each function renamed: their answers copy the prompt, so n-gram drafts hit); one plain
executor gives the reference ids and verifies the client drafts, one n-gram executor runs every n-gram request at
once. The KV and refusal tests use the tiny random engine (4-token blocks: drafts fill whole blocks).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from executor_testing import collect, final_tokens
from tiny_engines import build_tiny_engine

from benchmarks.speculative.speculative_acceptance import PROMPT_SETS, chat_prompt
from engine.executor.executor import Executor, ExecutorConfig, ExecutorConfigError, SpeculativeConfig
from engine.executor.request import (
    ExternalDraftTokens, FinishReason, OutputConfig, Request, SamplingConfig,
)

# 16 tokens: the n-gram drafts of the 8 prompts still number well over 100 with ~40% kept (40 tokens until
# 2026-11-30: every SmolLM2 token costs ~0.05-0.1 CPU-s, and no check needs the answers' later tokens).
MAX_TOKENS = 16
# Four of the acceptance benchmark's 5 articles and four of its 5 functions: 8 prompts, the engine's
# max_batch_size, so the reference and the client-draft requests run as one batch (its 20 prompts until
# 2026-11-29, then 10 until 2026-11-30: the last two ran a second 16-step batch of two rows on their own,
# and a fifth text of each kind added no case the first four lack).
PROMPTS = PROMPT_SETS["summarisation"][:4] + PROMPT_SETS["code_edit"][:4]
# Each prompt once more cut short by the n-gram executor: cut by max_tokens (at 7 tokens) or ended by a
# stop word, two summaries and two code edits each (6 and 6 of the first ones until 2026-11-30).
SHORT = [0, 1, 4, 5]
STOPPED = [2, 3, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_engine_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    assert len(PROMPTS) == 8
    return [chat_prompt(tokenizer, text) for text in PROMPTS]


def config(**kw) -> ExecutorConfig:
    return ExecutorConfig(exclude_input_from_output=True, max_tokens_in_paged_kv_cache=16384, **kw)


def run(executor, requests: list[Request]) -> list[list]:
    ids = executor.enqueue_requests(requests)
    got = collect(executor, ids, timeout=300)
    return [got[i] for i in ids]


def assert_no_blocks_held(executor) -> None:
    blocks = executor.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks, "a finished request left KV blocks behind"


@pytest.fixture(scope="module")
def plain_executor(smollm2_engine_dir):
    """Plain decoding (the engine's max_batch_size, 8): the reference ids, then the client-draft tests
    (the prompts' blocks are cached by then: they prefill once)."""
    with Executor(smollm2_engine_dir, config()) as executor:
        yield executor


@pytest.fixture(scope="module")
def reference(plain_executor, prompts) -> list[list[int]]:
    """Plain greedy ids of every prompt (no end_id: every answer is MAX_TOKENS long)."""
    return [final_tokens(r) for r in run(plain_executor, [Request(p, MAX_TOKENS) for p in prompts])]


@pytest.fixture(scope="module")
def ngram_executor(smollm2_engine_dir):
    with Executor(smollm2_engine_dir, config(speculative=SpeculativeConfig("ngram", max_draft_len=4))) as executor:
        yield executor


def stop_words_of(reference) -> list[list[int]]:
    """A stop word (two tokens) 12 tokens into each STOPPED answer (drafts may run past it)."""
    return [reference[i][12:14] for i in STOPPED]


@pytest.fixture(scope="module")
def ngram_responses(ngram_executor, prompts, reference) -> dict[str, list[list]]:
    """The n-gram tests' requests, sent at once (the batch stays full): the 8 prompts to MAX_TOKENS,
    every other one streamed, all with perf metrics; then the SHORT ones cut at 7 tokens and the STOPPED
    ones ended by a stop word."""
    perf = OutputConfig(return_perf_metrics=True)
    full = [Request(p, MAX_TOKENS, streaming=i % 2 == 1, output=perf) for i, p in enumerate(prompts)]
    short = [Request(prompts[i], 7) for i in SHORT]
    stopped = [Request(prompts[i], MAX_TOKENS, stop_words=[s]) for i, s in zip(STOPPED, stop_words_of(reference))]
    responses = run(ngram_executor, full + short + stopped)
    n = len(full)
    return {"full": responses[:n], "short": responses[n:n + len(SHORT)], "stopped": responses[n + len(SHORT):]}


def test_ngram_drafts_give_the_plain_greedy_ids_and_are_often_accepted(ngram_executor, ngram_responses, reference):
    responses = ngram_responses["full"]
    assert [final_tokens(r) for r in responses] == reference
    perf = [r[-1].result.perf for r in responses]
    drafted, accepted = sum(p.total_draft_tokens for p in perf), sum(p.total_accepted_draft_tokens for p in perf)
    assert drafted > 100 and accepted > drafted // 5  # summaries and edits copy their prompt
    for p in perf:
        assert p.acceptance_rate == pytest.approx(p.total_accepted_draft_tokens / max(1, p.total_draft_tokens))
    stats = ngram_executor.get_latest_iteration_stats()
    assert stats.num_draft_tokens_total >= drafted and stats.num_accepted_draft_tokens_total >= accepted
    assert_no_blocks_held(ngram_executor)


def test_ngram_streams_carry_every_token_accepted_in_a_step(ngram_responses, reference):
    """The streamed half of the full-length requests (2 summaries, 2 code edits)."""
    streamed = ngram_responses["full"][1::2]
    assert [final_tokens(r) for r in streamed] == reference[1::2]
    assert max(len(r.result.output_token_ids[0]) for rs in streamed for r in rs) > 1


def test_ngram_respects_max_tokens_and_stop_words(ngram_executor, ngram_responses, reference):
    for i, r in zip(SHORT, ngram_responses["short"], strict=True):
        assert final_tokens(r) == reference[i][:7] and r[-1].result.finish_reasons == [FinishReason.LENGTH]
    for index, s, r in zip(STOPPED, stop_words_of(reference), ngram_responses["stopped"], strict=True):
        ref = reference[index]
        end = next(i + 2 for i in range(len(ref)) if ref[i:i + 2] == s)
        assert final_tokens(r) == ref[:end] and r[-1].result.finish_reasons == [FinishReason.STOP_WORDS]
    assert_no_blocks_held(ngram_executor)


def test_external_drafts_right_wrong_or_partly_right_give_the_plain_greedy_ids(plain_executor, prompts, reference):
    """Mixed in one batch with requests without drafts: each kind of draft once streamed and once not
    (the first four and the last four prompts stream the other way round); the fifth request's right
    drafts are the longest allowed (8). (Until 2026-11-30 ten requests, whose second four repeated the
    first four's kinds and streaming, and two more for the longest drafts: a second batch.)"""
    requests, expected = [], []
    for i, (prompt, ref) in enumerate(zip(prompts, reference, strict=True)):
        wrong = [(t + 1) % 49152 for t in ref[:5]]
        variants = {"right": ref[:6] if i < 4 else ref[:8], "wrong": wrong, "partly": ref[:3] + wrong[3:], "none": None}
        drafts = variants[list(variants)[i % 4]]
        requests.append(Request(prompt, MAX_TOKENS, streaming=(i % 2 == 1) != (i >= 4),
                                output=OutputConfig(return_perf_metrics=True),
                                external_draft=None if drafts is None else ExternalDraftTokens(drafts)))
        expected.append(ref)
    responses = run(plain_executor, requests)
    assert [final_tokens(r) for r in responses] == expected
    assert_no_blocks_held(plain_executor)
    perf = [r[-1].result.perf for r in responses]
    assert (perf[0].total_draft_tokens, perf[0].total_accepted_draft_tokens, perf[0].acceptance_rate) == (6, 6, 1.0)
    assert (perf[1].total_draft_tokens, perf[1].total_accepted_draft_tokens) == (5, 0)
    assert (perf[2].total_draft_tokens, perf[2].total_accepted_draft_tokens) == (5, 3)
    assert perf[3].total_draft_tokens == 0
    assert (perf[4].total_draft_tokens, perf[4].total_accepted_draft_tokens) == (8, 8)


def test_external_drafts_past_max_tokens_or_a_stop_word_are_trimmed(plain_executor, prompts, reference):
    ref = reference[0]
    requests = [Request(prompts[0], 3, external_draft=ExternalDraftTokens(ref[:8])),
                Request(prompts[0], MAX_TOKENS, stop_words=[ref[2:4]], external_draft=ExternalDraftTokens(ref[:8])),
                Request(prompts[0], MAX_TOKENS, end_id=ref[5], external_draft=ExternalDraftTokens(ref[:8]))]
    short, stopped, ended = run(plain_executor, requests)
    assert_no_blocks_held(plain_executor)
    assert final_tokens(short) == ref[:3] and short[-1].result.finish_reasons == [FinishReason.LENGTH]
    assert final_tokens(stopped) == ref[:4] and stopped[-1].result.finish_reasons == [FinishReason.STOP_WORDS]
    assert final_tokens(ended) == ref[:ref.index(ref[5])]
    assert ended[-1].result.finish_reasons == [FinishReason.END_ID]


# ----- the tiny random engine: KV rollback, sampled requests, refusals -----

@pytest.fixture(scope="module")
def tiny_executor(tiny_engine):
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, max_beam_width=2)) as executor:
        yield executor


def plain_ids(executor, prompt: list[int], max_tokens: int) -> list[int]:
    return final_tokens(run(executor, [Request(prompt, max_tokens)])[0])


def test_rejected_drafts_never_reach_the_prefix_cache(tiny_executor, tiny_engine):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]  # two full 4-token blocks; eight drafts fill two more
    ref = plain_ids(tiny_executor, prompt, 12)
    wrong = next(t for t in range(128) if t not in prompt + ref)
    run(tiny_executor, [Request(prompt, 12, external_draft=ExternalDraftTokens([wrong] * 8))])
    blocks = tiny_executor.blocks
    assert all(wrong not in block.token_ids for block in blocks.blocks if block.token_ids is not None)
    assert_no_blocks_held(tiny_executor)
    # A prompt that continues with the rejected drafts reuses only the true prompt's blocks, and
    # its tokens are those of an executor that never saw the drafts.
    (responses,) = run(tiny_executor, [Request(prompt + [wrong] * 8, 4, output=OutputConfig(return_perf_metrics=True))])
    assert responses[-1].result.perf.kv_cache_reused_blocks <= len(prompt) // 4
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, enable_kv_cache_reuse=False)) as fresh:
        assert final_tokens(responses) == plain_ids(fresh, prompt + [wrong] * 8, 4)


def test_sampled_requests_with_drafts_run_to_their_length_and_count_acceptance(tiny_executor):
    prompt = [5, 6, 7, 8, 9]
    sampled = SamplingConfig(top_k=20, temperature=0.8, seed=3)
    logits = torch.randn(4, 128)
    drafts = [int(t) for t in logits.argmax(dim=-1)]
    requests = [Request(prompt, 16, sampling=sampled, output=OutputConfig(return_perf_metrics=True,
                                                                           return_log_probs=True),
                        external_draft=ExternalDraftTokens(drafts, logits=logits if i == 0 else None,
                                                           acceptance_threshold=0.01 if i == 1 else None))
                for i in range(3)]
    for responses in run(tiny_executor, requests):
        result = responses[-1].result
        assert len(result.output_token_ids[0]) == 16 and len(result.log_probs[0]) == 16
        assert all(lp <= 0 for lp in result.log_probs[0])
        assert result.perf.total_draft_tokens == 4
    # Returned sequences share the prompt's blocks; each verifies the drafts at its first step.
    several = replace(sampled, num_return_sequences=3)
    ids = tiny_executor.enqueue_requests([Request(prompt, 16, sampling=several, external_draft=ExternalDraftTokens(drafts),
                                                  output=OutputConfig(return_perf_metrics=True))])
    finals = [r for r in collect(tiny_executor, ids, timeout=60, streams={ids[0]: 3})[ids[0]] if r.result.is_final]
    assert sorted(r.result.sequence_index for r in finals) == [0, 1, 2]
    assert all(len(r.result.output_token_ids[0]) == 16 for r in finals)
    assert finals[-1].result.perf.total_draft_tokens == 12
    assert_no_blocks_held(tiny_executor)


@pytest.mark.parametrize("draft, named", [
    (ExternalDraftTokens([1, 128]), "draft_input_ids contains token id 128 outside the vocabulary"),
    (ExternalDraftTokens(list(range(9))), "draft_input_ids has 9 tokens; allowed: at most 8"),
    (ExternalDraftTokens([1, 2], logits=torch.zeros(3, 128)), "draft_logits has shape (3, 128)"),
    (ExternalDraftTokens([1, 2], logits=torch.zeros(2, 64)), "draft_logits has shape (2, 64)"),
    (ExternalDraftTokens([1], acceptance_threshold=1.5), "draft_acceptance_threshold must be in [0, 1]"),
])
def test_bad_drafts_fail_their_request_only(tiny_executor, draft, named):
    bad, good = run(tiny_executor, [Request([1, 2, 3], 4, external_draft=draft), Request([1, 2, 3], 4)])
    assert bad[-1].error is not None and named in bad[-1].error
    assert len(final_tokens(good)) == 4


def test_drafts_with_beam_search_are_refused_by_name(tiny_executor, tiny_engine):
    beams = SamplingConfig(beam_width=2)
    (bad,) = run(tiny_executor, [Request([1, 2, 3], 4, sampling=beams, external_draft=ExternalDraftTokens([4]))])
    assert "draft_input_ids are not supported with beam search (beam_width 2)" in bad[-1].error
    with Executor(tiny_engine, ExecutorConfig(max_beam_width=2, speculative=SpeculativeConfig("ngram"))) as executor:
        bad, good = run(executor, [Request([1, 2, 3], 4, sampling=beams), Request([1, 2, 3], 4)])
    assert "beam search is not supported with speculative decoding" in bad[-1].error
    assert good[-1].error is None


@pytest.mark.parametrize("speculative, named", [
    (SpeculativeConfig("beam_search"), "SpeculativeConfig.mode value of 'beam_search' is not supported"),
    (SpeculativeConfig("ngram", max_draft_len=0), "SpeculativeConfig.max_draft_len must be an integer in 1..64"),
    (SpeculativeConfig("ngram", max_matching_ngram_size=0), "SpeculativeConfig.max_matching_ngram_size"),
    (SpeculativeConfig("draft_model"), "SpeculativeConfig.draft_engine_dir must name the draft engine's directory"),
])
def test_bad_speculative_configs_are_refused_by_name(speculative, named):
    with pytest.raises(ExecutorConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ExecutorConfig(speculative=speculative).validate()


@pytest.mark.parametrize("options", [
    dict(sampling=SamplingConfig(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)),
    dict(bad_words=[[7, 8], [9]], end_id=11, sampling=SamplingConfig(min_tokens=6)),
    dict(embedding_bias=torch.linspace(-1, 1, 128), output=OutputConfig(return_log_probs=True)),
], ids=["penalties", "bans", "bias_and_log_probs"])
def test_right_drafts_under_penalties_bans_and_bias_give_the_plain_ids(tiny_executor, options):
    """Each verified position sees the drafts before it as generated tokens (penalties, bans)."""
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    (plain,) = run(tiny_executor, [Request(prompt, 16, **options)])
    ref = final_tokens(plain)
    drafted = run(tiny_executor, [Request(prompt, 16, external_draft=ExternalDraftTokens(ref[:8]),
                                          output=OutputConfig(return_perf_metrics=True,
                                                              return_log_probs=bool(plain[-1].result.log_probs)),
                                          **{k: v for k, v in options.items() if k != "output"})])[0]
    assert final_tokens(drafted) == ref
    assert drafted[-1].result.perf.total_accepted_draft_tokens == min(8, len(ref) - 1)
    if plain[-1].result.log_probs:
        assert drafted[-1].result.log_probs[0] == pytest.approx(plain[-1].result.log_probs[0], abs=1e-4)


CHI2_CRITICAL_4_DOF = 18.47  # p = 0.001: a correct sampler fails one run in a thousand


@pytest.fixture(scope="module")
def wide_executor(tiny_hf, tmp_path_factory):
    """The tiny engine's weights built for 128 rows a step (its 16, and 256 tokens a step, cut the
    chi-square tests' thousands of 2-token requests into ~190 steps each; ~24 here: 6.3 -> 3.4 s a test).
    Each request draws with its own seed, whatever shares its step."""
    engine = build_tiny_engine(tmp_path_factory.mktemp("wide_tiny_engine"), tiny_hf, max_batch_size=128,
                               max_num_tokens=1024)
    with Executor(engine, ExecutorConfig(exclude_input_from_output=True)) as executor:
        yield executor


# The fixed draft (no logits) is `make test-all`'s (6.6 s of CI's fresh clone): its law is
# test_speculative_acceptance.py's test_rejection_sampling_of_a_fixed_draft_keeps_the_target_distribution (three
# point masses, 20,000 trials each), and sampled requests with drafts without logits go through the executor in
# test_sampled_requests_with_drafts_run_to_their_length_and_count_acceptance; make test keeps the drafts drawn
# from draft logits (the seeds, the draft's law and the target's, carried through the executor).
@pytest.mark.parametrize("with_logits", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["fixed_draft", "drafts_drawn_from_draft_logits"])
def test_sampled_first_tokens_follow_the_targets_law_whatever_the_draft(wide_executor, with_logits):
    """Thousands of seeded requests verify a draft at their first step: the first token's
    frequencies match the target's top-5 law at temperature 0.7 (chi-square), as plain sampling's
    would. Without logits the draft is one fixed token (a point mass); with them each request's
    draft is drawn from the draft's law (the premise of rejection sampling), a noisy copy of the target's."""
    prompt = [9, 8, 7, 6, 5]
    (context,) = run(wide_executor, [Request(prompt, 1, output=OutputConfig(return_context_logits=True))])
    raw = context[-1].result.context_logits[-1]
    top = (raw / 0.7).topk(5)
    law = torch.softmax(top.values, dim=-1)
    trials = 3000
    generator = torch.Generator().manual_seed(0)
    draft_logits = (raw + torch.randn(128, generator=generator)).unsqueeze(0)
    draft_top = (draft_logits[0] / 0.7).topk(5)  # the draft's law as the executor sees it (same settings)
    draws = draft_top.indices[torch.multinomial(torch.softmax(draft_top.values, -1), trials, True, generator=generator)]
    requests = [Request(prompt, 2, sampling=SamplingConfig(top_k=5, temperature=0.7, seed=seed),
                        external_draft=ExternalDraftTokens([int(draws[seed])], logits=draft_logits) if with_logits
                        else ExternalDraftTokens([int(top.indices[1])]))  # often rejected, often kept
                for seed in range(trials)]
    firsts = [final_tokens(r)[0] for r in run(wide_executor, requests)]
    counts = torch.tensor([firsts.count(int(t)) for t in top.indices], dtype=torch.float32)
    assert counts.sum() == trials  # nothing outside the top 5
    expected = law * trials
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRITICAL_4_DOF


@pytest.mark.parametrize("options", [
    dict(enable_chunked_context=True, max_num_tokens=8, max_batch_size=4),  # drafts ride with the last chunk
    dict(batch_scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=48),  # verify steps preempt
], ids=["chunked_prompt", "preemption"])
def test_drafts_with_chunked_prompts_and_preemption_give_the_plain_ids(tiny_executor, tiny_engine, options):
    prompts = [[(7 * i + j) % 128 for j in range(10 + i)] for i in range(6)]
    refs = [plain_ids(tiny_executor, p, 14) for p in prompts]
    requests = [Request(p, 14, external_draft=ExternalDraftTokens(ref[:2 + i % 5] + [0] * (i % 2)))
                for i, (p, ref) in enumerate(zip(prompts, refs))]
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True, **options)) as executor:
        assert [final_tokens(r) for r in run(executor, requests)] == refs
        assert_no_blocks_held(executor)
        if options.get("batch_scheduler_policy") == "max_utilization":
            assert executor.scheduler.num_preemptions > 0


def test_a_streamed_response_carries_every_token_a_step_accepted(tiny_executor, tiny_engine):
    """Responses as the executor delivers them (a callback: no queue coalescing them): the
    prompt's step keeps 5 right drafts, so the first response carries 6 tokens."""
    prompt = [2, 7, 1, 8, 2, 8]
    ref = plain_ids(tiny_executor, prompt, 10)
    delivered = []
    with Executor(tiny_engine, ExecutorConfig(exclude_input_from_output=True),
                  response_callback=delivered.extend) as executor:
        executor.enqueue_request(Request(prompt, 10, streaming=True, external_draft=ExternalDraftTokens(ref[:5])))
        deadline = time.monotonic() + 60
        while not (delivered and delivered[-1].is_final):
            assert time.monotonic() < deadline, "no final response in 60 s"
            time.sleep(0.01)
    chunks = [r.result.output_token_ids[0] for r in delivered]
    assert chunks[0] == ref[:6] and [t for c in chunks for t in c] == ref
