"""The LoRA inputs of tensorrt_llm and the BLS -> the request's LoraRequest (serving/requests.py
lora_adapter), as NVIDIA's clients and TensorRT-LLM's LLM-API clients send them."""
from __future__ import annotations

import numpy as np
import pytest

from serving.bls import validate
from serving.requests import convert_request, to_executor_request


def minimal(**extra):
    tensors = {"input_ids": np.array([[1, 2, 3]], np.int32), "input_lengths": np.array([[3]], np.int32),
               "request_output_len": np.array([[4]], np.int32)}
    tensors.update(extra)
    return tensors


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


WEIGHTS = np.ones((1, 2, 16), np.float16)  # what inflight_batcher_llm_client.py sends: model.lora_weights.npy
CONFIG = np.array([[[1, 0, 2], [3, 0, 2]]], np.int32)


def lora_of(**inputs):
    (spec,) = convert_request(minimal(**inputs), decoupled=True)
    return to_executor_request(spec).lora


def test_a_task_first_request_carries_id_weights_and_config():
    lora = lora_of(lora_task_id=np.array([[3]], np.uint64), lora_weights=WEIGHTS, lora_config=CONFIG)
    assert lora.task_id == 3 and lora.path is None
    assert lora.weights.shape == (2, 16) and lora.config.tolist() == [[1, 0, 2], [3, 0, 2]]
    # the tensorrt_llm model reshapes lora_task_id to [] : (B,) arrives as well
    assert lora_of(lora_task_id=np.array([3], np.uint64)).task_id == 3


def test_later_requests_send_the_id_alone_and_no_id_means_the_base_model():
    lora = lora_of(lora_task_id=np.array([[3]], np.uint64))
    assert lora.task_id == 3 and lora.weights is None and lora.config is None
    assert lora_of() is None
    assert lora_of(lora_task_id=np.zeros((1, 0), np.uint64), lora_weights=np.zeros((1, 0, 16), np.float16)) is None


def test_the_llm_api_inputs_name_a_peft_directory():
    lora = lora_of(lora_id=np.array([[(1 << 62) | 5]], np.uint64), lora_name=text("sql"), lora_path=text("/adapters/sql"))
    assert (lora.task_id, lora.name, lora.path) == ((1 << 62) | 5, "sql", "/adapters/sql")


@pytest.mark.parametrize("inputs,message", [
    ({"lora_weights": WEIGHTS, "lora_config": CONFIG}, "^lora_weights was sent without lora_task_id"),
    ({"lora_path": text("/a")}, "^lora_path was sent without lora_task_id"),
    ({"lora_task_id": np.array([[3]], np.uint64), "lora_config": CONFIG}, "^lora_config was sent without lora_weights"),
    ({"lora_task_id": np.array([[3]], np.uint64), "lora_weights": WEIGHTS}, "^lora_weights was sent without lora_config"),
    ({"lora_task_id": np.array([[3]], np.uint64), "lora_id": np.array([[4]], np.uint64)}, "lora_task_id .3. and lora_id .4. differ"),
    ({"lora_task_id": np.array([[3]], np.uint64), "lora_weights": WEIGHTS, "lora_config": CONFIG,
      "lora_path": text("/a")}, "both sent"),
])
def test_wrong_combinations_are_refused_by_name(inputs, message):
    with pytest.raises(ValueError, match=message):
        convert_request(minimal(**inputs), decoupled=True)


def test_the_bls_checks_the_same_before_preprocessing():
    plain = {"text_input": text("hi"), "max_tokens": np.array([[4]], np.int32)}
    validate({**plain, "lora_task_id": np.array([3], np.uint64), "lora_weights": WEIGHTS, "lora_config": CONFIG})
    validate({**plain, "lora_id": np.array([[7]], np.uint64), "lora_path": text("/a"), "lora_name": text("a")})
    with pytest.raises(ValueError, match="^lora_config was sent without lora_weights"):
        validate({**plain, "lora_task_id": np.array([3], np.uint64), "lora_config": CONFIG})
