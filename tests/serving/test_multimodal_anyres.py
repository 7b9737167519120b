"""LLaVA-NeXT and LLaVA-OneVision through the serving side without a server: preprocessing lays out
each image's rows from its size (IMAGE_SIZES out, the successor's image_sizes_input in for image_input),
its tiles go to multimodal_encoders as PIXEL_VALUES, and the table made of them equals transformers'
image features; OneVision's images in a multi-image request are one tile each, as transformers does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.vision.encoder_dir import vision_encoder_dir  # noqa: E402
from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch, rows_pixels  # noqa: E402
from tiny_llava import VOCAB, encoded, make_image, tokenizer  # noqa: E402
from tiny_llava_next import KINDS, hf_model, image_processor, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=KINDS)
def built(request, tmp_path_factory):
    """(kind, vision-encoder dir, transformers model)."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_checkpoint(request.param, root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "256"]) == 0
    return request.param, vision_encoder_dir(str(root / "engine")), hf_model(request.param)


def png(seed: int, size: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(encoded(make_image(seed, size)), np.uint8).reshape(1, 1, 1, -1)


def hf_rows(hf, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        features = hf.model.get_image_features(**inputs)
    return torch.cat(list(getattr(features, "pooler_output", features)))


def test_one_image_rows_from_its_size_and_the_table_equals_transformers(built):
    kind, encoder_dir, hf = built
    prompts = ImagePrompts(encoder_dir, tokenizer(), VOCAB)
    query = "<image> What is in the image?"  # (LLaVA-NeXT's prompt is its language model's template)
    out = prepare_batch(prompts, {"IMAGE_BYTES": png(1, (40, 52))[None]}, [query], True, 4)
    expected = image_processor(kind)([make_image(1, (40, 52))], return_tensors="pt")
    rows = hf_rows(hf, {"pixel_values": expected["pixel_values"], "image_sizes": expected["image_sizes"]})
    assert out["INPUT_ID"].tolist() == [[*range(VOCAB, VOCAB + len(rows)), 7, 8, 9, 10, 11]]
    assert out["IMAGE_SIZES"].tolist() == [[[52, 40]]]
    (pixels, sizes), = rows_pixels(out["PIXEL_VALUES"], None, out["IMAGE_SIZES"])
    table = VisionEncoderRunner(encoder_dir, "cpu").tables([pixels], [sizes])[0]
    np.testing.assert_allclose(table, rows.numpy(), atol=1e-2, rtol=1e-2)  # (FP16 pixels and table on the way)
    # image_input (the client's tiles) takes its sizes from image_sizes_input, and needs them
    client = {"IMAGE": out["PIXEL_VALUES"], "IMAGE_SIZES": out["IMAGE_SIZES"]}
    assert prepare_batch(prompts, client, [query], True, 4)["INPUT_ID"].tolist() == out["INPUT_ID"].tolist()
    with pytest.raises(ValueError, match="image_sizes_input"):
        prepare_batch(prompts, {"IMAGE": out["PIXEL_VALUES"]}, [query], True, 4)


def test_two_images_in_one_request(built):
    kind, encoder_dir, hf = built
    prompts = ImagePrompts(encoder_dir, tokenizer(), VOCAB, max_num_images=2)
    files = [png(2, (40, 52)).reshape(-1), png(3, (90, 30)).reshape(-1)]  # one request's two encoded files
    padded = np.zeros((1, 2, 1, 1, max(map(len, files))), np.uint8)  # (the shorter one zero-padded)
    for i, data in enumerate(files):
        padded[0, i, 0, 0, :len(data)] = data
    out = prepare_batch(prompts, {"IMAGE_BYTES": padded}, ["<image> and <image>"], True, 4)
    pil = [make_image(2, (40, 52)), make_image(3, (90, 30))]
    if kind == "llava_onevision":  # several images in one request: one tile each, as its processor and model
        expected = image_processor(kind)([pil], return_tensors="pt")
        rows = hf_rows(hf, {"pixel_values": expected["pixel_values"], "image_sizes": expected["image_sizes"],
                            "batch_num_images": torch.tensor([2])})
        assert len(rows) == 2 * 17  # 16 rows and a newline each
    else:
        expected = image_processor(kind)(pil, return_tensors="pt")
        rows = hf_rows(hf, {"pixel_values": expected["pixel_values"], "image_sizes": expected["image_sizes"]})
    assert out["INPUT_ID"].shape[1] == len(rows) + 1  # both images' rows and the word "and"
    (pixels, sizes), = rows_pixels(out["PIXEL_VALUES"], None, out["IMAGE_SIZES"])
    table = VisionEncoderRunner(encoder_dir, "cpu").tables([pixels], [sizes])[0]
    np.testing.assert_allclose(table, rows.numpy(), atol=1e-2, rtol=1e-2)
