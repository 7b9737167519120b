"""disaggregated_serving_bls's rules (serving/disaggregated_bls.py) and its config (mirrors tensorrt_llm's)."""
import os
import re

import numpy as np
import pytest

from serving.disaggregated_bls import (context_inputs, context_parameters, context_phase_params, declared_shapes,
                                      generation_inputs, requested_outputs, reshaped_inputs)
from serving.requests import kv_transfer_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors(path: str, section: str) -> list[str]:
    text = open(os.path.join(ROOT, path)).read()
    body = text.split(f"\n{section} [", 1)[1].split("\n]", 1)[0]
    return re.findall(r'name: "(\w+)"', body)


def test_inputs_and_outputs_mirror_tensorrt_llm():
    for section in ("input", "output"):
        assert _tensors("all_models/disaggregated_serving_bls/config.pbtxt", section) == \
            _tensors("all_models/tensorrt_llm/config.pbtxt", section)
    text = open(os.path.join(ROOT, "all_models/disaggregated_serving_bls/config.pbtxt")).read()
    for placeholder in ("context_model_name", "generation_model_name", "disaggregated_serving_bls_count"):
        assert "${" + placeholder + "}" in text


def test_context_params_are_taken_in_batch_order_and_errors_named():
    ids = np.array([[1]], np.int32)
    assert "context_phase_params" not in context_inputs({"input_ids": ids, "context_phase_params": ids})
    stacked = {"context_phase_params": np.array([[2, 2], [1, 0]], np.uint8), "batch_index": np.array([[1], [0]])}
    params = context_phase_params("ctx", [(None, stacked)])
    assert params.tolist() == [[1, 0], [2, 2]]
    assert generation_inputs({"input_ids": ids}, params)["context_phase_params"] is params
    with pytest.raises(RuntimeError, match="^Context model ctx failed with error: boom$"):
        context_phase_params("ctx", [("boom", {})])
    with pytest.raises(RuntimeError, match="^Context response must have an output named context phase params$"):
        context_phase_params("ctx", [(None, {"output_ids": ids})])
    declared = ["output_ids", "sequence_length", "context_phase_params", "cum_log_probs", "batch_index"]
    assert requested_outputs([], declared) == ["output_ids", "sequence_length", "cum_log_probs", "batch_index"]
    assert requested_outputs(["output_ids"], declared) == ["output_ids", "sequence_length", "batch_index"]


def test_reshaped_inputs_go_on_with_their_declared_dims():
    config = [{"name": "end_id", "dims": ["1"], "reshape": {"shape": []}}, {"name": "input_ids", "dims": ["-1"]}]
    reshaped = reshaped_inputs(config)
    assert reshaped == {"end_id": (1,)}
    out = declared_shapes({"end_id": np.array([2, 2, 2]), "input_ids": np.ones((3, 4))}, reshaped)
    assert out["end_id"].shape == (3, 1) and out["input_ids"].shape == (3, 4)


def test_two_models_send_the_kv_through_shared_memory_one_model_keeps_it_in_place():
    assert context_parameters("tensorrt_llm", "tensorrt_llm") == {"request_type": "context_only"}
    assert context_parameters("context", "generation") == {"request_type": "context_only", "kv_transfer": "auto"}
    assert context_parameters("context", "generation", "nixl")["kv_transfer"] == "nixl"  # TRITONLLM_KV_TRANSFER
    assert context_parameters("context", "generation", "shm")["kv_transfer"] == "shm"
    assert context_parameters("context", "generation", "local")["kv_transfer"] == "auto"  # local cannot cross
    assert kv_transfer_of('{"request_type": "context_only", "kv_transfer": "shm"}') == "shm"
    assert kv_transfer_of("{}") is None and kv_transfer_of("") is None
    with pytest.raises(ValueError, match="kv_transfer: 'nccl' is not supported; allowed: local, shm, nixl, cuda_ipc, auto"):
        kv_transfer_of('{"kv_transfer": "nccl"}')
