"""serving/torchless_preprocessing.py's condition, per vision-language model type: the real preprocessing
stub (tests/serving/preprocessing_stub_process.py runs all_models/preprocessing/1/model.py's initialize and
_preprocess in a process of its own) on the tiny checkpoint the repo's tests make (tests/tiny_*.py, built by
engine.build) gives byte-identical outputs with torch hidden while transformers loads and with torch
(WITHOUT_TORCH emptied: the stub before that module): every output tensor of images of several sizes, an
aspect ratio that tiles, a JPEG, a grayscale PNG, an image larger than the processor's size (downscaled), a
text-only request, OneVision's video, and the image processor's own float32 outputs before preprocessing's
FP16. Hidden, transformers settles on no torch and, but for OneVision (serving/videos.py resizes frames with
torch: its stub imports it at start), torch is never loaded. tests/integration/test_multimodal_served.py
checks the served LLaVA, Mllama and Qwen3-VL stubs never load it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")

from engine.vision.registry import FAMILIES_BY_MODEL_TYPE  # noqa: E402
from serving.torchless_preprocessing import WITHOUT_TORCH  # noqa: E402
from tiny_llava import encoded, make_image  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STUB_PROCESS = Path(__file__).with_name("preprocessing_stub_process.py")
QUERY = "What is in the image?"


def _write_checkpoint(model_type: str, path: Path) -> Path:
    """The tiny checkpoint of ``model_type`` (builder_config.model_type) the repo's tests make."""
    if model_type == "llava":
        from tiny_llava import write_checkpoint

        return write_checkpoint(path)
    if model_type in ("llava_next", "llava_onevision"):
        from tiny_llava_next import write_checkpoint

        return write_checkpoint(model_type, path)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from tiny_qwen2_vl import write_checkpoint

        return write_checkpoint(path, model_type)
    module = {"mllama": "tiny_mllama", "qwen3_vl": "tiny_qwen3_vl", "gemma3": "tiny_gemma3",
              "blip2-opt": "tiny_blip2"}[model_type]
    return importlib.import_module(module).write_checkpoint(path)


def _image_request(image, format: str = "PNG") -> dict:
    return {"QUERY": np.array([[QUERY.encode()]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32),
            "IMAGE_BYTES": np.frombuffer(encoded(image, format), np.uint8).reshape(1, 1, 1, 1, -1)}


def _requests(model_type: str) -> list[dict]:
    requests = [_image_request(make_image(1)), _image_request(make_image(2, (61, 23))),  # tiles: 2 x 1
                _image_request(make_image(3, (56, 30)), "JPEG"), _image_request(make_image(4, (33, 47)).convert("L")),
                _image_request(make_image(5, (300, 170))),  # larger than every tiny processor's size
                {"QUERY": np.array([[b"Describe this picture"]], dtype=object),
                 "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)}]
    if model_type == "llava_onevision" and importlib.util.find_spec("av") is not None:  # (PyAV writes the clip)
        from tiny_llava_next import make_clip

        clip = np.frombuffer(make_clip(11, 4), np.uint8).reshape(1, 1, 1, 1, -1)
        requests.append({"QUERY": np.array([[QUERY.encode()]], dtype=object), "VIDEO_BYTES": clip,
                         "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32)})
    return requests


def _run_stub(mode: str, out: Path, engines: list[tuple[Path, Path]]) -> dict:
    """preprocessing_stub_process.py's OUT.pkl for (engine, requests file) pairs, in ``mode``."""
    done = subprocess.run([sys.executable, str(STUB_PROCESS), mode, str(out), *(str(p) for pair in engines for p in pair)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


# OneVision last: its stub imports torch at start (its video side), so the others run before torch is loaded
MODEL_TYPES = sorted(FAMILIES_BY_MODEL_TYPE, key=lambda model_type: (model_type == "llava_onevision", model_type))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model type -> (its tiny engine, its requests file), engine.build on each tiny checkpoint."""
    from engine.build import main

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the stubs keep torch (transformers' torchvision image processors)")
    root, engines = tmp_path_factory.mktemp("torchless"), {}
    for model_type in MODEL_TYPES:
        checkpoint = _write_checkpoint(model_type, root / model_type / "checkpoint")
        engine = root / model_type / "engine"
        assert main(["--checkpoint", str(checkpoint), "--output", str(engine), "--dtype", "float32",
                     "--max_seq_len", "128"]) == 0
        with open(root / model_type / "requests.pkl", "wb") as f:
            pickle.dump(_requests(model_type), f)
        engines[model_type] = (engine, root / model_type / "requests.pkl")
    return engines


@pytest.fixture(scope="module")
def with_torch(built, tmp_path_factory) -> dict:
    """Every type's stub with torch (one process: transformers' choice with torch is the same for each;
    ~6 CPU-s of torch's import once, not per type): model type -> its engine's results."""
    out = _run_stub("torch", tmp_path_factory.mktemp("with_torch") / "out.pkl", list(built.values()))
    assert out["transformers_has_torch"]
    return dict(zip(built, out["engines"]))


@pytest.fixture(scope="module")
def hidden(built, tmp_path_factory) -> dict:
    """Every type's stub with torch hidden, in one process as well (OneVision last: its stub imports torch): the
    first type's stub settles transformers on no torch for the process, as each stub's does for its own, and the
    others' processors then load and run in that transformers (a process per type cost ~1.5-2 CPU-s each of
    start alone; which types are hidden is WITHOUT_TORCH's, checked against the registry below):
    model type -> its engine's results."""
    out = _run_stub("hidden", tmp_path_factory.mktemp("hidden") / "out.pkl", list(built.values()))
    assert not out["transformers_has_torch"]
    return dict(zip(built, out["engines"]))


def test_every_vision_family_is_loaded_without_torch():
    """A new family is checked below before it joins WITHOUT_TORCH (or stays out with its reason there)."""
    assert set(WITHOUT_TORCH) == set(FAMILIES_BY_MODEL_TYPE)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_stubs_outputs_are_byte_identical_with_torch_hidden(model_type, built, with_torch, hidden):
    hidden, reference = hidden[model_type], with_torch[model_type]
    assert hidden["processor"] == reference["processor"]
    if model_type != "llava_onevision":  # (its stub imports torch at start for its video side; it runs last)
        assert not any(request["torch_loaded"] for request in hidden["requests"])
    with open(built[model_type][1], "rb") as f:
        requests = pickle.load(f)
    assert len(hidden["requests"]) == len(reference["requests"]) == len(requests)
    for request, without, with_ in zip(requests, hidden["requests"], reference["requests"]):
        pixels = "PIXEL_VALUES" in without["outputs"]
        assert pixels == ("IMAGE_BYTES" in request or "VIDEO_BYTES" in request)
        assert without["outputs"].keys() == with_["outputs"].keys()
        for name, (dtype, shape, data) in without["outputs"].items():
            assert (dtype, shape) == with_["outputs"][name][:2], name
            assert data == with_["outputs"][name][2], f"{model_type}: {name} differs with and without torch"
