"""Triton `postprocessing` model: token ids -> text, one string per (item, beam).

Glue only; decoding rules live in serving/text.py. A streamed chunk from `tensorrt_llm` never ends
inside a multi-byte character, so decoding each chunk alone is safe.
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.text import decode_batch  # noqa: E402
from serving.tokenization import load_tokenizer  # noqa: E402

INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH")


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
        self.tokenizer = load_tokenizer(tokenizer_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = {}
                for tensor in request.inputs():
                    if tensor.name() not in INPUTS:
                        raise ValueError(f"unknown input {tensor.name()}")
                    tensors[tensor.name()] = tensor.as_numpy()
                text = decode_batch(self.tokenizer, tensors["TOKENS_BATCH"], tensors["SEQUENCE_LENGTH"],
                                    self.skip_special_tokens)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", text.astype(np.object_))]))
            except Exception as error:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def finalize(self):
        pass
