"""The request loop of a one-request-at-a-time Python BLS model (whisper_bls, disaggregated_serving_bls)."""
from __future__ import annotations

from typing import Any, Callable


def error_response(pb_utils: Any, error: Exception):
    """The failed request's response: its error text, no outputs."""
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error)))


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
            response = error_response(pb_utils, error)
        if decoupled:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            responses.append(response)
    return None if decoupled else responses


def execute_concurrently(pb_utils: Any, requests: list, decoupled: bool, serve: Callable[[Any, Any], Any],
                         pool: Any) -> list | None:
    """Like ``execute_each``, but every request's ``serve(request, sender)`` runs at once on ``pool``
    (a ThreadPoolExecutor): a BLS whose calls block (the generation phase of a long answer) keeps
    serving the other requests meanwhile. Decoupled: returns at once; each worker sends its request's
    FINAL through a GuardedSender (``sender``), which its cancellation watcher shares. Otherwise the
    responses are returned in request order when all are done."""
    from serving.bls import GuardedSender

    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if not decoupled:
        def run(request):
            try:
                return serve(request, None)
            except Exception as error:
                return error_response(pb_utils, error)
        return list(pool.map(run, requests))

    def run_decoupled(request, sender):
        try:
            response = serve(request, sender)
        except Exception as error:
            response = error_response(pb_utils, error)
        try:
            sender.send_final(response)
        except Exception:  # the client is gone: nothing to deliver
            pass

    for request in requests:
        pool.submit(run_decoupled, request, GuardedSender(request.get_response_sender(), final))
    return None
