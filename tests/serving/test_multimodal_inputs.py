"""The multimodal part of preprocessing and the BLS without a server: prompt layout with image slots,
the three ways images come in, and each bad input's named error (tests/integration/test_multimodal_served.py
runs them through a real tritonserver)."""
from __future__ import annotations

import base64
import http.server
import threading

import numpy as np
import pytest

pytest.importorskip("PIL")

from serving.bls import validate  # noqa: E402
from serving.images import ImageError, ImageLimits, images_from_bytes, images_from_urls  # noqa: E402
from serving.multimodal import (ImagePrompts, image_limits, prepare_batch, refuse_images_on_text_model,  # noqa: E402
                                rows_pixels)
from tiny_llava import IMAGE_SIZE, encoded, image_processor, make_image, tokenizer  # noqa: E402

VOCAB = 128
SLOT = list(range(VOCAB, VOCAB + 16))


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    """A vision-encoder directory's files preprocessing reads (config.json, preprocessor_config.json)."""
    import json

    path = tmp_path_factory.mktemp("vision_encoder")
    (path / "config.json").write_text(json.dumps({"builder_config": {"model_type": "llava"}, "num_image_tokens": 16,
                                                  "image_token_index": 3}))
    image_processor().save_pretrained(path)
    return str(path)


def prompts(encoder_dir, **limits) -> ImagePrompts:
    return ImagePrompts(encoder_dir, tokenizer(), VOCAB, limits=ImageLimits(**limits))


def png(seed=1, size=(40, 52), format="PNG") -> np.ndarray:
    return np.frombuffer(encoded(make_image(seed, size), format), np.uint8).reshape(1, 1, 1, 1, -1)


def urls(*values: str) -> np.ndarray:
    return np.array([[v.encode() for v in values]], dtype=object)


def data_url(seed=1) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(make_image(seed))).decode()


def test_the_anchor_layout_and_pixel_values_from_each_way_in(encoder_dir):
    p = prompts(encoder_dir)
    expected_pixels = image_processor()(make_image(1), return_tensors="np")["pixel_values"]
    for images in ({"IMAGE_BYTES": png()}, {"IMAGE_URL": urls(data_url())},
                   {"IMAGE_BYTES": np.asarray(make_image(1))[None, None]},  # raw (H, W, C) pixels
                   {"IMAGE_BYTES": np.moveaxis(np.asarray(make_image(1)), -1, 0)[None, None]}):  # (C, H, W)
        out = prepare_batch(p, images, ["What is in the image?"], True, 4)
        assert out["INPUT_ID"].tolist() == [[5, *SLOT, 7, 8, 9, 10, 11, 6]]  # USER: <image> ... ASSISTANT:
        assert out["PIXEL_VALUES"].shape == (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)
        np.testing.assert_allclose(out["PIXEL_VALUES"][0].astype(np.float32), expected_pixels, atol=2e-3)


def test_image_input_counts_images_placeholders_place_them_and_text_passes(encoder_dir):
    p = prompts(encoder_dir, max_pixels=10**6)
    pixels = np.zeros((1, 1, 3, IMAGE_SIZE, IMAGE_SIZE), np.float16)
    out = prepare_batch(p, {"IMAGE": pixels}, ["Describe <image> this"], True, 4)
    assert out["INPUT_ID"].tolist() == [[12, *SLOT, 13]] and "PIXEL_VALUES" not in out
    assert prepare_batch(p, {}, ["Describe this"], True, 4)["INPUT_ID"].tolist() == [[12, 13]]
    two = ImagePrompts(encoder_dir, tokenizer(), VOCAB, max_num_images=2)
    out = prepare_batch(two, {"IMAGE_URL": urls(data_url(1), data_url(2))}, ["<image> <image> this"], True, 4)
    assert out["INPUT_ID"].tolist() == [[*SLOT, *range(VOCAB + 16, VOCAB + 32), 13]]  # rows count up per item
    assert out["PIXEL_VALUES"].shape[:2] == (1, 2)


@pytest.fixture
def http_image():
    """An http server on 127.0.0.1 with /cat.png; yields its base URL."""
    body = encoded(make_image(3))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_urls_from_allowed_hosts_only(http_image):
    allowed = image_limits(None, "127.0.0.1")
    [image] = images_from_urls([f"{http_image}/cat.png"], allowed)
    assert image.size == (40, 52)
    with pytest.raises(ImageError, match=r"^image_url_input 0: fetching http://127\.0\.0\.1.*/missing\.png failed"):
        images_from_urls([f"{http_image}/missing.png"], allowed)
    for limits in (image_limits(None, None), image_limits(None, "example.com")):
        with pytest.raises(ImageError, match="fetching images from host '127.0.0.1' is not allowed"):
            images_from_urls([f"{http_image}/cat.png"], limits)
    assert images_from_urls([f"{http_image}/cat.png"], image_limits(None, "*"))


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    """The OpenAI frontend's --allowed_local_media_path: file: URLs of files under it, nothing else."""
    media, outside = tmp_path / "media", tmp_path / "outside.png"
    media.mkdir()
    make_image(1).save(media / "cat.png")
    make_image(1).save(outside)
    (media / "escape.png").symlink_to(outside)
    limits = image_limits(None, None, str(media))
    [image] = images_from_urls([f"file://{media}/cat.png"], limits)
    assert image.size == (40, 52)
    for url in (f"file://{outside}", f"file://{media}/../outside.png", f"file://{media}/escape.png"):
        with pytest.raises(ImageError, match="is outside the directory images may be read from"):
            images_from_urls([url], limits)
    with pytest.raises(ImageError, match=r"reading .*missing\.png failed"):
        images_from_urls([f"file://{media}/missing.png"], limits)
    with pytest.raises(ImageError, match="URL scheme 'file' is not allowed on this server"):
        images_from_urls([f"file://{media}/cat.png"], image_limits(None, None))


@pytest.mark.parametrize("images, message", [
    ({"IMAGE_BYTES": np.frombuffer(b"GIF89a but not really", np.uint8).reshape(1, 1, 1, 1, -1)},
     "image_bytes_input image 0 cannot be decoded as an image"),
    ({"IMAGE_BYTES": png(format="TIFF")}, "image_bytes_input image 0 is a TIFF image, which is not supported"),
    ({"IMAGE_URL": urls("data:text/plain;base64,aGk=")}, "data URL media type 'text/plain' is not supported"),
    ({"IMAGE_URL": urls("data:image/png;base64,***")}, "the data URL's base64 payload is not valid base64"),
    ({"IMAGE_URL": urls("file:///etc/passwd")}, "URL scheme 'file' is not allowed"),
    ({"IMAGE_BYTES": png(size=(120, 120))}, "is 120x120 = 14400 pixels; allowed: at most 10000 pixels"),
    ({"IMAGE_BYTES": np.zeros((1, 1, 5, 6, 7), np.uint8)}, "no channel dimension of 1, 3 or 4"),
    ({"IMAGE_BYTES": np.concatenate([png(), png()], axis=1)}, "2 images were sent; allowed: at most 1 per request"),
    ({"IMAGE": np.zeros((1, 1, 3, 4, 4), np.float16), "IMAGE_BYTES": png()}, "image_input and image_bytes_input"),
    ({"VIDEO_BYTES": np.zeros((1, 2, 4, 4, 3), np.uint8)}, "video_bytes_input: video is not supported for llava"),
])
def test_bad_images_get_errors_naming_the_input(encoder_dir, images, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        prepare_batch(prompts(encoder_dir, max_pixels=10000), images, ["hi"], True, 4)


def test_placeholders_must_match_the_images(encoder_dir):
    with pytest.raises(ValueError, match="text_input has 2 <image> placeholder\\(s\\) but 1 image\\(s\\) were sent"):
        prepare_batch(prompts(encoder_dir), {"IMAGE_BYTES": png()}, ["<image> a <image> b"], True, 4)
    with pytest.raises(ValueError, match="text_input has 1 <image> placeholder\\(s\\) but 0 image\\(s\\) were sent"):
        prepare_batch(prompts(encoder_dir), {}, ["<image> a"], True, 4)


def test_images_to_a_text_only_model_are_refused_by_name():
    with pytest.raises(ValueError, match="^image_bytes_input: images and video were sent to a text-only model"):
        refuse_images_on_text_model({"IMAGE_BYTES": png()})
    refuse_images_on_text_model({"IMAGE_URL": urls(""), "IMAGE_BYTES": np.zeros((1, 0, 1, 1, 1), np.uint8)})
    bls = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([4], np.int32),
           "image_input": np.ones((1, 1, 3, 2, 2), np.float16)}
    with pytest.raises(ValueError, match="^image_input: images and video sent to a text-only model"):
        validate(bls)
    validate(bls, multimodal_encoders_name="multimodal_encoders")
    with pytest.raises(ValueError, match="Multimodal and speculative decoding is not currently supported"):
        validate({**bls, "num_draft_tokens": np.array([2], np.int32)}, "draft", "multimodal_encoders")


def test_encoder_inputs_per_row():
    pixels = np.ones((2, 1, 3, 4, 4), np.float16)
    assert [r.shape for r, _ in rows_pixels(pixels, None)] == [(1, 3, 4, 4), (1, 3, 4, 4)]
    assert rows_pixels(None, np.ones((1, 3, 4, 4), np.float16))[0][0].shape == (1, 3, 4, 4)  # (B, 3, H, W)
    assert rows_pixels(None, None) == [(None, None)]
    sizes = np.array([[[52, 40]], [[30, 90]]], np.int64)  # (B, images, 2): anyres families' image_sizes
    assert [s.tolist() for _, s in rows_pixels(pixels, None, sizes)] == [[[52, 40]], [[30, 90]]]
    with pytest.raises(ValueError, match="image_input has shape"):
        rows_pixels(None, np.ones((1, 1, 2, 4, 4), np.float16))
    assert images_from_bytes(np.asarray(make_image(1))[None], ImageLimits())[0].size == (40, 52)
