"""Triton `disaggregated_serving_bls` model: prefill on context_model_name, decode on
generation_model_name, the KV cache handed over through context_phase_params.

Glue only: the rules live in serving/disaggregated_bls.py, the KV transfer in
engine/executor/disaggregated.py (docs/features/disaggregated-serving.md). Parameters:
context_model_name, generation_model_name (default tensorrt_llm for both: one executor serves both
phases). Both models share this model's decoupled mode; a decoupled model relays the generation
model's stream as it comes.
"""
import json
import os
import sys

import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.disaggregated_bls import (CONTEXT_OUTPUTS, GENERATION_PARAMETERS, PARAMS,  # noqa: E402
                                       context_inputs, context_parameters, context_phase_params, declared_shapes,
                                       generation_inputs, requested_outputs, reshaped_inputs)
from serving.bls_execute import execute_each  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.stub_watchdog import start_server_watchdog  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.context_name = get_parameter(params, "context_model_name", str) or "tensorrt_llm"
        self.generation_name = get_parameter(params, "generation_model_name", str) or "tensorrt_llm"
        self.context_parameters = context_parameters(self.context_name, self.generation_name)
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.reshaped = reshaped_inputs(config["input"])
        self.output_names = [tensor["name"] for tensor in config["output"]]
        start_server_watchdog()

    def execute(self, requests):
        return execute_each(pb_utils, requests, self.decoupled, self._serve)

    def _inputs(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return declared_shapes(inputs, self.reshaped)

    def _call(self, model_name, inputs, parameters, outputs):
        call = pb_utils.InferenceRequest(
            model_name=model_name, requested_output_names=outputs, parameters=parameters,
            inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])
        if self.decoupled:
            return call.exec(decoupled=True)
        return [call.exec()]

    @staticmethod
    def _tensors(response):
        if response.has_error():
            return response.error().message(), {}
        return None, {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}

    def _serve(self, request, sender):
        inputs = self._inputs(request)
        outputs = requested_outputs(request.requested_output_names(), self.output_names)
        context = [self._tensors(r) for r in self._call(self.context_name, context_inputs(inputs),
                                                        self.context_parameters, CONTEXT_OUTPUTS)]
        params = context_phase_params(self.context_name, context)
        last = None
        for response in self._call(self.generation_name, generation_inputs(inputs, params), GENERATION_PARAMETERS,
                                   outputs):
            error, tensors = self._tensors(response)
            if error is not None:
                raise RuntimeError(f"Generation model {self.generation_name} failed with error: {error}")
            tensors.pop(PARAMS, None)
            if not tensors:
                continue  # a decoupled stream's empty final response: this model sends its own
            last = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in tensors.items()])
            if self.decoupled:
                sender.send(last)
        if last is None and not self.decoupled:
            raise RuntimeError(f"Generation model {self.generation_name} sent no output")
        return None if self.decoupled else last
