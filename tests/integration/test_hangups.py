"""Clients that hang up or cancel cost nothing: generation stops and KV blocks come back.

Through every entry model (ensemble, tensorrt_llm_bls, tensorrt_llm), over HTTP server-sent events
(the client closes its socket after k chunks) and gRPC streams (`stop_stream(cancel_requests=True)`
after k responses), with ASCII and multi-byte text. Each request asks for far more tokens than the
test waits for (end_id -1 never matches), so only the hang-up can end it in time.
"""
import http.client
import json
import urllib.parse

import numpy as np
import pytest

from test_grpc_stream import STOP, Stream, assert_idle, long_llm_request, text_inputs
from test_metrics import kv_and_requests, scrape
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


def wait_until_running(server):
    running = wait_for(lambda: (lambda used, active: used > 0 and active >= 1)(*kv_and_requests(scrape(server))),
                       timeout=5, interval=0.05)
    assert running, kv_and_requests(scrape(server))


def idle_within(server, seconds):
    return wait_for(lambda: kv_and_requests(scrape(server)) == (0.0, 0.0), timeout=seconds, interval=0.1)


def assert_still_serves(server, model):
    # 7 tokens: "The capital of France is Paris." whole (12 generated 5 more steps for nothing)
    body = {"text_input": chat("What is the capital of France?"), "max_tokens": 7}
    if model == "tensorrt_llm":
        model = "ensemble"
    response = server.generate(model, body)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["text_output"]


def entry_cases(texts):
    """(model, text, k) for every entry model and text case, but one case for tensorrt_llm: it takes
    token ids (long_llm_request, whatever the text), so its other cases would send the same request and
    hang up after another count of the same id chunks (the text cases are for the models that decode)."""
    return [(model, text, k) for model in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")
            for text, k in texts if model != "tensorrt_llm" or text == texts[-1][0]]


@pytest.mark.parametrize("model,text,chunks", entry_cases([("ascii", 1), ("japanese", 3), ("chinese", 6)]))
def test_http_stream_hang_up_stops_generation(triton_server, model, text, chunks):
    hang_up_after(triton_server, model, http_body(model, PROMPTS[text]), chunks)
    assert idle_within(triton_server, 2.0), kv_and_requests(scrape(triton_server))
    assert_still_serves(triton_server, model)


@pytest.mark.parametrize("model,text,responses", entry_cases([("ascii", 2), ("japanese", 4)]))
def test_grpc_stream_cancel_stops_generation(triton_server, model, text, responses):
    inputs = long_llm_request() if model == "tensorrt_llm" else \
        text_inputs([PROMPTS[text]], MANY_TOKENS, end_id=np.int32(-1))
    stream = Stream(triton_server)
    stream.send(model, inputs)
    for _ in range(responses):
        _, error, _ = stream.next()
        assert error is None, error
    stream.close(cancel=True)
    assert idle_within(triton_server, 2.0), kv_and_requests(scrape(triton_server))
    assert_still_serves(triton_server, model)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_unary_http_hang_up_runs_to_its_end_and_frees_everything(triton_server, model):
    """Triton 2.51's HTTP frontend does not cancel a unary call whose client leaves (nothing in the
    server is told), so the request runs to max_tokens; it must still end and free everything. 24 tokens
    (was 48): it is seen running (a gauge poll of 50 ms after ~100 ms of stats period) long before its end."""
    url = urllib.parse.urlparse(triton_server.http)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"text_input": PROMPTS["ascii"], "max_tokens": 24, "end_id": -1}
    connection.request("POST", f"/v2/models/{model}/generate", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    wait_until_running(triton_server)
    connection.sock.close()
    connection.close()
    assert idle_within(triton_server, 30.0), kv_and_requests(scrape(triton_server))
    assert_still_serves(triton_server, model)


def test_stop_by_request_key_from_postprocessing_is_harmless_for_unknown_keys(triton_server):
    stream = Stream(triton_server)
    try:
        stream.send("tensorrt_llm", STOP, request_id="request_key:987654321")
        items = stream.until_final(timeout=30)
        assert items[-1][1] is None and items[-1][2]
    finally:
        stream.close()
    assert_idle(triton_server)
