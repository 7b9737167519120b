"""The bad requests the soak (benchmarks/reliability/soak.py) mixes in: each kind must end with its own clear
error (or, where the input is odd but legal, a normal end), and must not disturb the requests
around it.

A kind is sent over gRPC (a dict of numpy tensors: the dtype and shape are the point of many
kinds) or as an HTTP body (bytes: malformed JSON, wrong JSON types). Token ids for the
`tensorrt_llm` kinds are arbitrary in-vocabulary ids of the default model (vocabulary 49,152).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from serving.cancellation import stop_request_inputs

VOCABULARY = 49_152
MAX_INPUT_LEN = 1024  # the default engine's build.max_input_len
TRITON_MAX_BATCH = 8  # the default repository's triton_max_batch_size


# Triton 2.51 does not check an ensemble request for required inputs: with one missing, no step
# can run, and a decoupled ensemble then ends the request with an empty final response and no
# error (core's ensemble scheduler: "it will send only the flag"). No model of ours is ever called.
MISSING_INPUT_NOTE = "Triton 2.51: a decoupled ensemble ends it with an empty final response, no error"


@dataclass(frozen=True)
class BadInput:
    kind: str
    model: str  # "ensemble" or "tensorrt_llm"
    protocol: str  # "grpc" (tensors) or "http" (body bytes to generate_stream)
    build: Callable[[], object]
    expect: str = "error"  # "ok": must end normally (legal input, or a known limit: see `note`)
    note: str = ""


def _one(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def text_request(**changes) -> dict[str, np.ndarray]:
    """A good streamed ensemble request, then `changes` (None removes an input)."""
    return _changed({"text_input": _one(b"Tell me about the sea.", object), "max_tokens": _one(8, np.int32),
                     "stream": _one(True, np.bool_)}, changes)


def ids_request(ids=(504, 3458, 314, 260, 2380, 30), **changes) -> dict[str, np.ndarray]:
    """A good streamed tensorrt_llm request, then `changes` (None removes an input)."""
    return _changed({"input_ids": np.array([list(ids)], np.int32), "input_lengths": _one(len(ids), np.int32),
                     "request_output_len": _one(8, np.int32), "streaming": _one(True, np.bool_)}, changes)


def _changed(tensors: dict[str, np.ndarray], changes: dict) -> dict[str, np.ndarray]:
    for name, value in changes.items():
        if value is None:
            tensors.pop(name, None)
        else:
            tensors[name] = value
    return tensors


def _word_list(offsets_and_ids) -> np.ndarray:
    """(1, 2, N) int32, the reference layout of bad_words_list/stop_words_list."""
    ids, offsets = offsets_and_ids
    return np.array([[ids, offsets]], np.int32)


BAD_INPUTS: list[BadInput] = [
    # ---- the ensemble's text inputs (gRPC)
    BadInput("text_input of INT32", "ensemble", "grpc", lambda: text_request(text_input=_one(7, np.int32))),
    BadInput("text_input missing", "ensemble", "grpc", lambda: text_request(text_input=None), expect="ok",
             note=MISSING_INPUT_NOTE),
    BadInput("empty prompt", "ensemble", "grpc", lambda: text_request(text_input=_one(b"", object))),
    BadInput("invalid UTF-8 prompt", "ensemble", "grpc", lambda: text_request(text_input=_one(b"\xff\xfe\xc3(", object))),
    BadInput("over-long prompt", "ensemble", "grpc",
             lambda: text_request(text_input=_one(("sea " * (MAX_INPUT_LEN + 200)).encode(), object))),
    BadInput("batch over the limit", "ensemble", "grpc", lambda: {
        name: np.repeat(value, TRITON_MAX_BATCH + 1, axis=0) for name, value in text_request().items()}),
    BadInput("batch rows not matching", "ensemble", "grpc",
             lambda: text_request(max_tokens=np.array([[8], [8]], np.int32))),
    BadInput("max_tokens missing", "ensemble", "grpc", lambda: text_request(max_tokens=None), expect="ok",
             note=MISSING_INPUT_NOTE),
    BadInput("max_tokens negative", "ensemble", "grpc", lambda: text_request(max_tokens=_one(-5, np.int32))),
    BadInput("max_tokens of FP32", "ensemble", "grpc", lambda: text_request(max_tokens=_one(8.0, np.float32))),
    BadInput("max_tokens of shape [1, 2]", "ensemble", "grpc",
             lambda: text_request(max_tokens=np.array([[8, 8]], np.int32))),
    BadInput("temperature NaN", "ensemble", "grpc", lambda: text_request(temperature=_one(np.nan, np.float32))),
    BadInput("temperature negative", "ensemble", "grpc", lambda: text_request(temperature=_one(-1.0, np.float32))),
    BadInput("top_p inf", "ensemble", "grpc", lambda: text_request(top_p=_one(np.inf, np.float32))),
    BadInput("top_p above 1", "ensemble", "grpc", lambda: text_request(top_p=_one(1.5, np.float32))),
    BadInput("top_k negative", "ensemble", "grpc", lambda: text_request(top_k=_one(-3, np.int32))),
    BadInput("repetition_penalty -inf", "ensemble", "grpc",
             lambda: text_request(repetition_penalty=_one(-np.inf, np.float32))),
    BadInput("frequency_penalty NaN", "ensemble", "grpc",
             lambda: text_request(frequency_penalty=_one(np.nan, np.float32))),
    BadInput("end_id out of range", "ensemble", "grpc", lambda: text_request(end_id=_one(10 ** 8, np.int32))),
    BadInput("pad_id negative", "ensemble", "grpc", lambda: text_request(pad_id=_one(-7, np.int32))),
    BadInput("beam_width above the engine's", "ensemble", "grpc", lambda: text_request(beam_width=_one(64, np.int32))),
    BadInput("num_return_sequences negative", "ensemble", "grpc",
             lambda: text_request(num_return_sequences=_one(-2, np.int32))),
    BadInput("bad_words of INT32", "ensemble", "grpc", lambda: text_request(bad_words=_one(5, np.int32))),
    BadInput("stop_words invalid UTF-8", "ensemble", "grpc",
             lambda: text_request(stop_words=_one(b"\xff\xff", object))),
    BadInput("seed of FP32", "ensemble", "grpc", lambda: text_request(seed=_one(1.5, np.float32))),
    # LoRA (on in make serve's repository): an id the cache does not hold, rows without their
    # config, a PEFT directory that is not there
    BadInput("LoRA task id not in the cache", "ensemble", "grpc",
             lambda: text_request(lora_task_id=_one(3, np.uint64))),
    BadInput("LoRA weights without lora_config", "ensemble", "grpc",
             lambda: text_request(lora_task_id=_one(4, np.uint64), lora_weights=np.ones((1, 2, 16), np.float16))),
    BadInput("LoRA path that does not exist", "ensemble", "grpc", lambda: text_request(
        lora_id=_one(5, np.uint64), lora_path=_one(b"/nonexistent/adapter", object))),
    # guided decoding: the serving layer refuses an unknown guide type, the executor a guide it cannot compile
    BadInput("guided decoding: unknown guide type", "ensemble", "grpc", lambda: text_request(
        guided_decoding_guide_type=_one(b"yaml", object), guided_decoding_guide=_one(b"{}", object))),
    BadInput("guided decoding: JSON schema not JSON", "ensemble", "grpc", lambda: text_request(
        guided_decoding_guide_type=_one(b"json_schema", object),
        guided_decoding_guide=_one(b'{"type": "object", "properties": ', object))),
    BadInput("unknown input name", "ensemble", "grpc", lambda: text_request(no_such_input=_one(1, np.int32))),
    # ---- the ensemble over HTTP generate_stream (JSON)
    BadInput("malformed JSON", "ensemble", "http", lambda: b'{"text_input": "hi", "max_tokens": '),
    BadInput("text_input a number", "ensemble", "http",
             lambda: b'{"text_input": 12, "max_tokens": 8, "stream": true}'),
    BadInput("max_tokens a string", "ensemble", "http",
             lambda: b'{"text_input": "hi", "max_tokens": "eight", "stream": true}'),
    # ---- tensorrt_llm's token inputs (gRPC)
    BadInput("input_ids out of vocabulary", "tensorrt_llm", "grpc", lambda: ids_request(ids=(5, VOCABULARY + 10))),
    BadInput("input_ids negative", "tensorrt_llm", "grpc", lambda: ids_request(ids=(5, -2, 7))),
    BadInput("input_ids of FP32", "tensorrt_llm", "grpc",
             lambda: ids_request(input_ids=np.array([[5.0, 6.0]], np.float32), input_lengths=_one(2, np.int32))),
    BadInput("input_lengths not matching", "tensorrt_llm", "grpc", lambda: ids_request(input_lengths=_one(40, np.int32))),
    BadInput("request_output_len missing", "tensorrt_llm", "grpc", lambda: ids_request(request_output_len=None)),
    BadInput("request_output_len 0", "tensorrt_llm", "grpc", lambda: ids_request(request_output_len=_one(0, np.int32))),
    BadInput("end_id out of range (tensorrt_llm)", "tensorrt_llm", "grpc",
             lambda: ids_request(end_id=_one(VOCABULARY + 1, np.int32))),
    BadInput("bad_words_list offsets past the ids", "tensorrt_llm", "grpc",
             lambda: ids_request(bad_words_list=_word_list(([11, 12], [5, -1])))),
    BadInput("stop_words_list of shape [1, 3, 2]", "tensorrt_llm", "grpc",
             lambda: ids_request(stop_words_list=np.zeros((1, 3, 2), np.int32))),
    BadInput("runtime_top_p NaN", "tensorrt_llm", "grpc", lambda: ids_request(runtime_top_p=_one(np.nan, np.float32))),
    BadInput("stop of an unknown request id", "tensorrt_llm", "grpc", stop_request_inputs, expect="ok"),
]
