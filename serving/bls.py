"""Plain helpers of the `tensorrt_llm_bls` model: validation, stream text, string stop words.

The BLS runs preprocessing -> tensorrt_llm -> postprocessing itself. For a stream it decodes a
short window of each chunk's ids with one token of context (serving.tokenization.DecodeWindow)
and sends the new text (or the whole text so far with `accumulate_tokens`), so every tokenizer
streams exactly the text a unary call returns; decoding costs the same per chunk however long
the sequence grows, and so does the stop-word search, which looks only at the tail a new chunk
can complete (the text so far is still kept, and appended to, per stream).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.requests import (UnsupportedFeature, any_nonzero, any_text, guided_decoding, lora_adapter, non_empty,
                              refuse_unsupported, without)
from serving.tokenization import REPLACEMENT_CHAR, DecodeWindow, TextDeltas

# BLS input -> tensorrt_llm input (besides what preprocessing produces)
LLM_INPUTS_FROM_REQUEST = {
    "beam_width": "beam_width", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
    "temperature": "temperature", "length_penalty": "len_penalty",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "seed": "seed", "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics", "exclude_input_in_output": "exclude_input_in_output",
    "num_return_sequences": "num_return_sequences", "prompt_vocab_size": "prompt_vocab_size",
    "lora_task_id": "lora_task_id", "lora_weights": "lora_weights", "lora_config": "lora_config",
    "lora_id": "lora_id", "lora_name": "lora_name", "lora_path": "lora_path",  # beyond the reference
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
    "prompt_embedding_table": "prompt_embedding_table",
    "num_top_log_probs": "num_top_log_probs",  # an extension of both models
}
# preprocessing output -> tensorrt_llm input
LLM_INPUTS_FROM_PREPROCESSING = {
    "INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_IDS": "bad_words_list",
    "STOP_WORDS_IDS": "stop_words_list", "EMBEDDING_BIAS": "embedding_bias",
    "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
}
# BLS input -> preprocessing input
PREPROCESSING_INPUTS = {
    "text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
PASS_THROUGH_OUTPUTS = (
    "cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
    "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
    "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
    "total_draft_tokens", "top_log_prob_ids", "top_log_probs",
)
# Beyond the reference: a request that carries num_top_log_probs (0 included) also gets the token
# ids behind each response's text, tensorrt_llm's output_ids as they are ((1, beams, T), -1 padded;
# a stream's new tokens only), so a caller can name the tokens its log-probs belong to. Token ids
# are cut neither at string stop words nor at the UTF-8 boundaries the text is.
TOKEN_IDS_OUTPUT = "output_ids"


def wants_token_ids(tensors: dict[str, np.ndarray]) -> bool:
    return "num_top_log_probs" in tensors


# The BLS's inputs of features this backend does not have, refused under the BLS's own names with
# the same kind of rules as tensorrt_llm's (serving/requests.py): absent, empty (size 0) or "off"
# values pass. Refused when: prompt_embedding_table,
# image_input, image_bytes_input, video_bytes_input: any element; prompt_table_extra_id,
# prompt_vocab_size: non-zero; image_url_input: a non-empty string; decoder_text_input: a
# non-empty string (an empty one is no decoder prompt); num_draft_tokens: > 0. use_draft_logits is
# accepted: it only matters with draft tokens. guided_decoding_guide_type/guided_decoding_guide go
# to tensorrt_llm as they are (not ragged here, (B, 1) both), after the same check it makes.
UNSUPPORTED_FEATURES = (
    UnsupportedFeature(
        "prompt tuning (prompt embedding tables) is",
        without("prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size")
        + " (an empty table, prompt_table_extra_id 0 and prompt_vocab_size 0 are accepted)",
        {"prompt_embedding_table": non_empty("prompt_embedding_table"),
         "prompt_table_extra_id": any_nonzero("prompt_table_extra_id"),
         "prompt_vocab_size": any_nonzero("prompt_vocab_size")}),
    UnsupportedFeature(
        "speculative decoding (num_draft_tokens) is",  # the text this check had before
        "send num_draft_tokens 0 or leave num_draft_tokens/use_draft_logits out",
        {"num_draft_tokens": lambda tensors, batch_size: bool(np.any(tensors["num_draft_tokens"] > 0))}),
    UnsupportedFeature(
        "encoder-decoder models are",
        "the engine is decoder-only and the prompt goes in text_input; "
        "send decoder_text_input empty or leave it out",
        {"decoder_text_input": any_text("decoder_text_input")}),
    UnsupportedFeature(
        "multimodal inputs (images, video) are",
        without("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
        + " (empty tensors and an empty image_url_input are accepted)",
        {"image_input": non_empty("image_input"), "image_bytes_input": non_empty("image_bytes_input"),
         "image_url_input": any_text("image_url_input"),
         "video_bytes_input": non_empty("video_bytes_input")}),
)


def validate(tensors: dict[str, np.ndarray]) -> None:
    """The reference BLS checks, with its texts; then inputs of features this backend lacks, and
    the guided-decoding pair and the LoRA inputs (serving/requests.py guided_decoding, lora_adapter)."""
    text = tensors.get("text_input")
    if text is None or text.size == 0:
        raise ValueError("text_input is required")
    max_tokens = tensors.get("max_tokens")
    if max_tokens is None or max_tokens.size != text.shape[0] or np.any(max_tokens <= 0):
        raise ValueError("max_tokens must be a single value > 0")
    refuse_unsupported(tensors, text.shape[0], UNSUPPORTED_FEATURES)
    for row in range(text.shape[0]):  # before preprocessing runs; tensorrt_llm checks the same
        guided_decoding(tensors, text.shape[0], row)
        lora_adapter(tensors, text.shape[0], row)


def with_batch_dim(array: np.ndarray, batch_size: int) -> np.ndarray:
    """BLS inputs reshaped to (B,) go to tensorrt_llm as (B, 1)."""
    return array.reshape(batch_size, 1) if array.ndim == 1 else array


def first_stop(text: str, stop_words: list[str], start: int = 0) -> int | None:
    """End index (exclusive) of the earliest stop word found in text[start:], or None."""
    ends = [found + len(word) for word in stop_words if word and (found := text.find(word, start)) >= 0]
    return min(ends) if ends else None


@dataclass
class StreamText:
    """Text state of one (batch_index, sequence_index) stream of a BLS request.

    update(full_text, is_final) -> the text to send: the delta (or the whole text so far with
    accumulate), cut right after the first string stop word; after a stop, "".

    A stream whose chunks carry new tokens (streaming, one beam) decodes through ``window`` a few
    ids per chunk and keeps its text so far in ``text``; any other response is decoded whole
    from ``token_ids`` (a beam's hypothesis may change from one response to the next).
    """

    stop_words: list[str] = field(default_factory=list)
    accumulate: bool = False
    # Stop words are searched from here: after the prompt when it is echoed; in a growing
    # stream's append-only text, from where a word could still end in the next chunk.
    search_start: int = 0
    grows: bool = False  # the text only ever grows at its end (a streamed single beam)
    token_ids: list[int] = field(default_factory=list)
    deltas: TextDeltas = field(default_factory=TextDeltas)
    stopped: bool = False
    window: DecodeWindow = field(default_factory=DecodeWindow)
    text: str = ""

    def update(self, full_text: str, is_final: bool) -> str:
        if self.stopped:
            return ""
        end = first_stop(full_text, self.stop_words, self.search_start)
        if end is not None:
            full_text, is_final, self.stopped = full_text[:end], True, True
        elif self.grows and self.stop_words:  # no stop so far: only the tail can start one
            settled = len(full_text.rstrip(REPLACEMENT_CHAR))  # an unfinished character may still change
            longest = max(map(len, self.stop_words))
            self.search_start = max(self.search_start, settled - longest + 1)
        delta = self.deltas.update(full_text, is_final)
        if self.accumulate:  # the whole text so far (a beam hypothesis may rewrite it)
            return full_text if is_final else full_text.rstrip(REPLACEMENT_CHAR)
        return delta


class GuardedSender:
    """A request's response sender shared by the serving coroutine and the cancellation watcher
    (tasks on one event loop in the BLS today; the lock keeps the invariant for threads too).

    Triton frees a decoupled request's response factory once its FINAL response is sent; a later
    ``is_cancelled()`` then reads freed memory inside tritonserver (Triton 2.51 crashed with SIGSEGV
    in TRITONBACKEND_ResponseFactoryIsCancelled under 64 concurrent BLS streams). So every call
    on the sender goes through one lock, and after the FINAL send ``is_cancelled()`` answers False
    without asking Triton. Invariant: no call reaches the sender after the FINAL send began.
    """

    def __init__(self, sender: Any, final_flag: int):
        self._sender = sender
        self._final_flag = final_flag
        self._lock = threading.Lock()
        self.closed = False

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.closed and bool(self._sender.is_cancelled())

    def send(self, response: Any) -> None:
        """A non-final response; an error (the client is gone) is for the caller to handle."""
        with self._lock:
            if not self.closed:
                self._sender.send(response)

    def send_final(self, response: Any | None) -> None:
        """The FINAL response (or the FINAL flag alone), at most once; errors propagate."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if response is None:
                self._sender.send(flags=self._final_flag)
            else:
                self._sender.send(response, flags=self._final_flag)
