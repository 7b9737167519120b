"""openai_frontend/audio.py without a server: WAV decoding (16/32-bit, stereo, other rates
resampled), the TEXT_PREFIX per task, and the response formats."""
import io
import wave

import numpy as np
import pytest

from openai_frontend.audio import AudioRequest, decode_wav, render, resample, text_prefix
from openai_frontend.errors import APIError


def wav(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(channels), f.setsampwidth(samples.dtype.itemsize), f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return buffer.getvalue()


def test_decode_and_resample():
    samples, rate = decode_wav(wav(np.array([16384, -16384, 0, 32767], np.int16)))
    assert rate == 16000 and samples.tolist() == [0.5, -0.5, 0.0, 32767 / 32768]
    stereo, _ = decode_wav(wav(np.array([2**30, 0, -2**30, 0], np.int32), channels=2))
    assert stereo.tolist() == [0.25, -0.25]
    assert resample(np.arange(8, dtype=np.float32), 32000).tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(APIError) as error:
        decode_wav(b"fLaC....")
    assert error.value.status == 400 and "file" in str(error.value.body())


def test_prefix_and_formats():
    assert text_prefix("de", "translate") == "<|startoftranscript|><|de|><|translate|><|notimestamps|>"
    audio = AudioRequest(np.zeros(24000, np.float32), None, "en", "vtt", 44100)
    response = render("hello", audio, "transcribe")
    assert response.text == "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nhello\n"
    assert response.headers["x-tritonllm-resampled"] == "44100->16000"
