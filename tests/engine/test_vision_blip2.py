"""BLIP-2 (ViT + Q-Former + projection over OPT) through engine.build: the encoder's rows equal
transformers' image features, greedy ids through encoder + engine equal transformers' generate on the
processor's outputs (two images batched beside a text-only request), and the Triton models' serving side
(preprocessing's prompt in the anchor's blip2 layout: the query slot, then the text with its BOS ->
multimodal_encoders' table -> tensorrt_llm's request) gives the same ids."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.hf_checkpoint import CheckpointError  # noqa: E402
from engine.vision import blip2  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, vision_encoder_dir, write_vision_encoder  # noqa: E402
from engine.vision.registry import VISION_FAMILIES  # noqa: E402
from tests.engine.table_graph_check import dense_table_steps_checked  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens, served_table_ids  # noqa: E402
from tiny_blip2 import NUM_QUERY_TOKENS, hf_model, processor, write_checkpoint  # noqa: E402
from tiny_llava import IMAGE_TOKEN_INDEX, VOCAB, encoded, make_image  # noqa: E402

NEW_TOKENS = 6
TEXT = "Question: which city is this? Answer:"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(checkpoint dir, engine dir, transformers model)."""
    root = tmp_path_factory.mktemp("blip2")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4"]) == 0
    return checkpoint, str(root / "engine"), hf_model()


def hf_ids(hf, batch) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


def test_greedy_ids_through_encoder_and_engine_equal_transformers_generate(built, tmp_path):
    _, engine, hf = built
    config = json.load(open(f"{vision_encoder_dir(engine)}/config.json"))
    assert config["builder_config"]["model_type"] == "blip2-opt" and config["num_image_tokens"] == NUM_QUERY_TOKENS
    batches = [processor()(images=[make_image(seed)], text=[TEXT], return_tensors="pt") for seed in (1, 2)]
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    tables = encoder.image_features(torch.cat([b["pixel_values"] for b in batches]))  # one batch of images
    with torch.no_grad():
        expected = hf.get_image_features(pixel_values=batches[0]["pixel_values"]).pooler_output[0]
    torch.testing.assert_close(tables[0], expected, atol=1e-5, rtol=1e-5)
    # the processor's prompt: the query slot (image tokens), then <s> and the text
    prompts = [[VOCAB + i if t == IMAGE_TOKEN_INDEX else t for i, t in enumerate(b["input_ids"][0].tolist())]
               for b in batches]
    assert prompts[0][:NUM_QUERY_TOKENS + 1] == [*range(VOCAB, VOCAB + NUM_QUERY_TOKENS), 1]
    requests = [Request(p, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True),
                        prompt_table=PromptTable(t)) for p, t in zip(prompts, tables)]
    text_only = [1, 15, 16, 17]
    requests.append(Request(text_only, NEW_TOKENS, output=OutputConfig(exclude_input_from_output=True)))
    with Executor(engine, ExecutorConfig(), device="cpu") as executor:
        with dense_table_steps_checked(executor) as checked:  # the prefill graphs' table twin, on the CPU
            ids = executor.enqueue_requests(requests)
            responses = collect(executor, ids)
        assert checked
    outputs = [final_tokens(responses[i]) for i in ids]
    assert outputs[:2] == [hf_ids(hf, b) for b in batches]
    with torch.no_grad():
        assert outputs[2] == hf.language_model.generate(input_ids=torch.tensor([text_only]), max_new_tokens=NEW_TOKENS,
                                                        do_sample=False)[0, 4:].tolist()
    assert outputs[0] != outputs[1]  # the image matters

    # float16 encoders keep the Q-Former float32 (transformers' _keep_in_fp32_modules); OPT is the only language model
    from engine.convert import getter_from_safetensors_dir

    get = getter_from_safetensors_dir(str(built[0]))
    half = load_vision_encoder(write_vision_encoder(VISION_FAMILIES["Blip2ForConditionalGeneration"], hf.config, get,
                                                    str(tmp_path / "half"), "float16", str(built[0])))
    assert half.query_tokens.dtype == half.qformer[0].cross.key.weight.dtype == torch.float32
    assert half.tower.patch_embed.weight.dtype == half.language_projection.weight.dtype == torch.float16
    t5 = type(hf.config)(text_config={"model_type": "t5"})
    with pytest.raises(CheckpointError, match="BLIP-2 over a t5 language model is not supported; supported: BLIP-2 over OPT"):
        blip2.text_config(t5)


def test_triton_pipeline_preprocessing_encoders_tensorrt_llm_give_transformers_ids(built):
    """preprocessing (prepare_batch: the anchor's blip2 layout, fake ids then the text with its
    special tokens; PIXEL_VALUES by the checkpoint's processor) -> multimodal_encoders
    (VisionEncoderRunner.tables, FP16) -> tensorrt_llm (convert_request) = transformers' generate."""
    from serving.multimodal import ImagePrompts, VisionEncoderRunner, prepare_batch
    from tiny_blip2 import tokenizer

    _, engine, hf = built
    encoder_dir = vision_encoder_dir(engine)
    prompts = ImagePrompts(encoder_dir, tokenizer(), VOCAB)
    png = np.frombuffer(encoded(make_image(3)), np.uint8).reshape(1, 1, 1, 1, -1)  # (batch, images, encoded file)
    pre = prepare_batch(prompts, {"IMAGE_BYTES": png}, [TEXT], True, 4)
    batch = processor()(images=[make_image(3)], text=[TEXT], return_tensors="pt")
    expected_ids = [VOCAB + i if t == IMAGE_TOKEN_INDEX else t for i, t in enumerate(batch["input_ids"][0].tolist())]
    assert pre["INPUT_ID"][0].tolist() == expected_ids
    np.testing.assert_allclose(pre["PIXEL_VALUES"][0], batch["pixel_values"].numpy(), atol=2e-3)
    [table] = VisionEncoderRunner(encoder_dir, "cpu").tables([pre["PIXEL_VALUES"][0]])
    assert table.shape == (NUM_QUERY_TOKENS, 64) and table.dtype == np.float16
    served = served_table_ids(engine, pre, table, NEW_TOKENS)
    batch["pixel_values"] = batch["pixel_values"].half().float()  # as PIXEL_VALUES carries them
    assert served == hf_ids(hf, batch)
