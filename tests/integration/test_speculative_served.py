"""Speculative decoding through a real tritonserver serving SmolLM2 (the session's non-decoupled
server, conftest.unary_server, shared with test_unary_served.py).

The repository is non-decoupled, as e2e_grpc_speculative_decoding_client.py needs (unary calls
with the prompt in output_ids), and serves three `tensorrt_llm` models on the same engine: the
target `tensorrt_llm`; `tensorrt_llm_draft`, the BLS's tensorrt_llm_draft_model_name, which itself
runs with decoding_mode ngram (one model for two roles: n-gram drafting keeps its greedy ids, so it
drafts what plain decoding would); and `tensorrt_llm_draft_target` (decoding_mode draft_target,
the same engine as its own draft model; served where its `extended` test runs). Greedy decoding must give plain decoding's ids whatever
the drafts: right ones (the draft is the target's own engine, so everything is accepted),
deliberately wrong ones sent straight to the target, n-gram lookups and draft-model drafts. The engine-level proofs
(20 prompts, sampling laws) are tests/executor/test_speculative*.py's.
"""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_helpers import DRAFT_MODEL, DRAFT_TARGET_MODEL, chat, grpc_inputs, wait_for

pytestmark = pytest.mark.integration

DRAFT = NGRAM = DRAFT_MODEL
DRAFT_TARGET = DRAFT_TARGET_MODEL
END_ID = 2  # SmolLM2's <|im_end|>
REFERENCE_CLIENTS = os.environ.get("TRITONLLM_REFERENCE_CLIENTS")  # tensorrtllm_backend's inflight_batcher_llm/client


@pytest.fixture(scope="module")
def server(unary_server):
    return unary_server


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_engine_dir)


def infer(server, model, tensors):
    """One unary gRPC call (all outputs); name -> numpy."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer(model, grpc_inputs(tensors))
        return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}
    finally:
        client.close()


def generate(server, prompt_ids, new_tokens, model="tensorrt_llm", **extra):
    """Greedy ids (prompt included, as NVIDIA's speculative client reads them) and the perf outputs."""
    tensors = {"input_ids": np.array([prompt_ids], np.int32), "input_lengths": np.array([[len(prompt_ids)]], np.int32),
               "request_output_len": np.array([[new_tokens]], np.int32), "end_id": np.array([[END_ID]], np.int32),
               "pad_id": np.array([[END_ID]], np.int32), "return_perf_metrics": np.array([[True]]), **extra}
    out = infer(server, model, tensors)
    ids = out["output_ids"][0, 0, : int(out["sequence_length"][0, 0])].tolist()
    perf = {name: out[name].item() for name in ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate")}
    return ids, perf


# 16 tokens of plain greedy decoding for the sea prompt: the draft_target request after it runs its
# prefill's token and three full steps of 4 drafts and the target's own token (12 drafts; 24 tokens,
# ~five steps, until 2026-11-30: the same path, longer).
SEA_TOKENS = 16


@pytest.fixture(scope="module")
def sea(server, tokenizer):
    """A chat prompt's ids and plain greedy decoding's SEA_TOKENS tokens after it (prompt included), with
    the perf outputs of that request; the two tests that compare with them ask for it once."""
    prompt = tokenizer.encode(chat("Write two sentences about the sea."))
    plain, perf = generate(server, prompt, SEA_TOKENS)
    return prompt, plain, perf


# Drafts sent to the target are the first step's: 4 of them, then plain decoding; 8 new tokens cover
# them and what follows them (24, one request after the other, until 2026-11-30: ~100 decode steps).
DRAFTED_TOKENS = 8


def test_drafts_sent_to_the_target_keep_plain_decodings_ids(server, sea):
    prompt, plain, perf = sea
    assert perf == {"total_draft_tokens": 0, "total_accepted_draft_tokens": 0, "acceptance_rate": 0.0}
    completion = plain[len(prompt):]
    assert len(completion) == SEA_TOKENS
    plain = plain[:len(prompt) + DRAFTED_TOKENS]
    right = np.array([completion[:4]], np.int32)
    wrong = np.array([[(t + 1) % 49152 for t in completion[:4]]], np.int32)
    half = np.array([completion[:2] + [(t + 1) % 49152 for t in completion[2:4]]], np.int32)
    # and with the draft model's logits (one-hot on the drafts), and a threshold: greedy ignores both
    logits = np.full((1, 4, 49152), -10.0, np.float32)
    logits[0, np.arange(4), wrong[0]] = 10.0
    cases = [({"draft_input_ids": right}, 4), ({"draft_input_ids": wrong}, 0), ({"draft_input_ids": half}, 2),
             ({"draft_input_ids": wrong, "draft_logits": logits,
               "draft_acceptance_threshold": np.array([[0.5]], np.float32)}, 0)]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: one batch
        results = list(pool.map(lambda case: generate(server, prompt, DRAFTED_TOKENS, **case[0]), cases))
    for (extra, accepted), (ids, perf) in zip(cases, results):
        assert ids == plain, extra["draft_input_ids"]
        assert perf["total_draft_tokens"] == 4 and perf["total_accepted_draft_tokens"] == accepted, perf
        assert perf["acceptance_rate"] == pytest.approx(accepted / 4)


@pytest.mark.parametrize("extra,message", [
    ({"draft_input_ids": np.array([[5, 60000]], np.int32)}, "draft_input_ids contains token id 60000 outside the vocabulary"),
    ({"draft_input_ids": np.array([[5, 6]], np.int32), "draft_logits": np.zeros((1, 2, 16), np.float32)},
     "draft_logits has shape (2, 16)"),
    ({"draft_logits": np.zeros((1, 2, 49152), np.float32)}, "draft_logits was sent without draft_input_ids"),
    ({"draft_input_ids": np.array([[5] * 9], np.int32)}, "draft_input_ids has 9 tokens; allowed: at most 8"),
])
def test_bad_drafts_fail_their_request_naming_the_input(server, extra, message):
    with pytest.raises(InferenceServerException) as raised:
        generate(server, [1, 504, 3458], 4, **extra)
    assert message in str(raised.value)
    ids, _ = generate(server, [1, 504, 3458], 4)  # the model keeps serving
    assert len(ids) == 7


def bls_body(question, max_tokens=24, **extra):
    return {"text_input": chat(question), "max_tokens": max_tokens, "exclude_input_in_output": True, **extra}


def counter(server, family, model):
    """The model's value of a label-less counter family, 0 while absent."""
    found = re.search(rf'{family}\{{model="{model}",version="1"\}} (\d+)', server.metrics_text())
    return int(found.group(1)) if found else 0


def value(outputs, name):
    return np.asarray(outputs[name]).reshape(-1)[0]


BLS_TOKENS = 20


def test_bls_with_a_draft_model_answers_the_ensembles_greedy_text(server):
    """The ensemble's greedy text and the BLS's with and without the draft's logits, the three at once.
    20 tokens: four full rounds of 4 drafts and the target's own token (32 until 2026-11-30, then 24: a
    fifth round of 3 drafts; a round cut short by max_tokens is tests/serving/test_speculative_serving.py's
    max_tokens 10, k 3 loop)."""
    question = "Name three colours and say why the sky is blue."
    bodies = [("ensemble", bls_body(question, BLS_TOKENS))] + [
        ("tensorrt_llm_bls", bls_body(question, BLS_TOKENS, num_draft_tokens=4, return_perf_metrics=True,
                                      use_draft_logits=use_draft_logits)) for use_draft_logits in (False, True)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        reference, *responses = pool.map(lambda job: server.generate(*job), bodies)
    assert reference.status_code == 200, reference.text
    expected = reference.json()["text_output"]
    for response in responses:
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["text_output"] == expected
        drafted, accepted = value(out, "total_draft_tokens"), value(out, "total_accepted_draft_tokens")
        # the draft is the target's own engine: (nearly) every draft is accepted, ~5 tokens a round
        assert drafted >= 16 and accepted >= drafted - 4, out
        assert value(out, "acceptance_rate") == pytest.approx(accepted / drafted, rel=1e-6)
    # counters are published every stats period
    assert wait_for(lambda: counter(server, "tritonllm_speculative_accepted_draft_tokens_total", "tensorrt_llm")
                    >= accepted, timeout=10)


def test_bls_speculative_refusals(server):
    response = server.generate("tensorrt_llm_bls", bls_body("Hi", num_draft_tokens=4, stream=True))
    assert response.status_code != 200 and "streaming is not supported with speculative decoding" in response.text
    response = server.generate("tensorrt_llm_bls", bls_body("Hi", num_draft_tokens=4, return_context_logits=True))
    assert response.status_code != 200 and "context logits are not supported with speculative decoding" in response.text


# The answer repeats the prompt's sentence from its first tokens on, so n-gram drafts are kept within
# 20 tokens (40 until 2026-11-30: the second half only repeated what the first had shown).
NGRAM_TOKENS = 20


def test_ngram_decoding_mode_keeps_the_greedy_ids(server, tokenizer):
    prompt = tokenizer.encode(chat("Repeat this sentence twice: the quick brown fox jumps over the lazy dog."))
    families = ("tritonllm_speculative_draft_tokens_total", "tritonllm_speculative_accepted_draft_tokens_total")
    before = [counter(server, family, NGRAM) for family in families]  # (the BLS tests drafted through it too)
    with ThreadPoolExecutor(2) as pool:  # plain and n-gram decoding at once (two engine processes)
        (plain, _), (ids, perf) = pool.map(lambda model: generate(server, prompt, NGRAM_TOKENS, model=model),
                                           ["tensorrt_llm", NGRAM])
    assert ids == plain
    assert perf["total_draft_tokens"] > 0 and perf["total_accepted_draft_tokens"] > 0, perf
    grown = (perf["total_draft_tokens"], perf["total_accepted_draft_tokens"])
    assert wait_for(lambda: all(counter(server, family, NGRAM) >= start + by
                                for family, start, by in zip(families, before, grown)), timeout=10)


@pytest.mark.skipif(not REFERENCE_CLIENTS, reason="set TRITONLLM_REFERENCE_CLIENTS to the folder of "
                    "tensorrtllm_backend's inflight_batcher_llm/client to run NVIDIA's clients themselves")
def test_nvidias_speculative_decoding_client(server):
    """e2e_grpc_speculative_decoding_client.py, unchanged: the draft model drafts, the target
    verifies; its final text is the ensemble's greedy one (prompt included)."""
    question = "Name three colours and say why the sky is blue."
    expected = server.generate("ensemble", {"text_input": chat(question), "max_tokens": 24}).json()["text_output"]
    run = subprocess.run([sys.executable, os.path.join(REFERENCE_CLIENTS, "e2e_grpc_speculative_decoding_client.py"),
                          "--url-target", server.grpc_url, "--draft-tensorrt-llm-model-name", DRAFT,
                          "--target-tensorrt-llm-model-name", "tensorrt_llm", "-p", chat(question), "-o", "24",
                          "--num-draft-tokens", "4"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error" not in run.stdout and "Final text" in run.stdout, run.stdout
    assert expected.strip() in run.stdout, (expected, run.stdout)


@pytest.mark.extended
def test_draft_target_decoding_mode_keeps_the_greedy_ids(server, sea):
    """decoding_mode draft_target with draft_model_path: the executor's own draft model (here the
    target's engine, so it drafts the target's tokens) gives the plain ids, most drafts accepted.
    `extended` (since 2026-12-01; the server holds DRAFT_TARGET only where this test runs: conftest
    DRAFT_TARGET_TEST): an engine process holding SmolLM2 twice and ~5 forward passes a step, of CI's 10
    minutes. In `make test`, tests/serving/test_speculative_serving.py's test_draft_target_names_the_draft_engine
    holds the model's parameters to the executor's settings and tests/executor/test_speculative_draft_model.py
    the draft model's drafts (plain greedy ids whatever they are, streams, stops, preemption, refusals)."""
    prompt, plain, _ = sea
    ids, perf = generate(server, prompt, SEA_TOKENS, model=DRAFT_TARGET)
    assert ids == plain
    assert perf["total_draft_tokens"] >= 12 and perf["total_accepted_draft_tokens"] >= perf["total_draft_tokens"] - 4, perf


def test_a_bls_without_a_draft_model_refuses_num_draft_tokens(triton_server):
    """The session's (decoupled) repository names no draft model: the reference's refusal."""
    response = triton_server.generate("tensorrt_llm_bls", bls_body("Hi", num_draft_tokens=4))
    assert response.status_code != 200 and "cannot perform speculative decoding without draft model" in response.text
    response = triton_server.generate("tensorrt_llm_bls", bls_body("Hi", max_tokens=4, num_draft_tokens=0))  # 0: off
    assert response.status_code == 200 and response.json()["text_output"]
