"""Triton `tensorrt_llm` inputs -> executor requests, with the reference's validation texts.

Inputs arrive as numpy arrays keyed by tensor name, each with Triton's leading batch dimension
B: `input_ids` (B, L); scalar inputs (B,) or (B, 1); word lists (B, 2, L). One Triton request
with B rows becomes B executor requests (row b keeps `batch_index` b).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from engine.executor.request import GUIDE_TYPES, guide_error
from engine.executor.top_log_probs import num_top_log_probs_error
from serving.mrope import mrope_fields
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
# KV-cache retention hints: they steer which cache blocks are evicted first, never the tokens a
# request produces, so they are accepted and ignored.
IGNORED_INPUTS = (
    "retention_token_range_starts", "retention_token_range_ends",
    "retention_token_range_priorities", "retention_token_range_durations_ms",
    "retention_decode_priority", "retention_decode_duration_ms",
)


# ----------------------------------------------------------------------------- unsupported features
#
# Inputs of features this backend does not implement are refused per request (a ValueError naming
# the input, what is not supported and what may be sent instead), so that nobody gets base-model
# text back for a request that asked for a feature it does not have, such as a prompt table. Only a real use is
# refused: an absent or empty (size 0) tensor is not "sent", and neither is a value that means
# "off". A plain request through the ensemble delivers preprocessing's decoder_input_ids ([[pad_id]]
# per item) and decoder_input_lengths ([[1]]); those pass. (Prompt-embedding tables are supported:
# see prompt_table below.) Rule per input (refused when):
#   decoder_input_ids: an item with 2+ tokens (counted by decoder_input_lengths when given, else the
#       row width); decoder_input_lengths: a value >= 2. A single token is the decoder start token,
#       i.e. no decoder prompt (preprocessing sends [[pad_id]] without decoder_text_input; an empty one
#       gives [BOS] or no token).
#   encoder_input_features, cross_attention_mask: any element. encoder_output_lengths: non-zero.
#       skip_cross_attn_blocks: a false value (true skips cross-attention, which a decoder-only
#       engine does not have anyway). (mrope_rotary_cos_sin / mrope_position_deltas: serving/mrope.py.)
#   runtime_top_p_decay: other than 1.0 (no decay, TRT-LLM's default). runtime_top_p_min: above the
#       item's top-p (runtime_top_p; 1.0 when unset or <= 0), since TRT-LLM's per-token update
#       top_p = max(top_p * decay, top_p_min) would raise it. runtime_top_p_reset_ids: an id >= 0
#       (-1 is none) in an item whose top-p moves (decay or min refused as above).
#   beam_search_diversity_rate: non-zero with beam_width > 1 (it has no effect without beams).
#   retention_*: never; see IGNORED_INPUTS.

def _present(array) -> bool:
    return array is not None and np.asarray(array).size > 0


def non_empty(name):
    """Used when present with any element: the input has no value that means "off"."""
    return lambda tensors, batch_size: _present(tensors.get(name))


def any_nonzero(name):
    """Used when some element is non-zero (0 means "none": no id, no size, no shift)."""
    def used(tensors, batch_size):
        array = tensors.get(name)
        return _present(array) and bool(np.any(np.asarray(array) != 0))
    return used


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def any_text(name):
    """STRING input: used when some element is a non-empty string ("" means "none")."""
    def used(tensors, batch_size):
        array = tensors.get(name)
        return _present(array) and any(_text(v) != "" for v in np.asarray(array, dtype=object).reshape(-1))
    return used


def any_false(name):
    """BOOL input whose true value means "off" (skip_cross_attn_blocks: true skips them)."""
    def used(tensors, batch_size):
        array = tensors.get(name)
        return _present(array) and not bool(np.all(np.asarray(array)))
    return used


def _decoder_ids_used(tensors, batch_size):
    """Some item has a decoder prompt of 2+ tokens (decoder_input_lengths trims padded rows)."""
    ids = tensors.get("decoder_input_ids")
    if not _present(ids):
        return False
    ids = np.asarray(ids)
    width = ids.shape[-1] if ids.ndim >= 2 else ids.size
    lengths = tensors.get("decoder_input_lengths")
    if _present(lengths):
        return bool(np.any(np.minimum(np.asarray(lengths).reshape(-1), width) >= 2))
    return width >= 2


def _decoder_lengths_used(tensors, batch_size):
    lengths = tensors.get("decoder_input_lengths")
    return _present(lengths) and bool(np.any(np.asarray(lengths) >= 2))


def _rows(tensors, name, batch_size):
    """Per-row values of a scalar input (None rows when absent); reference text on a bad size."""
    return [read_scalar(tensors, name, batch_size, row) for row in range(batch_size)]


def _initial_top_p(tensors, batch_size):
    # runtime_top_p <= 0 counts as unset (as in _sampling): no top-p filter, i.e. 1.0
    return [1.0 if p is None or p <= 0 else p for p in _rows(tensors, "runtime_top_p", batch_size)]


def _top_p_moves(tensors, batch_size):
    """Per item: would TRT-LLM's top-p update change top-p during generation?"""
    decay = _rows(tensors, "runtime_top_p_decay", batch_size)
    floor = _rows(tensors, "runtime_top_p_min", batch_size)
    initial = _initial_top_p(tensors, batch_size)
    return [(d is not None and d != 1.0) or (m is not None and m > p)
            for d, m, p in zip(decay, floor, initial)]


def _top_p_decay_used(tensors, batch_size):
    return any(d is not None and d != 1.0 for d in _rows(tensors, "runtime_top_p_decay", batch_size))


def _top_p_min_used(tensors, batch_size):
    floor = _rows(tensors, "runtime_top_p_min", batch_size)
    return any(m is not None and m > p for m, p in zip(floor, _initial_top_p(tensors, batch_size)))


def _top_p_reset_ids_used(tensors, batch_size):
    reset = _rows(tensors, "runtime_top_p_reset_ids", batch_size)
    return any(r is not None and r >= 0 and moves
               for r, moves in zip(reset, _top_p_moves(tensors, batch_size)))


def _diversity_used(tensors, batch_size):
    rate = _rows(tensors, "beam_search_diversity_rate", batch_size)
    width = _rows(tensors, "beam_width", batch_size)
    return any(r is not None and r != 0 and (w or 1) > 1 for r, w in zip(rate, width))


@dataclass(frozen=True)
class UnsupportedFeature:
    """A feature this backend does not have, the inputs that request it and the rule for each."""

    what: str  # "<what> not supported by this backend"
    allowed: str  # what the client may send instead
    inputs: Mapping[str, Any]  # input name -> used(tensors, batch_size) -> bool

    def check(self, tensors: Mapping[str, np.ndarray], batch_size: int) -> None:
        used = [name for name, rule in self.inputs.items()
                if name in tensors and rule(tensors, batch_size)]
        if used:
            raise ValueError(f"{', '.join(used)}: {self.what} not supported by this backend; "
                             f"{self.allowed}")


def without(*names: str) -> str:
    return "send the request without " + "/".join(names)


UNSUPPORTED_FEATURES = (
    UnsupportedFeature(
        "encoder-decoder models are",
        "the engine is decoder-only and the prompt goes in input_ids; send at most one decoder "
        "token per item (the start token preprocessing sends when there is no decoder_text_input) "
        "or leave decoder_input_ids/decoder_input_lengths out",
        {"decoder_input_ids": _decoder_ids_used, "decoder_input_lengths": _decoder_lengths_used}),
    UnsupportedFeature(
        "encoder and multimodal inputs (encoder features, cross-attention) are",
        without("encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                 "skip_cross_attn_blocks")
        + " (empty tensors, encoder_output_lengths 0 and skip_cross_attn_blocks true are accepted)",
        {"encoder_input_features": non_empty("encoder_input_features"),
         "encoder_output_lengths": any_nonzero("encoder_output_lengths"),
         "cross_attention_mask": non_empty("cross_attention_mask"),
         "skip_cross_attn_blocks": any_false("skip_cross_attn_blocks")}),
    UnsupportedFeature(
        "top-p decay is",
        "send runtime_top_p_decay 1.0, runtime_top_p_min no larger than runtime_top_p and "
        "runtime_top_p_reset_ids -1, or leave them out",
        {"runtime_top_p_decay": _top_p_decay_used, "runtime_top_p_min": _top_p_min_used,
         "runtime_top_p_reset_ids": _top_p_reset_ids_used}),
    UnsupportedFeature(
        "diverse beam search is",
        "send beam_search_diversity_rate 0 or leave it out (any value is accepted with beam_width 1)",
        {"beam_search_diversity_rate": _diversity_used}),
)
UNSUPPORTED_INPUTS = tuple(name for feature in UNSUPPORTED_FEATURES for name in feature.inputs)


# ----------------------------------------------------------------------------- encoder-decoder engines
#
# For a T5 / BART engine (gpt_model_path is its decoder/, encoder_model_path its encoder/: the
# anchor's kENCODER_DECODER model type; engine/encoder_decoder/), input_ids (trimmed by input_lengths)
# is the encoder's input and decoder_input_ids (trimmed by decoder_input_lengths) the decoder prompt.
# Preprocessing's default without decoder_text_input, one token equal to the item's pad_id, is no
# prompt: the engine then starts from the model's decoder_start_token_id, as transformers' generate
# does (T5's is its pad id; BART's is not). encoder_output_lengths, when sent, must equal the
# encoder's output length (a token input: its length). Whisper takes encoder_input_features instead
# of input_ids: (B, frames, num_mel_bins), an item's frames trimmed by input_lengths; its
# encoder_output_lengths is frames / 2 (either rounding). The engine checks the features' width.
ENCODER_DECODER_INPUTS = ("decoder_input_ids", "decoder_input_lengths", "encoder_output_lengths",
                          "encoder_input_features")
ENCODER_DECODER_FEATURES = tuple(
    replace(f, inputs={k: v for k, v in f.inputs.items() if k not in ENCODER_DECODER_INPUTS})
    for f in UNSUPPORTED_FEATURES if set(f.inputs) - set(ENCODER_DECODER_INPUTS))


def encoder_features(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> np.ndarray | None:
    """Item ``row``'s (frames, num_mel_bins) float32 features, or None when none were sent."""
    if not _present(tensors.get("encoder_input_features")):
        return None
    features = read_row(tensors, "encoder_input_features", batch_size, row)[0]
    if features.ndim != 2:
        raise ValueError(f"encoder_input_features has shape {tuple(tensors['encoder_input_features'].shape)}; send "
                         "[batch, frames, num_mel_bins]")
    length = read_scalar(tensors, "input_lengths", batch_size, row)
    if length is not None:
        if not 0 < int(length) <= features.shape[0]:
            raise ValueError(f"input_lengths is {int(length)} but the encoder_input_features item holds "
                             f"{features.shape[0]} frames; allowed: 1..{features.shape[0]}")
        features = features[:int(length)]
    return np.array(features, dtype=np.float32)  # a copy: Triton's buffers are read-only


# ----------------------------------------------------------------------------- Llama 3.2 Vision engines
#
# A decoder-only prompt (input_ids, <|image|> ids included) whose images come as the anchor's mllama
# tensors: encoder_input_features (B, vision states, hidden; trimmed by encoder_output_lengths),
# cross_attention_mask (B, positions, vision states) bool, skip_cross_attn_blocks (true: a text-only item;
# the features are then ignored). engine/encoder_decoder/mllama_stage.py checks the rest.
VISION_INPUTS = ("encoder_input_features", "encoder_output_lengths", "cross_attention_mask", "skip_cross_attn_blocks")
CROSS_ATTENTION_FEATURES = tuple(
    replace(f, inputs={k: v for k, v in f.inputs.items() if k not in VISION_INPUTS})
    for f in UNSUPPORTED_FEATURES if set(f.inputs) - set(VISION_INPUTS))


def vision_inputs(tensors: Mapping[str, np.ndarray], batch_size: int, row: int,
                  input_length: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """tensorrt_llm of a Llama 3.2 Vision engine: item ``row``'s (vision states (L, hidden) float32, mask
    (input_length, L) bool), or (None, None) for a text-only item (no features, or skip_cross_attn_blocks true)."""
    skip = _present(tensors.get("skip_cross_attn_blocks")) and read_scalar(tensors, "skip_cross_attn_blocks",
                                                                            batch_size, row)
    if skip or not _present(tensors.get("encoder_input_features")):
        return None, None
    features = np.asarray(read_row(tensors, "encoder_input_features", batch_size, row)[0], np.float32)
    if features.ndim != 2:
        raise ValueError(f"encoder_input_features has shape {tuple(tensors['encoder_input_features'].shape)}; send "
                         "[batch, vision states, hidden]")
    if _present(tensors.get("encoder_output_lengths")):
        length = int(read_scalar(tensors, "encoder_output_lengths", batch_size, row))
        if not 0 < length <= len(features):
            raise ValueError(f"encoder_output_lengths is {length} but the encoder_input_features item holds "
                             f"{len(features)} vision states; allowed: 1..{len(features)}")
        features = features[:length]
    if not _present(tensors.get("cross_attention_mask")):
        raise ValueError("cross_attention_mask is required with encoder_input_features for Llama 3.2 Vision: "
                         "[batch, positions, vision states] bool")
    mask = np.asarray(read_row(tensors, "cross_attention_mask", batch_size, row)[0]).astype(bool)
    if mask.ndim != 2 or mask.shape[0] < input_length or mask.shape[1] < len(features):
        raise ValueError(f"cross_attention_mask has shape {tuple(tensors['cross_attention_mask'].shape)}; send "
                         f"[batch, positions >= the prompt's {input_length}, vision states >= {len(features)}]")
    return np.array(features), np.array(mask[:input_length, :len(features)])


def decoder_prompt(tensors: Mapping[str, np.ndarray], batch_size: int, row: int, input_length: int,
                   pad_id: int | None, features: bool = False) -> list[int]:
    """Item ``row``'s decoder prompt ([] for none) of an encoder-decoder engine (rules above).
    ``input_length``: tokens, or feature frames when ``features``."""
    lengths = tensors.get("encoder_output_lengths")
    if _present(lengths):
        length = int(read_scalar(tensors, "encoder_output_lengths", batch_size, row))
        allowed = {input_length // 2, (input_length + 1) // 2} if features else {input_length}
        if length not in allowed:
            what = f"{input_length} frames (outputs: frames / 2)" if features else f"{input_length} tokens"
            raise ValueError(f"encoder_output_lengths is {length} but the encoder input holds {what}; send "
                             f"{min(allowed)} or leave it out")
    ids = read_row(tensors, "decoder_input_ids", batch_size, row) if _present(tensors.get("decoder_input_ids")) else None
    if ids is None:
        return []
    ids = ids.reshape(-1)
    if _present(tensors.get("decoder_input_lengths")):
        length = int(read_scalar(tensors, "decoder_input_lengths", batch_size, row))
        if not 0 <= length <= ids.size:
            raise ValueError(f"decoder_input_lengths is {length} but the decoder_input_ids row holds {ids.size} "
                             f"ids; allowed: 0..{ids.size}")
        ids = ids[:length]
    prompt = [int(t) for t in ids]
    return [] if pad_id is not None and prompt == [pad_id] else prompt


def refuse_unsupported(tensors: Mapping[str, np.ndarray], batch_size: int,
                       features=UNSUPPORTED_FEATURES) -> None:
    """Raise ValueError naming the inputs of the first feature the request really uses."""
    for feature in features:
        feature.check(tensors, batch_size)


# ----------------------------------------------------------------------------- guided decoding
#
# guided_decoding_guide_type and guided_decoding_guide (STRING, one per item) become the request's
# GuidedDecodingParams(guide_type, guide). An absent input, an empty tensor or an empty string is
# no guide. The executor compiles the guide and answers a schema, pattern or grammar it cannot
# compile with an error response naming guided_decoding_guide; here only the pair is checked, by
# the executor's own rule (engine.executor.request.guide_error), before the request goes anywhere.
GUIDE_TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"
GUIDED_INPUTS = (GUIDE_TYPE_INPUT, GUIDE_INPUT)


def read_text(tensors: Mapping[str, np.ndarray], name: str, batch_size: int, row: int) -> str | None:
    """Item `row` of a one-string-per-item STRING input: None when absent or empty."""
    array = read_row(tensors, name, batch_size, row)
    if array is None:
        return None
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size == 0:
        return None
    if values.size > 1:
        raise ValueError(f"{name} holds {values.size} strings for item {row}; send one string per item")
    value = values[0]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} of item {row} is not valid UTF-8 ({error})") from None
    return str(value) or None


def guided_decoding(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> tuple[str, str | None] | None:
    """(guide type, guide) of item `row`, or None for no guide; ValueError naming the input."""
    guide_type = read_text(tensors, GUIDE_TYPE_INPUT, batch_size, row)
    guide = read_text(tensors, GUIDE_INPUT, batch_size, row)
    if guide_type is None:
        if guide is not None:
            raise ValueError(f"{GUIDE_INPUT} was sent without {GUIDE_TYPE_INPUT}; send {GUIDE_TYPE_INPUT} "
                             f"(one of {', '.join(GUIDE_TYPES)}) with it, or leave both out")
        return None
    error = guide_error(guide_type, guide)
    if error is not None:
        raise ValueError(error)
    return guide_type, guide


# ----------------------------------------------------------------------------- LoRA adapters
#
# Two ways to name a request's adapter (engine.executor.request.LoraRequest):
# - the reference's lora_task_id (UINT64), with lora_weights (FP16 (rows, in*r + r*out)) and
#   lora_config (INT32 (rows, 3)) on the task's first request; later ones send the id alone;
# - beyond the reference, TensorRT-LLM's LLM-API inputs: lora_id (UINT64), lora_path (a PEFT
#   directory on the server's filesystem, read on first use) and lora_name (for metrics).
# An absent or empty tensor is not sent. The adapter itself is checked by the engine, which answers
# a bad one with a per-request error naming the tensor.
LORA_INPUTS = ("lora_task_id", "lora_weights", "lora_config", "lora_id", "lora_name", "lora_path")


def lora_adapter(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> dict[str, Any] | None:
    """Item `row`'s adapter as LoraRequest fields, or None for the base model; ValueError naming
    the input when the combination is wrong."""
    task_id = read_scalar(tensors, "lora_task_id", batch_size, row) if _present(tensors.get("lora_task_id")) else None
    lora_id = read_scalar(tensors, "lora_id", batch_size, row) if _present(tensors.get("lora_id")) else None
    weights = read_row(tensors, "lora_weights", batch_size, row) if _present(tensors.get("lora_weights")) else None
    config = read_row(tensors, "lora_config", batch_size, row) if _present(tensors.get("lora_config")) else None
    path = read_text(tensors, "lora_path", batch_size, row)
    name = read_text(tensors, "lora_name", batch_size, row)
    if task_id is not None and lora_id is not None and int(task_id) != int(lora_id):
        raise ValueError(f"lora_task_id ({int(task_id)}) and lora_id ({int(lora_id)}) differ; send one of them")
    key = task_id if task_id is not None else lora_id
    if key is None:
        sent = [n for n, v in (("lora_weights", weights), ("lora_config", config), ("lora_path", path),
                               ("lora_name", name)) if v is not None]
        if sent:
            raise ValueError(f"{sent[0]} was sent without lora_task_id (or lora_id); the adapter's id "
                             "names it in the cache and must come with it")
        return None
    if (weights is None) != (config is None):
        given, missing = ("lora_weights", "lora_config") if config is None else ("lora_config", "lora_weights")
        raise ValueError(f"{given} was sent without {missing}; a LoRA task's first request sends "
                         "lora_task_id, lora_weights and lora_config together")
    if weights is not None and path is not None:
        raise ValueError("lora_weights and lora_path were both sent; name the adapter one way "
                         "(TensorRT-LLM's rows or a PEFT directory)")
    key = int(key)
    if key < 0:
        raise ValueError(f"lora_task_id must be a non-negative integer, got {key}")
    return {"task_id": key, "weights": None if weights is None else weights[0],
            "config": None if config is None else config[0], "path": path, "name": name}


# ----------------------------------------------------------------------------- external draft tokens
#
# Speculative decoding with drafts from outside (TensorRT-LLM's ExternalDraftTokensConfig):
# draft_input_ids (INT32, (B, k)), draft_logits (logits dtype, (B, k, vocab)) and
# draft_acceptance_threshold (FP32, (B,)) of item b become the request's ExternalDraftTokens, only
# when one of them is sent (an absent or empty tensor is not). The target verifies the k drafts at
# the request's first generation step; greedy requests keep exactly their plain tokens. Here only
# the layout is checked; the executor checks the values (vocabulary, max_draft_len, the logits'
# shape, the threshold's range, beam search) and answers with an error naming the input.
DRAFT_INPUTS = ("draft_input_ids", "draft_logits", "draft_acceptance_threshold")


def external_draft(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> dict[str, Any] | None:
    """Item `row`'s ExternalDraftTokens fields, or None when no draft input was sent."""
    ids = read_row(tensors, "draft_input_ids", batch_size, row) if _present(tensors.get("draft_input_ids")) else None
    logits = read_row(tensors, "draft_logits", batch_size, row) if _present(tensors.get("draft_logits")) else None
    threshold = (read_scalar(tensors, "draft_acceptance_threshold", batch_size, row)
                 if _present(tensors.get("draft_acceptance_threshold")) else None)
    if ids is None and logits is None and threshold is None:
        return None
    if ids is not None and ids.ndim != 2:
        raise ValueError(f"draft_input_ids has shape {tuple(tensors['draft_input_ids'].shape)}; "
                         "send one row of draft token ids per item: [batch, num_draft_tokens]")
    if logits is not None:
        if ids is None:
            raise ValueError("draft_logits was sent without draft_input_ids; send the draft tokens the "
                             "logits belong to with them, or leave draft_logits out")
        if logits.ndim != 3:
            raise ValueError(f"draft_logits has shape {tuple(tensors['draft_logits'].shape)}; send one "
                             "(num_draft_tokens, vocab_size) matrix per item: [batch, num_draft_tokens, vocab_size]")
    return {"token_ids": [] if ids is None else [int(t) for t in ids[0]],
            "logits": None if logits is None else logits[0],
            "acceptance_threshold": None if threshold is None else float(threshold)}


# Lookahead decoding per request (TensorRT-LLM's LookaheadDecodingConfig on the request):
# lookahead_window_size, lookahead_ngram_size and lookahead_verification_set_size (INT32, (B, 1)) go
# together: all three or none. The executor allows them only with decoding_mode lookahead and each
# within the model's (engine/executor/speculative/lookahead.py lookahead_request_error).
LOOKAHEAD_INPUTS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")


def lookahead_sizes(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> tuple[int, int, int] | None:
    """Item `row`'s (window, ngram, verification set) sizes, or None when none was sent."""
    sent = {name: read_scalar(tensors, name, batch_size, row) for name in LOOKAHEAD_INPUTS if _present(tensors.get(name))}
    if not sent:
        return None
    if len(sent) < len(LOOKAHEAD_INPUTS):
        missing = [name for name in LOOKAHEAD_INPUTS if name not in sent]
        raise ValueError(f"{', '.join(missing)}: lookahead_window_size, lookahead_ngram_size and "
                         f"lookahead_verification_set_size go together; send all three or none")
    return tuple(int(sent[name]) for name in LOOKAHEAD_INPUTS)


# ----------------------------------------------------------------------------- prompt-embedding tables
#
# prompt_embedding_table (FP16 (B, rows, hidden), ragged: an item's rows) holds rows that stand in
# for the prompt ids >= vocab_size (id vocab_size + r takes row r: image features from
# multimodal_encoders, or a soft prompt); prompt_table_extra_ids (UINT64 (B, L), 0 at ordinary
# tokens) tell apart images whose fake ids are equal, for KV reuse; cut to the item's input length
# as the reference's model.py does. prompt_vocab_size is read by no backend (the reference's
# neither): accepted, ignored. An empty table is no table. The engine checks the rest (width, rows,
# fake ids) and answers with an error naming the input (engine/executor/prompt_table.py).
PROMPT_TABLE_INPUTS = ("prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size")


def prompt_table(tensors: Mapping[str, np.ndarray], batch_size: int, row: int,
                 input_length: int) -> dict[str, Any] | None:
    """Item `row`'s PromptTable fields, or None when it sent no table."""
    table = read_row(tensors, "prompt_embedding_table", batch_size, row) if _present(
        tensors.get("prompt_embedding_table")) else None
    extra = read_row(tensors, "prompt_table_extra_ids", batch_size, row) if _present(
        tensors.get("prompt_table_extra_ids")) else None
    if table is None:
        if extra is not None and np.any(extra != 0):
            raise ValueError("prompt_table_extra_ids was sent without prompt_embedding_table; an extra id "
                             "tells apart prompt-table rows, so send the table with it (or send extra ids 0)")
        return None
    embeddings = table[0]
    if embeddings.ndim != 2:
        raise ValueError(f"prompt_embedding_table has shape {tuple(tensors['prompt_embedding_table'].shape)}; "
                         "send one (rows, hidden_size) table per item: [batch, rows, hidden_size]")
    extra_ids = None
    if extra is not None and np.any(extra != 0):
        extra_ids = [int(v) for v in extra.reshape(-1)[:input_length]]
    return {"embeddings": embeddings, "extra_ids": extra_ids}


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
    guided_decoding: tuple[str, str | None] | None = None  # (guide type, guide)
    lora: dict[str, Any] | None = None  # LoraRequest fields (lora_adapter)
    external_draft: dict[str, Any] | None = None  # ExternalDraftTokens fields (external_draft)
    lookahead: tuple[int, int, int] | None = None  # (window, ngram, verification set) sizes (lookahead_sizes)
    prompt_table: dict[str, Any] | None = None  # PromptTable fields (prompt_table)
    mrope: dict[str, Any] | None = None  # Mrope fields (serving/mrope.py mrope_fields): Qwen2-VL
    encoder_input_ids: list[int] | None = None  # encoder-decoder engines: input_ids (decoder_prompt)
    encoder_input_features: np.ndarray | None = None  # Whisper: (frames, num_mel_bins) (encoder_features)
    cross_attention_mask: np.ndarray | None = None  # Llama 3.2 Vision: (positions, vision states) (vision_inputs)
    # Disaggregated serving (engine/executor/disaggregated.py): the Triton request parameter
    # request_type, and a generation_only item's context_phase_params (its context_only item's output).
    request_type: str = "context_and_generation"
    context_phase_params: bytes | None = None
    kv_transfer: str | None = None  # a context_only item's transport (kv_transfer_of); None: the engine's default

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


def batch_size_of(tensors: Mapping[str, np.ndarray], encoder_decoder: bool = False) -> int:
    if encoder_decoder and tensors.get("input_ids") is None and _present(tensors.get("encoder_input_features")):
        return tensors["encoder_input_features"].shape[0]  # Whisper: features, no input_ids
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
        if not 0 <= int(length) <= ids.size:
            raise ValueError(f"input_lengths is {int(length)} but the input_ids row holds {ids.size} ids; "
                             f"allowed: 1..{ids.size}")
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


# Beyond the reference: top log-probs per generated token (outputs top_log_prob_ids/top_log_probs).
NUM_TOP_LOG_PROBS_INPUT = "num_top_log_probs"


def _num_top_log_probs(tensors, batch_size: int, row: int) -> int:
    k = read_scalar(tensors, NUM_TOP_LOG_PROBS_INPUT, batch_size, row)
    if k is None:
        return 0
    error = num_top_log_probs_error(k)
    if error:
        raise ValueError(error)
    return k


def _output(tensors, batch_size: int, row: int, exclude_input_default: bool | None):
    output = {key: bool(read_scalar(tensors, name, batch_size, row) or False)
              for name, key in OUTPUT_INPUTS.items()}
    num_top = _num_top_log_probs(tensors, batch_size, row)
    if num_top:
        output["num_top_log_probs"] = num_top
    if read_scalar(tensors, "return_token_timestamps", batch_size, row):  # beyond the reference: Whisper engines
        output["return_token_timestamps"] = True
    exclude = read_scalar(tensors, "exclude_input_in_output", batch_size, row)
    if exclude is None:
        exclude = exclude_input_default
    output["exclude_input_from_output"] = bool(exclude or False)
    return output


def convert_row(tensors: Mapping[str, np.ndarray], row: int, batch_size: int, *,
                decoupled: bool, exclude_input_default: bool | None,
                max_input_len: int | None = None, encoder_decoder: bool = False,
                request_type: str = "context_and_generation", rotary_width: int = 0,
                cross_attention: bool = False, kv_transfer: str | None = None) -> RequestSpec:
    """Validate and convert batch row `row`; raises ValueError with the reference's text.
    ``encoder_decoder``: input_ids are the encoder's, the prompt is decoder_prompt's.
    ``rotary_width``: the engine's head_dim when it takes M-RoPE rows (mrope_rotary_cos_sin), else 0.
    ``request_type``, ``kv_transfer``: the Triton request's parameters of those names (request_type_of,
    kv_transfer_of).
    ``cross_attention``: a Llama 3.2 Vision engine (vision_inputs)."""
    max_tokens = read_scalar(tensors, "request_output_len", batch_size, row)
    if max_tokens is None:
        raise ValueError("A value is required for request_output_len")
    streaming = bool(read_scalar(tensors, "streaming", batch_size, row) or False)
    if streaming and not decoupled:
        raise ValueError(STREAMING_NEEDS_DECOUPLED)
    bias = read_row(tensors, "embedding_bias", batch_size, row)
    end_id = read_scalar(tensors, "end_id", batch_size, row)
    pad_id = read_scalar(tensors, "pad_id", batch_size, row)
    features = encoder_features(tensors, batch_size, row) if encoder_decoder else None
    input_token_ids = [] if features is not None else _input_token_ids(tensors, batch_size, row, max_input_len)
    encoder_input_ids = None
    if encoder_decoder:
        encoder_input_ids = None if features is not None else input_token_ids
        input_token_ids = decoder_prompt(tensors, batch_size, row,
                                         len(encoder_input_ids) if features is None else features.shape[0],
                                         None if pad_id is None else int(pad_id), features is not None)
    cross_mask = None
    if cross_attention:
        features, cross_mask = vision_inputs(tensors, batch_size, row, len(input_token_ids))
    return RequestSpec(
        batch_index=row,
        input_token_ids=input_token_ids,
        encoder_input_ids=encoder_input_ids,
        encoder_input_features=features,
        cross_attention_mask=cross_mask,
        max_tokens=int(max_tokens),
        streaming=streaming,
        end_id=None if end_id is None else int(end_id),
        pad_id=None if pad_id is None else int(pad_id),
        stop_words=decode_word_list(read_row(tensors, "stop_words_list", batch_size, row)),
        bad_words=decode_word_list(read_row(tensors, "bad_words_list", batch_size, row)),
        embedding_bias=bias.reshape(-1) if bias is not None and bias.size > 0 else None,
        sampling=_sampling(tensors, batch_size, row),
        output=_output(tensors, batch_size, row, exclude_input_default),
        guided_decoding=guided_decoding(tensors, batch_size, row),
        lora=lora_adapter(tensors, batch_size, row),
        external_draft=external_draft(tensors, batch_size, row),
        lookahead=lookahead_sizes(tensors, batch_size, row),
        prompt_table=prompt_table(tensors, batch_size, row, len(input_token_ids)),
        mrope=mrope_fields(tensors, batch_size, row, len(input_token_ids), rotary_width),
        request_type=request_type,
        context_phase_params=_context_phase_params(tensors, batch_size, row),
        kv_transfer=kv_transfer,
    )


REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")


def request_type_of(request_parameters: str) -> str:
    """The request_type parameter of a Triton request (its parameters as JSON text); a ValueError
    naming the allowed values for anything else."""
    try:
        value = json.loads(request_parameters or "{}").get("request_type", REQUEST_TYPES[0])
    except (ValueError, AttributeError):
        return REQUEST_TYPES[0]
    if value not in REQUEST_TYPES:
        raise ValueError(f"request_type: '{value}' is not supported; allowed: {', '.join(REQUEST_TYPES)}")
    return value


# How a context_only request's KV reaches its generation_only request (engine/executor/disaggregated.py
# TRANSPORTS): "local" within one engine process, "shm" through host shared memory to another process,
# "nixl" READ by the generation side's NIXL agent (another host; needs NIXL: nixl-cu12 or cu13), "cuda_ipc"
# GPU to GPU from another process of the host, "auto" cuda_ipc where the generation side can, else shm.
KV_TRANSFERS = ("local", "shm", "nixl", "cuda_ipc", "auto")


def kv_transfer_of(request_parameters: str) -> str | None:
    """The kv_transfer parameter of a Triton request (None when absent: the engine's default); a
    ValueError naming the allowed values for anything else. disaggregated_serving_bls sets it when its
    context and generation models differ (each has its own engine process)."""
    try:
        value = json.loads(request_parameters or "{}").get("kv_transfer")
    except (ValueError, AttributeError):
        return None
    if value is not None and value not in KV_TRANSFERS:
        raise ValueError(f"kv_transfer: '{value}' is not supported; allowed: {', '.join(KV_TRANSFERS)}")
    return value


def _context_phase_params(tensors: Mapping[str, np.ndarray], batch_size: int, row: int) -> bytes | None:
    """An item's context_phase_params (UINT8 [-1]) as bytes; None when not sent or empty."""
    if not _present(tensors.get("context_phase_params")):
        return None
    return np.ascontiguousarray(read_row(tensors, "context_phase_params", batch_size, row), dtype=np.uint8).tobytes()


def convert_request(tensors: Mapping[str, np.ndarray], *, decoupled: bool,
                    exclude_input_default: bool | None = None,
                    max_input_len: int | None = None, encoder_decoder: bool = False,
                    request_type: str = "context_and_generation", rotary_width: int = 0,
                    cross_attention: bool = False, kv_transfer: str | None = None) -> list[RequestSpec]:
    """All rows of one Triton request; raises ValueError on the first invalid input.

    `max_input_len` is the engine's prompt limit (an encoder-decoder's: its encoder input limit; the
    executor checks the other limits)."""
    batch_size = batch_size_of(tensors, encoder_decoder)
    refuse_unsupported(tensors, batch_size, ENCODER_DECODER_FEATURES if encoder_decoder else
                       CROSS_ATTENTION_FEATURES if cross_attention else UNSUPPORTED_FEATURES)
    return [convert_row(tensors, row, batch_size, decoupled=decoupled, exclude_input_default=exclude_input_default,
                        max_input_len=max_input_len, encoder_decoder=encoder_decoder, request_type=request_type,
                        rotary_width=rotary_width, cross_attention=cross_attention, kv_transfer=kv_transfer)
            for row in range(batch_size)]


def is_stop_request(tensors: Mapping[str, np.ndarray]) -> bool:
    stop = tensors.get("stop")
    return stop is not None and stop.size > 0 and bool(stop.reshape(-1)[0])


def to_executor_request(spec: RequestSpec):
    """Build the engine's `Request` (imported here so this module loads without the engine)."""
    from engine.executor.lookahead_sizes import LookaheadSizes
    from engine.executor.mrope_rotary import Mrope
    from engine.executor.prompt_table import PromptTable
    from engine.executor.request import (ExternalDraftTokens, GuidedDecodingParams, LoraRequest, OutputConfig, Request,
                                         SamplingConfig)

    return Request(
        input_token_ids=spec.input_token_ids, max_tokens=spec.max_tokens, end_id=spec.end_id,
        pad_id=spec.pad_id, streaming=spec.streaming, sampling=SamplingConfig(**spec.sampling),
        output=OutputConfig(**spec.output), stop_words=spec.stop_words, bad_words=spec.bad_words,
        embedding_bias=spec.embedding_bias,
        guided_decoding=None if spec.guided_decoding is None else GuidedDecodingParams(*spec.guided_decoding),
        lora=None if spec.lora is None else LoraRequest(**spec.lora),
        external_draft=None if spec.external_draft is None else _draft_tokens(ExternalDraftTokens, spec.external_draft),
        lookahead_config=None if spec.lookahead is None else LookaheadSizes(*spec.lookahead),
        prompt_table=None if spec.prompt_table is None else PromptTable(**spec.prompt_table),
        mrope=None if spec.mrope is None else Mrope(**spec.mrope),
        encoder_input_ids=spec.encoder_input_ids, encoder_input_features=spec.encoder_input_features,
        cross_attention_mask=spec.cross_attention_mask,
        request_type=spec.request_type, context_phase_params=spec.context_phase_params,
        kv_transfer=spec.kv_transfer,
    )


def _draft_tokens(cls, fields: dict[str, Any]):
    logits = fields["logits"]
    if logits is not None:  # the executor compares them with its float32 logits
        import torch

        logits = torch.tensor(np.asarray(logits), dtype=torch.float32)  # a copy: Triton's buffers are read-only
    return cls(token_ids=fields["token_ids"], logits=logits, acceptance_threshold=fields["acceptance_threshold"])
