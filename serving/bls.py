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

from serving.requests import (UnsupportedFeature, any_text, guided_decoding, lora_adapter, non_empty,
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
    "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id", "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids",
    # An encoder-decoder engine's decoder prompt, as the ensemble maps it: decoder_text_input tokenized
    # by preprocessing, or [[pad_id]] (no prompt: the decoder start token) without one. A decoder-only
    # tensorrt_llm takes the [[pad_id]] and refuses a real decoder prompt naming decoder_input_ids.
    "DECODER_INPUT_ID": "decoder_input_ids", "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths",
}
# BLS input -> preprocessing input
PREPROCESSING_INPUTS = {
    "text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
# Images (a BLS with multimodal_encoders_name): BLS input -> preprocessing input (image_input for
# its number of images: the prompt's image slots), and multimodal_encoders output -> tensorrt_llm input.
IMAGE_PREPROCESSING_INPUTS = {"image_input": "IMAGE", "image_bytes_input": "IMAGE_BYTES",
                              "image_url_input": "IMAGE_URL", "video_bytes_input": "VIDEO_BYTES",
                              "video_fps": "VIDEO_FPS", "video_num_frames": "VIDEO_NUM_FRAMES",
                              "image_sizes_input": "IMAGE_SIZES"}
IMAGE_PREPROCESSING_OUTPUTS = ["PIXEL_VALUES", "IMAGE_SIZES", "IMAGE_GRID_THW", "VISION_INPUT_ID", "IS_VIDEO_INPUT",
                               "VIDEO_SECOND_PER_GRID", "ASPECT_RATIO_IDS", "ASPECT_RATIO_MASK", "CROSS_ATTENTION_MASK"]
# (the MROPE pair only for Qwen2-VL encoders, the cross-attention four only for Llama 3.2 Vision's
# (serving/mllama.py; the anchor's BLS does not forward them); absent outputs are not forwarded)
LLM_INPUTS_FROM_ENCODERS = {"OUT_PROMPT_EMBEDDING_TABLE": "prompt_embedding_table",
                            "OUT_PROMPT_VOCAB_SIZE": "prompt_vocab_size",
                            "MROPE_ROTARY_COS_SIN": "mrope_rotary_cos_sin",
                            "MROPE_POSITION_DELTAS": "mrope_position_deltas",
                            "ENCODER_INPUT_FEATURES": "encoder_input_features",
                            "ENCODER_OUTPUT_LENGTHS": "encoder_output_lengths",
                            "CROSS_ATTENTION_MASK": "cross_attention_mask",
                            "SKIP_CROSS_ATTN_BLOCKS": "skip_cross_attn_blocks"}


def encoder_inputs(tensors: dict[str, np.ndarray], pre_out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """multimodal_encoders' inputs: preprocessing's PIXEL_VALUES (images it decoded), else the client's
    image_input, as the reference's BLS sends them; with preprocessing's IMAGE_SIZES (LLaVA-NeXT/OneVision),
    IS_VIDEO_INPUT (OneVision video), IMAGE_GRID_THW and VISION_INPUT_ID (Qwen2-VL; VIDEO_SECOND_PER_GRID for
    its video), ASPECT_RATIO_IDS/MASK and
    CROSS_ATTENTION_MASK (Llama 3.2 Vision)."""
    sizes = {encoder: pre_out[name] for name, encoder in (("IMAGE_SIZES", "image_sizes"), ("IMAGE_GRID_THW", "image_grid_thw"),
                                                           ("VISION_INPUT_ID", "vision_input_id"),
                                                           ("IS_VIDEO_INPUT", "is_video_input"),
                                                           ("VIDEO_SECOND_PER_GRID", "second_per_grid_ts"),
                                                           ("ASPECT_RATIO_IDS", "aspect_ratio_ids"),
                                                           ("ASPECT_RATIO_MASK", "aspect_ratio_mask"),
                                                           ("CROSS_ATTENTION_MASK", "cross_attention_mask"))
             if name in pre_out and pre_out[name].size}  # Qwen2-VL: its grids and raw ids
    if "PIXEL_VALUES" in pre_out and pre_out["PIXEL_VALUES"].size:
        return {"pixel_values": pre_out["PIXEL_VALUES"], **sizes}
    return {"IMAGE": tensors["image_input"].astype(np.float16), **sizes}


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
# values pass. (decoder_text_input goes through preprocessing to tensorrt_llm, which serves it on an
# encoder-decoder engine and refuses it on a decoder-only one.) Without multimodal_encoders_name (a text-only model): image_input, image_bytes_input,
# video_bytes_input: any element; image_url_input: a non-empty string. prompt_embedding_table,
# prompt_table_extra_id and prompt_vocab_size go to tensorrt_llm. guided_decoding_guide_type/
# guided_decoding_guide go to tensorrt_llm as they are (not ragged here, (B, 1) both), after the
# same check it makes. num_draft_tokens > 0 runs speculative decoding (speculative_generate).
IMAGE_INPUTS = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
TEXT_ONLY_MODEL = UnsupportedFeature(
    "images and video sent to a text-only model (this tensorrt_llm_bls has no multimodal_encoders_name) are",
    without(*IMAGE_INPUTS) + ", or serve a vision-language model's repository with multimodal_encoders "
    "(empty tensors and an empty image_url_input are accepted)",
    {"image_input": non_empty("image_input"), "image_bytes_input": non_empty("image_bytes_input"),
     "image_url_input": any_text("image_url_input"), "video_bytes_input": non_empty("video_bytes_input")})
UNSUPPORTED_FEATURES = (TEXT_ONLY_MODEL,)


def has_images(tensors: dict[str, np.ndarray]) -> bool:
    """The request carries an image or a video (empty tensors and an empty URL are none)."""
    return any(TEXT_ONLY_MODEL.inputs[name](tensors, 1) for name in IMAGE_INPUTS if name in tensors)


# The reference BLS's texts for speculative decoding requests it cannot serve.
NO_SPECULATIVE_STREAMING = "streaming is not supported with speculative decoding"
NO_SPECULATIVE_CONTEXT_LOGITS = "context logits are not supported with speculative decoding"
NO_DRAFT_MODEL = "cannot perform speculative decoding without draft model"


def num_draft_tokens(tensors: dict[str, np.ndarray]) -> int:
    """The request's num_draft_tokens (0, no speculative decoding, when absent or empty)."""
    value = tensors.get("num_draft_tokens")
    return 0 if value is None or value.size == 0 else max(int(np.asarray(value).reshape(-1)[0]), 0)


def _flag(tensors: dict[str, np.ndarray], name: str) -> bool:
    value = tensors.get(name)
    return value is not None and value.size > 0 and bool(np.any(value))


def validate(tensors: dict[str, np.ndarray], draft_model_name: str | None = None,
             multimodal_encoders_name: str | None = None) -> None:
    """The reference BLS checks, with its texts; then inputs of features this backend lacks, and
    the guided-decoding pair and the LoRA inputs (serving/requests.py guided_decoding, lora_adapter)."""
    text = tensors.get("text_input")
    if text is None or text.size == 0:
        raise ValueError("text_input is required")
    max_tokens = tensors.get("max_tokens")
    if max_tokens is None or max_tokens.size != text.shape[0] or np.any(max_tokens <= 0):
        raise ValueError("max_tokens must be a single value > 0")
    if num_draft_tokens(tensors) > 0:
        if _flag(tensors, "stream"):
            raise ValueError(NO_SPECULATIVE_STREAMING)
        if _flag(tensors, "return_context_logits"):
            raise ValueError(NO_SPECULATIVE_CONTEXT_LOGITS)
        if not draft_model_name:
            raise ValueError(NO_DRAFT_MODEL + " (set the tensorrt_llm_bls parameter tensorrt_llm_draft_model_name)")
        if text.shape[0] != 1:
            raise ValueError(f"speculative decoding (num_draft_tokens) serves one text_input per request, got a "
                             f"batch of {text.shape[0]}; send one request per prompt")
    features = UNSUPPORTED_FEATURES
    if multimodal_encoders_name:
        features = tuple(f for f in UNSUPPORTED_FEATURES if f is not TEXT_ONLY_MODEL)
        if has_images(tensors) and num_draft_tokens(tensors) > 0:
            raise ValueError("Multimodal and speculative decoding is not currently supported")
    refuse_unsupported(tensors, text.shape[0], features)
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


# ----------------------------------------------------------------------------- speculative decoding
#
# The reference BLS's draft-model loop (num_draft_tokens > 0, tensorrt_llm_draft_model_name): the
# draft tensorrt_llm model proposes k tokens after the ids so far, the target tensorrt_llm model is
# sent the same ids with those k as draft_input_ids (and the draft's generation logits as
# draft_logits with use_draft_logits) and max k + 1 new tokens; it keeps the drafts it accepts plus
# tokens of its own, and its output is the next round's ids. Both calls return the prompt with the
# output (exclude_input_in_output false), as e2e_grpc_speculative_decoding_client.py's do; the
# request's own exclusion is applied to the final ids.
#
# The loop ends when the ids reach prompt + max_tokens, when the target stopped by itself (fewer
# than k + 1 new tokens: end_id or a stop word; beyond the reference, which notices it one round
# later), when the target's output equals the draft's or did not grow (the reference's criteria),
# or when the ids end with a token-level stop word. Greedy requests get plain decoding's tokens
# whatever the draft proposes. Penalties (repetition, presence, frequency) see each round's ids as
# prompt, as in the reference; min_tokens is carried over the rounds (the reference resets it).

# Inputs the draft and target calls set themselves.
_ROUND_INPUTS = ("input_ids", "input_lengths", "request_output_len", "draft_input_ids", "draft_logits",
                 "streaming", "exclude_input_in_output", "return_generation_logits", "return_context_logits",
                 "return_perf_metrics", "num_return_sequences", "min_tokens")
_SUMMED_PERF = ("total_draft_tokens", "total_accepted_draft_tokens")


def _ids(response: dict[str, np.ndarray]) -> np.ndarray:
    """Beam 0 of item 0 of a tensorrt_llm response: its sequence_length ids."""
    length = int(response["sequence_length"].reshape(-1)[0])
    return np.asarray(response["output_ids"])[0, 0, :length].astype(np.int32)


def _ends_with_stop_word(ids: np.ndarray, stop_words_list: np.ndarray | None) -> bool:
    from serving.word_lists import decode_word_list

    words = decode_word_list(stop_words_list[:1]) if stop_words_list is not None and stop_words_list.size else None
    return any(word and len(ids) >= len(word) and ids[-len(word):].tolist() == list(word) for word in words or ())


def round_inputs(llm_inputs: dict[str, np.ndarray], ids: np.ndarray, max_new: int, *, min_tokens: int | None,
                 drafts: np.ndarray | None = None, draft_logits: np.ndarray | None = None,
                 generation_logits: bool = False, perf: bool = False) -> dict[str, np.ndarray]:
    """One draft or target call's tensorrt_llm inputs: the request's, with these ids and lengths."""
    inputs = {name: value for name, value in llm_inputs.items() if name not in _ROUND_INPUTS}
    inputs.update({
        "input_ids": ids.reshape(1, -1).astype(np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[max_new]], np.int32), "streaming": np.array([[False]]),
        "exclude_input_in_output": np.array([[False]]), "return_context_logits": np.array([[False]]),
        "return_generation_logits": np.array([[generation_logits]]), "return_perf_metrics": np.array([[perf]]),
    })
    if min_tokens:
        inputs["min_tokens"] = np.array([[min_tokens]], np.int32)
    if drafts is not None and len(drafts):
        inputs["draft_input_ids"] = drafts.reshape(1, -1).astype(np.int32)
        if draft_logits is not None:
            inputs["draft_logits"] = draft_logits[None]
    return inputs


async def speculative_generate(llm_inputs: dict[str, np.ndarray], *, max_tokens: int, num_draft_tokens: int,
                               use_draft_logits: bool, exclude_input: bool, want_perf: bool,
                               call_draft, call_target, cancelled=lambda: False) -> dict[str, np.ndarray]:
    """Run the draft/target loop for one prompt (llm_inputs: what tensorrt_llm would be sent for a
    plain request, batch 1); the final response, shaped like tensorrt_llm's non-streamed one.

    call_draft / call_target: async (inputs) -> tensorrt_llm response tensors. With want_perf the
    perf outputs are the last target call's, with the draft counts summed over all target calls
    and the arrival and first-token times of the first."""
    prompt = np.asarray(llm_inputs["input_ids"]).reshape(-1)
    if "input_lengths" in llm_inputs:
        prompt = prompt[: int(np.asarray(llm_inputs["input_lengths"]).reshape(-1)[0])]
    prompt = prompt.astype(np.int32)
    min_tokens = int(np.asarray(llm_inputs["min_tokens"]).reshape(-1)[0]) if "min_tokens" in llm_inputs else 0
    stop_words = llm_inputs.get("stop_words_list")
    end = len(prompt) + max_tokens
    ids, target, first_target, sums = prompt, None, None, dict.fromkeys(_SUMMED_PERF, 0)
    while True:
        k = min(num_draft_tokens, end - len(ids) - 1)
        generated = len(ids) - len(prompt)
        drafted, drafts, logits = None, None, None
        if k > 0:
            draft = await call_draft(round_inputs(llm_inputs, ids, k, min_tokens=max(min_tokens - generated, 0),
                                                  generation_logits=use_draft_logits))
            drafted = _ids(draft)
            drafts = drafted[len(ids):]
            if use_draft_logits and len(drafts) and draft.get("generation_logits") is not None:
                logits = np.asarray(draft["generation_logits"])[0, 0][-len(drafts):]
        max_new = (0 if drafts is None else len(drafts)) + 1
        target = await call_target(round_inputs(llm_inputs, ids, max_new, min_tokens=max(min_tokens - generated, 0),
                                                drafts=drafts, draft_logits=logits, perf=want_perf))
        first_target = first_target or target
        for name in _SUMMED_PERF:
            if name in target:
                sums[name] += int(np.asarray(target[name]).reshape(-1)[0])
        previous, ids = ids, _ids(target)
        if (len(ids) >= end or len(ids) - len(previous) < max_new
                or (drafted is not None and np.array_equal(drafted, ids)) or np.array_equal(previous, ids)
                or _ends_with_stop_word(ids, stop_words) or cancelled()):
            break
    out = {name: value for name, value in target.items() if name not in ("output_ids", "sequence_length")}
    final = ids[len(prompt):] if exclude_input else ids
    out["output_ids"] = final.reshape(1, 1, -1)
    out["sequence_length"] = np.array([[len(final)]], np.int32)
    if want_perf and "total_draft_tokens" in target:
        for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns"):
            if name in first_target:
                out[name] = first_target[name]
        out["total_draft_tokens"] = np.array([[sums["total_draft_tokens"]]], np.int32)
        out["total_accepted_draft_tokens"] = np.array([[sums["total_accepted_draft_tokens"]]], np.int32)
        rate = sums["total_accepted_draft_tokens"] / sums["total_draft_tokens"] if sums["total_draft_tokens"] else 0.0
        out["acceptance_rate"] = np.array([[rate]], np.float32)
    for name in ("generation_logits", "context_logits", "cum_log_probs", "output_log_probs"):
        out.pop(name, None)  # they would cover only the last round's tokens
    return out
