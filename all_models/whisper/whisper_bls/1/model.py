"""Triton `whisper_bls` model: TEXT_PREFIX, WAV, WAV_LENS -> TRANSCRIPTS through tensorrt_llm.

Glue only: the rules (audio, log-mels, prompt, tensorrt_llm's tensors, the transcript) live in
serving/whisper.py. Parameters: engine_dir (a Whisper engine's decoder/, whose tokenizer and
feature extractor this model reads; the anchor leaves it unused), n_mels (checked against the
feature extractor), zero_pad (true: no padding to the 30-s window), tensorrt_llm_model_name
(default tensorrt_llm), max_tokens (default 50, the anchor's request_output_len). A decoupled
model streams the transcript so far with each of tensorrt_llm's responses.
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
from serving.whisper import audio_samples, log_mel, prompt_ids, tensorrt_llm_inputs, transcript  # noqa: E402


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
        features = log_mel(self.extractor, samples, self.zero_pad)
        inputs = tensorrt_llm_inputs(features, prompt_ids(self.tokenizer, text_prefix), max_tokens=self.max_tokens,
                                     end_id=self.end_id, streaming=self.decoupled)
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm_name, requested_output_names=["output_ids", "sequence_length"],
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
        if self.decoupled:
            ids = []
            for llm_response in llm_request.exec(decoupled=True):
                outputs = self._outputs(llm_response)
                if outputs is None:
                    continue
                ids += outputs
                sender.send(self._response(transcript(self.tokenizer, ids)))
            return None
        else:
            text = transcript(self.tokenizer, self._outputs(llm_request.exec()) or [])
        return self._response(text)

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

    @staticmethod
    def _response(text: str):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TRANSCRIPTS", np.array([[text.encode("utf-8")]], dtype=object))])
