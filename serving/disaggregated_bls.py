"""The rules of the disaggregated_serving_bls model (all_models/disaggregated_serving_bls): what goes to
the context model, what comes back from it, what goes to the generation model. Triton-free, so that
tests/serving/test_disaggregated_bls.py checks them without a server.

Per request (the anchor's flow): every input -> context_model_name with request parameter
request_type context_only; exactly one usable response, which must carry context_phase_params; then
every input plus that blob -> generation_model_name with request_type generation_only; its responses
are relayed unchanged (the generation side's output already starts with the context's first token, so
nothing is dropped or duplicated).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

CONTEXT_PARAMETERS = {"request_type": "context_only"}
GENERATION_PARAMETERS = {"request_type": "generation_only"}
CROSS_PROCESS_TRANSFER = "auto"  # engine/executor/disaggregated.py: cuda_ipc where the generation side can, else shm
CONFIGURABLE = ("shm", "nixl", "cuda_ipc")  # TRITONLLM_KV_TRANSFER values that also cross processes
PARAMS = "context_phase_params"
CONTEXT_OUTPUTS = [PARAMS, "batch_index"]  # what the BLS asks of the context model
ALWAYS = ("output_ids", "sequence_length", "batch_index")  # asked of the generation model in any case


def context_parameters(context_model: str, generation_model: str, configured: str | None = None) -> dict[str, str]:
    """The context request's Triton parameters. Two models have two engine processes, so the KV must
    leave the context process: kv_transfer auto (the generation side picks cuda_ipc where it can map the
    context GPU's pool, else shm), or what ``configured`` (TRITONLLM_KV_TRANSFER of the server) names when it
    crosses processes: shm, cuda_ipc, or nixl (the generation model may then run on another host). One model
    serving both phases keeps its blocks pinned in place (the engine's default transport, no copy)."""
    if context_model == generation_model:
        return dict(CONTEXT_PARAMETERS)
    return {**CONTEXT_PARAMETERS, "kv_transfer": configured if configured in CONFIGURABLE else CROSS_PROCESS_TRANSFER}


def requested_outputs(client_asked: list[str], declared: list[str]) -> list[str]:
    """What the generation model is asked for: what the client asked (all declared outputs when it
    named none), plus the token outputs, never context_phase_params (the generation side has none)."""
    names = set(client_asked or declared) | set(ALWAYS)
    return [name for name in declared if name in names and name != PARAMS]


def reshaped_inputs(config_inputs: list[dict]) -> dict[str, tuple[int, ...]]:
    """name -> declared dims of each input the config reshapes (dims [1] -> shape []): this model
    receives them reshaped, and must send them to tensorrt_llm with their declared dims again."""
    return {tensor["name"]: tuple(int(d) for d in tensor["dims"]) for tensor in config_inputs if "reshape" in tensor}


def declared_shapes(inputs: Mapping[str, np.ndarray], reshaped: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """(batch,) arrays of reshaped inputs back to (batch, *dims)."""
    return {name: value.reshape(value.shape[0], *reshaped[name]) if name in reshaped else value
            for name, value in inputs.items()}


def context_inputs(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The context request's inputs: the client's, without a context_phase_params of its own."""
    return {name: value for name, value in inputs.items() if name != PARAMS}


def context_phase_params(model_name: str, responses: list[tuple[str | None, Mapping[str, np.ndarray]]]) -> np.ndarray:
    """The context model's (error, output tensors) responses -> its context_phase_params (batch, n)
    UINT8; a RuntimeError with the anchor's texts when it failed or sent none."""
    for error, _ in responses:
        if error is not None:
            raise RuntimeError(f"Context model {model_name} failed with error: {error}")
    for _, tensors in responses:
        blob = tensors.get(PARAMS)
        if blob is not None and np.asarray(blob).size:
            blob = np.asarray(blob, dtype=np.uint8)
            order = tensors.get("batch_index")  # a batch's responses come stacked in finishing order
            if order is not None and blob.shape[0] > 1:
                rows = np.asarray(order).reshape(-1).tolist()
                blob = blob[[rows.index(i) for i in range(len(rows))]]
            return blob
    raise RuntimeError("Context response must have an output named context phase params")


def generation_inputs(inputs: Mapping[str, np.ndarray], params: np.ndarray) -> dict[str, np.ndarray]:
    return {**context_inputs(inputs), PARAMS: params}
