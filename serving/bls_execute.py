"""The request loop of a one-request-at-a-time Python BLS model (whisper_bls, disaggregated_serving_bls)."""
from __future__ import annotations

from typing import Any, Callable


def execute_each(pb_utils: Any, requests: list, decoupled: bool, serve: Callable[[Any, Any], Any]) -> list | None:
    """``serve(request, sender)`` for each request in turn; it returns the (last) response, or None
    when a decoupled stream sent everything already. An exception fails that request only (its error
    response), and the model keeps serving. Decoupled: the final flag goes with the returned response
    (or alone); otherwise the responses are returned, one per request."""
    responses = []
    for request in requests:
        sender = request.get_response_sender() if decoupled else None
        try:
            response = serve(request, sender)
        except Exception as error:
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error)))
        if decoupled:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            responses.append(response)
    return None if decoupled else responses
