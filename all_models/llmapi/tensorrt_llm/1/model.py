"""Triton `tensorrt_llm` model of the LLM-API repository (TensorRT-LLM's all_models/llmapi interface):
text in (`text_input`, `sampling_param_*`), text out (`text_output`, `finish_reason`, ...), served by
this project's engine.

Glue only. It is the five-model repository's `tensorrt_llm` model (all_models/tensorrt_llm/1/model.py,
loaded from the source tree and subclassed: one executor or engine process, response forwarding,
cancellation, stop requests, stats, graceful shutdown, restart after an engine death) with three
changes: `initialize` reads model.yaml (serving/llmapi_yaml.py), checks tensor_parallel_size x
pipeline_parallel_size against the launcher's world size, and builds or reuses the checkpoint's engine
(serving/engine_cache.py, the cache `tritonllm serve` uses) before the usual start, this instance on its own GPU(s)
when config.pbtxt sets gpu_device_ids (serving/llmapi_instances.py); `execute`
tokenizes the prompt and reads the LLM-API inputs (serving/llmapi_params.py parse_request); and
each response's token ids become text, incrementally for streams, cut at `sampling_param_stop`
strings (serving/llmapi_params.py response_tensors).

Refused per request, naming the input: `image_url` (no multimodal input), `sampling_param_best_of`
> 1 (no best-of or beam search), `lora_ckpt_source` other than "hf". LoRA (`lora_id`, `lora_name`,
`lora_path`, a PEFT directory) runs when model.yaml sets `enable_lora`; otherwise the engine
answers such a request with an error saying LoRA is off. Refused at load, naming the key:
`tensor_parallel_size` x `pipeline_parallel_size` other than the world size, unknown keys and bad
values in model.yaml, `gpu_device_ids` that do not place every instance.

tensor_parallel_size x pipeline_parallel_size = N > 1 runs in leader mode
(scripts/launch_triton_server.py --world_size N): this model is rank 0's, the leader; ranks 1..N-1 are engine workers started by the launcher on the same
cached engine (it resolves model.yaml before starting them).
"""
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
import serving  # noqa: E402
from serving import engine_cache  # noqa: E402
from serving.llmapi_params import ResponseState, TextStream, parse_request, response_tensors  # noqa: E402
from serving.llmapi_instances import instance_gpu_ids  # noqa: E402
from serving.llmapi_yaml import (check_triton_config, check_world_size, engine_dir_for,  # noqa: E402
                                 executor_parameters, load_llmapi_config)
from serving.responses import only_requested, requested_outputs  # noqa: E402
from serving.tokenization import fast_decoder, first_token_id, load_text_tokenizer  # noqa: E402

# The folder holding the project's packages: a source checkout (all_models/ at its root), or
# site-packages of an installed wheel (the templates are tritonllm's package data there).
PACKAGES_ROOT = Path(os.environ.get("TRITONLLM_ROOT") or Path(serving.__file__).resolve().parents[1])
TEMPLATES = next((folder for folder in (PACKAGES_ROOT / "all_models", PACKAGES_ROOT / "tritonllm" / "all_models")
                  if folder.is_dir()), PACKAGES_ROOT / "all_models")
CONFIG_FILE = os.environ.get("LLM_CONFIG_PATH", "model.yaml")  # TensorRT-LLM's variable, in this directory


def _load_source(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


base = _load_source("tritonllm_tensorrt_llm_model", TEMPLATES / "tensorrt_llm" / "1" / "model.py")


def _config_path():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), CONFIG_FILE)


def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _engine_dir(config):
    """The engine of model.yaml's `model` (an engine directory, or the checkpoint's cached engine).
    torch is imported only when dtype is auto on a checkpoint (its CUDA check picks the dtype): the
    stub otherwise runs without it, as the base model's does (~1.5 CPU-s and ~250 MiB per instance)."""
    return engine_dir_for(config, _torch_sees_cuda, engine_cache)


def _draft_engine_dir(config):
    """speculative_config's draft model, built like `model` (same build options), or None."""
    return None if config.draft_model is None else _engine_dir(dataclasses.replace(config, model=config.draft_model))


class TritonPythonModel(base.TritonPythonModel):
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """model.yaml's triton_config, where the server auto-completes configurations (a value
        config.pbtxt already sets is left to `initialize`'s check, which names the key)."""
        try:
            config = load_llmapi_config(_config_path())
        except Exception:  # initialize reports it
            return auto_complete_model_config
        current = auto_complete_model_config.as_dict()
        if "decoupled" not in (current.get("model_transaction_policy") or {}):
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=config.decoupled))
        if not current.get("max_batch_size"):
            auto_complete_model_config.set_max_batch_size(config.triton_max_batch_size)
        return auto_complete_model_config

    def initialize(self, args):
        from engine.config import EngineConfig
        from engine.tensor_parallel.rank_info import rank_info_from_env

        config = load_llmapi_config(_config_path())
        model_config = json.loads(args["model_config"])
        check_triton_config(config, pb_utils.using_decoupled_model_transaction_policy(model_config),
                            int(model_config.get("max_batch_size", 0) or 0))
        check_world_size(config, rank_info_from_env().world_size)
        gpu_ids = instance_gpu_ids(model_config, args["model_name"], args.get("model_instance_name", ""),
                                   config.world_size)
        engine_dir = _engine_dir(config)
        parameters = model_config.setdefault("parameters", {})
        parameters.pop("gpu_device_ids", None)  # ';' between instances here; the base reads one ',' list
        if gpu_ids is not None:
            parameters["gpu_device_ids"] = {"string_value": ",".join(map(str, gpu_ids))}
            # This instance owns its engine: the base model, counting one instance, starts its own
            # engine process instead of joining the other instances' shared one.
            model_config["instance_group"] = [{"count": 1, "kind": "KIND_CPU"}]
        for name, value in executor_parameters(config, engine_dir, _draft_engine_dir(config)).items():
            parameters[name] = {"string_value": value}
        super().initialize({**args, "model_config": json.dumps(model_config)})
        tokenizer = load_text_tokenizer(config.tokenizer or engine_dir)  # encodes, decodes, special ids
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=True)
        self.encode_word = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self.end_id = first_token_id(tokenizer, tokenizer.eos_token)
        self.pad_id = first_token_id(tokenizer, tokenizer.pad_token)
        self.decode = fast_decoder(tokenizer, skip_special_tokens=True)
        self.tokens_per_block = EngineConfig.load(engine_dir).build.tokens_per_block
        self.batched = bool(model_config.get("max_batch_size", 0))
        self.states = {}  # Triton request key (serving/inflight.py) -> ResponseState
        forward = self.inflight.on_response

        def on_response(response):  # under self.lock: keep what the output tensors do not carry
            exec_request = self.inflight.by_exec_id.get(response.request_id)
            state = exec_request and self.states.get(exec_request.triton.key)
            if state and response.result is not None:
                state.on_result(response.result)
            return forward(response)

        self.inflight.on_response = on_response
        placement = f" on GPU(s) {','.join(map(str, gpu_ids))}" if gpu_ids is not None else ""
        pb_utils.Logger.log_info(f"tensorrt_llm (LLM-API) instance {args.get('model_instance_name')}: serving "
                                 f"{config.model} with engine {engine_dir}{placement}")

    def _convert(self, request, tensors):
        """The LLM-API inputs (text, sampling_param_*) -> the executor request, and the state that
        turns its token ids back into text (kept by _track)."""
        parsed = parse_request(tensors, decoupled=self.decoupled, encode=self.encode, encode_word=self.encode_word,
                               end_id=self.end_id, pad_id=self.pad_id, max_input_len=self.max_input_len)
        state = ResponseState(parsed, TextStream(self.decode, parsed.stop_strings), self.tokens_per_block,
                              requested=requested_outputs(request))
        return [parsed.spec], {}, state

    def _track(self, exec_ids, tracked) -> None:
        self.states[self.inflight.by_exec_id[exec_ids[0]].triton.key] = tracked

    def _deliver(self, send):
        """Token ids -> the LLM-API outputs; a stream that reached a stop string ends its generation."""
        state = self.states.get(send.key)
        if state is not None and send.tensors is not None:
            stopped_before = state.text.stopped
            tensors = response_tensors(state, send.tensors, send.final, batched=self.batched)
            if state.text.stopped and not stopped_before and not send.final:
                with self.lock:
                    exec_ids = self.inflight.cancel_key(send.key)
                for exec_id in exec_ids:
                    self.executor.cancel_request(exec_id)
            if tensors is None:
                return
            send = dataclasses.replace(send, tensors=only_requested(tensors, state.requested))
        if send.final:
            self.states.pop(send.key, None)
        super()._deliver(send)
