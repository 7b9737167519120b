"""A vision-language model served by a real tritonserver: the multimodal repository
`tritonllm serve` assembles (tritonllm/repository.py) for a tiny random LLaVA-1.5 built by engine.build,
and the OpenAI frontend beside it (image_url parts, the encoder run in the frontend).

Greedy text through `ensemble` and `tensorrt_llm_bls`, streamed and unary, with the tensors the
anchor's tools/multimodal/client.py sends for llava (text_output the only output asked for) and the image as
image_input (pixel values, as the anchor's llava client sends), image_bytes_input (an encoded PNG)
and image_url_input (a data: URL, also over HTTP generate), equals transformers' generate on the
same processor outputs; a re-sent image hits the prefix cache; bad images get named per-request
errors and the server keeps serving. One server for the module; it also serves a tiny LLaVA-OneVision
as onevision_ensemble (its preprocessing, multimodal_encoders and tensorrt_llm renamed beside the
LLaVA ones; postprocessing shared) for one video check through video_bytes_input, a tiny random
Llama 3.2 Vision (Mllama) as <model>_mllama (its multimodal repository, filled by `tritonllm serve`'s code
and renamed): the anchor client's --model_type mllama tensors, the anchor's curl request with an
image_url_input and a text-only request give transformers' greedy text, and a tiny Qwen3-VL as
qwen3vl_ensemble (its own postprocessing too: its tokenizer has Qwen's special tokens) with an OpenAI
frontend of its own: the anchor client's `--model_type qwen2_vl` tensors and an OpenAI chat image give
transformers' text, and so do a Qwen3-VL video's frames through the ensemble and an MP4 video_url with
mm_processor_kwargs.

`make test` serves LLaVA alone here (its ensemble, BLS, HTTP generate, the anchor's client, the prefix cache, bad
images and its OpenAI frontend); the OneVision video, Mllama and Qwen3-VL (image and video) cases are `extended`
(since 2026-12-01: their engines, stubs, frontend and references were ~half of this module's start on CI's 2 cores;
`make test-all` adds their models to this server). In `make test` the same pieces of the served path
(preprocessing, multimodal_encoders and tensorrt_llm's model code, run in process on the tensors each passes on)
give transformers' ids in tests/engine/test_vision_onevision_video.py
(test_triton_pipeline_video_image_and_text_give_transformers_ids, bad videos named, the OpenAI video_url part, the
anchor client's video tensors), test_vision_mllama.py
(test_triton_pipeline_preprocessing_encoders_tensorrt_llm_give_transformers_ids, the OpenAI image path, a re-sent
image's prompt blocks) and test_qwen3_vl.py (test_triton_pieces_and_openai_path_give_transformers_ids,
test_video_frames_through_the_triton_pieces_give_transformers_ids,
test_openai_video_url_gives_transformers_ids_and_takes_the_requests_frame_choice,
test_triton_video_fps_and_num_frames_choose_a_files_frames); tests/serving/test_torchless_preprocessing.py holds
every vision family's preprocessing stub without torch.
"""
from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import torch

pytest.importorskip("PIL")

from test_grpc_stream import Stream  # noqa: E402
from test_metrics import scrape, value  # noqa: E402
from tiny_llava import (IMAGE_TOKEN_INDEX, VOCAB, encoded, hf_model, image_processor, make_image,  # noqa: E402
                        write_checkpoint)
from triton_helpers import ROOT, Server, free_port, stop, wait_for  # noqa: E402

pytestmark = pytest.mark.integration
QUERY = "What is in the image?"
SERVED = "tiny-llava"  # the OpenAI API's model name
QWEN3_SERVED = "tiny-qwen3-vl"  # the second frontend's
MAX_TOKENS = 6
END_ID = 2  # the tiny tokenizer's </s>


def _load_tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _built(tmp_path_factory, name: str, write_checkpoint) -> str:
    """engine.build (float32, 128 positions) on the tiny checkpoint ``write_checkpoint`` makes."""
    from engine.build import main

    root = tmp_path_factory.mktemp(name)
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4", "--max_batch_size", "8"]) == 0
    return str(root / "engine")


ONEVISION = "onevision_"  # the prefix of the OneVision models' names in the repository
ONEVISION_MODELS = ("ensemble", "preprocessing", "multimodal_encoders", "tensorrt_llm")
ONEVISION_FRAMES = 8  # the clip's frames, also its max_num_frames
QWEN3 = "qwen3vl_"  # the Qwen3-VL models' prefix
QWEN3_MODELS = ("ensemble", "preprocessing", "multimodal_encoders", "tensorrt_llm", "postprocessing")


@pytest.fixture(scope="module")
def llava_engine(tmp_path_factory) -> str:
    return _built(tmp_path_factory, "llava_served", write_checkpoint)


@pytest.fixture(scope="module")
def onevision_engine(tmp_path_factory) -> str:
    from tiny_llava_next import write_checkpoint as write_onevision

    return _built(tmp_path_factory, "onevision_served", lambda path: write_onevision("llava_onevision", path))


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory) -> str:
    from tiny_qwen3_vl import write_checkpoint as write_qwen3_vl

    return _built(tmp_path_factory, "qwen3_vl_served", write_qwen3_vl)


def add_renamed_models(repo: str, engine: str, work: Path, models: tuple[str, ...], rename, **fill) -> None:
    """The multimodal repository `tritonllm serve` fills for ``engine`` (``fill``: its images settings),
    its ``models`` renamed ``rename(model)`` into ``repo``; the ensemble's steps renamed alike (a step not
    in ``models`` stays LLaVA's: OneVision's and Mllama's postprocessing, the same word ids)."""
    from tritonllm.serve import checkpoint_repository

    source, _ = checkpoint_repository(engine, str(work / rename("repo")), bls_instances=1, **fill)
    for name in models:
        target = Path(repo) / rename(name)
        shutil.copytree(Path(source) / name, target)
        config = (target / "config.pbtxt").read_text()
        for model in models:  # the model's own name, and the ensemble's model_name of each step
            config = config.replace(f'name: "{model}"', f'name: "{rename(model)}"')
        (target / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def mllama_engine(tmp_path_factory) -> str:
    from tiny_mllama import write_checkpoint as write_mllama

    return _built(tmp_path_factory, "mllama_served", write_mllama)


MLLAMA_MODELS = ("ensemble", "preprocessing", "multimodal_encoders", "tensorrt_llm")


# The `extended` tests of the families served beside LLaVA (`make test-all`), by family: a family's
# models (and Qwen3-VL's frontend) are in the repository only where one of its tests runs.
EXTENDED_FAMILY_TESTS = {
    "onevision": {"test_onevision_video_through_the_ensemble"},
    "mllama": {"test_mllama_anchor_client_tensors_curl_and_text_only_equal_transformers"},
    "qwen3": {"test_qwen3_vl_ensemble_with_the_anchor_clients_qwen2_vl_tensors",
              "test_qwen3_vl_openai_chat_with_an_image_equals_transformers",
              "test_qwen3_vl_video_through_the_ensemble_and_openai_chat"}}


def _selected_families(request) -> set[str]:
    """The families of EXTENDED_FAMILY_TESTS with a test of this module in the session (not deselected)."""
    selected = {item.originalname for item in request.session.items if getattr(item, "path", None) == request.node.path}
    return {family for family, tests in EXTENDED_FAMILY_TESTS.items() if tests & selected}


@pytest.fixture(scope="module")
def launched(llava_engine, tmp_path_factory, request):
    """tritonserver on the repository `tritonllm serve` fills for a vision-language engine (the
    multimodal one), with the OneVision, Mllama and Qwen3-VL models beside where their (`extended`) tests
    run, and the OpenAI frontends in this process: LLaVA's from the command line `tritonllm serve` starts
    it with (its launcher's openai_frontend_command, reading file: image URLs under ``media``), and
    Qwen3-VL's beside its models: (Server, the LLaVA frontend's URL, media, the Qwen3-VL frontend's URL or
    None). In this process rather than as the
    `python -m openai_frontend` process the launcher would start: that process's interpreter, torch
    import and encoder load were ~9 CPU-s of this module's start, and what it runs besides the app
    these flags configure (main: parse, config_from_arguments, serve) is the session frontend's
    (tests/integration/conftest.py `frontend`), its command line tests/scripts/test_launch_triton_server.py's."""
    from openai_frontend.__main__ import config_from_arguments, parse_arguments
    from triton_helpers import in_process_frontends
    from tritonllm import launcher
    from tritonllm.serve import checkpoint_repository, wait_until_ready

    families = _selected_families(request)
    work = tmp_path_factory.mktemp("llava_triton")
    media = work / "media"
    media.mkdir()
    repo, engine_models = checkpoint_repository(
        llava_engine, str(work / "repo"), bls_instances=1,  # fewer stubs: a faster start
        images={"max_image_pixels": 10000, "allowed_image_url_hosts": "127.0.0.1"})
    if "onevision" in families:
        add_renamed_models(repo, request.getfixturevalue("onevision_engine"), work, ONEVISION_MODELS,
                           lambda model: ONEVISION + model, images={"max_num_frames": ONEVISION_FRAMES})
    if "mllama" in families:  # Mllama's BLS calls preprocessing by its plain name, so it stays out
        add_renamed_models(repo, request.getfixturevalue("mllama_engine"), work, MLLAMA_MODELS,
                           lambda model: f"{model}_mllama", images={"allowed_image_url_hosts": "127.0.0.1"})
    if "qwen3" in families:
        add_renamed_models(repo, request.getfixturevalue("qwen3_engine"), work, QWEN3_MODELS, lambda model: QWEN3 + model)
    ports = [str(free_port()) for _ in range(4)]
    args = launcher.parse_arguments([f"--model_repo={repo}", "--no-mpi", "--host=127.0.0.1", f"--http_port={ports[0]}",
                                     f"--grpc_port={ports[1]}", f"--metrics_port={ports[2]}", "--force",
                                     f"--cache_dir={work / 'cache'}", f"--tensorrt_llm_model_name={engine_models}",
                                     f"--openai_port={ports[3]}", f"--openai_model_name={SERVED}",
                                     "--openai_workers=1"])
    command = launcher.openai_frontend_command(args) + [f"--allowed_local_media_path={media}"]
    assert command[1:3] == ["-m", "openai_frontend"], command
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = launcher.launch(args, stdout=log, stderr=log)
    try:
        if not wait_until_ready(process, ports[0], timeout=300):
            pytest.fail(f"tritonserver did not become ready:\n{log_path.read_text()[-5000:]}")
        server = Server(http=f"http://127.0.0.1:{ports[0]}", grpc_url=f"127.0.0.1:{ports[1]}",
                        metrics=f"http://127.0.0.1:{ports[2]}", log_path=log_path, pid=process.pid)
        configs = {"llava": config_from_arguments(parse_arguments(command[3:]))}
        if "qwen3" in families:
            # Qwen3-VL's frontend from its command line's flags (its engine directory holds the tokenizer
            # and vision_encoder/): `tritonllm serve`'s own frontend is LLaVA's.
            configs["qwen3"] = config_from_arguments(parse_arguments([
                f"--grpc_url=127.0.0.1:{ports[1]}", f"--tokenizer_dir={request.getfixturevalue('qwen3_engine')}",
                f"--llm_model={QWEN3}tensorrt_llm", f"--served_model_name={QWEN3_SERVED}"]))
        with in_process_frontends(configs) as urls:
            for name, url in urls.items():
                if not wait_for(lambda: _health(url) == 200, timeout=120):
                    pytest.fail(f"the {name} OpenAI frontend did not become ready")
            yield server, urls["llava"], media, urls.get("qwen3")
    finally:
        stop(process)


def _health(url: str) -> int | None:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code
    except requests.ConnectionError:
        return None


@pytest.fixture(scope="module")
def server(launched):
    return launched[0]


@pytest.fixture(scope="module")
def openai_client(launched):
    with openai.OpenAI(base_url=f"{launched[1]}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def oracle(llava_engine):
    """(image seed, query) -> the text transformers' greedy generate gives for the prompt the
    preprocessing model builds (USER:\\n <image> query ASSISTANT:), pixel values as FP16 carries them."""
    from transformers import AutoTokenizer

    hf, tokenizer, cache = hf_model(), AutoTokenizer.from_pretrained(llava_engine), {}

    def expected(seed: int, query: str = QUERY) -> str:
        if (seed, query) not in cache:
            ids = (tokenizer.encode("USER:\n") + [IMAGE_TOKEN_INDEX] * 16
                   + tokenizer.encode(query, add_special_tokens=False)
                   + tokenizer.encode(" ASSISTANT:", add_special_tokens=False))
            pixels = torch.from_numpy(fp16_pixels(seed)[0].astype(np.float32))
            out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=END_ID)[0, len(ids):]
            cache[(seed, query)] = tokenizer.decode(out, skip_special_tokens=True)
        return cache[(seed, query)]

    def text_only(query: str) -> str:
        ids = tokenizer.encode(query)
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=END_ID)[0, len(ids):]
        return tokenizer.decode(out, skip_special_tokens=True)

    expected.text_only = text_only
    return expected


def fp16_pixels(seed: int) -> np.ndarray:
    """image_input as the anchor's client makes it: the processor's pixel values, FP16, (1, 1, 3, H, W)."""
    return image_processor()(make_image(seed), return_tensors="np")["pixel_values"].astype(np.float16)[None]


def png(seed: int, size=(40, 52)) -> np.ndarray:
    """image_bytes_input of one encoded file: (1, 1, 1, 1, num_bytes) uint8."""
    return np.frombuffer(encoded(make_image(seed, size)), np.uint8).reshape(1, 1, 1, 1, -1)


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(make_image(seed))).decode()


def inputs(image: dict, stream: bool, query: str = QUERY) -> dict:
    """The tensors the anchor's tools/multimodal/client.py sends for llava (its CI's --end-id 2; pad_id the
    tiny tokenizer's), with the image given."""
    scalar = lambda value, dtype: np.array([[value]], dtype)  # noqa: E731
    return {"text_input": np.array([[query.encode()]], dtype=object), "max_tokens": scalar(MAX_TOKENS, np.int32),
            "beam_width": scalar(1, np.int32), "temperature": scalar(1.0, np.float32), "end_id": scalar(END_ID, np.int32),
            "pad_id": scalar(4, np.int32), "top_k": scalar(1, np.int32), "top_p": scalar(0.0, np.float32),
            "repetition_penalty": scalar(1.0, np.float32), "stream": scalar(stream, np.bool_), **image}


def image_as(kind: str, seed: int) -> dict:
    return {"image_input": {"image_input": fp16_pixels(seed)},
            "image_bytes_input": {"image_bytes_input": png(seed)},
            "image_url_input": {"image_url_input": np.array([[data_url(seed).encode()]], dtype=object)}}[kind]


def generate(server, model: str, request: dict) -> tuple[str, str | None]:
    """(text, error) of one request over a gRPC stream (unary when its stream input is false)."""
    stream = Stream(server)
    try:
        stream.send(model, request, outputs=["text_output"])  # all the anchor's client asks for
        items = stream.until_final()
    finally:
        stream.close()
    errors = [str(error) for _, error, _ in items if error is not None]
    pieces = [result.as_numpy("text_output") for result, _, _ in items if result is not None]
    text = "".join(p.reshape(-1)[0].decode() for p in pieces if p is not None and p.size)
    return text, errors[0] if errors else None


@pytest.mark.parametrize("model, kind, stream, seed", [
    ("ensemble", "image_input", True, 1),
    ("ensemble", "image_bytes_input", False, 2),
    ("ensemble", "image_url_input", True, 3),
    ("tensorrt_llm_bls", "image_input", False, 4),
    ("tensorrt_llm_bls", "image_bytes_input", True, 5),
    ("tensorrt_llm_bls", "image_url_input", False, 6),
])
def test_greedy_text_equals_transformers(server, oracle, model, kind, stream, seed):
    text, error = generate(server, model, inputs(image_as(kind, seed), stream))
    assert error is None
    assert text.split() == oracle(seed).split()  # one word per token (a stream's text starts with a space)


def test_http_generate_with_a_data_url_and_a_text_only_request(server, oracle):
    body = {"text_input": QUERY, "image_url_input": data_url(7), "max_tokens": MAX_TOKENS}
    response = server.generate("ensemble", body)
    assert response.status_code == 200, response.text
    assert response.json()["text_output"].split() == oracle(7).split()
    for model in ("ensemble", "tensorrt_llm_bls"):  # text only: no image slot, no prompt table
        text_only, error = generate(server, model, inputs({}, False, "Describe this picture"))
        assert error is None and text_only.split() == oracle.text_only("Describe this picture").split()


@pytest.mark.parametrize("use_processor, extra", [(True, ["--streaming"]), (False, ["--use_bls"])])
def test_the_multimodal_client(server, oracle, llava_engine, tmp_path, capsys, use_processor, extra):
    """tools/multimodal/client.py as the anchor's docs run it: the image processed by the client
    (--hf_model_dir: image_input) or by the server (a file: image_bytes_input)."""
    path = tmp_path / "image.png"
    make_image(10).save(path)
    client = _load_tool("multimodal/client")
    args = ["-u", server.grpc_url, "--model_type", "llava", "--text", QUERY, "--image", str(path),
            "--request-output-len", str(MAX_TOKENS), "--end-id", str(END_ID), "--pad-id", "4", *extra]
    if use_processor:
        args += ["--hf_model_dir", str(Path(llava_engine) / "vision_encoder")]
    assert client.main(args) == 0
    assert capsys.readouterr().out.split() == oracle(10).split()


def _reused_blocks_metric(server) -> float | None:
    return value(scrape(server), "tritonllm_kv_cache_blocks_total", source="reused", model="tensorrt_llm",
                 version="1")


def test_a_resent_image_hits_the_prefix_cache_and_another_misses(server):
    def reused_blocks(seed: int) -> int:
        request = inputs(image_as("image_bytes_input", seed), False, "Describe this picture")
        request["return_perf_metrics"] = np.array([[True]])
        stream = Stream(server)
        try:
            stream.send("tensorrt_llm_bls", request, outputs=["text_output", "kv_cache_reused_blocks"])
            items = stream.until_final()
        finally:
            stream.close()
        assert all(error is None for _, error, _ in items)
        return int(next(r.as_numpy("kv_cache_reused_blocks") for r, _, _ in items if r is not None).reshape(-1)[0])

    before = wait_for(lambda: _reused_blocks_metric(server) is not None) and _reused_blocks_metric(server)
    assert reused_blocks(8) == 0  # the first block already holds image tokens: nothing to share yet
    resent = reused_blocks(8)
    assert resent >= 4  # the prompt's blocks holding the image are found by the image's content
    assert reused_blocks(9) == 0  # another image with the same placeholder ids: a miss
    assert wait_for(lambda: _reused_blocks_metric(server) >= before + resent)  # the counter saw the hit


def test_image_preprocessing_stubs_run_without_torch(server):
    """serving/torchless_preprocessing.py: LLaVA's, Mllama's and Qwen3-VL's preprocessing stubs never load
    torch (~4 CPU-s of each one's start); OneVision's loads it after transformers, for its video side
    (serving/videos.py resizes frames with torch). The other tests hold their outputs to transformers' on
    pixels made with torch; tests/serving/test_torchless_preprocessing.py holds every vision-language type's
    stub outputs byte-identical with torch hidden and with torch."""
    import importlib.util

    from benchmarks.common import descendant_pids, process_name

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the stubs keep torch (transformers' torchvision image processors)")

    def loaded_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    stubs = {process_name(pid): pid for pid in descendant_pids(server.pid)}
    # LLaVA's always; the others where their (`extended`) tests put them in the repository (launched)
    image_only = [name for name in ("stub:preprocessing", "stub:preprocessing_mllama", f"stub:{QWEN3}preprocessing")
                  if name == "stub:preprocessing" or name in stubs]
    assert {name: loaded_torch(stubs[name]) for name in image_only} == dict.fromkeys(image_only, False)
    assert loaded_torch(stubs["stub:multimodal_encoders"])
    if f"stub:{ONEVISION}preprocessing" in stubs:
        assert loaded_torch(stubs[f"stub:{ONEVISION}preprocessing"])


BAD = [  # (model, image inputs, what the error names)
    ("ensemble", {"image_bytes_input": np.frombuffer(b"not an image at all", np.uint8).reshape(1, 1, 1, 1, -1)},
     "image_bytes_input image 0 cannot be decoded as an image"),
    ("ensemble", {"image_url_input": np.array([[b"data:image/tiff;base64,AAAA"]], dtype=object)},
     "data URL media type 'image/tiff' is not supported"),
    ("ensemble", {"image_bytes_input": np.concatenate([png(1), png(1)], axis=1)},
     "2 images were sent; allowed: at most 1 per request"),
    ("ensemble", {"image_bytes_input": png(1, size=(120, 120))},
     "is 120x120 = 14400 pixels; allowed: at most 10000 pixels"),
    ("ensemble", {"image_url_input": np.array([[b"http://example.com/cat.png"]], dtype=object)},
     "fetching images from host 'example.com' is not allowed"),
    ("tensorrt_llm_bls", {"image_url_input": np.array([[f"http://127.0.0.1:{free_port()}/cat.png".encode()]],
                                                      dtype=object)},
     "fetching http://127.0.0.1"),
]


def test_bad_images_get_named_errors_and_the_server_keeps_serving(server, oracle):
    for model, image, message in BAD:
        text, error = generate(server, model, inputs(image, False))
        assert error is not None and message in error, (model, message, error)
    mismatch = inputs(image_as("image_input", 1), False, "<image> one <image> two")
    text, error = generate(server, "ensemble", mismatch)
    assert error is not None and "text_input has 2 <image> placeholder(s) but 1 image(s) were sent" in error
    text, error = generate(server, "ensemble", inputs(image_as("image_input", 1), False))
    assert error is None and text.split() == oracle(1).split()


@pytest.mark.extended
def test_onevision_video_through_the_ensemble(server, llava_engine, onevision_engine):
    """LLaVA-OneVision video as the anchor's client sends it: video_bytes_input, the clip's frames
    decoded with PyAV (1, frames, H, W, 3): greedy text = transformers' generate on the prompt and
    FP16 pixel values the preprocessing makes, decoded by the served postprocessing's tokenizer; more
    frames than max_num_frames and an undecodable file get named errors, and the server keeps serving."""
    from transformers import AutoTokenizer

    from engine.vision.encoder_path import vision_encoder_dir
    from serving.images import ImageLimits
    from serving.multimodal import ImagePrompts, prepare_batch
    from serving.videos import VideoLimits, decode_video
    from tiny_llava_next import VIDEO_TOKEN_INDEX, hf_model as onevision_model, kind_tokenizer, make_clip

    frames = decode_video(make_clip(11, ONEVISION_FRAMES), "clip", VideoLimits(), ImageLimits())
    text, error = generate(server, ONEVISION + "ensemble", inputs({"video_bytes_input": frames[None]}, False))
    assert error is None, error
    prompts = ImagePrompts(vision_encoder_dir(onevision_engine), kind_tokenizer("llava_onevision"), VOCAB)
    pre = prepare_batch(prompts, {"VIDEO_BYTES": frames[None]}, [QUERY], True, 4)
    ids = [t if t < VOCAB else VIDEO_TOKEN_INDEX for t in pre["INPUT_ID"][0].tolist()]
    assert ids.count(VIDEO_TOKEN_INDEX) == 33  # 8 frames x 2 x 2 pooled rows + the newline
    out = onevision_model("llava_onevision").generate(
        input_ids=torch.tensor([ids]), pixel_values_videos=torch.from_numpy(pre["PIXEL_VALUES"].astype(np.float32)),
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=END_ID)[0, len(ids):]
    assert text.split() == AutoTokenizer.from_pretrained(llava_engine).decode(out, skip_special_tokens=True).split()
    for video, message in ((np.concatenate([frames, frames[:1]])[None], "video_bytes_input holds 9 frames; allowed: "
                            f"at most {ONEVISION_FRAMES} per video"),
                           (np.frombuffer(b"not a video" * 9, np.uint8).reshape(1, 1, 1, 1, -1),
                            "video_bytes_input cannot be decoded as a video")):
        _, error = generate(server, ONEVISION + "ensemble", inputs({"video_bytes_input": video}, False))
        assert error is not None and message in error, error
    assert generate(server, ONEVISION + "ensemble", inputs({"video_bytes_input": frames[None]}, False)) == (text, None)


# ----------------------------------------------------------------------------- OpenAI chat with image_url parts

@pytest.fixture(scope="module")
def image_host():
    """An HTTP server on 127.0.0.1 (an allowed host) serving /image<seed>.png; its base URL."""
    import http.server
    import threading

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = encoded(make_image(int(self.path.removeprefix("/image").removesuffix(".png"))))
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def chat_oracle(llava_engine):
    """(content parts with {"type": "image"} for each image, image seeds) -> (the text transformers'
    greedy generate gives for the prompt the checkpoint's chat template writes, its prompt length
    with each <image> expanded to the image's 16 tokens), the image's float32 processor outputs."""
    from transformers import AutoTokenizer

    hf, tokenizer = hf_model(), AutoTokenizer.from_pretrained(llava_engine)

    def expected(parts: list[dict], seeds: list[int]) -> tuple[str, int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                             add_generation_prompt=True)
        ids = [i for token in tokenizer.encode(text) for i in ([token] * 16 if token == IMAGE_TOKEN_INDEX else [token])]
        images = {"pixel_values": torch.from_numpy(image_processor()([make_image(s) for s in seeds],
                                                                     return_tensors="np")["pixel_values"])} if seeds else {}
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=END_ID, **images)[0, len(ids):]
        return tokenizer.decode(out, skip_special_tokens=True), len(ids)

    return expected


def chat_parts(url: str | None, query: str = QUERY) -> list[dict]:
    image = [{"type": "image_url", "image_url": {"url": url}}] if url else []
    return image + [{"type": "text", "text": query}]


@pytest.mark.parametrize("source, stream, seed", [("data", False, 11), ("http", True, 12), ("file", False, 13)])
def test_openai_chat_with_an_image_equals_transformers(openai_client, chat_oracle, image_host, launched, source,
                                                       stream, seed):
    """The official client, an image_url part (a data: URL, an http URL on an allowed host, a file
    under --allowed_local_media_path), greedy: the text and prompt tokens transformers gives for the
    same chat template and pixels."""
    url = {"data": lambda: data_url(seed), "http": lambda: f"{image_host}/image{seed}.png",
           "file": lambda: _media_file(launched[2], seed)}[source]()
    text, prompt_tokens = chat_oracle([{"type": "image"}, {"type": "text", "text": QUERY}], [seed])
    request = dict(model=SERVED, messages=[{"role": "user", "content": chat_parts(url)}], max_tokens=MAX_TOKENS,
                   temperature=0)
    if stream:
        chunks = list(openai_client.chat.completions.create(**request, stream=True,
                                                            stream_options={"include_usage": True}))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        completion = openai_client.chat.completions.create(**request)
        answer, usage = completion.choices[0].message.content, completion.usage
    assert answer.split() == text.split()
    assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == MAX_TOKENS


def _media_file(media: Path, seed: int) -> str:
    make_image(seed).save(media / f"image{seed}.png")
    return f"file://{media}/image{seed}.png"


def _refused(openai_client, parts: list[dict]) -> dict:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": parts}],
                                              max_tokens=MAX_TOKENS, temperature=0)
    return raised.value.body if "message" in raised.value.body else raised.value.body["error"]


def test_openai_bad_images_get_named_errors_and_text_still_works(openai_client, chat_oracle):
    field = "messages[0].content[0].image_url.url"
    for url, words in [("http://example.com/cat.png", "fetching images from host 'example.com' is not allowed"),
                       ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded as an image"),
                       ("file:///etc/passwd", "is outside the directory images may be read from")]:
        error = _refused(openai_client, chat_parts(url))
        assert error["param"] == field and words in error["message"], error
    error = _refused(openai_client, chat_parts(data_url(1)) + chat_parts(data_url(2)))
    assert error["param"] == "messages[0].content[2].image_url.url" and "at most 1 per request" in error["message"]
    error = _refused(openai_client, chat_parts(data_url(1), "<image> and one more"))  # a placeholder of its own
    assert error["param"] == "messages" and "2 <image> placeholder(s) but 1 image(s)" in error["message"]
    text, _ = chat_oracle([{"type": "text", "text": "Describe this picture"}], [])  # text only: no table
    completion = openai_client.chat.completions.create(model=SERVED, max_tokens=MAX_TOKENS, temperature=0,
                                                       messages=[{"role": "user", "content": "Describe this picture"}])
    assert completion.choices[0].message.content.split() == text.split()


# ----------------------------------------------------------------------------- Llama 3.2 Vision (Mllama)

HAIKU = "If I had to write a haiku for this one"


@pytest.fixture(scope="module")
def mllama_oracle(mllama_engine):
    """(image or None, text_input) -> transformers' greedy text on the processor's outputs, with the pixel
    values and the vision states rounded to FP16 as PIXEL_VALUES and ENCODER_INPUT_FEATURES carry them."""
    from transformers import AutoTokenizer
    from tiny_mllama import hf_model as mllama_model, processor

    hf, tokenizer = mllama_model(), AutoTokenizer.from_pretrained(mllama_engine)
    hf.model.multi_modal_projector.register_forward_hook(lambda module, args, out: out.half().float())

    def expected(image, text: str) -> str:
        batch = processor()(images=[[image]] if image is not None else None, text=[text], return_tensors="pt")
        if image is not None:
            batch["pixel_values"] = batch["pixel_values"].half().float()
        with torch.no_grad():
            out = hf.generate(**batch, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=END_ID)
        return tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    return expected


@pytest.mark.extended
def test_mllama_anchor_client_tensors_curl_and_text_only_equal_transformers(server, mllama_oracle, tmp_path):
    """The anchor client's --model_type mllama tensors (decoded pixels as image_bytes_input, <|image|> put
    before the text), streamed; the anchor's curl request (image_url_input, a data: URL) over HTTP generate;
    a text-only request (the cross-attention layers skipped): transformers' text through ensemble_mllama."""
    image = make_image(21, (44, 30))
    path = tmp_path / "image.png"
    image.save(path)
    client = _load_tool("multimodal/client")
    args = client.parse_args(["--model_type", "mllama", "--text", HAIKU, "--image", str(path), "--request-output-len",
                              str(MAX_TOKENS), "--end-id", str(END_ID), "--pad-id", "4", "--streaming"])
    tensors = client.request_tensors(args)
    assert tensors["image_bytes_input"].shape == (1, 1, 30, 44, 3)
    text, error = generate(server, "ensemble_mllama", tensors)
    assert error is None and text.split() == mllama_oracle(image, f"<|image|>{HAIKU}").split()
    url = "data:image/png;base64," + base64.b64encode(encoded(make_image(22))).decode()
    body = {"text_input": f"<|image|>{HAIKU}", "image_url_input": url, "max_tokens": MAX_TOKENS, "end_id": END_ID,
            "pad_id": 4, "top_k": 1, "temperature": 0}
    response = server.generate("ensemble_mllama", body)
    assert response.status_code == 200, response.text
    assert response.json()["text_output"].split() == mllama_oracle(make_image(22), f"<|image|>{HAIKU}").split()
    text, error = generate(server, "ensemble_mllama", inputs({}, False, "Describe this picture"))
    assert error is None and text.split() == mllama_oracle(None, "Describe this picture").split()


# ----------------------------------------------------------------------------- Qwen3-VL beside LLaVA

@pytest.fixture(scope="module")
def qwen3_oracle():
    """(prompt ids with one <|image_pad|> where the image goes, image seed, FP16 pixels?) -> the text
    transformers' greedy generate gives with the pad expanded to the image's rows (M-RoPE from
    mm_token_type_ids, as Qwen3VLProcessor returns it)."""
    from tiny_qwen3_vl import IMAGE_TOKEN, hf_model as qwen3_model, image_processor as qwen3_processor, tokenizer

    hf, tok = qwen3_model(), tokenizer()

    def expected(prompt: list[int], seed: int | None, fp16: bool = False) -> str:
        extra, ids = {}, list(prompt)
        if seed is not None:
            image = qwen3_processor()([make_image(seed)], return_tensors="pt")
            rows = int(image["image_grid_thw"].prod()) // 4
            at = ids.index(IMAGE_TOKEN)
            ids[at:at + 1] = [IMAGE_TOKEN] * rows
            pixels = image["pixel_values"].half().float() if fp16 else image["pixel_values"]
            extra = dict(pixel_values=pixels, image_grid_thw=image["image_grid_thw"],
                         mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN).int())
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=END_ID, **extra)[0, len(ids):]
        return tok.decode(out, skip_special_tokens=True)

    def video(ids, patches, grid) -> str:
        """The text of transformers' greedy generate on ``ids`` (fake ids: the video's rows) with these patches."""
        from tiny_qwen3_vl import VIDEO_TOKEN

        ids = torch.tensor([[VIDEO_TOKEN if t >= VOCAB else t for t in np.asarray(ids).tolist()]])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, pixel_values_videos=torch.as_tensor(patches, dtype=torch.float32),
                              video_grid_thw=torch.tensor([list(grid)]), mm_token_type_ids=(ids == VIDEO_TOKEN).int() * 2,
                              max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=END_ID)[0, ids.shape[1]:]
        return tok.decode(out, skip_special_tokens=True)

    expected.tokenizer, expected.video = tok, video
    return expected


@pytest.mark.extended
@pytest.mark.parametrize("image, stream", [("file", True), ("data", False), (None, False)])
def test_qwen3_vl_ensemble_with_the_anchor_clients_qwen2_vl_tensors(server, qwen3_oracle, tmp_path, image, stream):
    """tools/multimodal/client.py --model_type qwen2_vl's tensors (a file: image_bytes_input; a data: URL:
    image_url_input; none: text only) to the Qwen3-VL ensemble: preprocessing lays out Qwen3-VL's chat turn,
    multimodal_encoders sends the table with its DeepStack rows and the M-RoPE pair, tensorrt_llm adds them."""
    from tiny_qwen3_vl import IMAGE_TOKEN, VISION_END, VISION_START

    client = _load_tool("multimodal/client")
    path = tmp_path / "image.png"
    make_image(20).save(path)
    source = {"file": str(path), "data": data_url(20), None: None}[image]
    args = ["--model_type", "qwen2_vl", "--text", QUERY, "--request-output-len", str(MAX_TOKENS), "--end-id",
            str(END_ID), "--pad-id", "4", *(["--image", source] if source else []), *(["--streaming"] if stream else [])]
    text, error = generate(server, QWEN3 + "ensemble", client.request_tensors(client.parse_args(args)))
    assert error is None
    tok = qwen3_oracle.tokenizer
    slot = [VISION_START, IMAGE_TOKEN, VISION_END] if image else []
    prompt = (tok.encode("<|im_start|>user\n") + slot + tok.encode(QUERY, add_special_tokens=False)
              + tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)) if image else tok.encode(QUERY)
    assert text.split() == qwen3_oracle(prompt, 20 if image else None, fp16=True).split()


@pytest.mark.extended
def test_qwen3_vl_openai_chat_with_an_image_equals_transformers(launched, qwen3_oracle):
    """The Qwen3-VL frontend: the chat template writes <|vision_start|><|image_pad|><|vision_end|>, the
    frontend encodes the data: image in process and sends the wide table with the M-RoPE pair."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(21)}},
                                             {"type": "text", "text": QUERY}]}]
    prompt = qwen3_oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUERY}]}],
        add_generation_prompt=True, tokenize=True)["input_ids"]
    with openai.OpenAI(base_url=f"{launched[3]}/v1", api_key="unused", max_retries=0) as client:
        completion = client.chat.completions.create(model=QWEN3_SERVED, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0)
    assert completion.choices[0].message.content.split() == qwen3_oracle(prompt, 21).split()


@pytest.mark.extended
def test_qwen3_vl_video_through_the_ensemble_and_openai_chat(launched, qwen3_engine, qwen3_oracle, tmp_path):
    """Qwen3-VL video (serving/qwen3_video.py): five 52 x 40 frames as video_bytes_input through
    qwen3vl_ensemble, streamed, an 8-frame MP4 (8 fps) from tools/multimodal/client.py --video --video_fps 6
    (the file as video_bytes_input with video_fps: 6 frames), and the MP4 as an OpenAI video_url part with vLLM's mm_processor_kwargs {"num_frames": 6}: each frame pair after its timestamp, an image of its own in M-RoPE;
    transformers' greedy text on the same patches. A one-frame video and a num_frames over max_num_frames get
    named errors, and the next request is served."""
    from engine.vision.encoder_path import vision_encoder_dir
    from serving.images import ImageLimits
    from serving.multimodal import ImagePrompts, prepare_batch
    from serving.qwen3_video import pair_timestamps
    from serving.videos import VideoLimits, decode_video
    from tiny_llava_next import make_clip

    server, tok = launched[0], qwen3_oracle.tokenizer
    prompts = ImagePrompts(vision_encoder_dir(qwen3_engine), tok, VOCAB)
    frames = np.stack([np.asarray(make_image(seed, (52, 40))) for seed in range(5)])
    _, error = generate(server, QWEN3 + "ensemble", inputs({"video_bytes_input": frames[None, :1]}, False))
    assert error is not None and "video_bytes_input: the video has 1 frame(s); Qwen3-VL needs at least 2" in error
    text, error = generate(server, QWEN3 + "ensemble", inputs({"video_bytes_input": frames[None]}, True))
    assert error is None, error
    pre = prepare_batch(prompts, {"VIDEO_BYTES": frames[None]}, [QUERY], True, 4)
    assert text.split() == qwen3_oracle.video(pre["INPUT_ID"][0], pre["PIXEL_VALUES"][0, 0, 0],
                                              pre["IMAGE_GRID_THW"][0]).split()

    clip = make_clip(9, 8)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    args = ["--model_type", "qwen2_vl", "--text", QUERY, "--request-output-len", str(MAX_TOKENS), "--end-id",
            str(END_ID), "--pad-id", "4", "--video", str(path), "--video_fps", "6"]  # the file, sampled at 6 fps
    client = _load_tool("multimodal/client")
    text, error = generate(server, QWEN3 + "ensemble", client.request_tensors(client.parse_args(args)))
    assert error is None, error
    pre = prepare_batch(prompts, {"VIDEO_BYTES": np.frombuffer(clip, np.uint8).reshape(1, 1, 1, 1, -1),
                                  "VIDEO_FPS": np.array([[6.0]], np.float32)}, [QUERY], True, 4)
    assert pre["IMAGE_GRID_THW"][0, 0] == 3 and text.split() == qwen3_oracle.video(
        pre["INPUT_ID"][0], pre["PIXEL_VALUES"][0, 0, 0], pre["IMAGE_GRID_THW"][0]).split()
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip).decode()}},
        {"type": "text", "text": QUERY}]}]
    with openai.OpenAI(base_url=f"{launched[3]}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=QWEN3_SERVED, messages=messages, max_tokens=MAX_TOKENS,
                                           extra_body={"mm_processor_kwargs": {"num_frames": 40}})
        assert "mm_processor_kwargs.num_frames is 40; allowed: an integer from 1 to 32" in str(caught.value)
        completion = client.chat.completions.create(model=QWEN3_SERVED, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, extra_body={"mm_processor_kwargs": {"num_frames": 6}})
    indices = [0, 1, 3, 4, 6, 7]  # linspace(0, 7, 6) rounded, as the processor's sample_frames
    sampled = decode_video(clip, "clip", VideoLimits(), ImageLimits(), sampler=lambda total, fps: indices)
    patches, grid = prompts.qwen_video.processor(sampled)
    template = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUERY}]}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = prompts.expand_placeholders(template, [len(patches) // 4], kinds=["video"],
                                      seconds=pair_timestamps(indices, 8.0, 2))
    assert completion.choices[0].message.content.split() == qwen3_oracle.video(ids, patches, grid).split()
