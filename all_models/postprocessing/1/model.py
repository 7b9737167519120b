"""Triton `postprocessing` model: token ids -> text, one string per (item, beam).

Glue only; decoding rules live in serving/text.py. A streamed chunk from `tensorrt_llm` never ends
inside a multi-byte character, so decoding each chunk alone is safe.

Also where a gone ensemble client shows up (serving/cancellation.py): a step of a cancelled
ensemble request is created cancelled, so this model stops the `tensorrt_llm` request named by
REQUEST_KEY and answers with empty text (an error here would leave the ensemble request in flight).
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.cancellation import REQUEST_KEY_INPUT, ReportedKeys, send_stop_request, stop_id_for_key  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402
from serving.text import decode_batch  # noqa: E402
from serving.tokenization import load_text_tokenizer  # noqa: E402

INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH", REQUEST_KEY_INPUT)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        tokenizer_dir = get_parameter(params, "tokenizer_dir", str)
        if tokenizer_dir is None:
            raise ValueError("postprocessing: the tokenizer_dir parameter must be set")
        self.skip_special_tokens = get_parameter(params, "skip_special_tokens", bool)
        if self.skip_special_tokens is None:
            pb_utils.Logger.log_warn("postprocessing: skip_special_tokens is not set; using True")
            self.skip_special_tokens = True
        self.tokenizer = load_text_tokenizer(tokenizer_dir)  # decode and ids to tokens only
        self.llm_name = get_parameter(params, "tensorrt_llm_model_name", str) or "tensorrt_llm"
        self.reported = ReportedKeys()
        start_server_watchdog()  # this stub waits inside BLS calls

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = {}
                for tensor in request.inputs():
                    if tensor.name() not in INPUTS:
                        raise ValueError(f"unknown input {tensor.name()}")
                    tensors[tensor.name()] = tensor.as_numpy()
                if REQUEST_KEY_INPUT in tensors and request.is_cancelled():
                    responses.append(self._client_gone(tensors))
                    continue
                text = decode_batch(self.tokenizer, tensors["TOKENS_BATCH"], tensors["SEQUENCE_LENGTH"],
                                    self.skip_special_tokens)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", text.astype(np.object_))]))
            except Exception as error:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def _client_gone(self, tensors):
        """Stop the generation this step belongs to (once per request) and answer with empty text
        of the usual shape; the ensemble delivers it to nobody."""
        for key in {int(k) for k in tensors[REQUEST_KEY_INPUT].reshape(-1)}:
            if self.reported.first_report(key):
                self._stop_llm(stop_id_for_key(key))
        tokens = tensors["TOKENS_BATCH"]
        empty = np.full(tokens.shape[0] * tokens.shape[1], b"", dtype=np.object_)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", empty)])

    def _stop_llm(self, request_id):
        try:
            send_stop_request(pb_utils, self.llm_name, request_id)
        except Exception as error:  # e.g. a non-decoupled tensorrt_llm: it has nothing to stop
            pb_utils.Logger.log_warn(f"postprocessing: could not stop {request_id}: {error}")

    def finalize(self):
        stop_crash_dumps()
