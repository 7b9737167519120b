"""Triton `tensorrt_llm` inputs -> executor requests, with the reference's validation texts.

Inputs arrive as numpy arrays keyed by tensor name, each with Triton's leading batch dimension
B: `input_ids` (B, L); scalar inputs (B,) or (B, 1); word lists (B, 2, L). One Triton request
with B rows becomes B executor requests (row b keeps `batch_index` b).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from serving.word_lists import decode_word_list

STREAMING_NEEDS_DECOUPLED = "Streaming is only supported in decoupled mode."
MISSING_STOP_ID = "A request id must be provided for request cancellation"

# Triton input -> SamplingConfig field (None values are dropped so executor defaults apply).
SAMPLING_INPUTS = {
    "runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature",
    "min_tokens": "min_tokens", "seed": "seed", "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "len_penalty": "length_penalty", "early_stopping": "early_stopping",
}
OUTPUT_INPUTS = {
    "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics",
}
# Declared inputs this backend accepts and ignores (features it does not implement).
IGNORED_INPUTS = (
    "encoder_input_features", "encoder_output_lengths", "draft_input_ids", "decoder_input_ids",
    "decoder_input_lengths", "draft_logits", "draft_acceptance_threshold", "runtime_top_p_min",
    "runtime_top_p_decay", "runtime_top_p_reset_ids", "beam_search_diversity_rate",
    "prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size", "cross_attention_mask",
    "mrope_rotary_cos_sin", "mrope_position_deltas", "lora_task_id", "lora_weights", "lora_config",
    "context_phase_params", "skip_cross_attn_blocks", "retention_token_range_starts",
    "retention_token_range_ends", "retention_token_range_priorities",
    "retention_token_range_durations_ms", "retention_decode_priority",
    "retention_decode_duration_ms", "guided_decoding_guide_type", "guided_decoding_guide",
    "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size",
)


@dataclass
class RequestSpec:
    """Everything needed to build one executor `Request` for one batch row."""

    batch_index: int
    input_token_ids: list[int]
    max_tokens: int
    streaming: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] | None = None
    bad_words: list[list[int]] | None = None
    embedding_bias: np.ndarray | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    output: dict[str, Any] = field(default_factory=dict)

    @property
    def num_return_sequences(self) -> int:
        return self.sampling.get("num_return_sequences", 1)

    @property
    def beam_width(self) -> int:
        return self.sampling.get("beam_width", 1)


def conversion_error_message(request_id: str, error: Exception) -> str:
    return ("An error occurred when processing the input values for request id "
            f"{request_id}, the error was '{error}'")


def _python_value(value):
    return value.item() if isinstance(value, np.generic) else value


def read_scalar(tensors: Mapping[str, np.ndarray], name: str, batch_size: int, row: int):
    """Row `row` of a per-item scalar input, or None when absent."""
    array = tensors.get(name)
    if array is None:
        return None
    if array.size != batch_size:
        raise ValueError(f"Expected a scalar tensor for tensor {name}")
    return _python_value(array.reshape(-1)[row])


def read_row(tensors: Mapping[str, np.ndarray], name: str, batch_size: int, row: int):
    """Row `row` of a per-item tensor with a leading batch dim (kept as (1, ...)), or None."""
    array = tensors.get(name)
    if array is None:
        return None
    if array.shape[0] != batch_size:
        raise ValueError(f"Expected batch size doesn't match batch size for tensor {name}. "
                         f"Expected {batch_size} got {array.shape[0]}")
    return array[row:row + 1]


def batch_size_of(tensors: Mapping[str, np.ndarray]) -> int:
    input_ids = tensors.get("input_ids")
    if input_ids is None:
        raise ValueError("A value is required for input_ids")
    if input_ids.ndim != 2 or input_ids.size == 0:
        raise ValueError("Invalid format for input_ids")
    return input_ids.shape[0]


def _input_token_ids(tensors, batch_size: int, row: int, max_input_len: int | None) -> list[int]:
    ids = tensors["input_ids"][row]
    length = read_scalar(tensors, "input_lengths", batch_size, row)
    if length is not None:
        ids = ids[: int(length)]
    if ids.size == 0:
        raise ValueError("Invalid format for input_ids")
    if max_input_len is not None and ids.size > max_input_len:
        raise ValueError(f"input length {ids.size} exceeds the engine's max_input_len {max_input_len}")
    return [int(t) for t in ids]


def _sampling(tensors, batch_size: int, row: int) -> dict[str, Any]:
    sampling = {}
    for name, key in SAMPLING_INPUTS.items():
        value = read_scalar(tensors, name, batch_size, row)
        if value is not None:
            sampling[key] = value
    if sampling.get("top_p") is not None and sampling["top_p"] <= 0:
        del sampling["top_p"]  # the reference treats top_p <= 0 as unset
    sampling["beam_width"] = int(read_scalar(tensors, "beam_width", batch_size, row) or 1)
    sampling["num_return_sequences"] = int(
        read_scalar(tensors, "num_return_sequences", batch_size, row) or 1)
    return sampling


def _output(tensors, batch_size: int, row: int, exclude_input_default: bool | None):
    output = {key: bool(read_scalar(tensors, name, batch_size, row) or False)
              for name, key in OUTPUT_INPUTS.items()}
    exclude = read_scalar(tensors, "exclude_input_in_output", batch_size, row)
    if exclude is None:
        exclude = exclude_input_default
    output["exclude_input_from_output"] = bool(exclude or False)
    return output


def convert_row(tensors: Mapping[str, np.ndarray], row: int, batch_size: int, *,
                decoupled: bool, exclude_input_default: bool | None,
                max_input_len: int | None = None) -> RequestSpec:
    """Validate and convert batch row `row`; raises ValueError with the reference's text."""
    max_tokens = read_scalar(tensors, "request_output_len", batch_size, row)
    if max_tokens is None:
        raise ValueError("A value is required for request_output_len")
    streaming = bool(read_scalar(tensors, "streaming", batch_size, row) or False)
    if streaming and not decoupled:
        raise ValueError(STREAMING_NEEDS_DECOUPLED)
    bias = read_row(tensors, "embedding_bias", batch_size, row)
    end_id = read_scalar(tensors, "end_id", batch_size, row)
    pad_id = read_scalar(tensors, "pad_id", batch_size, row)
    return RequestSpec(
        batch_index=row,
        input_token_ids=_input_token_ids(tensors, batch_size, row, max_input_len),
        max_tokens=int(max_tokens),
        streaming=streaming,
        end_id=None if end_id is None else int(end_id),
        pad_id=None if pad_id is None else int(pad_id),
        stop_words=decode_word_list(read_row(tensors, "stop_words_list", batch_size, row)),
        bad_words=decode_word_list(read_row(tensors, "bad_words_list", batch_size, row)),
        embedding_bias=bias.reshape(-1) if bias is not None and bias.size > 0 else None,
        sampling=_sampling(tensors, batch_size, row),
        output=_output(tensors, batch_size, row, exclude_input_default),
    )


def convert_request(tensors: Mapping[str, np.ndarray], *, decoupled: bool,
                    exclude_input_default: bool | None = None,
                    max_input_len: int | None = None) -> list[RequestSpec]:
    """All rows of one Triton request; raises ValueError on the first invalid input.

    `max_input_len` is the engine's prompt limit (the executor checks the other limits)."""
    batch_size = batch_size_of(tensors)
    return [convert_row(tensors, row, batch_size, decoupled=decoupled,
                        exclude_input_default=exclude_input_default, max_input_len=max_input_len)
            for row in range(batch_size)]


def is_stop_request(tensors: Mapping[str, np.ndarray]) -> bool:
    stop = tensors.get("stop")
    return stop is not None and stop.size > 0 and bool(stop.reshape(-1)[0])


def to_executor_request(spec: RequestSpec):
    """Build the engine's `Request` (imported here so this module loads without the engine)."""
    from engine.executor.request import OutputConfig, Request, SamplingConfig

    return Request(
        input_token_ids=spec.input_token_ids, max_tokens=spec.max_tokens, end_id=spec.end_id,
        pad_id=spec.pad_id, streaming=spec.streaming, sampling=SamplingConfig(**spec.sampling),
        output=OutputConfig(**spec.output), stop_words=spec.stop_words, bad_words=spec.bad_words,
        embedding_bias=spec.embedding_bias,
    )
