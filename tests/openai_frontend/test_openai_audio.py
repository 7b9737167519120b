"""openai_frontend/audio.py without a server: decoding through libsndfile (wav 16/32-bit, stereo,
flac, mp3; other rates resampled), the TEXT_PREFIX per task, the response formats with one segment
per window, the stream's deltas, and the named refusals."""
import io

import numpy as np
import pytest
import soundfile

from openai_frontend.audio import (AudioRequest, Segment, Transcript, decode_audio, render, resample, text_delta,
                                   text_prefix)
from openai_frontend.errors import APIError


def encoded(samples: np.ndarray, fmt: str, rate: int = 16000, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def test_decode_and_resample():
    samples, rate = decode_audio(encoded(np.array([16384, -16384, 0, 32767], np.int16), "WAV"))
    assert rate == 16000 and samples.tolist() == [0.5, -0.5, 0.0, 32767 / 32768]
    stereo, _ = decode_audio(encoded(np.array([[2**30, 0], [-2**30, 0]], np.int32), "WAV", subtype="PCM_32"))
    assert stereo.tolist() == [0.25, -0.25]
    tone = (0.3 * np.sin(np.arange(16000) / 10)).astype(np.float32)
    flac, rate = decode_audio(encoded(tone, "FLAC", 22050))
    assert rate == 22050 and np.abs(flac - tone).max() < 1e-4  # 16-bit FLAC
    mp3, _ = decode_audio(encoded(tone, "MP3"))
    assert mp3.size >= tone.size and np.abs(mp3[:tone.size] - tone).max() < 0.05  # lossy
    assert resample(np.arange(8, dtype=np.float32), 32000).tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("data, message", [(b"ID3 not audio", "could not be decoded"), (b"", "file is empty"),
                                           (encoded(np.zeros(0, np.int16), "WAV"), "no audio samples")])
def test_bad_files_are_named(data, message):
    with pytest.raises(APIError) as error:
        decode_audio(data)
    assert error.value.status == 400 and error.value.param == "file" and message in error.value.message


def test_prefix_and_formats():
    assert text_prefix("de", "translate") == "<|startoftranscript|><|de|><|translate|><|notimestamps|>"
    assert text_prefix("en", "transcribe", timestamps=True) == "<|startoftranscript|><|en|><|transcribe|>"
    audio = AudioRequest(np.zeros(24000, np.float32), None, "en", "vtt", 44100)
    response = render(Transcript("hello"), audio, "transcribe")
    assert response.text == "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nhello\n"
    assert response.headers["x-tritonllm-resampled"] == "44100->16000"
    two = Transcript("a b", [Segment(0.0, 30.0, "a"), Segment(30.0, 31.5, "b")])
    audio.response_format = "srt"
    assert render(two, audio, "transcribe").text == ("1\n00:00:00,000 --> 00:00:30,000\na\n\n"
                                                     "2\n00:00:30,000 --> 00:00:31,500\nb\n")


def test_stream_deltas():
    assert text_delta("", "w30") == "w30" and text_delta("w30", "w30 w31") == " w31"
    assert text_delta("w30 w3", "w30 w41") == "41"  # a rewritten tail is sent from where it parts
