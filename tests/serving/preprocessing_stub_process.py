"""The real `preprocessing` model (all_models/preprocessing/1/model.py) in a process of its own, as a Triton
Python-backend stub runs it, for tests/serving/test_torchless_preprocessing.py:

    python preprocessing_stub_process.py {hidden|torch} OUT.pkl ENGINE_DIR REQUESTS.pkl [ENGINE_DIR REQUESTS.pkl ...]

For each engine in turn, ``initialize`` with a vision-language engine's parameters (tokenizer_dir and
gpt_model_path the engine, multimodal_model_path its vision_encoder/), then ``_preprocess`` on each request
of its REQUESTS.pkl (a list of {input name: array}). ``hidden``: serving/torchless_preprocessing.py as it is
(torch hidden while transformers is first imported, by the first engine's stub, for a model type in
WITHOUT_TORCH); ``torch``: WITHOUT_TORCH emptied, so transformers loads with torch (the stub before that
module). OUT.pkl: whether transformers saw torch, and per engine the process's own CPU time (user + system
seconds, the interpreter's start included: the first engine's is its stub's start) when its initialize
returns, its image processor's class, and per request each output as (dtype, shape, bytes), the image
processor's own float32 outputs for the request's decoded images, and whether torch was loaded after it.
Triton's triton_python_backend_utils is replaced by the few functions the model calls.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Tensor:
    def __init__(self, value):
        self.value = value

    def as_numpy(self):
        return self.value


def _backend_utils(np) -> types.ModuleType:
    """What model.py calls of triton_python_backend_utils (output dtypes: the outputs are compared before
    execute casts them to the config's)."""
    utils = types.ModuleType("triton_python_backend_utils")
    utils.get_input_tensor_by_name = lambda request, name: _Tensor(request[name]) if name in request else None
    utils.get_output_config_by_name = lambda config, name: {"data_type": "TYPE_FP32"}
    utils.triton_string_to_numpy = lambda name: np.float32
    utils.Logger = types.SimpleNamespace(log_warn=print, log_info=print, log_error=print)
    return utils


def _wire(outputs: dict) -> dict:
    import numpy as np

    return {name: (value.dtype.str, value.shape, value.tobytes()) for name, value in
            ((name, np.asarray(value)) for name, value in outputs.items() if value is not None)}


def _processor_outputs(model, request: dict) -> dict:
    """The image processor's own outputs (float32, before preprocessing's FP16) for the request's images."""
    import numpy as np

    from serving.images import images_from_bytes

    if "IMAGE_BYTES" not in request:
        return {}
    images = images_from_bytes(request["IMAGE_BYTES"][0], model.images.limits)
    batch = model.images.image_processor([images] if model.images.mllama is not None else images,
                                         return_tensors="np")
    return _wire({f"processor.{name}": np.asarray(value) for name, value in batch.items()})


def main(mode: str, out_path: str, *engines_and_requests: str) -> None:
    import serving.torchless_preprocessing as torchless  # (imports neither torch nor transformers)

    if mode == "torch":
        torchless.WITHOUT_TORCH = ()
    elif mode != "hidden":
        raise SystemExit(f"mode {mode!r}: hidden or torch")
    import numpy as np

    import serving.stub_watchdog

    serving.stub_watchdog.start_server_watchdog = lambda: None  # no server to watch
    sys.modules["triton_python_backend_utils"] = _backend_utils(np)
    spec = importlib.util.spec_from_file_location("preprocessing_model",
                                                  os.path.join(ROOT, "all_models/preprocessing/1/model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    engines = []
    for engine_dir, requests_path in zip(engines_and_requests[::2], engines_and_requests[1::2]):
        parameters = {"tokenizer_dir": engine_dir, "gpt_model_path": engine_dir, "add_special_tokens": "true",
                      "multimodal_model_path": os.path.join(engine_dir, "vision_encoder")}
        config = {"parameters": {name: {"string_value": value} for name, value in parameters.items()}}
        model = module.TritonPythonModel()
        model.initialize({"model_config": json.dumps(config)})
        times = os.times()
        with open(requests_path, "rb") as f:
            requests = pickle.load(f)
        results = []
        for request in requests:
            outputs = {**_wire(model._preprocess(request)), **_processor_outputs(model, request)}
            results.append({"outputs": outputs, "torch_loaded": sys.modules.get("torch") is not None})
        engines.append({"cpu_s": times.user + times.system, "processor": type(model.images.image_processor).__name__,
                        "requests": results})
    from transformers.utils import is_torch_available

    with open(out_path, "wb") as f:
        pickle.dump({"transformers_has_torch": is_torch_available(), "engines": engines}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
