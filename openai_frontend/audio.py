"""OpenAI /v1/audio/transcriptions and /v1/audio/translations, through the `whisper_bls` model.

A multipart form (OpenAI's fields): ``file`` (required; any format libsndfile decodes: wav, flac,
mp3, ogg; any rate: other rates are resampled to 16 kHz by linear interpolation and the response
says so in the ``x-tritonllm-resampled`` header and, for json bodies, a ``warnings`` list),
``model`` (the served name), ``language`` (ISO 639-1; omitted: detected on the first 30 s by a
multilingual checkpoint, as transformers' generate does, and reported in verbose_json; an
English-only one transcribes English), ``prompt`` (previous text: <|startofprev|> + its tokens before
the prefix, whisper_bls's PROMPT), ``response_format`` (json, text, verbose_json, srt, vtt), ``temperature`` (0 only: whisper_bls decodes greedily),
``timestamp_granularities[]`` (segment; word with verbose_json: ``words`` from the engine's token
timestamps, serving/whisper_words.py), ``stream``. The text is whisper_bls's TRANSCRIPTS for
TEXT_PREFIX <|startoftranscript|><|lang|><|transcribe or translate|>, with <|notimestamps|> for json
and text; verbose_json, srt and vtt decode timestamp tokens, and their segments are the ones the
model's timestamps close (serving/whisper_long_form.py: audio longer than the model's window is
decoded window after window, each window starting at the last closed timestamp).

``stream`` true (json or text only): server-sent events as OpenAI's API sends them,
``transcript.text.delta`` events (``delta``: the new text) and one ``transcript.text.done`` (``text``:
all of it), then ``data: [DONE]``. A decoupled whisper_bls streams as it decodes; a non-decoupled
one answers once, so its deltas come together at the end (one per window).

Refused by name (400): a file that does not decode, empty audio, audio longer than whisper_bls's
max_audio_seconds (whisper_bls says), a prompt with special tokens or too long to leave room (whisper_bls
says), word timestamps with another format than verbose_json, ``stream`` with verbose_json/srt/vtt, a
temperature other than 0.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web

from openai_frontend.errors import bad_request

SAMPLE_RATE = 16000
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAM_FORMATS = ("json", "text")


def _bad(message: str, field: str):
    return bad_request(field, message)


@dataclass
class Segment:
    start: float  # seconds
    end: float
    text: str


@dataclass
class AudioRequest:
    samples: np.ndarray  # float32, 16 kHz, mono
    model: str | None
    language: str | None  # None: detected (whisper_bls's LANGUAGE)
    response_format: str
    resampled_from: int | None  # the file's rate when it was not 16 kHz
    stream: bool = False
    prompt: str = ""  # previous text (whisper_bls's PROMPT)
    words: bool = False  # timestamp_granularities word (whisper_bls's WORD_TIMESTAMPS)

    @property
    def seconds(self) -> float:
        return self.samples.size / SAMPLE_RATE

    @property
    def warnings(self) -> list[str]:
        return [f"the audio was resampled from {self.resampled_from} Hz to {SAMPLE_RATE} Hz (linear "
                "interpolation)"] if self.resampled_from else []


@dataclass
class Transcript:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str = ""  # the code whisper_bls decoded with ("en", "de" ...)
    words: list[Segment] = field(default_factory=list)  # with word timestamps: each word, start, end


async def read_audio_request(request: web.Request) -> AudioRequest:
    """The form's fields, checked; APIError 400 naming the field."""
    if not request.content_type.startswith("multipart/"):
        raise _bad("send the audio as multipart/form-data with a file field", "file")
    form = await request.post()
    upload = form.get("file")
    if upload is None or not hasattr(upload, "file"):
        raise _bad("file is required: the audio as a multipart file field", "file")
    samples, rate = decode_audio(upload.file.read())
    fmt = str(form.get("response_format") or "json")
    if fmt not in RESPONSE_FORMATS:
        raise _bad(f"response_format {fmt!r} is not supported; allowed: {', '.join(RESPONSE_FORMATS)}",
                   "response_format")
    stream = str(form.get("stream") or "false").lower() not in ("false", "0")
    if stream and fmt not in STREAM_FORMATS:
        raise _bad(f"stream is supported with response_format {' or '.join(STREAM_FORMATS)}, not {fmt}", "stream")
    granularities = set(form.getall("timestamp_granularities[]", [])) | set(form.getall("timestamp_granularities", []))
    if granularities - {"segment", "word"}:
        raise _bad(f"timestamp_granularities {sorted(granularities)}: allowed: segment, word", "timestamp_granularities")
    if "word" in granularities and fmt != "verbose_json":
        raise _bad(f"timestamp_granularities word needs response_format verbose_json, not {fmt}",
                   "timestamp_granularities")
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise _bad("temperature must be a number", "temperature") from None
    if temperature != 0:
        raise _bad(f"temperature {temperature}: transcription is greedy here; send 0", "temperature")
    language = str(form.get("language") or "") or None
    if language is not None and (not language.isalpha() or len(language) > 3):
        raise _bad(f"language {language!r} is not an ISO 639-1 code such as en or de", "language")
    return AudioRequest(resample(samples, rate), form.get("model"), language and language.lower(), fmt,
                        None if rate == SAMPLE_RATE else rate, stream, str(form.get("prompt") or ""),
                        "word" in granularities)


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples, rate) of an audio file libsndfile decodes (wav, flac, mp3, ogg...);
    400 naming ``file`` otherwise."""
    import soundfile  # libsndfile >= 1.1 in its wheel: mp3 too (pinned in scripts/setup_env.sh)

    if not data:
        raise _bad("file is empty; send wav, flac, mp3 or ogg audio", "file")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as error:  # libsndfile's own error (soundfile.LibsndfileError) or a bad header
        raise _bad(f"file could not be decoded as audio ({error}); send wav, flac, mp3 or ogg", "file") from None
    if samples.size == 0:
        raise _bad("file holds no audio samples", "file")
    return np.ascontiguousarray(samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]), int(rate)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """``samples`` at 16 kHz (linear interpolation; unchanged when already 16 kHz)."""
    if rate == SAMPLE_RATE:
        return samples
    count = max(1, round(samples.size * SAMPLE_RATE / rate))
    return np.interp(np.arange(count) * (rate / SAMPLE_RATE), np.arange(samples.size), samples).astype(np.float32)


TIMESTAMPED_FORMATS = ("verbose_json", "srt", "vtt")  # their segments come from predicted timestamps


def text_prefix(language: str | None, task: str, timestamps: bool = False) -> str:
    """whisper_bls's TEXT_PREFIX; without <|notimestamps|> Whisper predicts timestamp tokens, whose
    pairs close the segments (serving/whisper_long_form.py); without a language whisper_bls detects it."""
    return ("<|startoftranscript|>" + (f"<|{language}|>" if language else "") + f"<|{task}|>"
            + ("" if timestamps else "<|notimestamps|>"))


def language_name(code: str) -> str:
    """verbose_json's language as OpenAI's API writes it ("english" for en); the code when unknown."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def _clock(seconds: float, separator: str) -> str:
    millis = int(round(seconds * 1000))
    return f"{millis // 3600000:02d}:{millis // 60000 % 60:02d}:{millis // 1000 % 60:02d}{separator}{millis % 1000:03d}"


def _headers(audio: AudioRequest) -> dict | None:
    return {"x-tritonllm-resampled": f"{audio.resampled_from}->{SAMPLE_RATE}"} if audio.resampled_from else None


def render(result: Transcript, audio: AudioRequest, task: str) -> web.Response:
    """The response in ``audio.response_format``; one segment per decoded window."""
    headers, fmt, text = _headers(audio), audio.response_format, result.text
    segments = result.segments if result.segments or not text else [Segment(0.0, audio.seconds, text)]
    warnings = {"warnings": audio.warnings} if audio.warnings else {}
    if fmt == "json":
        return web.json_response({"text": text, **warnings}, headers=headers)
    if fmt == "verbose_json":
        rows = [{"id": i, "seek": int(round(s.start * 100)), "start": s.start, "end": s.end, "text": s.text,
                 "temperature": 0.0} for i, s in enumerate(segments)]
        language = language_name(result.language or audio.language or "")
        words = {"words": [{"word": w.text, "start": w.start, "end": w.end} for w in result.words]} if audio.words else {}
        return web.json_response({"task": task, "language": language, "duration": audio.seconds, "text": text,
                                  "segments": rows, **words, **warnings}, headers=headers)
    if fmt == "srt":
        body = "\n".join(f"{i + 1}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n"
                         for i, s in enumerate(segments))
    elif fmt == "vtt":
        body = "WEBVTT\n\n" + "\n".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n"
                                        for s in segments)
    else:
        body = text
    return web.Response(text=body, headers=headers)


def stream_headers(audio: AudioRequest) -> dict:
    return _headers(audio) or {}


def delta_event(delta: str) -> dict:
    return {"type": "transcript.text.delta", "delta": delta}


def done_event(text: str) -> dict:
    return {"type": "transcript.text.done", "text": text}


def text_delta(before: str, now: str) -> str:
    """The new text of a stream whose responses carry the whole text so far (whisper_bls's):
    ``now`` past ``before``; when detokenization rewrote the tail, the text from where they part."""
    common = 0
    for a, b in zip(before, now):
        if a != b:
            break
        common += 1
    return now[common:]
