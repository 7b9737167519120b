"""Bookkeeping between Triton requests and executor requests (no Triton import).

One Triton request with B rows (and n return sequences each) becomes B executor requests and
B x n result streams. `InflightRequests` turns each executor `Response` into what to send on the
Triton response sender, decides where the FINAL flag goes (on the response that completes the
last executor request of that Triton request), holds back unfinished UTF-8 characters in
streams, reports each finished executor request for the metrics, and counts the tokens of
streamed responses and how many of them shared a response with other tokens (coalesced).

Not thread-safe on its own: the model calls it under one lock.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from serving.cancellation import REQUEST_KEY_OUTPUT, key_from_stop_id
from serving.metrics import RequestLatency, generated_token_count
from serving.requests import RequestSpec
from serving.responses import error_message_tensors, only_requested, result_tensors, stack_responses
from serving.tokenization import Utf8Holdback


@dataclass
class Send:
    """One thing to send: tensors or an error, with or without the FINAL flag."""

    sender: Any
    tensors: dict[str, np.ndarray] | None = None
    error: str | None = None
    final: bool = False
    key: int = -1  # the Triton request's key (InflightRequests.cancel_key after a failed send)


@dataclass
class Finished:
    """One executor request that ended (for the token and latency histograms)."""

    input_tokens: int
    output_tokens: int
    latency: RequestLatency
    error: bool = False


@dataclass
class StreamCounts:
    """Tokens sent in streamed responses (beam width 1), and how many of them went out in a
    response that carried more than one token: the relay had fallen behind the engine and the
    stream's waiting chunks merged (engine/executor/output.py ResponseQueue), or a multi-byte
    character's tokens were held back to go together. Only ever grows."""

    tokens: int = 0
    coalesced_tokens: int = 0
    responses: int = 0

    def add(self, tokens: int) -> None:
        self.responses += 1
        self.tokens += tokens
        if tokens > 1:
            self.coalesced_tokens += tokens


@dataclass
class TritonRequest:
    key: int
    sender: Any
    user_id: str
    batch_size: int
    live_exec_ids: set[int] = field(default_factory=set)
    final_tensors: list[dict[str, np.ndarray]] = field(default_factory=list)  # non-decoupled
    errors: list[str] = field(default_factory=list)  # non-decoupled
    cancelled: bool = False  # the client is gone or cancelled: only the FINAL response is still sent
    failure: str | None = None  # ended by the server (shutting down): the FINAL response is this error
    errors_as_output: bool = False  # the caller asked for ERROR_MESSAGE_OUTPUT (serving/responses.py)
    requested_outputs: frozenset[str] | None = None  # None: all (serving/responses.py only_requested)


@dataclass
class ExecRequest:
    triton: TritonRequest
    spec: RequestSpec
    streams_left: int
    latency: RequestLatency
    holdbacks: dict[int, Utf8Holdback] = field(default_factory=dict)
    output_tokens: int = 0


class InflightRequests:
    def __init__(self, *, decoupled: bool, decode: Callable[[list[int]], str] | None = None,
                 logits_dtype=np.float32, clock: Callable[[], float] = time.time, first_key: int = 0):
        self.decoupled = decoupled
        self._decode = decode  # enables the UTF-8 holdback for streams
        self._logits_dtype = logits_dtype
        self._clock = clock
        # Keys of model instances that share an engine start apart (serving/shared_engine.py).
        self._keys = itertools.count(first_key)
        self.by_exec_id: dict[int, ExecRequest] = {}
        self.by_user_id: dict[str, TritonRequest] = {}
        self.triton_requests: dict[int, TritonRequest] = {}
        self.stream_counts = StreamCounts()

    def add(self, sender: Any, user_id: str, specs: list[RequestSpec], exec_ids: list[int],
            errors_as_output: bool = False, requested_outputs: frozenset[str] | None = None) -> None:
        """Register one Triton request's executor requests (before any response is handled);
        its responses carry only ``requested_outputs`` (None: every output)."""
        triton = TritonRequest(key=next(self._keys), sender=sender, user_id=user_id,
                               batch_size=len(specs), live_exec_ids=set(exec_ids),
                               errors_as_output=errors_as_output, requested_outputs=requested_outputs)
        self.triton_requests[triton.key] = triton
        if user_id:
            self.by_user_id[user_id] = triton  # a later request with the same id replaces it
        now = self._clock()
        for spec, exec_id in zip(specs, exec_ids):
            streams = 1 if spec.beam_width > 1 else spec.num_return_sequences
            self.by_exec_id[exec_id] = ExecRequest(triton=triton, spec=spec, streams_left=streams,
                                                   latency=RequestLatency(arrival=now))

    def exec_ids_for_user(self, user_id: str) -> list[int]:
        triton = self.by_user_id.get(user_id)
        return sorted(triton.live_exec_ids) if triton else []

    def stop(self, user_id: str) -> list[int]:
        """A stop request: the executor ids to cancel for the live request with this id (a user's
        request id, or `stop_id_for_key(key)` from the postprocessing step of a gone client)."""
        key = key_from_stop_id(user_id)
        if key is not None:
            return self.cancel_key(key)
        return self.exec_ids_for_user(user_id)

    def newly_cancelled(self) -> list[int]:
        """Executor ids of Triton requests whose client cancelled since the last call."""
        ids = []
        for triton in list(self.triton_requests.values()):
            if not triton.cancelled and _is_cancelled(triton.sender):
                ids.extend(self.cancel_key(triton.key))
        return ids

    def cancel_key(self, key: int) -> list[int]:
        """Mark the Triton request with this key as gone (client hung up, cancelled, or a send to
        it failed); returns the executor ids to cancel, once ([] if unknown or already marked).
        Its remaining non-final responses are dropped; the FINAL one is still sent, because Triton
        releases a request (and an ensemble its in-flight count) only on it."""
        triton = self.triton_requests.get(key)
        if triton is None or triton.cancelled:
            return []
        triton.cancelled = True
        return sorted(triton.live_exec_ids)

    def fail_all(self, message: str) -> list[int]:
        """End every request with the error `message` (the server is shutting down): returns the
        executor ids to cancel; their FINAL responses then carry the error instead of tokens."""
        ids = []
        for triton in self.triton_requests.values():
            if triton.failure is None:
                triton.failure = message
                triton.cancelled = True
                ids.extend(sorted(triton.live_exec_ids))
        return ids

    def on_response(self, response: Any) -> tuple[list[Send], list[Finished]]:
        exec_request = self.by_exec_id.get(response.request_id)
        if exec_request is None:
            return [], []
        if response.error is not None:
            return self._on_error(exec_request, response)
        return self._on_result(exec_request, response)

    # ------------------------------------------------------------------------------------------

    def _on_error(self, exec_request: ExecRequest, response) -> tuple[list[Send], list[Finished]]:
        triton = exec_request.triton
        if triton.failure is not None:  # the server ended it: say that, not how the executor stopped
            response = _ErrorResponse(response.request_id, triton.failure)
        finished = self._finish(response.request_id, exec_request, error=True)
        done = not triton.live_exec_ids
        if self.decoupled and triton.errors_as_output:
            tensors = only_requested(error_message_tensors(response.error), triton.requested_outputs)
            return [Send(triton.sender, tensors=tensors, final=done, key=triton.key)], [finished]
        if self.decoupled:
            return [Send(triton.sender, error=response.error, final=done, key=triton.key)], [finished]
        triton.errors.append(response.error)
        return ([Send(triton.sender, error="; ".join(triton.errors), final=True, key=triton.key)]
                if done else []), [finished]

    def _on_result(self, exec_request: ExecRequest, response) -> tuple[list[Send], list[Finished]]:
        result, spec, triton = response.result, exec_request.spec, exec_request.triton
        if triton.failure is not None and result.is_final:
            return self._on_error(exec_request, _ErrorResponse(response.request_id, triton.failure))
        tokens = self._tokens_to_send(exec_request, result)
        now = self._clock()
        new_tokens = self._count_tokens(exec_request, result, tokens)
        exec_request.latency.on_tokens(now, new_tokens)
        exec_request.output_tokens += new_tokens
        finished = []
        if result.is_final:
            exec_request.streams_left -= 1
            if exec_request.streams_left == 0:
                exec_request.latency.use_perf(getattr(result, "perf", None))
                finished.append(self._finish(response.request_id, exec_request))
        done = not triton.live_exec_ids
        if not done and (triton.cancelled or tokens is None and not result.is_final):
            return [], finished  # nobody to send to, or everything in this chunk is held back
        tensors = result_tensors(
            result, batch_index=spec.batch_index, batch_size=triton.batch_size,
            num_return_sequences=spec.num_return_sequences,
            want_perf=spec.output.get("return_perf_metrics", False),
            logits_dtype=self._logits_dtype, output_token_ids=tokens)
        tensors[REQUEST_KEY_OUTPUT] = np.array([[triton.key]], dtype=np.uint64)
        tensors = only_requested(tensors, triton.requested_outputs)
        if self.decoupled:
            if spec.streaming and spec.beam_width == 1:
                self.stream_counts.add(len(tokens[0]) if tokens else 0)
            return [Send(triton.sender, tensors=tensors, final=done, key=triton.key)], finished
        if result.is_final:
            triton.final_tensors.append(tensors)
        if not done:
            return [], finished
        if triton.errors:
            return [Send(triton.sender, error="; ".join(triton.errors), final=True, key=triton.key)], finished
        return [Send(triton.sender, tensors=stack_responses(triton.final_tensors), final=True,
                     key=triton.key)], finished

    def _tokens_to_send(self, exec_request: ExecRequest, result) -> list[list[int]] | None:
        """The beams' tokens to send now; None when a non-final chunk is entirely held back."""
        spec = exec_request.spec
        use_holdback = (self._decode is not None and spec.streaming and spec.beam_width == 1
                        and not spec.output.get("return_log_probs") and not spec.output.get("num_top_log_probs")
                        and not spec.output.get("return_generation_logits")
                        and not spec.output.get("return_token_timestamps"))
        if not use_holdback:
            return [list(beam) for beam in result.output_token_ids]
        index = getattr(result, "sequence_index", 0) or 0
        holdback = exec_request.holdbacks.setdefault(index, Utf8Holdback(self._decode))
        ready = holdback.push(result.output_token_ids[0] if result.output_token_ids else [])
        if result.is_final:
            ready += holdback.flush()
        return [ready] if ready or result.is_final else None

    def _count_tokens(self, exec_request: ExecRequest, result, tokens) -> int:
        spec = exec_request.spec
        beams = result.output_token_ids
        if spec.beam_width > 1 and spec.streaming:
            beams = beams if result.is_final else []  # beam streams resend the whole hypothesis
        prompt_included = not spec.streaming and not spec.output.get("exclude_input_from_output")
        return generated_token_count([len(b) for b in beams], len(spec.input_token_ids),
                                     prompt_included)

    def _finish(self, exec_id: int, exec_request: ExecRequest, error: bool = False) -> Finished:
        triton = exec_request.triton
        self.by_exec_id.pop(exec_id, None)
        triton.live_exec_ids.discard(exec_id)
        if not triton.live_exec_ids:
            self.triton_requests.pop(triton.key, None)
            if self.by_user_id.get(triton.user_id) is triton:
                del self.by_user_id[triton.user_id]
        return Finished(input_tokens=len(exec_request.spec.input_token_ids),
                        output_tokens=exec_request.output_tokens, latency=exec_request.latency,
                        error=error)


@dataclass
class _ErrorResponse:
    request_id: int
    error: str


def _is_cancelled(sender: Any) -> bool:
    try:
        return bool(sender.is_cancelled())
    except Exception:  # a sender that is already closed counts as not cancellable
        return False
