"""Triton `disaggregated_serving_bls` model: prefill on context_model_name, decode on
generation_model_name, the KV cache handed over through context_phase_params.

Glue only: the rules live in serving/disaggregated_bls.py, the KV transfer in
engine/executor/disaggregated.py (docs/features/disaggregated-serving.md). Parameters:
context_model_name, generation_model_name (default tensorrt_llm for both: one executor serves both
phases). Both models share this model's decoupled mode; a decoupled model relays the generation
model's stream as it comes.

Requests run at once, each on a worker thread (serving/bls_execute.execute_concurrently): their
calls block for the whole answer. A client that cancels (or hangs up) during the generation phase is
seen by a watcher within CANCELLATION_CHECK_PERIOD_S, which sends the generation model a stop request
for the inner request's id; the stream then ends with its FINAL response as usual.
"""
import json
import os
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.disaggregated_bls import (CONTEXT_OUTPUTS, GENERATION_PARAMETERS, PARAMS,  # noqa: E402
                                       context_inputs, context_parameters, context_phase_params, declared_shapes,
                                       generation_inputs, requested_outputs, reshaped_inputs)
from serving.bls_execute import execute_concurrently  # noqa: E402
from serving.cancellation import send_stop_request  # noqa: E402
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402

CANCELLATION_CHECK_PERIOD_S = 0.1
MAX_CONCURRENT_REQUESTS = 1024  # worker threads (each waits on its request's calls); more requests queue


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.context_name = get_parameter(params, "context_model_name", str) or "tensorrt_llm"
        self.generation_name = get_parameter(params, "generation_model_name", str) or "tensorrt_llm"
        self.context_parameters = context_parameters(self.context_name, self.generation_name,
                                                     os.environ.get("TRITONLLM_KV_TRANSFER"))
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.reshaped = reshaped_inputs(config["input"])
        self.output_names = [tensor["name"] for tensor in config["output"]]
        self.workers = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="disagg")
        self.watchers = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="disagg-watch")
        start_server_watchdog()

    def execute(self, requests):
        return execute_concurrently(pb_utils, requests, self.decoupled, self._serve, self.workers)

    def _inputs(self, request):
        inputs = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return declared_shapes(inputs, self.reshaped)

    def _call(self, model_name, inputs, parameters, outputs, request_id=""):
        call = pb_utils.InferenceRequest(
            model_name=model_name, requested_output_names=outputs, parameters=parameters, request_id=request_id,
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
        generation_id = f"disagg-{uuid.uuid4().hex}"
        done = threading.Event()
        cancelled = sender.is_cancelled if sender is not None else request.is_cancelled
        self.watchers.submit(self._watch, cancelled, done, generation_id)
        last = None
        try:
            for response in self._call(self.generation_name, generation_inputs(inputs, params), GENERATION_PARAMETERS,
                                       outputs, generation_id):
                error, tensors = self._tensors(response)
                if error is not None:
                    raise RuntimeError(f"Generation model {self.generation_name} failed with error: {error}")
                tensors.pop(PARAMS, None)
                if not tensors:
                    continue  # a decoupled stream's empty final response: this model sends its own
                last = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in tensors.items()])
                if self.decoupled:
                    try:
                        sender.send(last)
                    except Exception:  # the client is gone; the watcher stops the generation
                        pass
        finally:
            done.set()
        if last is None and not self.decoupled:
            raise RuntimeError(f"Generation model {self.generation_name} sent no output")
        return None if self.decoupled else last

    def _watch(self, cancelled, done, generation_id):
        """Stop the generation request once its client is gone (checked until the request is done)."""
        while not done.wait(CANCELLATION_CHECK_PERIOD_S):
            if cancelled():
                send_stop_request(pb_utils, self.generation_name, generation_id, self.decoupled)
                return


    def finalize(self):
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.watchers.shutdown(wait=False, cancel_futures=True)
        stop_crash_dumps()
