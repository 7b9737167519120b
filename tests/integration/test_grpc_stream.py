"""gRPC streaming with tritonclient: incremental tokens, FINAL last, batch_index, cancellation."""
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from triton_helpers import chat, wait_for
from test_metrics import kv_and_requests, scrape

pytestmark = pytest.mark.integration


def tensor(name, array):
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


class Stream:
    """One gRPC stream; every response lands in a queue as (result, error, is_final)."""

    def __init__(self, server):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses = queue.Queue()
        self.arrivals = []  # (time.monotonic() at arrival, is_final), in order
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        final = False
        if result is not None:
            params = result.get_response().parameters
            final = "triton_final_response" in params and params["triton_final_response"].bool_param
        self.arrivals.append((time.monotonic(), final))
        self.responses.put((result, error, final))

    def send(self, model, inputs, request_id="", outputs=None):
        requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
        self.client.async_stream_infer(model, [tensor(n, a) for n, a in inputs.items()],
                                       request_id=request_id, outputs=requested,
                                       enable_empty_final_response=True)

    def next(self, timeout=60):
        return self.responses.get(timeout=timeout)

    def until_final(self, timeout=120):
        items = []
        while True:
            items.append(self.next(timeout))
            if items[-1][2] or items[-1][1] is not None:
                return items

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def text_inputs(prompts, max_tokens, **extra):
    batch = len(prompts)
    inputs = {"text_input": np.array([[p.encode()] for p in prompts], dtype=object),
              "max_tokens": np.full((batch, 1), max_tokens, np.int32),
              "stream": np.ones((batch, 1), np.bool_),
              "exclude_input_in_output": np.ones((batch, 1), np.bool_)}
    inputs.update({name: np.full((batch, 1), value, dtype=np.asarray(value).dtype) for name, value in extra.items()})
    return inputs


ENTRIES = ["ensemble", "tensorrt_llm_bls"]
QUESTIONS = ["What is the capital of France?", "What is the capital of Germany?"]


def streamed_items(server, model, inputs, outputs=None):
    """Every (result, error, is_final) of one request on a stream of its own, up to its final one."""
    stream = Stream(server)
    try:
        stream.send(model, inputs, outputs=outputs)
        return stream.until_final()
    finally:
        stream.close()


@pytest.fixture(scope="module")
def replies(triton_server):
    """The requests of the tests below that end by themselves and are compared only with each other's
    text (both entries' streams of the capital question and two-prompt requests, and QUESTIONS one
    by one through the ensemble), sent at once when the first test asks, all answered before it reads
    its own (so none runs in the cancel and stop tests' idle checks): {test: [answers]}. One test after
    another (each test's or fixture's own requests at once), these took ~9 s of CI's make test (2026-11-30)."""
    def answer(question):
        body = {"text_input": chat(question), "max_tokens": 16, "exclude_input_in_output": True}
        return triton_server.generate("ensemble", body).json()["text_output"]

    sends = {
        **{f"incremental_{model}": [partial(streamed_items, triton_server, model,
                                            text_inputs([chat("What is the capital of France?")], 24))]
           for model in ENTRIES},
        "one_by_one": [partial(answer, question) for question in QUESTIONS],
        **{f"two_prompts_{model}": [partial(streamed_items, triton_server, model,
                                            text_inputs([chat(q) for q in QUESTIONS], 16),
                                            outputs=["text_output", "batch_index"])] for model in ENTRIES},
    }
    with ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
        futures = {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}
        return {test: [future.result() for future in test_futures] for test, test_futures in futures.items()}


@pytest.mark.parametrize("model", ENTRIES)
def test_tokens_arrive_incrementally_with_final_last(replies, model):
    items, = replies[f"incremental_{model}"]
    assert all(error is None for _, error, _ in items)
    texts = [r.as_numpy("text_output") for r, _, _ in items if r.as_numpy("text_output") is not None]
    pieces = [t[0].decode() for t in texts]  # as the reference clients read it: text_output[0]
    assert len([p for p in pieces if p]) >= 5
    assert "".join(pieces) == "The capital of France is Paris."
    assert [final for _, _, final in items].count(True) == 1 and items[-1][2]


@pytest.mark.parametrize("model", ENTRIES)
def test_two_prompts_in_one_request_come_back_with_batch_index(replies, model):
    # the two-prompt request against the ensemble's answers to each prompt as a request of its own
    expected, (items,) = replies["one_by_one"], replies[f"two_prompts_{model}"]
    texts = {0: "", 1: ""}
    for result, error, _ in items:
        assert error is None, error
        out = result.as_numpy("text_output")
        if out is None:
            continue
        index = int(result.as_numpy("batch_index").reshape(-1)[0])
        texts[index] += out.reshape(-1)[0].decode()
    assert [texts[0], texts[1]] == expected
    assert "Paris" in texts[0] and "Berlin" in texts[1]


LONG = chat("Write a very long story about a dragon who learns to cook, with many chapters.")


def long_llm_request(max_tokens=1500):
    # Direct tensorrt_llm call; end_id -1 never matches, so only max_tokens or a cancel ends it.
    return {"input_ids": np.array([[1, 504, 3458, 314, 260, 1345, 282]], np.int32),
            "input_lengths": np.array([[7]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32),
            "end_id": np.array([[-1]], np.int32), "streaming": np.array([[True]], np.bool_)}


def assert_idle(server):
    idle = wait_for(lambda: kv_and_requests(scrape(server)) == (0.0, 0.0), timeout=20)
    assert idle, kv_and_requests(scrape(server))


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_client_cancel_ends_generation_and_frees_kv(triton_server, model):
    # (An ensemble stream cannot be cancelled this way: Triton 2.51 ensembles do not forward a
    # client's cancellation to the step already running; see the stop-request test below.)
    inputs = long_llm_request() if model == "tensorrt_llm" else text_inputs([LONG], 1500, end_id=np.int32(-1))
    stream = Stream(triton_server)
    stream.send(model, inputs)
    for _ in range(3):
        result, error, _ = stream.next()
        assert error is None, error
    # Gauges are refreshed periodically (stats_check_period_ms, and the engine process's own
    # stats period before it): wait for the running request to show, as a scraper would.
    running = wait_for(lambda: (lambda used, active: used > 0 and active == 1)(*kv_and_requests(scrape(triton_server))),
                       timeout=5, interval=0.05)
    assert running, kv_and_requests(scrape(triton_server))
    stream.close(cancel=True)
    assert_idle(triton_server)  # 1500 tokens would take far longer than 20 s on CPU


STOP = {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[0]], np.int32),
        "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]], np.bool_)}


@pytest.mark.parametrize("model", ["tensorrt_llm", "ensemble"])
def test_stop_request_ends_generation_and_frees_kv(triton_server, model):
    inputs = long_llm_request() if model == "tensorrt_llm" else text_inputs([LONG], 1500, end_id=np.int32(-1))
    stream = Stream(triton_server)
    try:
        stream.send(model, inputs, request_id=f"stop-me-{model}")
        for _ in range(3):
            result, error, _ = stream.next()
            assert error is None, error
        # The ensemble passes its request id to tensorrt_llm, so the same stop request works.
        stream.send("tensorrt_llm", STOP, request_id=f"stop-me-{model}")
        finals, deadline = 0, time.time() + 30
        while finals < 2 and time.time() < deadline:  # the generation's FINAL and the stop's FINAL
            result, error, final = stream.next()
            assert error is None, error
            finals += final
        assert finals == 2
    finally:
        stream.close()
    assert_idle(triton_server)


def test_stop_request_without_id_is_an_error(triton_server):
    stream = Stream(triton_server)
    try:
        stream.send("tensorrt_llm", STOP, request_id="")
        result, error, _ = stream.next()
        assert "A request id must be provided for request cancellation" in str(error)
    finally:
        stream.close()


def test_bls_instances_serve_more_streams_than_there_are_instances(triton_server):
    """The session server fills 2 tensorrt_llm_bls instances; 4 concurrent streams must all be
    generating before the first of them ends (a blocking execute served one per instance, so the
    last two would start only after the first two had ended). 16 tokens: the four first responses
    come within the first steps, the first final after 16 steps at batch 4."""
    streams = [Stream(triton_server) for _ in range(4)]
    try:
        for index, stream in enumerate(streams):
            stream.send("tensorrt_llm_bls", text_inputs([f"Count from {index + 1} upwards:"], 16,
                                                        end_id=np.int32(-1)))
        for stream in streams:
            items = stream.until_final()
            assert items[-1][1] is None, items[-1][1]
            assert len(items) > 2  # streamed: several text responses, then the final one
        first_response = max(stream.arrivals[0][0] for stream in streams)
        first_final = min(stream.arrivals[-1][0] for stream in streams)
        assert first_response < first_final, "a stream started only after another had ended"
    finally:
        for stream in streams:
            stream.close()
