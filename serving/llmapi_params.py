"""Requests and responses of the LLM-API `tensorrt_llm` model (all_models/llmapi), no Triton import.

Inputs (TensorRT-LLM's llmapi config.pbtxt): `text_input` (one prompt), `streaming`, the
`sampling_param_*` set, `return_finish_reason` / `return_stop_reason` / `return_cumulative_logprob`,
`stop` (a stop request for the request id), `lora_id` / `lora_name` / `lora_path` /
`lora_ckpt_source`, `image_url`. They become one executor request (serving/requests.py
RequestSpec) of the prompt's token ids; its token ids come back as text through `TextStream`,
with `sampling_param_stop` strings cut out of the text, and `response_tensors` gives the outputs.

Refused per request, by name: `image_url` (and any multimodal input: the engine is text-only),
`sampling_param_best_of` > 1 (no beam search / best-of here), `lora_ckpt_source` other than "hf".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from serving.requests import (STREAMING_NEEDS_DECOUPLED, RequestSpec, any_text, lora_adapter, read_scalar,
                              read_text)
from serving.tokenization import DecodeWindow

DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM's SamplingParams.max_tokens default
# sampling_param_* input -> SamplingConfig field
SAMPLING_INPUTS = {
    "sampling_param_temperature": "temperature", "sampling_param_top_k": "top_k", "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty",
    "sampling_param_presence_penalty": "presence_penalty", "sampling_param_seed": "seed",
}
OUTPUT_FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
LORA_CKPT_SOURCES = ("hf",)
PERF_OUTPUTS = ("kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks",
                "kv_cache_alloc_total_blocks", "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns",
                "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens")
# What the FinishReason values of engine/executor/request.py are called in the LLM API.
FINISH_REASONS = {"end_id": "stop", "stop_words": "stop", "length": "length", "cancelled": "cancelled",
                  "error": "error", "not_finished": "None"}


@dataclass
class LlmapiRequest:
    spec: RequestSpec
    stop_strings: list[str] = field(default_factory=list)
    outputs: dict[str, bool] = field(default_factory=dict)  # OUTPUT_FLAGS and return_perf_metrics
    prompt: str = ""
    echo_prompt: bool = False  # sampling_param_exclude_input_from_output false: text_output starts with it


def _scalar(tensors: Mapping[str, np.ndarray], name: str):
    """The one value of a per-request scalar input (any shape of size 1), or None when absent."""
    array = tensors.get(name)
    if array is None or array.size == 0:
        return None
    return read_scalar({name: array}, name, 1, 0)


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    values = [v.decode("utf-8") if isinstance(v, bytes) else str(v)
              for v in np.asarray(array, dtype=object).reshape(-1)]
    return [v for v in values if v]


def prompt_of(tensors: Mapping[str, np.ndarray]) -> str:
    text = tensors.get("text_input")
    if text is None or text.size == 0:
        raise ValueError("text_input is required: one prompt string")
    if text.size != 1:
        raise ValueError(f"text_input holds {text.size} strings; this model takes one prompt per request "
                         "(send one request per prompt; the engine batches them)")
    prompt = _strings(text)
    if not prompt:
        raise ValueError("text_input is empty; send a prompt")
    return prompt[0]


def refuse_unsupported(tensors: Mapping[str, np.ndarray]) -> None:
    if any_text("image_url")(tensors, 1):
        raise ValueError("image_url: multimodal input is not supported by this backend (the engine is "
                         "text-only); send the request without image_url")
    best_of = _scalar(tensors, "sampling_param_best_of")
    if best_of is not None and int(best_of) > 1:
        raise ValueError(f"sampling_param_best_of {int(best_of)}: best-of / beam search is not supported by "
                         "the LLM-API model here; send 1 or leave it out")
    source = read_text(tensors, "lora_ckpt_source", 1, 0) if "lora_ckpt_source" in tensors else None
    if source is not None and source not in LORA_CKPT_SOURCES:
        raise ValueError(f"lora_ckpt_source {source!r} is not supported; allowed: hf (a PEFT directory in "
                         "lora_path), or leave it out")


def parse_request(tensors: Mapping[str, np.ndarray], *, decoupled: bool, encode: Callable[[str], list[int]],
                  encode_word: Callable[[str], list[int]], end_id: int | None, pad_id: int | None,
                  max_input_len: int | None = None) -> LlmapiRequest:
    """Validate one request's inputs (numpy arrays by name) and build its executor request spec.
    `encode` tokenizes the prompt (special tokens added), `encode_word` a stop string (without)."""
    refuse_unsupported(tensors)
    prompt = prompt_of(tensors)
    streaming = bool(_scalar(tensors, "streaming") or False)
    if streaming and not decoupled:
        raise ValueError(STREAMING_NEEDS_DECOUPLED + " (set triton_config.decoupled: true in model.yaml)")
    max_tokens = _scalar(tensors, "sampling_param_max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    if max_tokens < 1:
        raise ValueError(f"sampling_param_max_tokens must be >= 1, got {max_tokens}")
    ids = encode(prompt)
    if max_input_len is not None and len(ids) > max_input_len:
        raise ValueError(f"input length {len(ids)} exceeds the engine's max_input_len {max_input_len}")
    sampling = {key: _scalar(tensors, name) for name, key in SAMPLING_INPUTS.items()}
    sampling = {key: value for key, value in sampling.items() if value is not None}
    if sampling.get("top_p") is not None and sampling["top_p"] <= 0:
        del sampling["top_p"]
    stop_strings = _strings(tensors.get("sampling_param_stop"))
    outputs = {name: bool(_scalar(tensors, name) or False) for name in OUTPUT_FLAGS}
    outputs["return_perf_metrics"] = bool(_scalar(tensors, "sampling_param_return_perf_metrics") or False)
    exclude = _scalar(tensors, "sampling_param_exclude_input_from_output")
    spec = RequestSpec(
        batch_index=0, input_token_ids=ids, max_tokens=max_tokens, streaming=streaming, end_id=end_id,
        pad_id=pad_id, stop_words=[w for w in (encode_word(s) for s in stop_strings) if w] or None,
        sampling=sampling,
        # The executor returns generated ids only (the prompt is echoed as text when asked); perf
        # metrics always (the model's latency histograms use them).
        output={"exclude_input_from_output": True, "return_perf_metrics": True,
                "return_log_probs": outputs["return_cumulative_logprob"]},
        lora=lora_adapter(tensors, 1, 0))
    return LlmapiRequest(spec=spec, stop_strings=stop_strings, outputs=outputs, prompt=prompt,
                         echo_prompt=exclude is not None and not bool(exclude))


def _earliest(text: str, words: list[str], start: int) -> tuple[int, str] | None:
    found = [(index, word) for word in words if (index := text.find(word, start)) >= 0]
    return min(found) if found else None


def _held_tail(text: str, words: list[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop word (it may still become one)."""
    for length in range(min(len(text), max(map(len, words)) - 1), 0, -1):
        tail = text[-length:]
        if any(word.startswith(tail) for word in words):
            return length
    return 0


@dataclass
class TextStream:
    """The text of one request: push(new ids, final) -> the text to send now.

    Ids are decoded a few at a time (serving/tokenization.py DecodeWindow), so a character split
    over tokens goes out whole and the chunks of a stream add up to the unary text. A stop string
    ends the text before it (TensorRT-LLM's LLM API leaves it out); while the end of the text could
    still grow into one, that end is held back."""

    decode: Callable[[list[int]], str]
    stop_strings: list[str] = field(default_factory=list)
    window: DecodeWindow = field(default_factory=DecodeWindow)
    text: str = ""
    sent: int = 0
    stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_ids: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        self.window.extend(token_ids)
        if self.window.pending:
            head, window = self.window.windows()
            self.text += self.window.advance(self.decode(head) if head else "", self.decode(window), final)
        end = len(self.text)
        if self.stop_strings:
            hit = _earliest(self.text, self.stop_strings, self.sent)
            if hit is not None:
                end, self.stop_reason = hit
                self.text = self.text[:end]
            elif not final:
                end -= _held_tail(self.text, self.stop_strings)
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta


@dataclass
class ResponseState:
    """Everything the model keeps per request between its responses."""

    request: LlmapiRequest
    text: TextStream
    tokens_per_block: int
    requested: frozenset[str] | None = None  # the outputs the caller asked for (None: all)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    prompt_sent: bool = False

    def on_result(self, result: Any) -> None:
        """From the executor's Result (before it becomes a Send): what the tensors do not carry."""
        reasons = getattr(result, "finish_reasons", None) or []
        if reasons:
            reason = getattr(reasons[0], "value", reasons[0])
            self.finish_reason = FINISH_REASONS.get(str(reason), str(reason))
        cum = getattr(result, "cum_log_probs", None)
        if cum is not None and len(cum):
            self.cumulative_logprob = float(np.asarray(cum, dtype=np.float64).reshape(-1)[0])


def _column(values: list, dtype, batched: bool) -> np.ndarray:
    array = np.array(values, dtype=dtype)
    return array.reshape(1, -1) if batched else array


def response_tensors(state: ResponseState, tensors: Mapping[str, np.ndarray], final: bool,
                     batched: bool = False) -> dict[str, np.ndarray] | None:
    """The LLM-API outputs of one response of the `tensorrt_llm` model's machinery (output_ids,
    sequence_length, perf tensors; serving/responses.py). None: nothing to send (a stream's chunk
    held back whole, or one after the stop string). `batched`: Triton's max_batch_size > 0, so
    every output gets a leading batch dim of 1."""
    request, was_stopped = state.request, state.text.stopped
    ids = np.asarray(tensors.get("output_ids", np.zeros((1, 1, 0), np.int32)))
    length = int(np.asarray(tensors.get("sequence_length", [[ids.shape[-1]]])).reshape(-1)[0])
    new_ids = [int(t) for t in ids.reshape(-1)[:length] if t >= 0]
    delta = state.text.push(new_ids, final)
    if request.echo_prompt and not state.prompt_sent:
        delta, state.prompt_sent = request.prompt + delta, True
    if not final and not delta and (was_stopped or request.spec.streaming):
        return None
    out = {"text_output": _column([delta.encode("utf-8")], object, batched)}
    outputs = request.outputs
    if outputs["return_finish_reason"]:
        reason = ("stop" if state.text.stopped else state.finish_reason or "None") if final else "None"
        out["finish_reason"] = _column([reason.encode()], object, batched)
    if outputs["return_stop_reason"]:
        out["stop_reason"] = _column([str(state.text.stop_reason).encode()], object, batched)
    if outputs["return_cumulative_logprob"]:
        out["cumulative_logprob"] = _column([state.cumulative_logprob], np.float32, batched)
    if outputs["return_perf_metrics"] and final:
        out.update({name: _column([value], dtype, batched)
                    for name, (value, dtype) in perf_values(tensors, len(request.spec.input_token_ids),
                                                            state.tokens_per_block).items()})
    return out


def perf_values(tensors: Mapping[str, np.ndarray], prompt_tokens: int, tokens_per_block: int) -> dict[str, tuple]:
    """The LLM-API perf outputs from the executor's RequestPerfMetrics tensors (serving/responses.py
    perf_tensors). Missed blocks and the hit rate are derived: the prompt's blocks not reused. The
    speculative-decoding ones are the executor's (0 while no drafts were verified)."""
    def value(name):
        array = tensors.get(name)
        return 0 if array is None else np.asarray(array).reshape(-1)[0].item()

    reused = int(value("kv_cache_reused_blocks"))
    prompt_blocks = -(-prompt_tokens // max(tokens_per_block, 1))
    missed = max(prompt_blocks - reused, 0)
    hit_rate = reused / (reused + missed) if reused + missed else 0.0
    return {
        "kv_cache_reused_block": (reused, np.int32), "kv_cache_missed_block": (missed, np.int32),
        "kv_cache_alloc_new_blocks": (int(value("kv_cache_alloc_new_blocks")), np.int32),
        "kv_cache_alloc_total_blocks": (int(value("kv_cache_alloc_total_blocks")), np.int32),
        "kv_cache_hit_rate": (hit_rate, np.float32),
        "arrival_time_ns": (int(value("arrival_time_ns")), np.int64),
        "first_scheduled_time_ns": (int(value("first_scheduled_time_ns")), np.int64),
        "first_token_time_ns": (int(value("first_token_time_ns")), np.int64),
        "last_token_time_ns": (int(value("last_token_time_ns")), np.int64),
        "acceptance_rate": (float(value("acceptance_rate")), np.float32),
        "total_accepted_draft_tokens": (int(value("total_accepted_draft_tokens")), np.int32),
        "total_draft_tokens": (int(value("total_draft_tokens")), np.int32),
    }
