"""OpenAI /v1/audio/transcriptions and /v1/audio/translations, through the `whisper_bls` model.

A multipart form (OpenAI's fields): ``file`` (required; WAV, 16- or 32-bit PCM, or 32-bit float,
any rate: other rates are resampled to 16 kHz by linear interpolation and the response says so in
the ``x-tritonllm-resampled`` header), ``model`` (the served name), ``language`` (ISO 639-1, default
en), ``prompt``, ``response_format`` (json, text, verbose_json, srt, vtt), ``temperature`` (0 only:
whisper_bls decodes greedily), ``timestamp_granularities[]``, ``stream``. The text is whisper_bls's
TRANSCRIPTS for TEXT_PREFIX <|startoftranscript|><|lang|><|transcribe or translate|><|notimestamps|>.

Refused by name (400): a file that is not such a WAV (flac, mp3: no decoder is installed), empty
audio, audio longer than the model's window (whisper_bls says), ``prompt``, ``stream`` true, word or
segment timestamps beyond the one segment of the whole clip, a temperature other than 0.
"""
from __future__ import annotations

import io
import wave
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from openai_frontend.errors import bad_request

SAMPLE_RATE = 16000
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def _bad(message: str, field: str):
    return bad_request(field, message)


@dataclass
class AudioRequest:
    samples: np.ndarray  # float32, 16 kHz, mono
    model: str | None
    language: str
    response_format: str
    resampled_from: int | None  # the file's rate when it was not 16 kHz

    @property
    def seconds(self) -> float:
        return self.samples.size / SAMPLE_RATE


async def read_audio_request(request: web.Request) -> AudioRequest:
    """The form's fields, checked; APIError 400 naming the field."""
    if not request.content_type.startswith("multipart/"):
        raise _bad("send the audio as multipart/form-data with a file field", "file")
    form = await request.post()
    upload = form.get("file")
    if upload is None or not hasattr(upload, "file"):
        raise _bad("file is required: the audio as a multipart file field", "file")
    samples, rate = decode_wav(upload.file.read())
    fmt = str(form.get("response_format") or "json")
    if fmt not in RESPONSE_FORMATS:
        raise _bad(f"response_format {fmt!r} is not supported; allowed: {', '.join(RESPONSE_FORMATS)}",
                          "response_format")
    if form.get("prompt"):
        raise _bad("prompt is not supported yet; send the request without it", "prompt")
    if str(form.get("stream") or "false").lower() not in ("false", "0"):
        raise _bad("stream is not supported for audio yet; send stream false", "stream")
    granularities = set(form.getall("timestamp_granularities[]", [])) | set(form.getall("timestamp_granularities", []))
    if granularities - {"segment"}:
        raise _bad(f"timestamp_granularities {sorted(granularities)}: only segment (the whole clip as one "
                          "segment) is supported", "timestamp_granularities")
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise _bad("temperature must be a number", "temperature") from None
    if temperature != 0:
        raise _bad(f"temperature {temperature}: transcription is greedy here; send 0", "temperature")
    language = str(form.get("language") or "en")
    if not language.isalpha() or len(language) > 3:
        raise _bad(f"language {language!r} is not an ISO 639-1 code such as en or de", "language")
    return AudioRequest(resample(samples, rate), form.get("model"), language.lower(), fmt,
                        None if rate == SAMPLE_RATE else rate)


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples, rate) of a PCM or float WAV file; 400 naming ``file`` otherwise."""
    try:
        with wave.open(io.BytesIO(data), "rb") as f:
            rate, width, channels, frames = f.getframerate(), f.getsampwidth(), f.getnchannels(), \
                f.readframes(f.getnframes())
    except (wave.Error, EOFError) as error:
        raise _bad(f"file is not a WAV file this server can decode ({error}); send 16- or 32-bit PCM WAV "
                          "(flac and mp3 are not decoded here)", "file") from None
    if width not in (2, 4):
        raise _bad(f"file holds {8 * width}-bit samples; send 16- or 32-bit PCM WAV", "file")
    samples = np.frombuffer(frames, dtype=np.int16 if width == 2 else np.int32).astype(np.float32)
    samples /= 32768.0 if width == 2 else 2147483648.0
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    if samples.size == 0:
        raise _bad("file holds no audio samples", "file")
    return samples, rate


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """``samples`` at 16 kHz (linear interpolation; unchanged when already 16 kHz)."""
    if rate == SAMPLE_RATE:
        return samples
    count = max(1, round(samples.size * SAMPLE_RATE / rate))
    return np.interp(np.arange(count) * (rate / SAMPLE_RATE), np.arange(samples.size), samples).astype(np.float32)


def text_prefix(language: str, task: str) -> str:
    return f"<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"


def _clock(seconds: float, separator: str) -> str:
    millis = int(round(seconds * 1000))
    return f"{millis // 3600000:02d}:{millis // 60000 % 60:02d}:{millis // 1000 % 60:02d}{separator}{millis % 1000:03d}"


def render(text: str, audio: AudioRequest, task: str) -> web.Response:
    """The response in ``audio.response_format``; the whole clip is one segment."""
    headers = {"x-tritonllm-resampled": f"{audio.resampled_from}->{SAMPLE_RATE}"} if audio.resampled_from else None
    fmt, end = audio.response_format, audio.seconds
    if fmt == "json":
        return web.json_response({"text": text}, headers=headers)
    if fmt == "verbose_json":
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": end, "text": text, "temperature": 0.0}
        return web.json_response({"task": task, "language": audio.language, "duration": end, "text": text,
                                  "segments": [segment]}, headers=headers)
    if fmt == "srt":
        body = f"1\n{_clock(0, ',')} --> {_clock(end, ',')}\n{text}\n"
    elif fmt == "vtt":
        body = f"WEBVTT\n\n{_clock(0, '.')} --> {_clock(end, '.')}\n{text}\n"
    else:
        body = text
    return web.Response(text=body, headers=headers)
