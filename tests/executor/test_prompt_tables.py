"""Prompt-embedding tables through the executor: ids >= vocab_size take rows of the request's table
(image features), equal to transformers fed the same embeddings, through chunked prefill, preemption,
beside text-only requests; the prefix cache keys table rows by content; bad tables get named errors."""
from __future__ import annotations

import pytest
import torch

from engine.executor import Executor, ExecutorConfig, OutputConfig, Request
from engine.executor.prompt_table import PromptTable
from engine.executor.request import RequestState, Sequence
from tiny_engines import VOCAB
from tests.executor.executor_testing import collect, final_tokens

HIDDEN = 64
EXCLUDE = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)


def image_table(seed: int, rows: int = 6) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=generator)


def image_prompt(rows: int = 6, before=(3, 17, 5), after=(9, 42)) -> list[int]:
    """A prompt whose image slot is ids vocab_size .. vocab_size + rows - 1 (the anchor's layout)."""
    return [*before, *range(VOCAB, VOCAB + rows), *after]


def transformers_greedy(hf, prompt: list[int], table: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy continuation with the fake ids' embeddings replaced by the table rows."""
    embed = hf.get_input_embeddings()
    tokens = torch.tensor([t if t < VOCAB else 0 for t in prompt])
    embeds = embed(tokens).detach().clone()
    for position, token in enumerate(prompt):
        if token >= VOCAB:
            embeds[position] = table[token - VOCAB]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = hf(inputs_embeds=embeds.unsqueeze(0)).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            embeds = torch.cat([embeds, embed(torch.tensor([token]))])
    return out


def run(executor, requests: list[Request]) -> list:
    ids = executor.enqueue_requests(requests)
    responses = collect(executor, ids)
    return [responses[i] for i in ids]


def test_table_rows_replace_fake_ids_as_transformers_does(tiny_engine, tiny_hf):
    prompt, table = image_prompt(), image_table(1)
    expected = transformers_greedy(tiny_hf, prompt, table, 8)
    text_prompt = [3, 17, 5, 11, 12, 13]
    with Executor(tiny_engine, ExecutorConfig()) as executor:
        image, text = run(executor, [Request(prompt, 8, output=EXCLUDE, prompt_table=PromptTable(table)),
                                     Request(text_prompt, 8, output=EXCLUDE)])
    assert final_tokens(image) == expected
    plain = tiny_hf.generate(torch.tensor([text_prompt]), max_new_tokens=8, do_sample=False)[0, len(text_prompt):]
    assert final_tokens(text) == plain.tolist()  # a text-only request in the same batch


def test_chunked_prefill_splits_the_image_and_preemption_recomputes_it(tiny_engine, tiny_hf):
    # max_num_tokens 8 cuts the 11-token prompt inside the image; a pool of 10 blocks of 4 tokens cannot
    # hold six 30-token requests at once, so max_utilization preempts and recomputes some.
    tables = [image_table(10 + i) for i in range(6)]
    prompt = image_prompt()
    expected = [transformers_greedy(tiny_hf, prompt, t, 19) for t in tables]
    config = ExecutorConfig(enable_chunked_context=True, max_num_tokens=8, batch_scheduler_policy="max_utilization",
                            max_tokens_in_paged_kv_cache=40, enable_kv_cache_reuse=False)
    with Executor(tiny_engine, config) as executor:
        responses = run(executor, [Request(prompt, 19, output=EXCLUDE, prompt_table=PromptTable(t)) for t in tables])
        preempted = sum(s.num_preempted_requests for s in executor.get_iteration_stats_history())
    assert [final_tokens(r) for r in responses] == expected
    assert preempted > 0


def test_prefix_cache_keys_table_blocks_by_content(tiny_engine, tiny_hf, monkeypatch):
    prompt = image_prompt(rows=8, before=(3, 17, 5, 6), after=(9, 42, 1, 2, 7))  # 17 tokens: 4 full blocks
    first, other = image_table(2, rows=8), image_table(3, rows=8)

    def on_the_executors_thread(*args):
        raise AssertionError("the keys are made at enqueue (request.py normalize_all)")
    monkeypatch.setattr("engine.executor.admission.prompt_cache_keys", on_the_executors_thread)
    with Executor(tiny_engine, ExecutorConfig()) as executor:
        sent = run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(first))])[0]
        again = run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(first.clone()))])[0]
        different = run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(other))])[0]
        extra = run(executor, [Request(prompt, 4, output=EXCLUDE,
                                       prompt_table=PromptTable(first, extra_ids=[0] * 4 + [7] * 8 + [0] * 5))])[0]
    assert again[-1].result.perf.kv_cache_reused_blocks == 4
    assert final_tokens(again) == final_tokens(sent)
    assert different[-1].result.perf.kv_cache_reused_blocks == 1  # the text block before the image only
    assert final_tokens(different) == transformers_greedy(tiny_hf, prompt, other, 4)
    assert extra[-1].result.perf.kv_cache_reused_blocks == 1  # another extra id: another image


def test_table_digests_run_off_the_enqueuing_call_and_are_waited_for_where_read(monkeypatch):
    """request.py normalize_all: each table's keys are a Future digested on the pool's threads (in order, each
    request its own), and the call does not wait for them; Sequence.prompt_cache_keys waits on first read."""
    import threading

    from engine.executor import request as request_module
    from engine.executor.prompt_table import prompt_cache_keys

    threads, release = [], threading.Event()

    def digest(*args):
        release.wait(5)
        threads.append(threading.current_thread().name)
        return prompt_cache_keys(*args)
    monkeypatch.setattr(request_module, "DIGEST_THREADS", 2)
    monkeypatch.setattr(request_module, "prompt_cache_keys", digest)
    requests = [Request(image_prompt(), 4, prompt_table=PromptTable(image_table(seed))) for seed in (5, 6, 5)]
    prepared = request_module.normalize_all([*requests[:2], Request([3, 17], 4), requests[2]], VOCAB)
    assert [p[2] for p in prepared] == [None] * 4 and prepared[2][1] is None
    futures = [p[1][2] for i, p in enumerate(prepared) if i != 2]
    assert not any(f.done() for f in futures) and not threads  # returned before any digest finished
    state = RequestState(1, prepared[0][0], True)
    seq = Sequence(1, state, 0)
    seq.prompt_cache_keys = futures[0]
    release.set()
    keys = [seq.prompt_cache_keys] + [f.result() for f in futures[1:]]
    assert seq.prompt_cache_keys is keys[0] and isinstance(keys[0], list)
    assert keys[0] == keys[2] != keys[1]  # each its own table's digests (5, 6, 5)
    assert len(threads) == 3 and all(name.startswith("prompt-table-digest") for name in threads)
    def does_not_fit(*args):
        raise IndexError("a table that does not fit the ids: validate_request names it")
    monkeypatch.setattr(request_module, "prompt_cache_keys", does_not_fit)
    assert request_module.normalize_all(requests[:1], VOCAB)[0][1][2].result() is None  # ids as the keys


def test_prefix_cache_keys_each_image_by_its_own_rows(tiny_engine, tiny_hf):
    # Two images: A (rows 0-7) and B (rows 8-15), 29 tokens = 7 full blocks of 4:
    # text | A A | text | B B | text. Keys are per image, so (A, C) reuses the blocks through A and
    # the text after it (4), and (A, B) again with an unused row appended to the table reuses all 7.
    a, b, c = image_table(4, rows=8), image_table(5, rows=8), image_table(6, rows=8)
    prompt = [3, 17, 5, 6, *range(VOCAB, VOCAB + 8), 9, 42, 1, 2, *range(VOCAB + 8, VOCAB + 16), 7, 8, 10, 11, 12]

    def reused_total(executor) -> int:
        return executor.get_latest_iteration_stats().kv_cache_stats.reused_blocks

    with Executor(tiny_engine, ExecutorConfig()) as executor:
        run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(torch.cat([a, b])))])
        before = reused_total(executor)
        other = run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(torch.cat([a, c])))])[0]
        assert reused_total(executor) - before == 4  # the executor's prefix-hit counter: A's blocks only
        padded = torch.cat([a, b, image_table(7, rows=1)])
        again = run(executor, [Request(prompt, 4, output=EXCLUDE, prompt_table=PromptTable(padded))])[0]
    assert other[-1].result.perf.kv_cache_reused_blocks == 4
    assert final_tokens(other) == transformers_greedy(tiny_hf, prompt, torch.cat([a, c]), 4)
    assert again[-1].result.perf.kv_cache_reused_blocks == 7
    assert final_tokens(again) == transformers_greedy(tiny_hf, prompt, torch.cat([a, b]), 4)


@pytest.mark.parametrize("request_fields, message", [
    (dict(prompt_table=PromptTable(torch.ones(6, 32))),
     "prompt_embedding_table has rows of width 32; they must have the model's table width (64: its hidden size"),
    (dict(input_token_ids=image_prompt(rows=7), prompt_table=PromptTable(torch.ones(6, HIDDEN))),
     f"input_ids contains id {VOCAB + 6}, which names row 6 of a prompt_embedding_table of 6 rows"),
    (dict(input_token_ids=[3, 4, 5], prompt_table=PromptTable(torch.ones(6, HIDDEN))),
     "prompt_embedding_table was sent but input_ids hold no id >= vocab_size (128)"),
    (dict(), f"input_token_ids contains token id {VOCAB} outside the vocabulary; allowed ids are 0..127 "
             "(ids from vocab_size on name rows of a prompt_embedding_table, and the request sent none)"),
    (dict(prompt_table=PromptTable(torch.ones(6, HIDDEN), extra_ids=[1, 2])),
     "prompt_table_extra_ids has 2 values for 11 prompt tokens"),
])
def test_bad_tables_get_named_errors_and_the_next_request_runs(tiny_engine, request_fields, message):
    fields = dict(input_token_ids=image_prompt(), max_tokens=2) | request_fields
    with Executor(tiny_engine, ExecutorConfig()) as executor:
        bad, good = run(executor, [Request(**fields), Request([3, 4, 5], 2)])
    assert message in bad[-1].error
    assert good[-1].error is None


def test_a_table_whose_hashing_fails_ends_that_request_alone(tiny_engine, monkeypatch):
    """An unexpected error while hashing one table (on the digest threads) is that request's error, not an
    exception in the executor's loop (which failed every request in flight as an internal error)."""
    import engine.executor.request as request_module

    hashed = request_module.prompt_cache_keys

    def keys(prompt, table, vocab_size):
        if float(torch.as_tensor(table.embeddings)[0, 0]) == 7.0:
            raise MemoryError("out of host memory")
        return hashed(prompt, table, vocab_size)

    monkeypatch.setattr(request_module, "prompt_cache_keys", keys)
    with Executor(tiny_engine, ExecutorConfig()) as executor:
        bad, good, text = run(executor, [Request(image_prompt(), 4, prompt_table=PromptTable(torch.full((6, HIDDEN), 7.0))),
                                         Request(image_prompt(), 4, prompt_table=PromptTable(image_table(2))),
                                         Request([3, 4, 5], 4)])
    assert "hashing its rows for the prefix cache failed (MemoryError: out of host memory)" in bad[-1].error
    assert good[-1].error is None and text[-1].error is None


def test_a_request_is_checked_for_a_hashing_error_until_its_keys_are_known_good():
    """The executor checks a table request's keys each step (prompt_keys_error) only while prompt_keys_settled is
    False: a digest still running, or one that failed; made keys, done or not a Future, settle it."""
    from concurrent.futures import Future

    from engine.executor.request import PromptKeysError, prompt_keys_error, prompt_keys_settled

    prompt, table = image_prompt(), PromptTable(image_table(1))
    state = RequestState(1, Request(prompt, 4, prompt_table=table), False)
    digest = Future()
    state.prompt_cache_keys = (prompt, table, digest)
    assert not prompt_keys_settled(state) and prompt_keys_error(state) is None  # (still hashing)
    digest.set_result(["key"] * len(prompt))
    assert prompt_keys_settled(state) and prompt_keys_error(state) is None
    failed = Future()
    failed.set_result(PromptKeysError("hashing failed"))
    state.prompt_cache_keys = (prompt, table, failed)
    assert not prompt_keys_settled(state) and prompt_keys_error(state) == "hashing failed"
    state.prompt_cache_keys = (prompt, table, ["key"] * len(prompt))  # (made in the enqueuing call)
    assert prompt_keys_settled(state)


@pytest.mark.parametrize("tp_size, pp_size, named", [
    (2, 1, "by a tensor-parallel engine (tp_size 2): its ranks' steps carry token ids"),
    (1, 2, "by a pipeline-parallel engine (pp_size 2)"),
    (1, 1, "for this model's architecture yet")])
def test_an_engine_that_takes_no_tables_says_why(tp_size, pp_size, named):
    """A request with a table on an engine that cannot splice one gets the engine's reason, not the architecture's,
    where its layout is the reason (executor.prompt_tables_refusal fills RequestLimits)."""
    from engine.config import BuildConfig
    from engine.executor.executor import prompt_tables_refusal
    from engine.executor.request import RequestLimits, validate_request

    limits = RequestLimits(vocab_size=VOCAB, max_seq_len=64, max_beam_width=1, max_num_tokens=64,
                           enable_chunked_context=True, num_kv_blocks=64, tokens_per_block=4, hidden_size=8,
                           supports_prompt_tables=False,
                           prompt_tables_refusal=prompt_tables_refusal(BuildConfig(tp_size=tp_size, pp_size=pp_size)))
    error = validate_request(Request([1, VOCAB, 2], 4, prompt_table=PromptTable(torch.zeros(1, 8))), limits)
    assert error.startswith(f"prompt_embedding_table is not supported {named}")
    assert error.endswith("send the request without it")
