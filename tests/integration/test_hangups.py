"""Clients that hang up or cancel cost nothing: generation stops and KV blocks come back.

Through every entry model (ensemble, tensorrt_llm_bls, tensorrt_llm), over HTTP server-sent events
(the client closes its socket after k chunks) and gRPC streams (`stop_stream(cancel_requests=True)`
after k responses), with ASCII and multi-byte text. Each request asks for far more tokens than the
test waits for (end_id -1 never matches), so only the hang-up can end it in time.
"""
import http.client
import json
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from test_grpc_stream import STOP, Stream, assert_idle, long_llm_request, text_inputs
from test_metrics import LLM, kv_and_requests, scrape, value
from triton_helpers import chat, wait_for

pytestmark = pytest.mark.integration

PROMPTS = {
    "ascii": chat("Write a long story about a lighthouse keeper."),
    "japanese": chat("海についての長い詩を日本語で書いてください。"),
    "chinese": chat("请用中文写一篇关于大海的长文章。"),
}
MANY_TOKENS = 1500  # minutes of CPU time: only a stop can end it within the test's waits


def http_body(model, prompt, max_tokens=MANY_TOKENS):
    if model == "tensorrt_llm":
        ids = [int(t) for t in long_llm_request()["input_ids"][0]]
        return {"input_ids": ids, "input_lengths": len(ids), "request_output_len": max_tokens,
                "end_id": -1, "streaming": True}
    return {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "end_id": -1}


def hang_up_after(server, model, body, chunks):
    """POST generate_stream, read `chunks` SSE events, then close the socket mid-stream."""
    url = urllib.parse.urlparse(server.http)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", f"/v2/models/{model}/generate_stream", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    events = []
    while len(events) < chunks:
        line = response.fp.readline()
        assert line, "the stream ended before the hang-up"
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            events.append(event)
    connection.sock.close()  # the client is gone, mid-stream
    connection.close()
    return events


def idle_within(server, seconds):
    """Whether the gauges read idle within ``seconds`` (test_engine_recovery's hang-ups)."""
    return wait_for(lambda: kv_and_requests(scrape(server)) == (0.0, 0.0), timeout=seconds, interval=0.1)


def engine_state(server):
    """(used KV blocks, active requests, iterations run) as the tensorrt_llm gauges report them."""
    samples = scrape(server)
    return (*kv_and_requests(samples),
            value(samples, "nv_trt_llm_general_metrics", general_type="iteration_counter", **LLM))


def idle_iteration(server):
    """The engine's iteration count once its gauges read idle: exact, since nothing runs until the
    next request (a gauge read just after a request can still show its last step as running)."""
    state = wait_for(lambda: (state := engine_state(server))[:2] == (0.0, 0.0) and state, timeout=20, interval=0.05)
    assert state, engine_state(server)
    return state[2]


# A hang-up or cancel must leave the engine idle within this many iterations of its loop after it (2-5 on a
# quiet machine): far fewer than the MANY_TOKENS only a stop can cut short. Steps, not seconds: the stop
# passes through Triton's frontend, the model's cancellation poll and the engine, all slowed alike on a
# loaded machine (the bound was 2 s until 2026-11-30, once missed under heavy load).
STOP_STEPS = 30


def assert_stopped_within_steps(server, start, steps=STOP_STEPS):
    """The engine reads idle within ``steps`` iterations of the gauges' count now, in gauges of a step
    after iteration ``start`` (before the requests: idle in older ones is not theirs); polled until idle
    or past them. Returns the iteration count at idle."""
    limit = engine_state(server)[2] + steps

    def done():
        used, active, iteration = state = engine_state(server)
        return (iteration > start and (used, active) == (0.0, 0.0) or iteration > limit) and state
    state = wait_for(done, timeout=60, interval=0.05)
    assert state and state[:2] == (0.0, 0.0) and state[2] <= limit, (start, limit, state)
    return state[2]


def assert_still_serves(server, models):
    """An answer through each of ``models`` (tensorrt_llm's through the ensemble), at once."""
    # 7 tokens: "The capital of France is Paris." whole (12 generated 5 more steps for nothing)
    body = {"text_input": chat("What is the capital of France?"), "max_tokens": 7}
    decoding = sorted({"ensemble" if model == "tensorrt_llm" else model for model in models})
    with ThreadPoolExecutor(len(decoding)) as pool:
        responses = list(pool.map(lambda model: server.generate(model, body), decoding))
    for model, response in zip(decoding, responses):
        assert response.status_code == 200, (model, response.text)
        assert "Paris" in response.json()["text_output"], (model, response.text)


def entry_cases(texts):
    """(model, text, k) for every entry model and text case, but one case for tensorrt_llm: it takes
    token ids (long_llm_request, whatever the text), so its other cases would send the same request and
    hang up after another count of the same id chunks (the text cases are for the models that decode)."""
    return [(model, text, k) for model in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")
            for text, k in texts if model != "tensorrt_llm" or text == texts[-1][0]]


HTTP_CASES = entry_cases([("ascii", 1), ("japanese", 3), ("chinese", 6)])
GRPC_CASES = entry_cases([("ascii", 2), ("japanese", 4)])


def test_http_stream_hang_ups_stop_generation(triton_server):
    """Every (entry model, text, chunks read) case at once (one test a case, one after the other, until
    2026-11-30: each its own wait and answer after it), then an answer through each model."""
    start = idle_iteration(triton_server)
    with ThreadPoolExecutor(len(HTTP_CASES)) as pool:
        list(pool.map(lambda case: hang_up_after(triton_server, case[0], http_body(case[0], PROMPTS[case[1]]),
                                                 case[2]), HTTP_CASES))
    assert_stopped_within_steps(triton_server, start)
    assert_still_serves(triton_server, [model for model, _, _ in HTTP_CASES])


def grpc_cancel_after(server, model, text, responses):
    inputs = long_llm_request() if model == "tensorrt_llm" else \
        text_inputs([PROMPTS[text]], MANY_TOKENS, end_id=np.int32(-1))
    stream = Stream(server)
    stream.send(model, inputs)
    for _ in range(responses):
        _, error, _ = stream.next()
        assert error is None, error
    stream.close(cancel=True)


# `make test-all` (6.2 s of CI's fresh clone): make test cancels gRPC streams of tensorrt_llm and the BLS in
# test_grpc_stream.py's test_client_cancel_ends_generation_and_frees_kv (each idle after, no KV block used) and of
# the ensemble in test_streaming_relay.py's test_gone_ensemble_clients_are_stopped_on_either_instance; the
# multi-byte texts are the HTTP hang-ups' above (the same stop in the model, whichever frontend cancelled).
@pytest.mark.extended
def test_grpc_stream_cancels_stop_generation(triton_server):
    """Every (entry model, text, responses read) case at once, then an answer through each model."""
    start = idle_iteration(triton_server)
    with ThreadPoolExecutor(len(GRPC_CASES)) as pool:
        list(pool.map(lambda case: grpc_cancel_after(triton_server, *case), GRPC_CASES))
    assert_stopped_within_steps(triton_server, start)
    assert_still_serves(triton_server, [model for model, _, _ in GRPC_CASES])


UNARY_MODELS = ["ensemble", "tensorrt_llm_bls"]
UNARY_TOKENS = 12


def test_unary_http_hang_ups_run_to_their_end_and_free_everything(triton_server):
    """Triton 2.51's HTTP frontend does not cancel a unary call whose client leaves (nothing in the
    server is told), so the requests run to max_tokens; they must still end and free everything. One
    request to each model at once (one test a model until 2026-11-30), hung up once the engine runs both.
    12 tokens (48, then 24 until 2026-11-30): they are seen running (a gauge poll of 50 ms after ~100 ms of
    stats period) long before their end."""
    start = idle_iteration(triton_server)
    url = urllib.parse.urlparse(triton_server.http)
    body = {"text_input": PROMPTS["ascii"], "max_tokens": UNARY_TOKENS, "end_id": -1}
    connections = []
    for model in UNARY_MODELS:
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        connection.request("POST", f"/v2/models/{model}/generate", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        connections.append(connection)
    running = wait_for(lambda: (lambda used, active, iteration: used > 0 and active == len(UNARY_MODELS)
                                and iteration > start)(*engine_state(triton_server)), timeout=20, interval=0.05)
    assert running, engine_state(triton_server)
    for connection in connections:
        connection.sock.close()
        connection.close()
    end = assert_stopped_within_steps(triton_server, start, steps=UNARY_TOKENS + STOP_STEPS)
    assert end - start >= UNARY_TOKENS, (start, end)  # they ran to their end: a token a step at most
    assert_still_serves(triton_server, UNARY_MODELS)


def test_stop_by_request_key_from_postprocessing_is_harmless_for_unknown_keys(triton_server):
    stream = Stream(triton_server)
    try:
        stream.send("tensorrt_llm", STOP, request_id="request_key:987654321")
        items = stream.until_final(timeout=30)
        assert items[-1][1] is None and items[-1][2]
    finally:
        stream.close()
    assert_idle(triton_server)
