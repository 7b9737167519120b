"""Llama 3.2 Vision (Mllama) through engine.build: the tiled ViT's states equal transformers' vision model +
projector; greedy ids through the vision encoder and the engine (cross-attention layers over the cross-KV
pool, per-token masks) equal transformers' generate on the processor's outputs: one image after some text
(its text rows see no image), two images in a row, chunked prefill, beside a text-only request (which skips
the cross layers); named errors for bad vision inputs."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.encoder_decoder.mllama_cross import CrossMask  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, vision_encoder_dir  # noqa: E402
from serving.mllama import dense_mask  # noqa: E402
from tests.executor.executor_testing import collect, generated_ids  # noqa: E402
from tiny_llava import make_image  # noqa: E402
from tiny_mllama import IMAGE_TOKEN, MAX_TILES, PATCHES_PER_TILE, hf_model, processor, write_checkpoint  # noqa: E402

NEW_TOKENS = 6
ONE_IMAGE = MAX_TILES * PATCHES_PER_TILE


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(engine dir, transformers model)."""
    root = tmp_path_factory.mktemp("mllama")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4",
                 "--max_encoder_input_len", str(2 * ONE_IMAGE)]) == 0
    return str(root / "engine"), hf_model()


def hf_ids(hf, batch) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def image_request(encoder, batch, output: OutputConfig | None = None) -> Request:
    """The engine's request for one processor output: vision states + the processor's mask over them."""
    states = encoder.image_features(batch["pixel_values"][0], batch["aspect_ratio_ids"][0],
                                    batch["aspect_ratio_mask"][0]).flatten(0, 1)
    mask = dense_mask(batch["cross_attention_mask"][0].numpy(), PATCHES_PER_TILE)
    return Request(batch["input_ids"][0].tolist(), NEW_TOKENS, encoder_input_features=states,
                   cross_attention_mask=mask, output=output or OutputConfig(exclude_input_from_output=True))


def test_vision_states_equal_transformers(built):
    engine, hf = built
    config = json.load(open(f"{vision_encoder_dir(engine)}/config.json"))
    assert config["builder_config"]["model_type"] == "mllama" and config["num_image_tokens"] == ONE_IMAGE
    batch = processor()(images=[[make_image(1, (40, 52)), make_image(2, (60, 20))]],
                        text=[f"{IMAGE_TOKEN}{IMAGE_TOKEN} What"], return_tensors="pt")
    assert batch["aspect_ratio_mask"][0].sum(1).tolist() == [4, 3]  # the second image has a padded tile
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    ours = encoder.image_features(batch["pixel_values"][0], batch["aspect_ratio_ids"][0], batch["aspect_ratio_mask"][0])
    with torch.no_grad():
        states = hf.model.vision_model(pixel_values=batch["pixel_values"], aspect_ratio_ids=batch["aspect_ratio_ids"],
                                       aspect_ratio_mask=batch["aspect_ratio_mask"]).last_hidden_state
        expected = hf.model.multi_modal_projector(states).reshape(2, ONE_IMAGE, -1)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_cross_mask_rows():
    dense = np.array([[0, 0], [1, 0], [1, 1], [1, 1]], bool)
    mask = CrossMask.from_dense(dense)
    assert mask.rows_at(np.array([0, 1, 2, 3, 9])).tolist() == dense[[0, 1, 2, 3, 3]].tolist()
    assert dense_mask(np.array([[[1, 0]], [[0, 1]]]), 3).tolist() == [[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]]


def test_greedy_ids_equal_transformers_generate(built):
    assert_greedy_ids_equal_transformers(*built)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_ids_equal_transformers(built):
    """The same on a GPU (float32): the self-attention layers through the Triton kernels, the cross layers
    through torch's fused attention over the gathered cross blocks."""
    assert_greedy_ids_equal_transformers(*built, device="cuda")


def assert_greedy_ids_equal_transformers(engine: str, hf, device: str | None = None) -> None:
    proc = processor()
    encoder = load_vision_encoder(vision_encoder_dir(engine), device or "cpu")
    one = proc(images=[[make_image(1, (40, 52))]], text=[f"What is {IMAGE_TOKEN} in the image?"], return_tensors="pt")
    two = proc(images=[[make_image(2, (60, 20)), make_image(3, (30, 30))]],
               text=[f"{IMAGE_TOKEN}{IMAGE_TOKEN} Describe this picture"], return_tensors="pt")
    text_only = [1, 12, 13, 14]
    requests = [image_request(encoder, one), image_request(encoder, two),
                Request(text_only, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True))]
    # chunks of 4 tokens: prompts split over steps, text-only and image rows in the same steps
    got = generated_ids(engine, requests, ExecutorConfig(max_num_tokens=4, enable_chunked_context=True), device)
    with torch.no_grad():
        expected_text = hf.generate(input_ids=torch.tensor([text_only]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, len(text_only):].tolist()
    assert got == [hf_ids(hf, one), hf_ids(hf, two), expected_text]


def test_bad_vision_inputs_are_named(built):
    engine, _ = built
    states = torch.zeros(ONE_IMAGE, 64)
    mask = np.ones((3, ONE_IMAGE), bool)
    cases = [(dict(encoder_input_features=states), "cross_attention_mask: required with encoder_input_features"),
             (dict(cross_attention_mask=mask), "cross_attention_mask: sent without encoder_input_features"),
             (dict(encoder_input_features=torch.zeros(ONE_IMAGE - 1, 64), cross_attention_mask=mask),
              "encoder_input_features: shape"),
             (dict(encoder_input_features=torch.zeros(3 * ONE_IMAGE, 64),
                   cross_attention_mask=np.ones((3, 3 * ONE_IMAGE), bool)), "exceed the engine's max_encoder_input_len"),
             (dict(encoder_input_features=states, cross_attention_mask=mask[:, :5]), "cross_attention_mask: shape")]
    with Executor(engine, ExecutorConfig()) as executor:
        ids = executor.enqueue_requests([Request([1, 7, 8], 2, **kw) for kw, _ in cases])
        responses = collect(executor, ids)
    for request_id, (_, message) in zip(ids, cases):
        assert message in responses[request_id][-1].error


def fp16_states(hf):
    """transformers with its vision states rounded to float16, as multimodal_encoders sends them."""
    return hf.model.multi_modal_projector.register_forward_hook(lambda module, args, out: out.half().float())


def test_triton_pipeline_preprocessing_encoders_tensorrt_llm_give_transformers_ids(built):
    """preprocessing (prepare_batch: the checkpoint's processor on text_input with <|image|>, as the anchor's
    client sends it) -> the BLS's mapping -> multimodal_encoders (encoder_outputs: FP16 states, the mask with max_tokens rows more,
    skip for a text-only item) -> tensorrt_llm (convert_request: encoder_input_features / cross_attention_mask)
    = transformers' generate on the processor's outputs; an item without images skips the cross layers."""
    from serving.bls import LLM_INPUTS_FROM_ENCODERS, encoder_inputs
    from serving.mllama import encoder_outputs
    from serving.multimodal import ImagePrompts, engine_vocab_size, prepare_batch
    from serving.requests import convert_request, to_executor_request
    from tiny_llava import encoded
    from tiny_mllama import tokenizer

    engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    prompts = ImagePrompts(encoder_dir, tokenizer(), engine_vocab_size(engine))
    image, text = make_image(4, (44, 30)), f"{IMAGE_TOKEN}If I had to write a haiku for this one"
    png = np.frombuffer(encoded(image), np.uint8).reshape(1, 1, 1, 1, -1)  # (batch, images, encoded file)
    got = []
    for tensors, query in (({"IMAGE_BYTES": png}, text), ({}, "What is in the image?")):
        pre = prepare_batch(prompts, tensors, [query], True, 4)
        sent = encoder_inputs({}, pre) if tensors else {}  # what the BLS sends multimodal_encoders (as the ensemble)
        outputs = encoder_outputs(load_vision_encoder(encoder_dir), "cpu", sent.get("pixel_values"),
                                  sent.get("aspect_ratio_ids"), sent.get("aspect_ratio_mask"),
                                  sent.get("cross_attention_mask"), np.array([[NEW_TOKENS]], np.int32))
        assert outputs["SKIP_CROSS_ATTN_BLOCKS"].tolist() == [[not tensors]]
        inputs = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"],
                  "request_output_len": np.array([[NEW_TOKENS]], np.int32),
                  **{llm: outputs[name] for name, llm in LLM_INPUTS_FROM_ENCODERS.items() if name in outputs}}
        [spec] = convert_request(inputs, decoupled=False, exclude_input_default=True, cross_attention=True)
        got.append((pre["INPUT_ID"][0].tolist(), to_executor_request(spec)))
    got = [(ids, generated) for (ids, _), generated in zip(got, generated_ids(engine, [r for _, r in got],
                                                                               ExecutorConfig()))]
    batch = processor()(images=[[image]], text=[text], return_tensors="pt")
    assert got[0][0] == batch["input_ids"][0].tolist()
    batch["pixel_values"] = batch["pixel_values"].half().float()  # as PIXEL_VALUES carries them
    hook = fp16_states(hf)
    try:
        expected = hf_ids(hf, batch)
    finally:
        hook.remove()
    text_batch = processor()(text=["What is in the image?"], return_tensors="pt")
    assert [ids for _, ids in got] == [expected, hf_ids(hf, text_batch)]
    with pytest.raises(ValueError, match="image_input: Llama 3.2 Vision takes images as image_bytes_input"):
        prepare_batch(prompts, {"IMAGE": np.zeros((1, 1, 3, 28, 28), np.float16)}, [text], True, 4)
    with pytest.raises(ValueError, match="cross_attention_mask is required with encoder_input_features"):
        convert_request({"input_ids": np.array([[1, 2]], np.int32), "request_output_len": np.array([[2]], np.int32),
                         "encoder_input_features": np.zeros((1, ONE_IMAGE, 64), np.float16)},
                        decoupled=False, cross_attention=True)


def test_openai_image_path_gives_the_pipelines_ids(built):
    """The OpenAI frontend's direct path: ChatImages encodes the image in process, the chat template's
    <|image|> id stays, cross_inputs makes the processor's mask from the ids; = transformers' generate."""
    import asyncio
    import base64

    pytest.importorskip("tritonclient", reason="the OpenAI frontend's direct path needs tritonclient")
    from openai_frontend.protocol import SamplingParams
    from openai_frontend.triton_client import direct_inputs
    from openai_frontend.vision import ChatImages, VisionSettings
    from serving.requests import convert_request, to_executor_request
    from tiny_llava import encoded
    from tiny_mllama import tokenizer

    engine, hf = built
    image = make_image(5, (30, 50))
    url = "data:image/png;base64," + base64.b64encode(encoded(image)).decode()
    images = ChatImages(VisionSettings(vision_encoder_dir(engine)), tokenizer(), device="cpu")
    try:
        states, tiles, _ = asyncio.run(images.encode([{"url": url, "field": "messages[0].content[0]"}]))
        batch = processor()(images=[[image]], text=[f"Describe {IMAGE_TOKEN} this picture"], return_tensors="pt")
        ids = images.expand(batch["input_ids"][0].tolist(), tiles)
        vision = images.cross_inputs(ids, states, tiles)
    finally:
        images.close()
    assert tiles == batch["aspect_ratio_mask"][0].sum(1).tolist()
    assert (vision["cross_attention_mask"][0] == dense_mask(batch["cross_attention_mask"][0].numpy(),
                                                            PATCHES_PER_TILE)).all()
    tensors = direct_inputs(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), NEW_TOKENS, None, 2, 4,
                            vision=vision)
    tensors["streaming"] = np.array([[False]])
    [spec] = convert_request(tensors, decoupled=False, cross_attention=True)
    got = generated_ids(engine, [to_executor_request(spec)], ExecutorConfig())[0]
    hook = fp16_states(hf)
    try:
        assert got == hf_ids(hf, batch)
    finally:
        hook.remove()



def test_a_resent_image_reuses_its_prompt_blocks_and_another_image_does_not(built):
    """Prompt blocks of a request with images are keyed by its vision states and mask too: the same image
    again reuses them, the same prompt with another image (same ids) does not, and its ids still differ."""
    engine, _ = built
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    text = [f"{IMAGE_TOKEN}Describe this picture What is in the image?"]

    def request(seed: int) -> Request:
        batch = processor()(images=[[make_image(seed, (40, 52))]], text=text, return_tensors="pt")
        return image_request(encoder, batch, output=OutputConfig(exclude_input_from_output=True,
                                                                 return_perf_metrics=True))

    with Executor(engine, ExecutorConfig()) as executor:
        results = []
        for seed in (6, 6, 7):
            [request_id] = executor.enqueue_requests([request(seed)])
            results.append(collect(executor, [request_id])[request_id][-1].result)
    assert [r.perf.kv_cache_reused_blocks for r in results] == [0, 2, 0]  # 10 prompt tokens: 2 full blocks of 4
    assert results[1].output_token_ids == results[0].output_token_ids != results[2].output_token_ids


def test_unsupported_builds_are_refused_by_name(built, tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint"
    write_checkpoint(checkpoint)
    for flags, message in ((["--tp_size", "2"], "tp_size 2: MllamaForConditionalGeneration (Llama 3.2 Vision) builds "
                                                "for one GPU only"),
                           (["--max_encoder_input_len", "10"], f"a Llama 3.2 Vision image brings {ONE_IMAGE} vision")):
        assert main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine"), *flags]) != 0
        assert message in capsys.readouterr().err
