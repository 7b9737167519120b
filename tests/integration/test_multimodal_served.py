"""A vision-language model served by a real tritonserver: the multimodal repository
(tools/assemble_repository.py --kind multimodal) of a tiny random LLaVA-1.5 built by engine.build.

Greedy text through `ensemble` and `tensorrt_llm_bls`, streamed and unary, with the tensors the
anchor's tools/multimodal/client.py sends for llava (text_output the only output asked for) and the image as
image_input (pixel values, as the anchor's llava client sends), image_bytes_input (an encoded PNG)
and image_url_input (a data: URL, also over HTTP generate), equals transformers' generate on the
same processor outputs; a re-sent image hits the prefix cache; bad images get named per-request
errors and the server keeps serving. One server for the module.
"""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from test_grpc_stream import Stream  # noqa: E402
from test_metrics import scrape, value  # noqa: E402
from tiny_llava import (IMAGE_TOKEN_INDEX, encoded, hf_model, image_processor, make_image,  # noqa: E402
                        write_checkpoint)
from triton_helpers import ROOT, Server, free_port, stop, wait_for  # noqa: E402

pytestmark = pytest.mark.integration
QUERY = "What is in the image?"
MAX_TOKENS = 6
END_ID = 2  # the tiny tokenizer's </s>


def _load_tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llava_engine(tmp_path_factory) -> str:
    from engine.build import main

    root = tmp_path_factory.mktemp("llava_served")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4", "--max_batch_size", "8"]) == 0
    return str(root / "engine")


@pytest.fixture(scope="module")
def server(llava_engine, tmp_path_factory):
    from tritonllm import launcher
    from tritonllm.serve import wait_until_ready

    work = tmp_path_factory.mktemp("llava_triton")
    repo = Path(_load_tool("assemble_repository").assemble_repository(
        "multimodal", llava_engine, str(work / "repo"),
        overrides={"preprocessing": {"max_image_pixels": "10000", "allowed_image_url_hosts": "127.0.0.1"},
                   "tensorrt_llm_bls": {"bls_instance_count": "1"}}))  # fewer stubs: a faster start
    ports = [str(free_port()) for _ in range(3)]
    args = launcher.parse_arguments([f"--model_repo={repo}", "--no-mpi", "--host=127.0.0.1", f"--http_port={ports[0]}",
                                     f"--grpc_port={ports[1]}", f"--metrics_port={ports[2]}", "--force",
                                     f"--cache_dir={work / 'cache'}",
                                     "--tensorrt_llm_model_name=tensorrt_llm,multimodal_encoders"])
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        process = launcher.launch(args, stdout=log, stderr=log)
    try:
        if not wait_until_ready(process, ports[0], timeout=300):
            pytest.fail(f"tritonserver did not become ready:\n{log_path.read_text()[-5000:]}")
        yield Server(http=f"http://127.0.0.1:{ports[0]}", grpc_url=f"127.0.0.1:{ports[1]}",
                     metrics=f"http://127.0.0.1:{ports[2]}", log_path=log_path, pid=process.pid)
    finally:
        stop(process)


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
