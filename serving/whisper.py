"""`whisper_bls` (all_models/whisper/whisper_bls): audio + text prefix -> tensorrt_llm's Whisper
inputs, and output ids -> transcript. Plain Python, importable without Triton.

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

import numpy as np

DEFAULT_PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SAMPLE_RATE = 16000
SPECIAL_TOKEN = re.compile(r"<\|[^|>]*\|>")


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
    """(frames, n_mels) float32 log-mels of ``samples`` by the checkpoint's feature extractor:
    padded (or cut) to its window, or, with ``zero_pad``, just the audio's frames."""
    window = extractor.n_samples
    if samples.size > window:
        raise WhisperInputError(f"WAV holds {samples.size / SAMPLE_RATE:.2f} s of audio; the model takes at most "
                                f"{window / SAMPLE_RATE:.0f} s per request (long-form chunking is not built)")
    padding = "longest" if zero_pad else "max_length"
    features = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np", padding=padding)["input_features"]
    return np.ascontiguousarray(features[0].T, dtype=np.float32)


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
