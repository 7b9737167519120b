"""`whisper_bls` (all_models/whisper/whisper_bls): audio + text prefix -> tensorrt_llm's Whisper
inputs, and output ids -> transcript. Plain Python, importable without Triton.

Long-form audio (longer than the feature extractor's window, 30 s for real checkpoints) is cut as
transformers' sequential long-form generation cuts it: log-mels of the whole clip at once (no
padding, no truncation), then consecutive windows of ``nb_max_frames`` frames, the last one padded
with zero features to the window (unless zero_pad); each window is one tensorrt_llm request with the
same prompt (no conditioning on the previous window's text, transformers' default), and the texts are
joined by decoding all windows' ids together. Without timestamp tokens (the <|notimestamps|> prompt)
each window is one segment and the next window starts where it ended (transformers'
`_retrieve_segment` when no timestamp was predicted; openai-whisper's without_timestamps).

The anchor's tensors: TEXT_PREFIX (STRING [1]; empty: <|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>), WAV (FP32 [-1], 16 kHz samples), WAV_LENS (INT32 [1]: the samples of WAV that
are audio; the anchor's client pads WAV to 10-s blocks) -> TRANSCRIPTS (STRING [1]). tensorrt_llm is
called with encoder_input_features [1, frames, n_mels] (log-mels as the checkpoint's feature
extractor computes them: padded to its window, 3,000 frames for 30 s, unless zero_pad),
input_lengths [[frames]], encoder_output_lengths [[frames // 2]], decoder_input_ids [1, L] (the
tokenized prefix), request_output_len, end_id = pad_id = <|endoftext|> (the tokenizer's eos).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

DEFAULT_PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SAMPLE_RATE = 16000
SPECIAL_TOKEN = re.compile(r"<\|[^|>]*\|>")
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
                                f"{extractor.n_samples / SAMPLE_RATE:g}-s window; use windows()")
    padding = "longest" if zero_pad else "max_length"
    features = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np", padding=padding)["input_features"]
    return np.ascontiguousarray(features[0].T, dtype=np.float32)


@dataclass
class Window:
    """One tensorrt_llm request's audio: (frames, n_mels) float32 log-mels and the seconds of the
    clip it covers (``end`` stops at the audio's last frame, not at the padding)."""

    features: np.ndarray
    start: float
    end: float


def windows(extractor, samples: np.ndarray, zero_pad: bool,
            max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS) -> list[Window]:
    """The windows ``samples`` is decoded in: one (log_mel) when it fits the extractor's window,
    else transformers' long-form cut (module docstring). Audio over ``max_seconds`` is refused."""
    seconds = samples.size / SAMPLE_RATE
    if seconds > max_seconds:
        raise WhisperInputError(f"WAV holds {seconds:.2f} s of audio; this model takes at most {max_seconds:g} s "
                                "per request (whisper_bls parameter max_audio_seconds)")
    if samples.size <= extractor.n_samples:
        return [Window(log_mel(extractor, samples, zero_pad), 0.0, seconds)]
    whole = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np", padding="longest",
                      truncation=False)["input_features"][0]  # (n_mels, total frames)
    frames, hop = extractor.nb_max_frames, extractor.hop_length
    result = []
    for seek in range(0, whole.shape[1], frames):
        piece = whole[:, seek:seek + frames]
        end = (seek + piece.shape[1]) * hop / SAMPLE_RATE
        if piece.shape[1] < frames and not zero_pad:  # transformers pads the last window with 0 features
            piece = np.pad(piece, ((0, 0), (0, frames - piece.shape[1])))
        result.append(Window(np.ascontiguousarray(piece.T, dtype=np.float32), seek * hop / SAMPLE_RATE, end))
    return result


def prompt_ids(tokenizer, text_prefix: str | None) -> list[int]:
    """The decoder prompt: TEXT_PREFIX (default DEFAULT_PREFIX) tokenized without extra specials."""
    ids = tokenizer.encode(text_prefix or DEFAULT_PREFIX, add_special_tokens=False)
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
