"""Guided decoding (structured output) through a real tritonserver serving SmolLM2, as clients use it:
the ensemble over HTTP generate (3 JSON-schema completions, every one parsed and validated), regex
and EBNF outputs that fullmatch, sampling that still conforms, bad guides that fail only their own
request, the BLS, the reference's documented curl body, and NVIDIA's end_to_end_grpc_client invocation
(its tensors over a gRPC stream; the client itself too when TRITONLLM_REFERENCE_CLIENTS names a folder
holding it). The requests that wait on no other go out at once (``replies``). The session server fills
guided_decoding_backend:xgrammar (scripts/serve_default.py)."""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_helpers import chat, grpc_inputs

pytestmark = pytest.mark.integration

# Each schema finite (short strings, enums, bounded integers and arrays, no extra properties; the
# engine compiles schemas without free whitespace), so no completion can run into max_tokens, and
# short (15-25 tokens). Enums at the top level and a negative integer range are STREAMED_SCHEMA's
# (test_streamed_guided_output_concatenates_to_valid_json); an optional field, string lengths and an
# integer range are PERSON_SCHEMA's, greedy and sampled through the BLS (test_the_bls_constrains_like_the_ensemble).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "nick": {"type": "string", "maxLength": 6}},
    "required": ["name", "age"], "additionalProperties": False}
# Until 2026-11-30 also "person" (PERSON_SCHEMA: the BLS's) and "order" (an array of enums with
# minItems/maxItems, a boolean: tests/executor/test_executor_guided_decoding.py's PERSON has the array of
# enums, STREAMED_SCHEMA a boolean), each greedy and sampled: 7 completions, 28 s
# of CI's fresh clone for the first test (it waits on the file's other requests too).
SCHEMAS = {
    "city": {  # a nested object, an optional array
        "type": "object",
        "properties": {"city": {"type": "object",
                                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                                               "country": {"enum": ["France", "Japan", "Kenya"]}},
                                "required": ["name", "country"], "additionalProperties": False},
                       "tags": {"type": "array", "maxItems": 1, "items": {"enum": ["coast", "river"]}}},
        "required": ["city"], "additionalProperties": False},
    "grid": {  # an array of arrays of bounded integers, negative ones too
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                          "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False},
}
STREAMED_SCHEMA = {  # enums and a negative integer range
    "type": "object",
    "properties": {"mood": {"enum": ["good", "bad", "meh"]},
                   "score": {"type": "integer", "minimum": -5, "maximum": 5},
                   "again": {"type": "boolean"}},
    "required": ["mood", "score"], "additionalProperties": False}
QUESTIONS = {
    "city": "A city near {} as JSON.",
    "grid": "A 2x2 grid for {} as JSON.",
}
# Each schema greedy (the first subject), "grid" sampled too (the second subject, its own seed): 3
# completions. The grammar guarantees conformance, so more completions of the same schemas prove nothing
# more, and sampling goes through the same masked sampler whatever the schema (the BLS samples PERSON_SCHEMA).
# 20 subjects until 2026-11-28, 10 and 5 until 2026-11-29; "review" and "city" were sampled too until
# 2026-11-30, "review" greedy too (the streamed test's schema: the same greedy path), "city" had a required
# "pop" and two tags (32 tokens).
SUBJECTS = ["Alice", "a pirate"]
SAMPLED_SCHEMAS = ("grid",)
SAMPLING = {"temperature": 1.0, "top_k": 40, "top_p": 0.95}


def generate(server, body, model="ensemble"):
    response = server.generate(model, body, timeout=300)
    return response.status_code, response.json()


def short_chat(question):
    """SmolLM2's chat format without the system prompt (fewer prompt tokens to compute)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def guided_body(question, guide_type, guide=None, max_tokens=96, **extra):
    body = {"text_input": short_chat(question), "max_tokens": max_tokens, "exclude_input_in_output": True,
            "guided_decoding_guide_type": guide_type, **extra}
    if guide is not None:
        body["guided_decoding_guide"] = guide
    return body


JSON_SCHEMA_JOBS = [(name, guided_body(QUESTIONS[name].format(subject), "json_schema", json.dumps(schema),
                                       **({**SAMPLING, "seed": 1000 + i} if i % 2 else {})))
                    for name, schema in SCHEMAS.items()
                    for i, subject in enumerate(SUBJECTS[:2 if name in SAMPLED_SCHEMAS else 1])]

REGEXES = [
    (r"(yes|no), because [a-z ]{3,30}\.", "Is the sky blue? Answer yes or no and say why."),
    (r"\d{3}-\d{4}", "Make up a short phone number."),
    (r"[A-Z][a-z]{2,10} (is|was) [a-z]{2,12}\.", "Describe a famous person in three words."),
]
# Each regex greedy, the first (the freest) sampled too: the masked sampler is the same whatever the
# regex. (Each sampled too until 2026-11-30, and two tests, one after the other, before.)
REGEX_CASES = [(pattern, guided_body(question, "regex", pattern, **extra))
               for i, (pattern, question) in enumerate(REGEXES)
               for extra in (({}, {**SAMPLING, "seed": 7}) if i == 0 else ({},))]

# xgrammar's EBNF dialect (GBNF-like); the regex is the same language, to check the output with.
GRAMMARS = [
    ('root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]', r"The answer is [0-9][0-9]?\.",
     "What is 6 times 7?"),
    ('root ::= "[" item (", " item){0,2} "]"\nitem ::= "\\"" [a-z]{1,8} "\\""',
     r'\["[a-z]{1,8}"(, "[a-z]{1,8}"){0,2}\]', "List a few fruits."),
    ('root ::= color " and " color\ncolor ::= "red" | "green" | "blue"', r"(red|green|blue) and (red|green|blue)",
     "Name two colours."),
]
# Each grammar greedy, the list (a repetition) sampled too (each sampled until 2026-11-30).
GRAMMAR_CASES = [(grammar, pattern, guided_body(question, "ebnf_grammar", grammar, **extra))
                 for i, (grammar, pattern, question) in enumerate(GRAMMARS)
                 for extra in (({}, {**SAMPLING, "seed": 3}) if i == 1 else ({},))]

# Any JSON is not a finite language (a number may go on and on), so one prompt whose greedy answer is short.
ANY_JSON_BODY = {"text_input": chat("What is the year after 2024? Answer in JSON."), "max_tokens": 64,
                 "exclude_input_in_output": True, "guided_decoding_guide_type": "json"}
STREAMED_BODY = guided_body("Review a bicycle as JSON.", "json_schema", json.dumps(STREAMED_SCHEMA), stream=True)
# docs/guided_decoding.md's body, unchanged (its ids 2 are SmolLM2's <|im_end|> too).
CURL_PROMPT = "What is the year after 2024? Answer:"
CURL_BODY = {"text_input": CURL_PROMPT, "max_tokens": 20, "bad_words": "", "stop_words": "", "pad_id": 2,
             "end_id": 2, "guided_decoding_guide_type": "json"}
# Through the BLS: a schema greedy and sampled, and a streamed regex.
BLS_SCHEMA = PERSON_SCHEMA
BLS_BODIES = [guided_body("Describe Alice as JSON.", "json_schema", json.dumps(BLS_SCHEMA), **extra)
              for extra in ({}, {**SAMPLING, "seed": 11})]
BLS_STREAMED_BODY = guided_body("Make up a phone number.", "regex", r"\d{3}-\d{4}", stream=True)
CLIENT_MODELS = ["ensemble", "tensorrt_llm_bls"]
ANCHOR_SCHEMA = ('{"properties": {"answer": {"title": "Answer", "type": "integer"}}, "required": ["answer"], '
                 '"title": "Answer", "type": "object"}')


def streamed_text(server, body, model="ensemble"):
    """generate_stream's text deltas, concatenated (a stream of several of them)."""
    response = server.generate(model, body, stream=True, timeout=300)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert not [event for event in events if "error" in event], events
    assert len([event for event in events if event["text_output"]]) > 3  # token by token
    return "".join(event["text_output"] for event in events)


def _client_tensors(prompt, output_len, guide_type, guide):
    """What end_to_end_grpc_client.py sends for `-p PROMPT -o N --exclude-input-in-output
    --guided-decoding-guide-type T --guided-decoding-guide G` (its defaults: no streaming, beam 1,
    temperature 1.0)."""
    return {"text_input": np.array([[prompt]]).astype(object),
            "max_tokens": np.ones((1, 1), np.int32) * output_len,
            "stream": np.array([[False]], dtype=bool), "beam_width": np.array([[1]], dtype=np.int32),
            "temperature": np.array([[1.0]], dtype=np.float32),
            "exclude_input_in_output": np.array([[True]], dtype=bool),
            "guided_decoding_guide_type": np.array([[guide_type]]).astype(object),
            "guided_decoding_guide": np.array([[guide]]).astype(object)}


def _client_invocation(server, model):
    """The documented json_schema call of the anchor's client to ``model``, its tensors over a gRPC
    stream as it sends them; (errors, the text_output of each response, read as it reads it)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    inputs = grpc_inputs(_client_tensors("What is the year after 2024? Answer:", 30, "json_schema", ANCHOR_SCHEMA))
    client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput("text_output")])
    client.stop_stream()  # waits for the server to close the stream
    client.close()
    errors = [error for _, error in results if error is not None]
    return errors, [result.as_numpy("text_output")[0].decode() for result, _ in results if result is not None]


@pytest.fixture(scope="module")
def replies(triton_server):
    """Every request of the tests below that waits on no other's (all but the bad guides' and their
    follow-up), sent at once when the first test asks: {test: [Future of each request's answer]}. The
    engine batches 8 and keeps its slots full from the queue. One test after another (each test's own
    requests at once), the file's tests took 37.6 s of CI's make test (2026-11-30); on a quiet dev server
    37.1 s, 21.4 s so (36.0 -> 24.3 CPU-s of the server)."""
    server = triton_server
    sends = {
        "json_schema": [partial(generate, server, body) for _, body in JSON_SCHEMA_JOBS],
        "regex": [partial(generate, server, body) for _, body in REGEX_CASES],
        "ebnf": [partial(generate, server, body) for _, _, body in GRAMMAR_CASES],
        "any_json": [partial(generate, server, ANY_JSON_BODY)],
        "streamed": [partial(streamed_text, server, STREAMED_BODY)],
        "bls": [partial(generate, server, body, "tensorrt_llm_bls") for body in BLS_BODIES]
               + [partial(streamed_text, server, BLS_STREAMED_BODY, "tensorrt_llm_bls")],
        "curl": [partial(generate, server, CURL_BODY)],
        "grpc_client": [partial(_client_invocation, server, model) for model in CLIENT_MODELS],
    }
    with ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
        yield {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}


def answers(replies, test):
    return [future.result() for future in replies[test]]


def test_3_json_schema_completions_parse_and_validate(replies):
    """2 schemas greedy, one of them sampled at temperature 1 (top_k, top_p, seed) too."""
    results = answers(replies, "json_schema")
    failures = []
    for (name, body), (status, reply) in zip(JSON_SCHEMA_JOBS, results):
        try:
            assert status == 200, reply
            value = json.loads(reply["text_output"])
            jsonschema.validate(value, SCHEMAS[name])
        except Exception as error:  # collect all, report together
            failures.append(f"{name} {body.get('seed')}: {error!r:.300} <- {reply.get('text_output', reply)!r:.300}")
    assert not failures, f"{len(failures)} of {len(JSON_SCHEMA_JOBS)} did not conform:\n" + "\n".join(failures[:10])
    outputs = {reply["text_output"] for _, reply in results}
    # The two schemas' completions differ anyway; the sampled completion must differ from the greedy one too.
    assert len(outputs) == len(JSON_SCHEMA_JOBS), "the completions should differ across prompts and seeds"


def test_regex_outputs_fullmatch_greedy_and_sampled(replies):
    for (pattern, body), (status, reply) in zip(REGEX_CASES, answers(replies, "regex")):
        assert status == 200, reply
        assert re.fullmatch(pattern, reply["text_output"]), (pattern, body.get("seed"), reply["text_output"])


def test_ebnf_grammar_outputs_fullmatch(replies):
    for (grammar, pattern, _), (status, reply) in zip(GRAMMAR_CASES, answers(replies, "ebnf")):
        assert status == 200, reply
        assert re.fullmatch(pattern, reply["text_output"]), (grammar, reply["text_output"])


def test_json_gives_parseable_json(replies):
    [(status, reply)] = answers(replies, "any_json")
    assert status == 200, reply
    json.loads(reply["text_output"])


def test_streamed_guided_output_concatenates_to_valid_json(replies):
    [text] = answers(replies, "streamed")
    jsonschema.validate(json.loads(text), STREAMED_SCHEMA)


# guide type, guide -> what the per-request error must name
BAD_GUIDES = [
    ("json_schema", '{"type": "object", "properties": ', ["guided_decoding_guide", "json_schema"]),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}',
     ["guided_decoding_guide", "no-such-type"]),
    ("regex", "[0-9", ["guided_decoding_guide", "regex"]),
    ("ebnf_grammar", "root ::= [0-9", ["guided_decoding_guide", "ebnf_grammar"]),
    ("ebnf_grammar", "root ::= undefined_rule", ["guided_decoding_guide", "undefined_rule"]),
    ("yaml", "a: 1", ["guided_decoding_guide_type", "'yaml'", "json_schema"]),
    ("regex", None, ["guided_decoding_guide", "regex"]),
]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_bad_guides_fail_their_own_request_and_the_server_keeps_serving(triton_server, model):
    """The bad guides and as many good requests all at once (each good one shares the batches of the bad
    ones: they fail alone), then one more good request (the model still serves after them all)."""
    good = guided_body("Is water wet? Answer yes or no.", "regex", "(yes|no)")
    bodies = [guided_body("Hello", guide_type, guide) for guide_type, guide, _ in BAD_GUIDES] + [good] * len(BAD_GUIDES)
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        results = list(pool.map(lambda body: generate(triton_server, body, model), bodies))
    for (guide_type, guide, names), (status, reply) in zip(BAD_GUIDES, results):
        assert status == 400 and "error" in reply, (guide_type, guide, reply)
        for name in names:
            assert name in reply["error"], (name, reply["error"])
    for status, reply in [*results[len(BAD_GUIDES):], generate(triton_server, good, model)]:
        assert status == 200 and reply["text_output"] in ("yes", "no"), reply


def test_the_bls_constrains_like_the_ensemble(replies):
    """A schema greedy and sampled, and a streamed regex, through the BLS."""
    *results, stream_text = answers(replies, "bls")
    for status, reply in results:
        assert status == 200, reply
        jsonschema.validate(json.loads(reply["text_output"]), BLS_SCHEMA)
    assert re.fullmatch(r"\d{3}-\d{4}", stream_text)


def test_the_references_documented_curl_call(replies):
    """The reference's server there excludes the prompt, ours echoes it (exclude_input_in_output unset)."""
    [(status, reply)] = answers(replies, "curl")
    assert status == 200, reply
    assert reply["model_name"] == "ensemble" and reply["text_output"].startswith(CURL_PROMPT)
    json.loads(reply["text_output"][len(CURL_PROMPT):])


def test_the_end_to_end_grpc_client_invocation_to_the_ensemble_and_the_bls(replies):
    """The client's call to each model: one response each, its text valid under the schema."""
    for model, (errors, texts) in zip(CLIENT_MODELS, answers(replies, "grpc_client")):
        assert not errors, (model, errors)
        assert len(texts) == 1, (model, texts)
        jsonschema.validate(json.loads(texts[0]), json.loads(ANCHOR_SCHEMA))


REFERENCE_CLIENTS = os.environ.get("TRITONLLM_REFERENCE_CLIENTS")  # a folder with end_to_end_grpc_client.py


@pytest.mark.skipif(not REFERENCE_CLIENTS, reason="set TRITONLLM_REFERENCE_CLIENTS to the folder of "
                    "tensorrtllm_backend's inflight_batcher_llm/client to run NVIDIA's client itself")
@pytest.mark.parametrize("flags", [[], ["--streaming"]], ids=["unary", "streaming"])
def test_nvidias_end_to_end_grpc_client_unchanged(triton_server, flags):
    command = [sys.executable, os.path.join(REFERENCE_CLIENTS, "end_to_end_grpc_client.py"),
               "-u", triton_server.grpc_url, "-p", "What is the year after 2024? Answer:", "-o", "30",
               "--exclude-input-in-output", "--verbose", "--model-name", "ensemble", *flags,
               "--guided-decoding-guide-type", "json_schema", "--guided-decoding-guide", ANCHOR_SCHEMA]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Received an error from server" not in run.stdout, run.stdout
    # unary: "0: <text>"; streaming: the chunks, then the whole text on the last line
    text = run.stdout.strip().splitlines()[-1]
    text = text[3:] if text.startswith("0: ") else text
    jsonschema.validate(json.loads(text), json.loads(ANCHOR_SCHEMA))
