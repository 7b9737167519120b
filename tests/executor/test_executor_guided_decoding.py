"""Guided decoding in the executor (xgrammar), on the embedded SmolLM2 engine and its real tokenizer.

One executor per module (overlapped scheduling, the default) and one synchronous one; every test
checks what the grammar promises (the text parses, validates or fullmatches), never exact text.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.executor.executor import Executor, ExecutorConfig
from engine.executor.request import FinishReason, GuidedDecodingParams, OutputConfig, Request, SamplingConfig
from executor_testing import collect, final_tokens

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_engine_dir)


@pytest.fixture(scope="module")
def executor(smollm2_engine_dir):
    with Executor(smollm2_engine_dir, ExecutorConfig(guided_decoding_backend="xgrammar", exclude_input_from_output=True,
                                                     max_tokens_in_paged_kv_cache=8192)) as ex:
        yield ex


def prompt(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              return_dict=False))


def request(tokenizer, guide_type: str, guide: str | None, max_tokens: int = 64,
            question: str = "Describe a person as JSON.", **kw) -> Request:
    return Request(prompt(tokenizer, question), max_tokens=max_tokens,
                   end_id=tokenizer.eos_token_id, guided_decoding=GuidedDecodingParams(guide_type, guide), **kw)


def run(executor, requests: list[Request], streams: dict | None = None) -> list[list]:
    ids = executor.enqueue_requests(requests)
    got = collect(executor, ids, timeout=120, streams=streams and {ids[i]: n for i, n in streams.items()})
    return [got[i] for i in ids]


def text(tokenizer, responses) -> str:
    return tokenizer.decode(final_tokens(responses), skip_special_tokens=True)


STRUCTURAL_TAG_CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}


def generation_requests(tokenizer) -> dict[str, Request]:
    """The requests of the tests that only read what came out, by name: sent at once (one batch of
    up to the engine's 8 sequences, the rest joining as others end) instead of one test after another."""
    sampled = SamplingConfig(temperature=1.0, top_k=50, seed=7)
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": True,
        "tags": [{"begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": STRUCTURAL_TAG_CITY},
                  "end": "</tool_call>"}]}}
    return {
        "schema_greedy": request(tokenizer, "json_schema", json.dumps(PERSON)),
        "schema_sampled": request(tokenizer, "json_schema", json.dumps(PERSON), sampling=sampled, streaming=True),
        "unconstrained": Request(prompt(tokenizer, "Say hello."), max_tokens=16, end_id=tokenizer.eos_token_id),
        "three_sequences": request(tokenizer, "json_schema", json.dumps(PERSON), sampling=SamplingConfig(
            temperature=1.0, top_k=40, seed=3, num_return_sequences=3)),
        "regex": request(tokenizer, "regex", r"[A-Z][a-z]{2,6}-[0-9]{3}"),
        "ebnf": request(tokenizer, "ebnf_grammar", 'root ::= "yes" | "no" | "maybe " [0-9]'),
        "any_json": request(tokenizer, "json", None, max_tokens=256),
        "length_limit": request(tokenizer, "json_schema", json.dumps(PERSON), max_tokens=3),
        "min_tokens": request(tokenizer, "regex", "[0-9]{2}", sampling=SamplingConfig(min_tokens=10),
                              output=OutputConfig(return_log_probs=True)),
        "stop_word": request(tokenizer, "regex", "a{1,3}b{1,3}c", stop_words=[tokenizer.encode("b", add_special_tokens=False)]),
        "structural_tag": request(tokenizer, "structural_tag", json.dumps(tag), question="Call the weather tool for a city."),
    }


@pytest.fixture(scope="module")
def generated(executor, tokenizer) -> dict[str, list]:
    """Every response of generation_requests, by name (each request's own stream of responses)."""
    requests = generation_requests(tokenizer)
    names = list(requests)
    ids = executor.enqueue_requests(list(requests.values()))
    got = collect(executor, ids, timeout=300, streams={ids[names.index("three_sequences")]: 3})
    return {name: got[i] for name, i in zip(names, ids)}


def test_json_schema_greedy_and_sampled_outputs_validate(generated, tokenizer):
    """Greedy, and sampled and streamed, beside an unconstrained request in the same batch."""
    for responses in (generated["schema_greedy"], generated["schema_sampled"]):
        assert responses[-1].result.finish_reasons[0] is FinishReason.END_ID
        jsonschema.validate(json.loads(text(tokenizer, responses)), PERSON)
    assert generated["unconstrained"][-1].error is None


def test_every_returned_sequence_has_its_own_matcher(generated, tokenizer):
    responses = generated["three_sequences"]
    outputs = {r.result.sequence_index: r.result.output_token_ids[0] for r in responses if r.result.is_final}
    assert sorted(outputs) == [0, 1, 2]
    for tokens in outputs.values():
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), PERSON)


def test_regex_grammar_and_any_json(generated, tokenizer):
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", text(tokenizer, generated["regex"]))
    assert re.fullmatch(r"yes|no|maybe [0-9]", text(tokenizer, generated["ebnf"]))
    json.loads(text(tokenizer, generated["any_json"]))


def test_length_limit_ends_an_open_grammar_with_length(generated, tokenizer):
    responses = generated["length_limit"]
    assert responses[-1].result.finish_reasons[0] is FinishReason.LENGTH
    assert len(final_tokens(responses)) == 3
    assert text(tokenizer, responses).startswith("{")


def test_min_tokens_never_breaks_the_grammar_and_log_probs_come_back(generated, tokenizer):
    responses = generated["min_tokens"]
    assert re.fullmatch("[0-9]{2}", text(tokenizer, responses))
    result = responses[-1].result
    assert result.finish_reasons[0] is FinishReason.END_ID
    assert len(result.log_probs[0]) == len(final_tokens(responses)) and all(p <= 0 for p in result.log_probs[0])


def test_stop_words_still_stop_a_guided_request(generated, tokenizer):
    stop = tokenizer.encode("b", add_special_tokens=False)
    responses = generated["stop_word"]
    assert responses[-1].result.finish_reasons[0] is FinishReason.STOP_WORDS
    assert final_tokens(responses)[-1:] == stop and re.fullmatch("a{1,3}b{1,3}", text(tokenizer, responses))


def test_structural_tag_constrains_the_tagged_segment(generated, tokenizer):
    match = re.fullmatch(r"(?s).*<tool_call>(.*)</tool_call>", text(tokenizer, generated["structural_tag"]))
    assert match and json.loads(match.group(1))["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("guide_type, guide, named", [
    ("json_schema", '{"type": "object", "properties": ', "invalid json_schema"),
    ("json_schema", '{"type": "frobnicate"}', "invalid json_schema"),
    ("regex", "[0-9", "invalid regex"),
    ("ebnf_grammar", "root ::= (", "invalid ebnf_grammar"),
    ("yaml", "a: 1", "guided_decoding_guide_type value of 'yaml'"),
    ("regex", "", "guided_decoding_guide is empty"),
])
def test_bad_guides_fail_their_request_only(executor, tokenizer, guide_type, guide, named):
    bad, good = run(executor, [request(tokenizer, guide_type, guide), request(tokenizer, "regex", "[ab]{3}")])
    assert bad[-1].error is not None and named in bad[-1].error
    assert re.fullmatch("[ab]{3}", text(tokenizer, good))


def test_beam_search_with_a_guide_is_refused_by_name(smollm2_engine_dir, tokenizer):
    with Executor(smollm2_engine_dir, ExecutorConfig(guided_decoding_backend="xgrammar", exclude_input_from_output=True, max_beam_width=2,
                                                     max_tokens_in_paged_kv_cache=2048)) as ex:
        [responses] = run(ex, [request(tokenizer, "json", None, sampling=SamplingConfig(beam_width=2))])
    assert "not supported with beam search" in responses[-1].error


def test_without_a_backend_guided_requests_are_refused_and_others_served(smollm2_engine_dir, tokenizer):
    with Executor(smollm2_engine_dir, ExecutorConfig(max_tokens_in_paged_kv_cache=2048, exclude_input_from_output=True,
                                                     disable_overlap_scheduler=True)) as ex:
        refused, plain = run(ex, [request(tokenizer, "json", None),
                                  Request(prompt(tokenizer, "Hi"), max_tokens=4, end_id=tokenizer.eos_token_id)])
    assert "guided_decoding_backend" in refused[-1].error
    assert plain[-1].error is None


def test_synchronous_and_overlapped_loops_give_the_same_guided_tokens(smollm2_engine_dir, executor, tokenizer):
    """The JSON is cut at 12 tokens (each loop masks every one of them; the regex's request runs to
    its grammar's end in both): the whole object was ~30 more steps of each loop."""
    reqs = lambda: [request(tokenizer, "json_schema", json.dumps(PERSON), max_tokens=12),  # noqa: E731
                    request(tokenizer, "regex", "[a-z]{4} [0-9]{4}", streaming=True)]
    overlapped = [final_tokens(r) for r in run(executor, reqs())]
    with Executor(smollm2_engine_dir, ExecutorConfig(guided_decoding_backend="xgrammar", exclude_input_from_output=True, disable_overlap_scheduler=True,
                                                     max_tokens_in_paged_kv_cache=4096)) as ex:
        synchronous = [final_tokens(r) for r in run(ex, reqs())]
    assert overlapped == synchronous


def test_compiled_grammars_are_cached_and_nothing_stays_behind(executor, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    before = len(executor.grammars.compile_seconds)
    run(executor, [request(tokenizer, "json_schema", schema) for _ in range(4)])
    run(executor, [request(tokenizer, "json_schema", schema)])
    assert len(executor.grammars.compile_seconds) == before + 1  # four at once share one compilation
    assert not executor._compiling and not executor._active
    assert executor.blocks.num_free_blocks == executor.blocks.num_blocks


def test_a_slow_grammar_delays_only_its_own_request(executor, tokenizer, monkeypatch):
    import threading

    import engine.executor.guided as guided

    release, compile_guide = threading.Event(), guided._compile_guide

    def slow(compiler, guide_type, guide):
        if guide == "(slow)+":
            assert release.wait(30)
        return compile_guide(compiler, guide_type, guide)

    monkeypatch.setattr(guided, "_compile_guide", slow)
    slow_id, plain_id, fast_id = executor.enqueue_requests([
        request(tokenizer, "regex", "(slow)+", max_tokens=8),
        Request(prompt(tokenizer, "Hi"), max_tokens=8, end_id=tokenizer.eos_token_id),
        request(tokenizer, "regex", "[xyz]{5}")])
    done = collect(executor, [plain_id, fast_id], timeout=60)  # while the slow grammar still compiles
    assert re.fullmatch("[xyz]{5}", text(tokenizer, done[fast_id]))
    assert slow_id in executor._compiling
    release.set()
    [slow_done] = collect(executor, [slow_id], timeout=60).values()
    assert re.fullmatch("(slow)+", text(tokenizer, slow_done))


def test_xgrammar_and_the_vocabulary_load_when_the_first_guide_arrives(smollm2_engine_dir, executor, monkeypatch):
    """Guided decoding on costs an engine that never sees a guide nothing at start (xgrammar's import
    pulls transformers: ~1.4 CPU-s and ~100 MiB in every engine process); the first guides load the
    tokenizer's vocabulary once, however many arrive together, and compile as before."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import engine.executor.guided as guided

    root = Path(__file__).resolve().parents[2]
    check = ("import sys; from engine.executor.executor import Executor, ExecutorConfig; "
             f"ex = Executor({smollm2_engine_dir!r}, ExecutorConfig(guided_decoding_backend='xgrammar', "
             "max_tokens_in_paged_kv_cache=256)); ex.shutdown(); "
             "loaded = {'xgrammar', 'transformers'} & set(sys.modules); assert not loaded, loaded")
    run = subprocess.run([sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]

    loads, load = [], guided._load_vocabulary
    monkeypatch.setattr(guided, "_load_vocabulary", lambda folder, size: loads.append(folder) or load(folder, size))
    cache = guided.GrammarCache(smollm2_engine_dir, executor.runner.vocab_size)
    time.sleep(0.2)  # a load started at construction would have begun on the pool by now
    assert loads == []
    first, second, again = (cache.compile(GuidedDecodingParams("regex", guide)) for guide in ("[ab]+", "[cd]+", "[ab]+"))
    assert first.result(timeout=60) is again.result(timeout=60) and second.result(timeout=60) is not None
    assert loads == [smollm2_engine_dir]
    cache.shutdown()
