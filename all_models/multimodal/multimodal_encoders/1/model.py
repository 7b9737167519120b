"""Triton `multimodal_encoders` model: a request's images -> its prompt-embedding table.

Glue only; the encoder is engine/vision/ and the request rules serving/multimodal.py. Every image of
the requests Triton hands over at once runs as one batch.
"""
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.mllama import encoder_outputs  # noqa: E402
from serving.multimodal import VisionEncoderRunner, rows_pixels  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.video_prompts import rows_video  # noqa: E402
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        encoder_dir = get_parameter(params, "multimodal_model_path", str)
        if not encoder_dir:
            raise ValueError("multimodal_encoders: the multimodal_model_path parameter must name a vision-encoder "
                             "directory (<engine>/vision_encoder, written by engine.build)")
        self.runner = VisionEncoderRunner(encoder_dir)
        if self.runner.mllama:  # Llama 3.2 Vision: ENCODER_INPUT_FEATURES in encoder_input_features_data_type
            config = json.loads(args["model_config"])
            kind = pb_utils.get_output_config_by_name(config, "ENCODER_INPUT_FEATURES")["data_type"]
            if kind not in ("TYPE_FP16", "TYPE_FP32"):
                raise ValueError(f"multimodal_encoders: encoder_input_features_data_type {kind} is not supported for "
                                 "Llama 3.2 Vision (the python backend writes numpy arrays); use TYPE_FP16 or TYPE_FP32")
            self.features_dtype = pb_utils.triton_string_to_numpy(kind)
        start_server_watchdog()

    def execute(self, requests):
        if self.runner.qwen:  # table + MROPE tensors per request (serving/qwen_vl.py)
            return [self._qwen(request) for request in requests]
        if self.runner.mllama:  # cross-attention states and masks per request (serving/mllama.py)
            return [self._mllama(request) for request in requests]
        rows, videos, errors = [], [], {}
        for index, request in enumerate(requests):
            try:
                request_rows = rows_pixels(_input(request, "pixel_values"), _input(request, "IMAGE"),
                                           _input(request, "image_sizes"))
                request_videos = rows_video(_input(request, "is_video_input"), len(request_rows))  # OneVision
            except Exception as error:  # this request's error, never the model's
                errors[index] = str(error)
                request_rows, request_videos = [(None, None)], [False]
            rows.append(request_rows)
            videos += request_videos
        try:
            flat = self.runner.tables([pixels for request_rows in rows for pixels, _ in request_rows],
                                      [sizes for request_rows in rows for _, sizes in request_rows], videos)
        except Exception as error:  # the batch failed: every request in it gets the error
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError(f"multimodal_encoders: {error}"))
                    for _ in requests]
        responses, start = [], 0
        for index, request_rows in enumerate(rows):
            tables, start = flat[start:start + len(request_rows)], start + len(request_rows)
            if index in errors:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(errors[index])))
            elif any(table is None for table in tables):  # no image: tensorrt_llm gets no table
                responses.append(pb_utils.InferenceResponse(output_tensors=[]))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._tables(tables)))
        return responses

    def _qwen(self, request):
        try:
            outputs = self.runner.qwen_outputs(_input(request, "pixel_values"), _input(request, "image_grid_thw"),
                                               _input(request, "vision_input_id"),
                                               _input(request, "second_per_grid_ts"))  # a Qwen video's time axis
        except Exception as error:  # this request's error, never the model's
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"multimodal_encoders: {error}"))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def _mllama(self, request):
        try:
            outputs = encoder_outputs(self.runner.encoder, self.runner.device, _input(request, "pixel_values"),
                                      _input(request, "aspect_ratio_ids"), _input(request, "aspect_ratio_mask"),
                                      _input(request, "cross_attention_mask"), _input(request, "max_tokens"),
                                      self.features_dtype)
        except Exception as error:  # this request's error, never the model's
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"multimodal_encoders: {error}"))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])

    @staticmethod
    def _tables(tables):
        """(B, rows, hidden) FP16, rows zero-padded to the longest item, and each item's row count."""
        width = max(len(table) for table in tables)
        stacked = np.zeros((len(tables), width, tables[0].shape[1]), dtype=np.float16)
        for b, table in enumerate(tables):
            stacked[b, :len(table)] = table
        sizes = np.array([[len(table)] for table in tables], dtype=np.int32)
        return [pb_utils.Tensor("OUT_PROMPT_EMBEDDING_TABLE", stacked), pb_utils.Tensor("OUT_PROMPT_VOCAB_SIZE", sizes)]

    def finalize(self):
        stop_crash_dumps()
