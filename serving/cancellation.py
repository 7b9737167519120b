"""How a request whose client is gone reaches the executor (no Triton import).

Triton 2.51 cancels a request whose HTTP client hung up or whose gRPC stream was cancelled, but an
ensemble does not pass that on to the step already running: the `tensorrt_llm` step of a
cancelled ensemble request keeps `is_cancelled() == False` and its sends keep succeeding. Only the
ensemble's *later* steps are created cancelled: each `postprocessing` step of that request reports
`is_cancelled() == True`. So the postprocessing step is where a gone ensemble client shows up, and
it tells `tensorrt_llm` with an ordinary stop request:

    tensorrt_llm --output request_key (uint64, one per Triton request)--> ensemble
    postprocessing (REQUEST_KEY input): is_cancelled() -> stop request, id "request_key:<key>"
    tensorrt_llm: a stop whose id names a key cancels that request's executor requests

Two facts of Triton 2.51 shape the rest (seen with a two-step test ensemble, and in the core's
ensemble scheduler): a step that *fails* while a decoupled step of the same ensemble request is
still streaming leaves that ensemble request in flight forever (Ctrl-C then waits out the exit
timeout), and a dynamic batcher fails a cancelled request instead of running it. Hence the
postprocessing model has no dynamic batcher and answers a cancelled step with empty text, never an
error; and `tensorrt_llm` always ends a stream with its FINAL response, even for a gone client.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

REQUEST_KEY_OUTPUT = "request_key"  # tensorrt_llm output, uint64 (1, 1) on every response
REQUEST_KEY_INPUT = "REQUEST_KEY"  # postprocessing input fed from it by the ensemble
_STOP_ID_PREFIX = "request_key:"


def stop_id_for_key(key: int) -> str:
    """The request id of a stop request that cancels the Triton request with this key."""
    return f"{_STOP_ID_PREFIX}{int(key)}"


def key_from_stop_id(request_id: str) -> int | None:
    """The key a stop request's id names, or None for a user's own request id."""
    if not request_id.startswith(_STOP_ID_PREFIX):
        return None
    try:
        return int(request_id[len(_STOP_ID_PREFIX):])
    except ValueError:
        return None


def stop_request_inputs() -> dict[str, np.ndarray]:
    """The tensors of a `tensorrt_llm` stop request (its id says which request to stop)."""
    return {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
            "request_output_len": np.zeros((1, 1), np.int32), "stop": np.ones((1, 1), np.bool_)}


def send_stop_request(pb_utils, model_name: str, request_id: str, decoupled: bool = True) -> None:
    """Stop ``model_name``'s request ``request_id`` (a tensorrt_llm model) from a BLS or a step of an
    ensemble, and wait for the stop's own responses. ``pb_utils``: the Python backend's module, passed in so
    that this module loads without Triton."""
    request = pb_utils.InferenceRequest(
        model_name=model_name, requested_output_names=["output_ids"], request_id=request_id,
        inputs=[pb_utils.Tensor(name, value) for name, value in stop_request_inputs().items()])
    for _ in (request.exec(decoupled=True) if decoupled else [request.exec()]):
        pass


class ReportedKeys:
    """Keys already reported as gone, so that each later step of the same request (every streamed
    token still in flight produces one) does not send another stop. Bounded: the oldest go first."""

    def __init__(self, capacity: int = 4096):
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def first_report(self, key: int) -> bool:
        """True the first time `key` is seen (the caller then sends the stop)."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
        return True
