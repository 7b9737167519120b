"""Disaggregated serving across two engine processes of the shared server (conftest.disaggregated_server):
disaggregated_serving_bls sends the prefill to tensorrt_llm (context_only, kv_transfer auto: shm on CPU) and the
decode to `generation` (generation_only). Greedy ids equal the aggregated model's for 20 prompts sent
at once, unary and streamed; stop words end the generation phase; no KV block stays used on either
side, and no transfer file stays in shared memory."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from engine.executor import kv_transfer_nixl
from triton_helpers import grpc_inputs, wait_for

# make test-all only (~55 worker-s of CI's 2-core run, its second engine process's start most of it): make test
# reaches the same paths through test_model_families_served.py's test_disaggregated_bls_greedy_ids_equal_transformers_
# generate and test_disaggregated_bad_params_are_named (disaggregated_serving_bls, context_only then generation_only on
# a real tritonserver) and tests/executor/test_disaggregated.py (equality with aggregated decoding, both transports,
# cancels at each phase, failing exports, bad params)
pytestmark = pytest.mark.extended

BLS = "disaggregated_serving_bls"
# Each prompt's first token comes from the context process, the other five are decoded on the KV it
# sent: a block moved wrong changes them at once (12 until 2026-11-30: the 20 prompts' two passes, 8 at a
# time, cost ~0.4 s a decode step each; the stop-word test needs 4 generated tokens).
MAX_TOKENS = 6
# SmolLM2 token ids (vocabulary 49,152): 20 prompts of 3-41 tokens, some longer than a KV block
PROMPTS = [[(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(3 + 2 * i)] for i in range(20)]


def _body(prompt: list[int], **extra) -> dict:
    return {"input_ids": prompt, "input_lengths": [len(prompt)], "request_output_len": [MAX_TOKENS],
            "end_id": [2], "pad_id": [2], **extra}


def _output_ids(server, model: str, prompt: list[int], **extra) -> list[int]:
    response = server.generate(model, _body(prompt, **extra))
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def _infer(server, model: str, prompt: list[int], parameters=None, outputs=("output_ids", "sequence_length"),
           **extra: np.ndarray):
    """One unary request over a gRPC stream (generate's JSON cannot carry stop_words_list's [2, -1]
    shape, nor return context_phase_params, and HTTP infer takes no decoupled model): its final result."""
    tensors = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
               "request_output_len": np.array([[MAX_TOKENS]], np.int32), "end_id": np.array([[2]], np.int32),
               "pad_id": np.array([[2]], np.int32), **extra}
    inputs = grpc_inputs(tensors)
    results = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
                              parameters=parameters)
    client.stop_stream()
    client.close()
    assert [error for _, error in results if error is not None] == []
    (result, _), = [(r, e) for r, e in results if r is not None and r.as_numpy(outputs[0]) is not None]
    return result


def _infer_ids(server, model: str, prompt: list[int], parameters=None, **extra: np.ndarray) -> list[int]:
    """prompt + output ids of one request (``_infer``)."""
    result = _infer(server, model, prompt, parameters, **extra)
    return result.as_numpy("output_ids")[0, 0, :int(result.as_numpy("sequence_length")[0, 0])].tolist()


def _streamed_ids(server, model: str, prompt: list[int]) -> list[int]:
    response = server.generate(model, _body(prompt, streaming=[True]), stream=True)
    assert response.status_code == 200
    ids = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            event = json.loads(line[len(b"data: "):])
            assert "error" not in event, event
            step = event.get("output_ids", [])
            ids += step if isinstance(step, list) else [step]  # one token comes as a number
    return ids


def _used_blocks(server) -> dict[str, float]:
    found = re.findall(r'nv_trt_llm_kv_cache_block_metrics\{kv_cache_block_type="used",model="(\w+)",version="1"\} (\S+)',
                       server.metrics_text())
    return {model: float(value) for model, value in found}


def _transfers(server) -> float:
    match = re.search(r'nv_trt_llm_disaggregated_serving_metrics\{disaggregated_serving_type="request_count",'
                      r'model="generation",version="1"\} (\S+)', server.metrics_text())
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def served(disaggregated_server):
    """The shared server, its generation phase loaded (conftest.disaggregated_server)."""
    return disaggregated_server


@pytest.fixture(scope="module")
def aggregated(served):
    """Each prompt's greedy ids from tensorrt_llm alone (context_and_generation)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: _output_ids(served, "tensorrt_llm", p), PROMPTS))


def test_twenty_prompts_at_once_give_the_aggregated_greedy_ids(served, aggregated):
    before = _transfers(served)
    with ThreadPoolExecutor(9) as pool:  # the streamed one alongside the unary twenty
        streamed = pool.submit(_streamed_ids, served, BLS, PROMPTS[7])
        split = list(pool.map(lambda p: _output_ids(served, BLS, p), PROMPTS))
        streamed = streamed.result()
    assert split == aggregated
    assert _transfers(served) - before >= len(PROMPTS) + 1  # each went through the generation process
    assert PROMPTS[7] + streamed == aggregated[7] or streamed == aggregated[7]


def test_stop_words_end_the_generation_phase_and_no_block_stays_used(served, aggregated):
    prompt, expected = PROMPTS[4], aggregated[4]
    generated = expected[len(prompt):]
    stop = generated[3]  # a one-token stop word: the output ends with it
    got = _infer_ids(served, BLS, prompt, stop_words_list=np.array([[[stop], [1]]], np.int32))
    assert got == expected[:len(prompt) + generated.index(stop) + 1]
    assert wait_for(lambda: all(v == 0 for m, v in _used_blocks(served).items()
                                if m in ("tensorrt_llm", "generation")), timeout=10), _used_blocks(served)
    assert {"tensorrt_llm", "generation"} <= set(_used_blocks(served))


def test_a_cancelled_stream_stops_the_generation_phase(served):
    """A client that cancels its stream mid-decode: the BLS's watcher stops the generation request
    (it would run 400 more tokens otherwise: end_id -1 never ends it), and its blocks are freed."""
    before = _used_blocks(served)
    assert before.get("generation") == 0
    tensors = {"input_ids": np.array([PROMPTS[5]], np.int32), "input_lengths": np.array([[len(PROMPTS[5])]], np.int32),
               "request_output_len": np.array([[400]], np.int32), "end_id": np.array([[-1]], np.int32),
               "pad_id": np.array([[2]], np.int32), "streaming": np.array([[True]])}
    inputs = grpc_inputs(tensors)
    responses = []
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    client.async_stream_infer(BLS, inputs, outputs=[grpcclient.InferRequestedOutput("output_ids")])
    assert wait_for(lambda: len(responses) >= 3, timeout=60), responses
    # decoding holds blocks; the gauge is refreshed by the model's metrics update, not per response, so a
    # read right after the third response could still see 0 under load (it did on 2 CPU cores)
    assert wait_for(lambda: _used_blocks(served)["generation"] > 0, timeout=10), _used_blocks(served)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for(lambda: _used_blocks(served)["generation"] == 0, timeout=10), _used_blocks(served)
    assert len(responses) < 100  # stopped long before its 400 tokens


def test_a_bad_transport_is_named_and_the_next_request_is_served(served, aggregated):
    """generate's fields that are not inputs are the request's parameters (request_type, kv_transfer)."""
    response = served.generate("tensorrt_llm", {**_body(PROMPTS[0]), "request_type": "context_only",
                                                       "kv_transfer": "nccl"})
    assert response.status_code == 400 and "kv_transfer: 'nccl' is not supported; allowed: local, shm, nixl, cuda_ipc, auto" in response.text
    assert _output_ids(served, BLS, PROMPTS[0]) == aggregated[0]


@pytest.mark.skipif(not kv_transfer_nixl.available(), reason="NIXL is not installed (scripts/setup_env.sh)")
def test_the_nixl_transport_between_the_two_engine_processes(served, aggregated):
    """kv_transfer nixl: the generation process READs the KV from the context process's pool through NIXL
    (engine/executor/kv_transfer_nixl.py); same ids, no block left on either side."""
    prompt = PROMPTS[9]
    context = _infer(served, "tensorrt_llm", prompt, {"request_type": "context_only", "kv_transfer": "nixl"},
                     outputs=("context_phase_params",))
    blob = context.as_numpy("context_phase_params")
    assert blob.dtype == np.uint8 and blob.size < 2048
    got = _infer_ids(served, "generation", prompt, {"request_type": "generation_only"},
                     context_phase_params=blob.reshape(1, -1))
    assert got == aggregated[9] or prompt + got == aggregated[9]
    assert wait_for(lambda: all(v == 0 for m, v in _used_blocks(served).items()
                                if m in ("tensorrt_llm", "generation")), timeout=10), _used_blocks(served)
