"""`whisper_bls` (all_models/whisper/whisper_bls): audio + text prefix -> tensorrt_llm's Whisper
inputs, and output ids -> transcript. Plain Python, importable without Triton.

Audio is decoded window after window as transformers' sequential long-form generation does it
(serving/whisper_long_form.py); the transcript decodes all segments' ids together.

The anchor's tensors: TEXT_PREFIX (STRING [1]; empty: <|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>), WAV (FP32 [-1], 16 kHz samples), WAV_LENS (INT32 [1]: the samples of WAV that
are audio; the anchor's client pads WAV to 10-s blocks) -> TRANSCRIPTS (STRING [1]). tensorrt_llm is
called with encoder_input_features [1, frames, n_mels] (log-mels as the checkpoint's feature
extractor computes them: padded to its window, 3,000 frames for 30 s, unless zero_pad),
input_lengths [[frames]], encoder_output_lengths [[frames // 2]], decoder_input_ids [1, L] (the
tokenized prefix), request_output_len, end_id = pad_id = <|endoftext|> (the tokenizer's eos).
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

DEFAULT_PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SAMPLE_RATE = 16000
SPECIAL_TOKEN = re.compile(r"<\|[^|>]*\|>")
LANGUAGE_TOKEN = re.compile(r"<\|[a-z]{2,3}\|>")  # <|en|>, <|de|>, <|haw|> ...
DEFAULT_MAX_AUDIO_SECONDS = 1800.0  # whisper_bls's max_audio_seconds when the parameter is unset


class WhisperInputError(ValueError):
    """A request whose audio or prefix cannot be used; the message names the tensor."""


def audio_samples(wav: np.ndarray, wav_len) -> np.ndarray:
    """The request's audio: WAV's first WAV_LENS samples, float32."""
    samples = np.asarray(wav, dtype=np.float32).reshape(-1)
    if wav_len is not None:
        length = int(np.asarray(wav_len).reshape(-1)[0])
        if not 0 < length <= samples.size:
            raise WhisperInputError(f"WAV_LENS is {length} but WAV holds {samples.size} samples; allowed: "
                                    f"1..{samples.size}")
        samples = samples[:length]
    if samples.size == 0:
        raise WhisperInputError("WAV is empty; send at least one sample of 16 kHz audio")
    if not np.all(np.isfinite(samples)):
        raise WhisperInputError("WAV holds NaN or infinite samples")
    return samples


def log_mel(extractor, samples: np.ndarray, zero_pad: bool) -> np.ndarray:
    """(frames, n_mels) float32 log-mels of at most one window of ``samples`` by the checkpoint's
    feature extractor: padded to its window, or, with ``zero_pad``, just the audio's frames."""
    if samples.size > extractor.n_samples:
        raise WhisperInputError(f"WAV holds {samples.size / SAMPLE_RATE:.2f} s of audio, more than one "
                                f"{extractor.n_samples / SAMPLE_RATE:g}-s window (serving/whisper_long_form.py)")
    padding = "longest" if zero_pad else "max_length"
    features = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np", padding=padding)["input_features"]
    return np.ascontiguousarray(features[0].T, dtype=np.float32)


def check_length(samples: np.ndarray, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS) -> None:
    """Audio over ``max_seconds`` is refused naming WAV (its windows are decoded one after another)."""
    seconds = samples.size / SAMPLE_RATE
    if seconds > max_seconds:
        raise WhisperInputError(f"WAV holds {seconds:.2f} s of audio; this model takes at most {max_seconds:g} s "
                                "per request (whisper_bls parameter max_audio_seconds)")


def timestamp_begin(tokenizer, prompt: list[int]) -> int | None:
    """The first timestamp id when ``prompt`` asks for timestamps (it holds no <|notimestamps|>);
    None otherwise (the tokenizer knows no <|notimestamps|>: a prompt without it is plain)."""
    no_timestamps = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    if not isinstance(no_timestamps, int) or no_timestamps == tokenizer.unk_token_id or no_timestamps in prompt:
        return None
    return no_timestamps + 1


def is_multilingual(engine_dir: str) -> bool:
    """False for an English-only checkpoint (tiny.en ... medium.en, distil .en): its generation
    config (copied into the engine's decoder/ by engine.build) says so; True when it says nothing."""
    try:
        with open(os.path.join(engine_dir, "generation_config.json")) as f:
            return bool(json.load(f).get("is_multilingual", True))
    except (OSError, ValueError):
        return True


def english_only_prefix(text_prefix: str) -> str:
    """An English-only model's prompt has no language or task token (<|startoftranscript|>
    <|notimestamps|>, as openai-whisper and transformers give it): <|en|> and <|transcribe|> are
    dropped, another language or <|translate|> refused naming TEXT_PREFIX."""
    asked = [token for token in SPECIAL_TOKEN.findall(text_prefix)
             if token == "<|translate|>" or (LANGUAGE_TOKEN.fullmatch(token) and token != "<|en|>")]
    if asked:
        raise WhisperInputError(f"TEXT_PREFIX asks for {', '.join(asked)} but this Whisper checkpoint is English-only; "
                                "allowed: English transcription (<|startoftranscript|><|notimestamps|>, or with "
                                "<|en|><|transcribe|>)")
    return text_prefix.replace("<|en|>", "").replace("<|transcribe|>", "")


def prompt_ids(tokenizer, text_prefix: str | None, english_only: bool = False) -> list[int]:
    """The decoder prompt: TEXT_PREFIX (default DEFAULT_PREFIX) tokenized without extra specials;
    for an English-only checkpoint without language and task tokens (english_only_prefix)."""
    text_prefix = text_prefix or DEFAULT_PREFIX
    if english_only:
        text_prefix = english_only_prefix(text_prefix)
    ids = tokenizer.encode(text_prefix, add_special_tokens=False)
    if not ids:
        raise WhisperInputError(f"TEXT_PREFIX {text_prefix!r} tokenizes to nothing")
    return ids


def tensorrt_llm_inputs(features: np.ndarray, prompt: list[int], *, max_tokens: int, end_id: int,
                        streaming: bool, dtype=np.float16) -> dict[str, np.ndarray]:
    """The tensorrt_llm request (each with its batch dim of 1)."""
    frames = features.shape[0]
    return {"encoder_input_features": features[None].astype(dtype), "input_lengths": np.array([[frames]], np.int32),
            "encoder_output_lengths": np.array([[frames // 2]], np.int32),
            "decoder_input_ids": np.array([prompt], np.int32),
            "decoder_input_lengths": np.array([[len(prompt)]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32), "end_id": np.array([[end_id]], np.int32),
            "pad_id": np.array([[end_id]], np.int32), "streaming": np.array([[streaming]], bool)}


def transcript(tokenizer, ids) -> str:
    """Generated ids -> text without Whisper's <|...|> tokens."""
    text = tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
    return SPECIAL_TOKEN.sub("", text).strip()


# ---- OpenAI's `prompt` (previous text) and language detection -----------------------------------

START_OF_PREV = "<|startofprev|>"


def decoder_limits(engine_dir: str) -> tuple[int, int, int]:
    """(vocab size, max_target_positions, max_seq_len) of the Whisper engine whose decoder/ is
    ``engine_dir`` (its config.json, written by engine.build)."""
    with open(os.path.join(engine_dir, "config.json")) as f:
        config = json.load(f)
    return (int(config["model"]["vocab_size"]), int(config["model"]["max_position_embeddings"]),
            int(config["build"]["max_seq_len"]))


def previous_text_ids(tokenizer, text: str, max_positions: int) -> list[int]:
    """OpenAI's ``prompt``: <|startofprev|> then " " + the stripped text, tokenized without extra
    specials (transformers' WhisperTokenizer.get_prompt_ids), the text cut to its last
    ``max_positions // 2 - 1`` tokens (the previous-text length transformers' generate and
    openai-whisper keep). The ids go before <|startoftranscript|>; text holding a special or
    timestamp token is refused, as get_prompt_ids refuses it."""
    start = tokenizer.convert_tokens_to_ids(START_OF_PREV)
    if not isinstance(start, int) or start == tokenizer.unk_token_id:
        raise WhisperInputError(f"PROMPT: this checkpoint's tokenizer has no {START_OF_PREV}; send no prompt")
    ids = tokenizer(START_OF_PREV, " " + text.strip(), add_special_tokens=False)["input_ids"][1:]
    special = [t for t in tokenizer.convert_ids_to_tokens(ids) if SPECIAL_TOKEN.fullmatch(t or "")]
    if special:
        raise WhisperInputError(f"PROMPT holds the special token {special[0]}; send plain text")
    return [start] + ids[-(max_positions // 2 - 1):]


def language_ids(engine_dir: str) -> dict[str, int]:
    """{"<|en|>": id, ...}: the languages a multilingual checkpoint detects among (its generation
    config's lang_to_id, copied into the engine's decoder/); {} when it names none."""
    try:
        with open(os.path.join(engine_dir, "generation_config.json")) as f:
            return {k: int(v) for k, v in (json.load(f).get("lang_to_id") or {}).items()}
    except (OSError, ValueError):
        return {}


def language_position(tokenizer, prompt: list[int], languages: dict[str, int]) -> int | None:
    """Where the language token goes in ``prompt`` when it has none: right after
    <|startoftranscript|> (as transformers' generate puts the detected one); None when the prompt
    names a language or has no <|startoftranscript|>."""
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    if start not in prompt:
        return None
    after = prompt.index(start) + 1
    return None if after < len(prompt) and prompt[after] in languages.values() else after


def check_language_known(tokenizer, prompt: list[int], languages: dict[str, int]) -> None:
    """A multilingual checkpoint whose generation config names no languages (no lang_to_id) cannot
    detect one: a prompt with <|startoftranscript|> but no <|xx|> token after it is refused naming
    TEXT_PREFIX (transformers' generate would decode it without a language token)."""
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    if languages or start not in prompt:
        return
    after = prompt.index(start) + 1
    token = tokenizer.convert_ids_to_tokens(prompt[after]) if after < len(prompt) else ""
    if not LANGUAGE_TOKEN.fullmatch(token or ""):
        raise WhisperInputError("TEXT_PREFIX names no language and this checkpoint's generation config has no "
                                "lang_to_id to detect one from; put the language after <|startoftranscript|> "
                                "(e.g. <|en|>)")


def detection_inputs(features: np.ndarray, start_id: int, end_id: int, vocab_size: int,
                     languages: dict[str, int], dtype=np.float16) -> dict[str, np.ndarray]:
    """The tensorrt_llm request that detects the language of a window, as transformers'
    detect_language does: one step after [<|startoftranscript|>], every non-language logit at -inf
    (embedding_bias), the argmax. (The engine applies no timestamp rules to a prompt that ends on
    <|startoftranscript|>: engine/encoder_decoder/whisper_timestamps.py.)"""
    bias = np.full((1, vocab_size), -np.inf, np.float32)
    bias[0, list(languages.values())] = 0.0
    inputs = tensorrt_llm_inputs(features, [start_id], max_tokens=1, end_id=end_id, streaming=False, dtype=dtype)
    return {**inputs, "embedding_bias": bias}


def language_code(tokenizer, prompt: list[int], languages: dict[str, int]) -> str:
    """The language the prompt names ("en", "de" ...), or "" when it names none."""
    names = {v: k for k, v in languages.items()}
    for token in prompt:
        if token in names:
            return names[token].strip("<|>")
    return ""


def fit_max_tokens(prompt: list[int], max_tokens: int, max_positions: int, max_seq_len: int) -> int:
    """Tokens a window may generate after ``prompt``: ``max_tokens``, fewer when the prompt and
    they would pass the decoder's positions or the engine's max_seq_len; a prompt that leaves no
    room is refused naming PROMPT."""
    room = min(max_positions, max_seq_len) - len(prompt)
    if room < 1:
        raise WhisperInputError(f"PROMPT: the decoder prompt is {len(prompt)} tokens, which leaves no room to "
                                f"generate in this engine's {min(max_positions, max_seq_len)} positions; send a "
                                "shorter prompt")
    return min(max_tokens, room)
