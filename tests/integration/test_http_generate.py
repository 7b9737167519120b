"""HTTP generate / generate_stream through the ensemble and the BLS, stop words, bad input."""
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests

from triton_helpers import chat

pytestmark = pytest.mark.integration

EXPECTED = "The capital of France is Paris."
MODELS = ["ensemble", "tensorrt_llm_bls"]


def france(**extra):
    return {"text_input": chat("What is the capital of France?"), "max_tokens": 24,
            "exclude_input_in_output": True, **extra}


def stream_chunks(response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
    errors = [event for event in events if "error" in event]
    assert not errors, errors
    return events


def unary_and_streamed(server, model, body) -> list:
    """Sends of ``body`` unary (the response) and streamed (its events), for ``replies``."""
    return [partial(server.generate, model, body),
            lambda: stream_chunks(server.generate(model, {**body, "stream": True}, stream=True))]


@pytest.fixture(scope="module")
def replies(triton_server):
    """Every generation request of the tests below but the bad inputs' and the one after them (each
    waits on no other's), sent at once when the first test asks: {test: [each request's answer]}.
    The engine batches 8 and keeps its slots full from the queue. One test after another (each test's
    unary and streamed requests at once), the file's tests took 29 s of CI's make test (2026-11-30)."""
    server = triton_server
    sends = {
        **{f"paris_{model}": unary_and_streamed(server, model, france()) for model in MODELS},
        "echoed": [partial(server.generate, "ensemble", france(exclude_input_in_output=False))],
        **{f"stop_words_{model}": unary_and_streamed(server, model, france(stop_words=[" Paris", "never said"]))
           for model in MODELS},
        "bls_string_stop": unary_and_streamed(server, "tensorrt_llm_bls", france(stop_words=["is Par"])),
        "perf": [partial(server.generate, "ensemble", france(return_perf_metrics=True))],
        **{f"beams_{model}": unary_and_streamed(server, model, france(beam_width=2, max_tokens=12)) for model in MODELS},
        "return_sequences": [partial(server.generate, "tensorrt_llm_bls", france(
            num_return_sequences=2, top_k=20, temperature=1.0, seed=3, max_tokens=8))],
        **{f"top_log_probs_{model}": [partial(server.generate, model, france(temperature=0.0, num_top_log_probs=3)),
                                      partial(server.generate, model, france())] for model in MODELS},
    }
    with ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
        futures = {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}
        yield {test: [future.result() for future in test_futures] for test, test_futures in futures.items()}


@pytest.mark.parametrize("model", MODELS)
def test_unary_generate_answers_paris_and_stream_deltas_concatenate_to_it(replies, model):
    response, chunks = replies[f"paris_{model}"]
    assert response.status_code == 200, response.text
    unary = response.json()["text_output"]
    texts = [chunk["text_output"] for chunk in chunks]
    assert len([t for t in texts if t]) >= 5  # token by token, not one blob
    assert "".join(texts) == unary == EXPECTED


def test_prompt_is_echoed_unless_excluded(replies):
    text = replies["echoed"][0].json()["text_output"]
    assert "What is the capital of France?" in text and text.endswith(EXPECTED)


def unary_and_streamed_texts(answers) -> list[str]:
    """The text of a unary_and_streamed pair's answers (the deltas joined)."""
    response, chunks = answers
    assert response.status_code == 200, response.text
    return [response.json()["text_output"], "".join(c["text_output"] for c in chunks)]


@pytest.mark.parametrize("model", MODELS)
def test_stop_words_end_generation(replies, model):
    # " Paris" is the generated token (with its space): a token-level stop, kept in the output.
    texts = unary_and_streamed_texts(replies[f"stop_words_{model}"])
    assert texts == ["The capital of France is Paris"] * 2


def test_bls_string_stop_words_cut_inside_tokens(replies):
    # "is Par" matches no token sequence; the BLS's string check still cuts right after it.
    texts = unary_and_streamed_texts(replies["bls_string_stop"])
    assert texts == ["The capital of France is Par"] * 2


def test_perf_metrics_are_returned_on_request(replies):
    out = replies["perf"][0].json()
    assert out["arrival_time_ns"] > 0 and out["first_token_time_ns"] >= out["first_scheduled_time_ns"] > 0
    assert out["kv_cache_alloc_total_blocks"] >= 1 and out["acceptance_rate"] == 0.0


BAD_BODIES = {
    "missing text_input": {"max_tokens": 4},
    "missing max_tokens": {"text_input": "hello"},
    "max_tokens wrong dtype": {"text_input": "hello", "max_tokens": "many"},
    "text_input wrong dtype": {"text_input": 5, "max_tokens": 4},
    "max_tokens wrong shape": {"text_input": "hello", "max_tokens": [[1, 2], [3, 4]]},
    "max_tokens zero": {"text_input": "hello", "max_tokens": 0},
    "max_tokens negative": {"text_input": "hello", "max_tokens": -3},
    "max_tokens too large": {"text_input": "hello", "max_tokens": 100000},
    "prompt longer than max_input_len": {"text_input": "hello " * 1500, "max_tokens": 4},
    "top_p wrong dtype": {"text_input": "hello", "max_tokens": 4, "top_p": "high"},
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_input_is_an_error_response(triton_server, model, case):
    response = triton_server.generate(model, BAD_BODIES[case])
    assert response.status_code >= 400, (case, response.text)
    assert response.json()["error"], case


def test_specific_error_texts(triton_server):
    too_long = triton_server.generate("ensemble", BAD_BODIES["prompt longer than max_input_len"]).json()
    assert "max_input_len" in too_long["error"]
    zero = triton_server.generate("ensemble", BAD_BODIES["max_tokens zero"]).json()
    assert "max_tokens" in zero["error"]
    bls_zero = triton_server.generate("tensorrt_llm_bls", BAD_BODIES["max_tokens zero"]).json()
    assert "max_tokens must be a single value > 0" in bls_zero["error"]


def test_malformed_json_and_unknown_model(triton_server):
    url = f"{triton_server.http}/v2/models/ensemble/generate"
    response = requests.post(url, data=b'{"text_input": "hi", "max_tokens": ', timeout=30,
                             headers={"Connection": "close"})
    assert response.status_code >= 400 and response.json()["error"]
    unknown = triton_server.generate("no_such_model", france())
    assert unknown.status_code >= 400 and unknown.json()["error"]


def test_server_keeps_serving_after_bad_input(triton_server):
    for body in BAD_BODIES.values():
        triton_server.generate("ensemble", body)
    assert triton_server.generate("ensemble", france()).json()["text_output"] == EXPECTED


@pytest.mark.parametrize("model", MODELS)
def test_beam_search_unary_and_streamed_agree(replies, model):
    response, chunks = replies[f"beams_{model}"]
    beams = response.json()["text_output"]
    assert len(beams) == 2 and beams[0] == EXPECTED and beams[1] != beams[0]
    assert chunks[-1]["text_output"] == beams  # beam streams carry whole hypotheses


def test_two_return_sequences_through_the_bls(replies):
    out = replies["return_sequences"][0].json()
    assert sorted(out["sequence_index"]) == [0, 1] and len(out["text_output"]) == 2


def _flat(value) -> list:
    """A JSON output of the generate endpoint as a flat list (nested or not)."""
    return [x for item in value for x in _flat(item)] if isinstance(value, list) else [value]


@pytest.mark.parametrize("model", MODELS)
def test_top_log_probs_on_request(replies, model):
    """Greedy: each token's log-prob is its top-1 alternative's; k entries per token, descending."""
    asked, plain = replies[f"top_log_probs_{model}"]  # at once: no comparison between the two
    out, plain = asked.json(), plain.json()
    chosen, top = _flat(out["output_log_probs"]), _flat(out["top_log_probs"])
    assert out["text_output"] == EXPECTED and len(chosen) >= 5 and len(top) == 3 * len(chosen)
    rows = [top[i:i + 3] for i in range(0, len(top), 3)]
    for lp, row in zip(chosen, rows):
        assert lp == pytest.approx(row[0], abs=1e-5) and row == sorted(row, reverse=True)
    if model == "tensorrt_llm_bls":  # the BLS names the tokens too
        ids = _flat(out["top_log_prob_ids"])
        assert [ids[i] for i in range(0, len(ids), 3)] == _flat(out["output_ids"])
    assert "top_log_probs" not in plain and "output_ids" not in plain


@pytest.mark.parametrize("model", MODELS)
def test_too_many_top_log_probs_is_an_error_naming_the_input(triton_server, model):
    response = triton_server.generate(model, france(num_top_log_probs=21))
    assert response.status_code >= 400
    assert "num_top_log_probs must be an integer in 0..20" in response.json()["error"]
