"""Triton `whisper_bls` model: TEXT_PREFIX, WAV, WAV_LENS -> TRANSCRIPTS (and SEGMENT_TEXTS,
SEGMENT_TIMES) through tensorrt_llm.

Glue only: the rules (audio, windows, log-mels, prompt, tensorrt_llm's tensors, the transcript) live
in serving/whisper.py. Parameters: engine_dir (a Whisper engine's decoder/, whose tokenizer and
feature extractor this model reads; the anchor leaves it unused), n_mels (checked against the
feature extractor), zero_pad (true: no padding to the 30-s window), tensorrt_llm_model_name
(default tensorrt_llm), max_tokens (default 50, the anchor's request_output_len, per window),
max_audio_seconds (default 1800: longer audio is refused naming WAV), tensorrt_llm_streaming
(default: this model's decoupled mode; false lets a decoupled whisper_bls call a non-decoupled
tensorrt_llm). Audio longer than one window is decoded window after window (long-form). A
decoupled model sends the transcript so far with each of tensorrt_llm's streamed responses (or
after each window when tensorrt_llm_streaming is false), its segments so far beside it.
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.bls_execute import execute_each  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.stub_watchdog import start_server_watchdog  # noqa: E402
from serving.whisper import (DEFAULT_MAX_AUDIO_SECONDS, audio_samples, prompt_ids, tensorrt_llm_inputs,  # noqa: E402
                             transcript, windows)


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        config = json.loads(args["model_config"])
        params = model_parameters(config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        engine_dir = get_parameter(params, "engine_dir", str)
        if engine_dir is None:
            raise ValueError("whisper_bls: engine_dir (the Whisper engine's decoder/) must be set")
        self.tokenizer = AutoTokenizer.from_pretrained(engine_dir)
        self.extractor = WhisperFeatureExtractor.from_pretrained(engine_dir)
        n_mels = get_parameter(params, "n_mels", int)
        if n_mels is not None and n_mels != self.extractor.feature_size:
            raise ValueError(f"whisper_bls: n_mels {n_mels} differs from the feature extractor's "
                             f"{self.extractor.feature_size} in {engine_dir}")
        self.zero_pad = bool(get_parameter(params, "zero_pad", bool))
        self.llm_name = get_parameter(params, "tensorrt_llm_model_name", str) or "tensorrt_llm"
        self.max_tokens = get_parameter(params, "max_tokens", int) or 50
        self.max_seconds = get_parameter(params, "max_audio_seconds", float) or DEFAULT_MAX_AUDIO_SECONDS
        streaming = get_parameter(params, "tensorrt_llm_streaming", bool)
        self.llm_streaming = self.decoupled if streaming is None else streaming
        if self.llm_streaming and not self.decoupled:
            raise ValueError("whisper_bls: tensorrt_llm_streaming true needs a decoupled whisper_bls")
        self.end_id = self.tokenizer.eos_token_id
        start_server_watchdog()

    def execute(self, requests):
        # decoupled: the stream sent the text; the final response closes it (or is the error)
        return execute_each(pb_utils, requests, self.decoupled, self._transcribe)

    def _transcribe(self, request, sender):
        prefix = _input(request, "TEXT_PREFIX")
        text_prefix = None if prefix is None else prefix.reshape(-1)[0]
        if isinstance(text_prefix, bytes):
            text_prefix = text_prefix.decode("utf-8")
        samples = audio_samples(_input(request, "WAV"), _input(request, "WAV_LENS"))
        prompt = prompt_ids(self.tokenizer, text_prefix)
        done = []  # (window, its ids) of the windows decoded so far
        for window in windows(self.extractor, samples, self.zero_pad, self.max_seconds):
            if done and getattr(request, "is_cancelled", lambda: False)():
                raise RuntimeError("the request was cancelled")
            inputs = tensorrt_llm_inputs(window.features, prompt, max_tokens=self.max_tokens, end_id=self.end_id,
                                         streaming=self.llm_streaming)
            llm_request = pb_utils.InferenceRequest(
                model_name=self.llm_name, requested_output_names=["output_ids", "sequence_length"],
                inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
            done.append((window, []))
            if self.llm_streaming:
                for llm_response in llm_request.exec(decoupled=True):
                    ids = self._outputs(llm_response)
                    if ids:
                        done[-1][1].extend(ids)
                        sender.send(self._response(done))
            else:
                done[-1][1].extend(self._outputs(llm_request.exec()) or [])
                if self.decoupled:
                    sender.send(self._response(done))
        return None if self.decoupled else self._response(done)

    @staticmethod
    def _outputs(llm_response):
        """The response's new ids (its first beam), or None for an empty final response."""
        if llm_response.has_error():
            raise RuntimeError(llm_response.error().message())
        ids = pb_utils.get_output_tensor_by_name(llm_response, "output_ids")
        if ids is None:
            return None
        length = int(pb_utils.get_output_tensor_by_name(llm_response, "sequence_length").as_numpy().reshape(-1)[0])
        return ids.as_numpy().reshape(-1)[:length].tolist()

    def _response(self, done):
        """TRANSCRIPTS (all windows' ids decoded together), SEGMENT_TEXTS and SEGMENT_TIMES
        ([start, end] seconds per window) of the windows in ``done``."""
        text = transcript(self.tokenizer, [t for _, ids in done for t in ids])
        texts = [transcript(self.tokenizer, ids).encode("utf-8") for _, ids in done]
        times = np.array([[[w.start, w.end] for w, _ in done]], np.float32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TRANSCRIPTS", np.array([[text.encode("utf-8")]], dtype=object)),
            pb_utils.Tensor("SEGMENT_TEXTS", np.array([texts], dtype=object)),
            pb_utils.Tensor("SEGMENT_TIMES", times)])
