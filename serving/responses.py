"""Executor results -> Triton `tensorrt_llm` output tensors (numpy), per the reference layout.

Shapes (leading 1 = this response's batch dim):
    output_ids (1, beams, T) int32, shorter beams padded with -1; sequence_length (1, beams)
    cum_log_probs (1, beams); output_log_probs (1, beams, T); context/generation logits (1, ...)
    top_log_prob_ids int32 / top_log_probs float32 (1, beams, T, k), only when num_top_log_probs k > 0
    (an extension: T counts the generated tokens this response carries, most likely first)
    token_timestamps (1, beams, T) float32, only when return_token_timestamps (Whisper; an extension)
    batch_index / sequence_index (1, 1), only when the batch / num_return_sequences is > 1
    the 10 perf tensors (1, 1) each, only when perf metrics were requested
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

# Beyond the reference: a caller whose request carries the parameter ERRORS_AS_OUTPUT=true gets a
# failure during generation as a response carrying the message in ERROR_MESSAGE_OUTPUT (bytes,
# shape (1, 1)) instead of an error response. Why: the Python backend of Triton 2.51 drops the
# request id of an *error* response, so a BLS caller iterating a decoupled stream never sees an
# error that follows other responses and waits forever (fixed upstream after 2.51). Our BLS asks.
# (A parameter, not the requested outputs: a client that names no outputs is sent all of them.)
ERROR_MESSAGE_OUTPUT = "error_message"
ERRORS_AS_OUTPUT = "errors_as_output"


def error_message_tensors(message: str) -> dict[str, np.ndarray]:
    return {ERROR_MESSAGE_OUTPUT: np.array([[message.encode()]], dtype=object)}


# A model sends only the outputs its caller asked for. Why: the Python backend of Triton 2.51 drops
# the others in a decoupled send (response_sender.send) after releasing the interpreter lock, so
# their numpy arrays are freed without it. Under Python 3.12 that crashed the tensorrt_llm stub
# (SIGSEGV) on the first response to the BLS, which asks for a subset; the BLS request then hung
# (H100, 2026-11-24; fixed upstream in python_backend #390, after 2.51). A caller that names no
# outputs is asked for all of them by Triton, so it still gets everything.
def requested_outputs(request: Any) -> frozenset[str] | None:
    """The output names a Python-backend request asks for; None where the request cannot say."""
    names = getattr(request, "requested_output_names", None)
    return frozenset(names()) if callable(names) else None


def only_requested(tensors: dict[str, np.ndarray], requested: frozenset[str] | None) -> dict[str, np.ndarray]:
    if requested is None:
        return tensors
    return {name: value for name, value in tensors.items() if name in requested}


def wants_errors_as_output(request_parameters: str) -> bool:
    """From a Triton request's parameters (a JSON object as text)."""
    try:
        return json.loads(request_parameters or "{}").get(ERRORS_AS_OUTPUT) is True
    except (ValueError, AttributeError):
        return False


PERF_OUTPUTS = (
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
    "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
    "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
)
_PERF_DTYPES = {"acceptance_rate": np.float32, "arrival_time_ns": np.int64,
                "first_scheduled_time_ns": np.int64, "first_token_time_ns": np.int64,
                "last_token_time_ns": np.int64}


def pad_beams(beams: list[list[int]] | list[list[float]], dtype, pad) -> np.ndarray:
    """(beams, max_len) array of ragged per-beam lists, padded with `pad`."""
    if len(beams) == 1:  # every streamed token of a beam-1 request comes through here
        return np.array(beams[0], dtype=dtype).reshape(1, -1)
    width = max([0] + [len(beam) for beam in beams])
    out = np.full((len(beams), width), pad, dtype=dtype)
    for i, beam in enumerate(beams):
        out[i, : len(beam)] = beam
    return out


def _as_numpy(value, dtype=None) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().float().cpu().numpy() if str(value.dtype) == "torch.bfloat16" \
            else value.detach().cpu().numpy()
    array = np.asarray(value)
    return array.astype(dtype) if dtype is not None else array


def perf_tensors(perf: Any) -> dict[str, np.ndarray]:
    """The 10 perf outputs from a `RequestPerfMetrics` (missing fields read as 0)."""
    out = {}
    for name in PERF_OUTPUTS:
        value = getattr(perf, name, None) or 0
        out[name] = np.array([[value]], dtype=_PERF_DTYPES.get(name, np.int32))
    return out


def result_tensors(result: Any, *, batch_index: int, batch_size: int, num_return_sequences: int,
                   want_perf: bool, logits_dtype=np.float32,
                   output_token_ids: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """Output tensors of one executor `Result`; `output_token_ids` overrides the result's tokens
    (a streamed chunk whose tail is held back)."""
    if output_token_ids is None:
        output_token_ids = result.output_token_ids
    beams = [list(beam) for beam in output_token_ids]
    tensors = {
        "output_ids": pad_beams(beams, np.int32, -1)[None],
        "sequence_length": np.array([[len(beam) for beam in beams]], dtype=np.int32),
    }
    if getattr(result, "cum_log_probs", None) is not None:
        tensors["cum_log_probs"] = _as_numpy(result.cum_log_probs, np.float32).reshape(1, -1)
    if getattr(result, "log_probs", None) is not None:
        tensors["output_log_probs"] = pad_beams(
            [list(b) for b in result.log_probs], np.float32, 0.0)[None]
    if getattr(result, "top_log_prob_ids", None) is not None:
        tensors.update(top_log_prob_tensors(result.top_log_prob_ids, result.top_log_probs))
    for name in ("context_logits", "generation_logits"):
        value = getattr(result, name, None)
        if value is not None:
            tensors[name] = _as_numpy(value, logits_dtype)[None]
    if getattr(result, "token_timestamps", None) is not None:  # Whisper: seconds per output token
        tensors["token_timestamps"] = pad_beams([list(b) for b in result.token_timestamps], np.float32, 0.0)[None]
    blob = getattr(result, "context_phase_params", None)
    if blob is not None:  # a context_only request's final result: (1, len) UINT8, opaque to the client
        tensors["context_phase_params"] = np.frombuffer(blob, dtype=np.uint8)[None]
    if batch_size > 1:
        tensors["batch_index"] = np.array([[batch_index]], dtype=np.int32)
    if num_return_sequences > 1:
        tensors["sequence_index"] = np.array([[getattr(result, "sequence_index", 0) or 0]],
                                             dtype=np.int32)
    if want_perf:
        tensors.update(perf_tensors(getattr(result, "perf", None)))
    return tensors


def top_log_prob_tensors(ids: list[list[list[int]]], values: list[list[list[float]]]) -> dict[str, np.ndarray]:
    """Per beam, per token, k entries -> top_log_prob_ids int32 / top_log_probs float32 (1, beams, T, k)."""
    beams, tokens = len(ids), max([0] + [len(beam) for beam in ids])
    k = max([0] + [len(entry) for beam in ids for entry in beam])
    out_ids = np.full((1, beams, tokens, k), -1, dtype=np.int32)
    out_values = np.zeros((1, beams, tokens, k), dtype=np.float32)
    for b, (beam_ids, beam_values) in enumerate(zip(ids, values)):
        if beam_ids:
            out_ids[0, b, :len(beam_ids)] = beam_ids
            out_values[0, b, :len(beam_values)] = beam_values
    return {"top_log_prob_ids": out_ids, "top_log_probs": out_values}


def stack_responses(responses: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several (1, ...) response tensor sets -> one (N, ...) set, padding ragged dims.

    output_ids pads with -1, everything else with 0; a tensor missing from any response is
    dropped. Used where Triton allows a single response (non-decoupled) for N result streams.
    """
    if len(responses) == 1:
        return responses[0]
    names = [name for name in responses[0] if all(name in r for r in responses)]
    stacked = {}
    for name in names:
        arrays = [r[name] for r in responses]
        shape = [max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim)]
        fill = -1 if name == "output_ids" else 0
        padded = []
        for a in arrays:
            out = np.full([a.shape[0], *shape[1:]], fill, dtype=a.dtype)
            out[tuple(slice(0, n) for n in a.shape)] = a
            padded.append(out)
        stacked[name] = np.concatenate(padded, axis=0)
    return stacked
