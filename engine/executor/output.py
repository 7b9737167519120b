"""What the executor sends: Results built from sequences, and the queue that coalesces them.

Streaming: each response carries the tokens produced since that stream's previous response.
Non-streaming: one final response with prompt + output (unless exclude_input_from_output).
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import replace

from engine.executor import beam_search
from engine.executor.request import RequestState, Response, Result, Sequence


class ResponseQueue:
    """Responses waiting for ``await_responses``; streaming chunks of one stream coalesce.

    A streaming client that polls slower than the loop runs gets one response carrying every
    token produced since its last poll, instead of falling behind one response per token.
    """

    def __init__(self):
        self._pending: OrderedDict[object, Response] = OrderedDict()
        self._cv = threading.Condition()
        self._unique = itertools.count()

    def put(self, responses: list[Response]) -> None:
        with self._cv:
            for response in responses:
                self._put_one(response)
            self._cv.notify_all()

    def _put_one(self, response: Response) -> None:
        result = response.result
        key = (response.request_id, result.sequence_index) if result is not None else next(self._unique)
        queued = self._pending.get(key)
        if queued is not None and _mergeable(queued.result, result):
            self._pending[key] = Response(response.request_id, None, _merge(queued.result, result))
            return
        if queued is not None:  # keep order: the earlier response stays under a fresh key
            self._pending[next(self._unique)] = self._pending.pop(key)
        self._pending[key] = response

    def take(self, timeout: float | None) -> list[Response]:
        with self._cv:
            if not self._pending:
                self._cv.wait(timeout)
            responses = list(self._pending.values())
            self._pending.clear()
            return responses


def _mergeable(a: Result | None, b: Result | None) -> bool:
    return a is not None and b is not None and not a.is_final and getattr(a, "_streaming_delta", False)


def _merge(a: Result, b: Result) -> Result:
    def cat(x, y):
        return None if x is None or y is None else [p + q for p, q in zip(x, y)]

    merged = replace(
        b,
        output_token_ids=[p + q for p, q in zip(a.output_token_ids, b.output_token_ids)],
        log_probs=cat(a.log_probs, b.log_probs),
        top_log_prob_ids=cat(a.top_log_prob_ids, b.top_log_prob_ids),
        top_log_probs=cat(a.top_log_probs, b.top_log_probs),
        context_logits=a.context_logits if a.context_logits is not None else b.context_logits,
        generation_logits=(_cat_steps(a.generation_logits, b.generation_logits)
                           if a.generation_logits is not None and b.generation_logits is not None else b.generation_logits),
    )
    merged._streaming_delta = True
    return merged


def responses_for(state: RequestState, stream_interval: int = 1) -> list[Response]:
    """This step's responses of one request; a stream waits for `stream_interval` new tokens."""
    if state.is_beam_search:
        return beam_search.responses(state)
    responses = []
    for seq in state.sequences:
        if seq.sequence_index in state.finished_streams:
            continue
        if state.request.streaming and _stream_is_due(seq, stream_interval):
            responses.append(Response(state.request_id, result=streaming_result(seq)))
        elif seq.is_finished:
            responses.append(Response(state.request_id, result=final_result(seq)))
        if seq.is_finished:
            state.finished_streams.add(seq.sequence_index)
    return responses

def _stream_is_due(seq: Sequence, stream_interval: int) -> bool:
    """The first token and the end go out at once (time to first token and to the last stay as
    they are); in between, a response waits until `stream_interval` tokens are new."""
    new_tokens = seq.num_known_generated_tokens - seq.num_emitted
    if seq.is_finished:
        return True
    return new_tokens >= stream_interval or (new_tokens > 0 and seq.num_emitted == 0)


def streaming_result(seq: Sequence) -> Result:
    start, seq.num_emitted = seq.num_emitted, seq.num_known_generated_tokens
    # A slice of token_ids itself: generated_token_ids would copy the whole output every step.
    first = seq.num_prompt_tokens
    result = build_result(seq, seq.token_ids[first + start:first + seq.num_emitted], start,
                          with_context_logits=start == 0)
    result._streaming_delta = True
    return result

def final_result(seq: Sequence) -> Result:
    seq.num_emitted = seq.num_generated_tokens
    tokens = seq.generated_token_ids if seq.state.exclude_input else list(seq.token_ids)
    return build_result(seq, tokens, 0, with_context_logits=True)

def build_result(seq: Sequence, tokens: list[int], start: int, with_context_logits: bool) -> Result:
    state, output = seq.state, seq.state.request.output
    result = Result(output_token_ids=[tokens], is_final=seq.is_finished, finish_reasons=[seq.finish_reason],
                    sequence_index=seq.sequence_index)
    if output.return_log_probs:
        result.log_probs = [seq.log_probs[start:]]
        result.cum_log_probs = [seq.cum_log_prob]
    if output.num_top_log_probs:  # one entry per generated token (a final result's prompt has none)
        result.top_log_prob_ids = [seq.top_log_prob_ids[start:]]
        result.top_log_probs = [seq.top_log_probs[start:]]
    if output.return_generation_logits and seq.generation_logits[start:]:
        result.generation_logits = _torch().stack(seq.generation_logits[start:]).unsqueeze(0)
    if output.return_context_logits and with_context_logits and state.context_logits_parts:
        result.context_logits = _torch().cat(state.context_logits_parts)
    if output.return_perf_metrics:
        result.perf = replace(state.perf)
    if seq.is_finished and state.context_phase_params is not None:
        result.context_phase_params = state.context_phase_params
    return result


def _cat_steps(a, b):
    """Two chunks' generation_logits (beams, steps, vocab) joined along steps: torch tensors from an
    executor in this process, numpy arrays from the engine process's wire (engine_process.py)."""
    if hasattr(a, "detach"):
        return _torch().cat([a, b], dim=1)
    import numpy as np

    return np.concatenate([a, b], axis=1)


def _torch():
    """torch, imported where the executor builds logits (never on the client side of an engine
    process, which gets numpy logits: its unpickling and merging must not import torch, see
    engine_process.py "What a client unpickles")."""
    import torch

    return torch
