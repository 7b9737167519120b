"""A non-decoupled repository (`decoupled_mode:false`): one response per request, as clients like
end_to_end_test.py and benchmark_core_model.py use it. The session's non-decoupled server
(conftest.unary_server), which test_speculative_served.py shares (its draft models beside these five
models change nothing here: no request sends drafts); this file's last test kills it. Until 2026-11-30
this file started a server of its own (test_non_decoupled.py), the same five models."""
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_helpers import chat, wait_for
from test_grpc_stream import tensor
from test_metrics import scrape, value

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(smollm2_engine_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_engine_dir)


MODELS = ["ensemble", "tensorrt_llm_bls"]
CAPITAL = chat("What is the capital of France?")


@pytest.fixture(scope="module")
def replies(unary_server, tokenizer):
    """The requests of the tests below that end by themselves and are checked each on its own (both
    entries' generate, the batch of two, the log-probs and the logits requests), sent at once when the
    first test asks, all answered before it reads its own (so none runs in the cancel test's idle
    check): {test: answer}. One after another they took ~6 s of CI's make test (2026-11-30)."""
    body = {"text_input": CAPITAL, "max_tokens": 24, "exclude_input_in_output": True}
    sends = {**{f"generate_{model}": partial(unary_server.generate, model, body) for model in MODELS},
             "batch_of_two": partial(infer, unary_server, *batch_of_two(tokenizer)),
             "log_probs": partial(infer, unary_server, log_probs_inputs(tokenizer),
                                  ["output_ids", "cum_log_probs", "output_log_probs"]),
             "logits": partial(infer, unary_server, logits_inputs(tokenizer),
                               ["output_ids", "context_logits", "generation_logits"])}
    with ThreadPoolExecutor(max_workers=len(sends)) as pool:
        futures = {test: pool.submit(send) for test, send in sends.items()}
        return {test: future.result() for test, future in futures.items()}


@pytest.mark.parametrize("model", MODELS)
def test_unary_generate(replies, model):
    response = replies[f"generate_{model}"]
    assert response.status_code == 200, response.text
    assert response.json()["text_output"] == "The capital of France is Paris."


def infer(server, inputs, outputs):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return client.infer("tensorrt_llm", [tensor(n, a) for n, a in inputs.items()],
                            outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
    finally:
        client.close()


def two_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(chat(q)) for q in ("What is the capital of France?", "Say hello.")]


def batch_of_two(tokenizer):
    """(inputs, outputs) of one request holding two prompts."""
    prompts = two_prompts(tokenizer)
    width = max(map(len, prompts))
    input_ids = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
    inputs = {"input_ids": input_ids, "input_lengths": np.array([[len(p)] for p in prompts], np.int32),
              "request_output_len": np.array([[12], [12]], np.int32), "end_id": np.array([[2], [2]], np.int32)}
    return inputs, ["output_ids", "sequence_length", "batch_index"]


def test_batch_of_two_comes_back_as_one_stacked_response(replies, tokenizer):
    prompts = two_prompts(tokenizer)
    result = replies["batch_of_two"]
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    index = result.as_numpy("batch_index").reshape(-1).tolist()
    assert output_ids.shape[:2] == (2, 1) and sorted(index) == [0, 1]
    first = output_ids[index.index(0), 0, : lengths[index.index(0), 0]].tolist()
    assert first[: len(prompts[0])] == prompts[0]  # the prompt is echoed by default
    assert tokenizer.decode(first[len(prompts[0]):]) == "The capital of France is Paris."


def log_probs_inputs(tokenizer):
    prompt = tokenizer.encode(CAPITAL)
    return {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[6]], np.int32), "return_log_probs": np.array([[True]]),
            "exclude_input_in_output": np.array([[True]])}


def test_log_probs_and_streaming_rejection(unary_server, replies, tokenizer):
    inputs, result = log_probs_inputs(tokenizer), replies["log_probs"]
    log_probs = result.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 1, 6) and (log_probs <= 0).all()
    assert np.isclose(result.as_numpy("cum_log_probs").item(), log_probs.sum(), atol=1e-3)
    with pytest.raises(Exception, match="Streaming is only supported in decoupled mode."):
        infer(unary_server, {**inputs, "streaming": np.array([[True]])}, ["output_ids"])


def logits_inputs(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    return {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[3]], np.int32), "return_context_logits": np.array([[True]]),
            "return_generation_logits": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}


def test_logits_have_the_reference_shapes(replies, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    result = replies["logits"]
    vocab = tokenizer.vocab_size
    assert result.as_numpy("context_logits").shape == (1, len(prompt), vocab)
    generation = result.as_numpy("generation_logits")
    assert generation.shape == (1, 1, 3, vocab) and generation.dtype == np.float32
    # The generated tokens are the argmax of their logits (greedy).
    assert generation[0, 0].argmax(-1).tolist() == result.as_numpy("output_ids")[0, 0].tolist()


def test_out_of_vocabulary_ids_are_an_error_and_serving_goes_on(unary_server, tokenizer):
    bad = {"input_ids": np.array([[5, 2**31 - 1]], np.int32), "input_lengths": np.array([[2]], np.int32),
           "request_output_len": np.array([[3]], np.int32)}
    with pytest.raises(Exception, match="input_token_ids"):
        infer(unary_server, bad, ["output_ids"])
    good = {**bad, "input_ids": np.array([[5, 6]], np.int32)}
    assert infer(unary_server, good, ["output_ids"]).as_numpy("output_ids").shape[-1] == 5


def test_cancelling_a_unary_call_ends_generation_and_frees_kv(unary_server):
    from test_grpc_stream import assert_idle, long_llm_request
    from test_metrics import kv_and_requests, scrape

    inputs = {name: value for name, value in long_llm_request().items() if name != "streaming"}
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    call = client.async_infer("tensorrt_llm", [tensor(n, a) for n, a in inputs.items()],
                              callback=lambda *_: None)
    assert wait_for(lambda: kv_and_requests(scrape(unary_server))[1] == 1)
    call.cancel()
    assert_idle(unary_server)  # 1500 tokens would take far longer on CPU
    client.close()


def stub_pids(model_file: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(b"triton_python_backend_stub" in part for part in cmdline[:1]) and \
                any(model_file.encode() in part for part in cmdline):
            pids.append(int(entry.name))
    return pids


def test_zz_killed_server_leaves_no_generating_stub_behind(unary_server, tokenizer):
    """Runs last in this module, and `make test` runs this module after every other that uses the session's
    unary_server (tests/tools/test_file_order.py): it kills that server (a module after it would get a fresh one)."""
    repo_model = str(unary_server.log_path.parent / "repo" / "tensorrt_llm" / "1" / "model.py")
    stubs = stub_pids(repo_model)
    assert len(stubs) == 1
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[1500]], np.int32), "end_id": np.array([[-1]], np.int32)}
    client.async_infer("tensorrt_llm", [tensor(n, a) for n, a in inputs.items()], callback=lambda *_: None)
    # A BLS call in flight too: its stub then waits inside a BLS request when the server dies.
    threading.Thread(target=lambda: unary_server.generate("tensorrt_llm_bls", {
        "text_input": chat("Tell me a long story."), "max_tokens": 1500, "end_id": -1}, timeout=30),
        daemon=True).start()
    # generating now: both requests admitted by the engine (was a 2-s sleep)
    assert wait_for(lambda: value(scrape(unary_server), "nv_trt_llm_request_metrics", request_type="active",
                                  model="tensorrt_llm", version="1") == 2, timeout=30, interval=0.05)
    os.kill(unary_server.pid, signal.SIGKILL)
    models = [str(path) for path in (unary_server.log_path.parent / "repo").glob("*/1/model.py")]
    deadline = time.time() + 15
    while any(stub_pids(model) for model in models) and time.time() < deadline:
        time.sleep(0.2)
    assert {model: stub_pids(model) for model in models} == {model: [] for model in models}
