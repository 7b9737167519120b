#!/usr/bin/env python3
"""Transcribe a 16-kHz WAV file through the `whisper_bls` model over gRPC and print the transcript,
with the flags of tensorrtllm_backend's tools/whisper/client.py:

    python3 tools/whisper/client.py --audio-path speech.wav [--whisper-prompt PREFIX] [--streaming]
        [--server-addr localhost] [--server-port 8001] [--num-tasks 1] [--model-name whisper_bls]

Sends WAV (FP32 [1, N], the samples zero-padded to a multiple of 10 s), WAV_LENS ([[samples]]) and
TEXT_PREFIX (BYTES [1, 1]; default <|startoftranscript|><|en|><|transcribe|><|notimestamps|>); reads
TRANSCRIPTS. --streaming needs a decoupled whisper_bls (its last response is the whole text).
Reads 16-bit or 32-bit PCM WAV with the standard library; other rates are an error (resample first).
"""
from __future__ import annotations

import argparse
import queue
import sys
import wave
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SAMPLE_RATE = 16000
PAD_SECONDS = 10
DEFAULT_PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server-addr", default="localhost")
    p.add_argument("--server-port", type=int, default=8001)
    p.add_argument("--audio-path", required=True, help="a 16 kHz mono WAV file")
    p.add_argument("--whisper-prompt", default=DEFAULT_PREFIX)
    p.add_argument("--streaming", action="store_true")
    p.add_argument("--num-tasks", type=int, default=1, help="send the file this many times, concurrently")
    p.add_argument("--model-name", default="whisper_bls", choices=["whisper_bls", "whisper_bls_async", "whisper"])
    return p.parse_args(argv)


def read_wav(path: str) -> np.ndarray:
    """Mono float32 samples in [-1, 1] of a 16 kHz PCM WAV file."""
    with wave.open(path, "rb") as f:
        rate, width, channels, frames = f.getframerate(), f.getsampwidth(), f.getnchannels(), f.readframes(f.getnframes())
    if rate != SAMPLE_RATE:
        sys.exit(f"{path}: {rate} Hz; the model takes {SAMPLE_RATE} Hz audio (resample it first)")
    if width not in (2, 4):
        sys.exit(f"{path}: {8 * width}-bit samples; send 16- or 32-bit PCM")
    samples = np.frombuffer(frames, dtype=np.int16 if width == 2 else np.int32).astype(np.float32)
    samples /= 32768.0 if width == 2 else 2147483648.0
    return samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples


def request_tensors(samples: np.ndarray, prompt: str) -> dict[str, np.ndarray]:
    block = PAD_SECONDS * SAMPLE_RATE
    padded = np.zeros(-(-samples.size // block) * block, np.float32)
    padded[:samples.size] = samples
    return {"WAV": padded[None], "WAV_LENS": np.array([[samples.size]], np.int32),
            "TEXT_PREFIX": np.array([[prompt.encode()]], dtype=object)}


def transcribe(url: str, model: str, tensors: dict[str, np.ndarray], streaming: bool) -> str:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput("TRANSCRIPTS")]
    client = grpcclient.InferenceServerClient(url)
    try:
        if not streaming:
            return client.infer(model, inputs, outputs=outputs).as_numpy("TRANSCRIPTS").reshape(-1)[0].decode()
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, outputs=outputs, enable_empty_final_response=True)
        text = ""
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                text = result.as_numpy("TRANSCRIPTS").reshape(-1)[0].decode()
            if response.parameters.get("triton_final_response") and response.parameters["triton_final_response"].bool_param:
                return text
    finally:
        client.stop_stream() if streaming else None
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = f"{args.server_addr}:{args.server_port}"
    tensors = request_tensors(read_wav(args.audio_path), args.whisper_prompt)
    try:
        with ThreadPoolExecutor(max_workers=args.num_tasks) as pool:
            texts = list(pool.map(lambda _: transcribe(url, args.model_name, tensors, args.streaming),
                                  range(args.num_tasks)))
    except Exception as error:  # the server's message, e.g. a bad WAV
        print(f"error: {error}", file=sys.stderr)
        return 1
    for text in texts:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
