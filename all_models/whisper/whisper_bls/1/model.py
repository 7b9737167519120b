"""Triton `whisper_bls` model: TEXT_PREFIX, WAV, WAV_LENS -> TRANSCRIPTS (and SEGMENT_TEXTS,
SEGMENT_TIMES) through tensorrt_llm.

Glue only: the rules (audio, windows, log-mels, prompt, tensorrt_llm's tensors, the transcript) live
in serving/whisper.py. Parameters: engine_dir (a Whisper engine's decoder/, whose tokenizer and
feature extractor this model reads; the anchor leaves it unused), n_mels (checked against the
feature extractor), zero_pad (true: no padding to the 30-s window), tensorrt_llm_model_name
(default tensorrt_llm), max_tokens (default 50, the anchor's request_output_len, per window),
max_audio_seconds (default 1800: longer audio is refused naming WAV), tensorrt_llm_streaming
(default: this model's decoupled mode; false lets a decoupled whisper_bls call a non-decoupled
tensorrt_llm). Audio is decoded window after window (long-form, serving/whisper_long_form.py); a
prefix without <|notimestamps|> decodes timestamp tokens, whose pairs close segments. PROMPT (optional,
OpenAI's previous-text prompt) goes before the prefix as <|startofprev|> + its tokens; a prefix
without a language token on a multilingual checkpoint has the language detected on the first
window (LANGUAGE says which). WORD_TIMESTAMPS (optional) asks tensorrt_llm for token timestamps and
returns WORDS / WORD_TIMES (serving/whisper_words.py). A decoupled model sends the transcript so far with each of tensorrt_llm's streamed responses (or after each
window when tensorrt_llm_streaming is false), its closed segments beside it.
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
from serving.whisper import (DEFAULT_MAX_AUDIO_SECONDS, audio_samples, check_language_known,  # noqa: E402
                             check_length, decoder_limits, detection_inputs, fit_max_tokens, is_multilingual,
                             language_code, language_ids, language_position, previous_text_ids, prompt_ids,
                             tensorrt_llm_inputs, timestamp_begin, transcript)
from serving.whisper_long_form import LongForm  # noqa: E402
from serving.whisper_words import window_words  # noqa: E402


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
        self.english_only = not is_multilingual(engine_dir)
        self.vocab_size, self.max_positions, self.max_seq_len = decoder_limits(engine_dir)
        self.languages = {} if self.english_only else language_ids(engine_dir)
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
        check_length(samples, self.max_seconds)
        prompt = prompt_ids(self.tokenizer, text_prefix, self.english_only)
        previous = _input(request, "PROMPT")
        previous = None if previous is None else previous.reshape(-1)[0]
        if isinstance(previous, bytes):
            previous = previous.decode("utf-8")
        if previous:
            prompt = previous_text_ids(self.tokenizer, previous, self.max_positions) + prompt
        max_tokens = fit_max_tokens(prompt, self.max_tokens, self.max_positions, self.max_seq_len)
        clip = LongForm.of(self.extractor, samples, self.zero_pad, timestamp_begin(self.tokenizer, prompt))
        if not self.english_only:
            check_language_known(self.tokenizer, prompt, self.languages)
        position = language_position(self.tokenizer, prompt, self.languages) if self.languages else None
        if position is not None:  # detected on the first window, used for all (as transformers' generate)
            prompt = prompt[:position] + [self._detect(clip.next_window())] + prompt[position:]
            max_tokens = fit_max_tokens(prompt, self.max_tokens, self.max_positions, self.max_seq_len)
        language = language_code(self.tokenizer, prompt, self.languages) or ("en" if self.english_only else "")
        word_timestamps = _input(request, "WORD_TIMESTAMPS")
        word_timestamps = word_timestamps is not None and bool(word_timestamps.reshape(-1)[0])
        words = []
        while (window := clip.next_window()) is not None:
            if clip.segments and getattr(request, "is_cancelled", lambda: False)():
                raise RuntimeError("the request was cancelled")
            inputs = tensorrt_llm_inputs(window.features, prompt, max_tokens=max_tokens, end_id=self.end_id,
                                         streaming=self.llm_streaming)
            outputs = ["output_ids", "sequence_length"]
            if word_timestamps:  # each token's time in the window (engine/encoder_decoder/whisper_alignment.py)
                inputs["return_token_timestamps"] = np.array([[True]])
                outputs.append("token_timestamps")
            llm_request = pb_utils.InferenceRequest(
                model_name=self.llm_name, requested_output_names=outputs,
                inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
            ids, times = [], None
            if self.llm_streaming:
                for llm_response in llm_request.exec(decoupled=True):
                    new = self._outputs(llm_response)
                    times = self._times(llm_response) if times is None else times
                    if new:
                        ids += new
                        sender.send(self._response(clip.segments, language, words,
                                                   [t for t in ids if t != self.end_id]))
            else:
                llm_response = llm_request.exec()
                ids, times = self._outputs(llm_response) or [], self._times(llm_response)
            ids = [t for t in ids if t != self.end_id]
            segments = clip.finish(window, ids)
            if word_timestamps:
                words += window_words(self.tokenizer, segments, ids, times, window.seek * clip.seconds_per_frame,
                                      clip.timestamp_begin, language)
            if self.decoupled and not self.llm_streaming:
                sender.send(self._response(clip.segments, language, words))
        return None if self.decoupled else self._response(clip.segments, language, words)

    def _detect(self, window) -> int:
        """The language token of ``window`` (serving/whisper.py detection_inputs)."""
        start = self.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        inputs = detection_inputs(window.features, start, self.end_id, self.vocab_size, self.languages)
        llm_request = pb_utils.InferenceRequest(
            model_name=self.llm_name, requested_output_names=["output_ids", "sequence_length"],
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
        responses = llm_request.exec(decoupled=True) if self.llm_streaming else [llm_request.exec()]
        ids = [t for response in responses for t in (self._outputs(response) or [])]
        if not ids or ids[0] not in self.languages.values():
            raise RuntimeError(f"language detection answered {ids} instead of a language token")
        return ids[0]

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
    def _times(llm_response):
        """The response's token_timestamps (its first beam), or None."""
        times = None if llm_response.has_error() else pb_utils.get_output_tensor_by_name(llm_response,
                                                                                           "token_timestamps")
        return None if times is None else times.as_numpy().reshape(-1).tolist()

    def _response(self, segments, language, words, pending=()):
        """LANGUAGE (the prompt's language code, detected or asked), TRANSCRIPTS (all segments' ids,
        then ``pending`` ones of the window being decoded, decoded
        together), SEGMENT_TEXTS and SEGMENT_TIMES ([start, end] seconds) of the closed segments."""
        text = transcript(self.tokenizer, [t for s in segments for t in s.ids] + list(pending))
        texts = [transcript(self.tokenizer, s.ids).encode("utf-8") for s in segments]
        times = np.array([[[s.start, s.end] for s in segments]], np.float32).reshape(1, len(segments), 2)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("TRANSCRIPTS", np.array([[text.encode("utf-8")]], dtype=object)),
            pb_utils.Tensor("SEGMENT_TEXTS", np.array([texts], dtype=object).reshape(1, len(segments))),
            pb_utils.Tensor("SEGMENT_TIMES", times),
            pb_utils.Tensor("LANGUAGE", np.array([[language.encode("utf-8")]], dtype=object)),
            pb_utils.Tensor("WORDS", np.array([[w.word.encode("utf-8") for w in words]], dtype=object).reshape(1, -1)),
            pb_utils.Tensor("WORD_TIMES", np.array([[[w.start, w.end] for w in words]], np.float32).reshape(1, -1, 2))])
