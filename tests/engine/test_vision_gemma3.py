"""Gemma 3 (SigLIP + pooled projector over the Gemma 3 text model) through engine.build: the encoder's rows
equal transformers' image features; greedy ids through encoder + engine, with each image's rows attending
to each other both ways in prefill, equal transformers' generate on the processor's outputs (two images,
chunked prefill that would split an image, beside a text-only request); the Triton models' serving side
(preprocessing's Gemma 3 layout -> multimodal_encoders' table -> tensorrt_llm's request) gives the same ids,
with pan-and-scan's crops too."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.image_spans import chunk_end, step_mask, step_span_ahead  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, vision_encoder_dir  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens, served_table_ids  # noqa: E402
from tiny_gemma3 import BOI, IMAGE_TOKEN_ID, MM_TOKENS, hf_model, processor, write_checkpoint  # noqa: E402
from tiny_llava import VOCAB, encoded, make_image  # noqa: E402

NEW_TOKENS = 6
TEXT = f"Describe this picture {BOI} {BOI} What is in the image?"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine dir, transformers model)."""
    root = tmp_path_factory.mktemp("gemma3")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4"]) == 0
    return str(root / "engine"), hf_model()


def fake_ids(ids: list[int]) -> list[int]:
    """transformers' prompt with each image token replaced by its table row's placeholder id."""
    rows = iter(range(VOCAB, VOCAB + 1000))
    return [next(rows) if t == IMAGE_TOKEN_ID else t for t in ids]


def hf_ids(hf, batch) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def test_spans_mask_and_chunk_ends():
    v = 10
    ids = [1, 2, v, v + 1, v + 2, 3, v + 3, v + 4, 4]
    assert chunk_end(ids, 9, 0, 4, v, 16) == 2  # would end inside the first image: stops before it
    assert chunk_end(ids, 9, 2, 2, v, 16) == -3  # the image alone does not fit: wait for 3 tokens of budget
    assert chunk_end(ids, 9, 2, 2, v, 2) == 2  # never fits: cut
    assert chunk_end(ids, 9, 0, 5, v, 16) == 5 and chunk_end(ids, 9, 5, 4, v, 16) == 4
    mask = step_mask([(5, ids[:5]), (1, [])], v)
    assert mask[:5, :5].tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1],
                                     [1, 1, 1, 1, 1]] and mask[5, :1].tolist() == [True]
    assert step_mask([(3, [1, v, 2])], v) is None  # one-row spans change nothing
    assert step_span_ahead([(5, ids[:5]), (1, [])], v).tolist() == [0, 0, 2, 1, 0, 0]


def test_greedy_ids_with_bidirectional_image_spans_equal_transformers_generate(built):
    assert_greedy_ids_equal_transformers(*built)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_ids_equal_transformers(built):
    """The same on a GPU (float32), every step's attention in the Triton kernels: prefill chunks with
    image spans read AttentionMetadata.span_ahead (decode CUDA graphs included)."""
    assert_greedy_ids_equal_transformers(*built, device="cuda")


def assert_greedy_ids_equal_transformers(engine: str, hf, device: str | None = None) -> None:
    config = json.load(open(f"{vision_encoder_dir(engine)}/config.json"))
    assert config["builder_config"]["model_type"] == "gemma3" and config["num_image_tokens"] == MM_TOKENS
    batch = processor()(images=[[make_image(1), make_image(2)]], text=[TEXT], return_tensors="pt")
    assert batch["token_type_ids"].sum() == 2 * MM_TOKENS
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    rows = [r.cpu() for r in encoder.image_features(batch["pixel_values"])]
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    torch.testing.assert_close(torch.stack(rows), expected, atol=1e-5, rtol=1e-5)
    prompt = fake_ids(batch["input_ids"][0].tolist())
    text_only = [1, 12, 13, 14]
    requests = [Request(prompt, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True,
                                                                return_context_logits=True),
                        prompt_table=PromptTable(torch.cat(rows))),
                Request(text_only, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True))]
    # chunks of 8 tokens: the scheduler ends a chunk before an image rather than inside it
    with Executor(engine, ExecutorConfig(max_num_tokens=8, enable_chunked_context=True), device=device) as executor:
        ids = executor.enqueue_requests(requests)
        responses = collect(executor, ids)
    got = [final_tokens(responses[i]) for i in ids]
    expected_image = hf_ids(hf, batch)
    with torch.no_grad():
        expected_text = hf.generate(input_ids=torch.tensor([text_only]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, len(text_only):].tolist()
    assert got == [expected_image, expected_text]
    with torch.no_grad():  # every prompt row, the images' too, as transformers' with the token_type_ids mask
        logits = hf(**batch).logits[0]
        causal = hf(**{k: v for k, v in batch.items() if k != "token_type_ids"}).logits[0]
    assert (causal - logits).abs().max() > 1e-2  # without the spans transformers' rows differ: they matter here
    torch.testing.assert_close(responses[ids[0]][-1].result.context_logits.cpu(), logits, atol=1e-4, rtol=1e-4)


def test_triton_pipeline_preprocessing_encoders_tensorrt_llm_give_transformers_ids(built):
    """preprocessing (prepare_batch: <start_of_image> in text_input becomes the processor's
    \\n\\n<start_of_image> rows <end_of_image>\\n\\n, the rows as fake ids) -> multimodal_encoders
    (VisionEncoderRunner.tables, FP16) -> tensorrt_llm (convert_request) = transformers' generate."""
    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from tiny_gemma3 import tokenizer

    engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    prompts = ImagePrompts(encoder_dir, tokenizer(), VOCAB)
    text = f"{BOI} What is in the image?"
    png = np.frombuffer(encoded(make_image(3)), np.uint8).reshape(1, 1, 1, 1, -1)  # (batch, images, encoded file)
    pre = prepare_batch(prompts, {"IMAGE_BYTES": png}, [text], True, 4)
    batch = processor()(images=[make_image(3)], text=[text], return_tensors="pt")
    assert pre["INPUT_ID"][0].tolist() == fake_ids(batch["input_ids"][0].tolist())
    # the OpenAI path: a chat template's <start_of_image> id becomes the same ids
    assert prompts.expand_placeholders(tokenizer().encode(text), [MM_TOKENS]) == pre["INPUT_ID"][0].tolist()
    no_placeholder = prepare_batch(prompts, {"IMAGE_BYTES": png}, ["What is in the image?"], True, 4)
    assert no_placeholder["INPUT_ID"][0].tolist() == pre["INPUT_ID"][0].tolist()  # the image goes first
    [table] = VisionEncoderRunner(encoder_dir, "cpu").tables([pre["PIXEL_VALUES"][0]])
    served = served_table_ids(engine, pre, table, NEW_TOKENS)
    batch["pixel_values"] = batch["pixel_values"].half().float()  # as PIXEL_VALUES carries them
    assert served == hf_ids(hf, batch)
    with pytest.raises(ValueError, match=f"text_input has 2 {BOI} placeholder"):
        prepare_batch(prompts, {"IMAGE_BYTES": png}, [f"{BOI}{BOI} x"], True, 4)


# Crops of 8 pixels and up, so the tiny 28-pixel processor makes them (transformers' default is 256)
PAN_AND_SCAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=4,
                    pan_and_scan_min_ratio_to_activate=1.2)


def test_pan_and_scan_crops_give_transformers_ids(built, tmp_path):
    """A preprocessor config with do_pan_and_scan on: preprocessing's PIXEL_VALUES are each image then its
    crops as the image processor makes them (a 90 x 30 image: 3 crops; a 40 x 52 one: 2), its prompt
    Gemma3Processor's text for crops (whole-text tokenized, as the OpenAI path's expansion of a template's
    placeholders), multimodal_encoders encodes every crop as an image: served greedy ids equal
    transformers' generate with do_pan_and_scan=True. The OpenAI path (ChatImages, the same engine with
    that preprocessor config) makes the same crops, rows and ids. Crops that leave no room in max_seq_len
    are an error naming the input."""
    from openai_frontend.vision import ChatImages, VisionSettings
    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from tiny_gemma3 import tokenizer

    engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    pas_engine = tmp_path / "engine"  # the engine's files, its vision encoder's preprocessor config with crops on
    (pas_engine / "vision_encoder").mkdir(parents=True)
    for path in Path(engine).iterdir():
        if path.name != "vision_encoder":
            (pas_engine / path.name).symlink_to(path)
    (pas_engine / "vision_encoder" / "model.safetensors").symlink_to(Path(encoder_dir) / "model.safetensors")
    shutil.copy(f"{encoder_dir}/config.json", pas_engine / "vision_encoder")
    with open(f"{encoder_dir}/preprocessor_config.json") as f:
        settings = json.load(f) | PAN_AND_SCAN
    pas_dir = pas_engine / "vision_encoder"
    (pas_dir / "preprocessor_config.json").write_text(json.dumps(settings))
    prompts = ImagePrompts(str(pas_dir), tokenizer(), VOCAB, max_num_images=2, max_seq_len=128)
    images = [make_image(4, (90, 30)), make_image(5)]
    urls = np.array([[b"data:image/png;base64," + base64.b64encode(encoded(image)) for image in images]], object)
    text = f"{BOI} and {BOI} What is in the image?"
    pre = prepare_batch(prompts, {"IMAGE_URL": urls}, [text], True, 4)
    batch = processor()(images=[images], text=[text], return_tensors="pt", **PAN_AND_SCAN)
    assert batch["pixel_values"].shape[0] == 1 + 3 + 1 + 2 == pre["PIXEL_VALUES"].shape[1]
    assert pre["INPUT_ID"][0].tolist() == fake_ids(batch["input_ids"][0].tolist())
    expanded = prompts.expand_placeholders(tokenizer().encode(text), [4 * MM_TOKENS, 3 * MM_TOKENS])  # OpenAI's
    assert expanded == pre["INPUT_ID"][0].tolist()
    [table] = VisionEncoderRunner(encoder_dir, "cpu").tables([pre["PIXEL_VALUES"][0]])
    assert table.shape[0] == 7 * MM_TOKENS
    served = served_table_ids(engine, pre, table, NEW_TOKENS)
    batch["pixel_values"] = batch["pixel_values"].half().float()  # as PIXEL_VALUES carries them
    assert served == hf_ids(hf, batch)
    chat = ChatImages(VisionSettings(str(pas_dir), max_num_images=2), tokenizer(), "cpu")
    chat_table, counts, _ = chat._encode([{"url": url.decode(), "field": f"messages[0].content[{i}]"}
                                          for i, url in enumerate(urls[0])])
    chat.close()
    assert counts == [4 * MM_TOKENS, 3 * MM_TOKENS] and chat_table.shape == table.shape
    np.testing.assert_allclose(chat_table.astype(np.float32), table.astype(np.float32), atol=2e-2)
    assert chat.expand(tokenizer().encode(text), counts) == expanded
    tight = ImagePrompts(str(pas_dir), tokenizer(), VOCAB, max_num_images=2, max_seq_len=40)
    with pytest.raises(ValueError, match="image_bytes_input/image_url_input: Gemma 3's pan-and-scan crops of the "
                                         r"images \(20 rows beside the images' own 8\) make the prompt"):
        prepare_batch(tight, {"IMAGE_URL": urls}, [text], True, 4)
