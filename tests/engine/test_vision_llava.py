"""LLaVA-1.5 through engine.build: the language engine plus vision_encoder/; the plain-torch encoder
gives transformers' image features, and greedy ids through encoder + engine equal transformers'
generate on the same processor outputs (images batched, beside a text-only request)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, vision_encoder_dir  # noqa: E402
from tests.engine.table_graph_check import dense_table_steps_checked  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens  # noqa: E402
from tiny_llava import IMAGE_TOKEN_INDEX, VOCAB, hf_model, image_processor, make_image, write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def llava_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    checkpoint = write_checkpoint(root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "128", "--tokens_per_block", "4"]) == 0
    return str(root / "engine")


def pixel_values(*seeds: int) -> torch.Tensor:
    return image_processor()([make_image(s) for s in seeds], return_tensors="pt")["pixel_values"]


def test_build_writes_the_encoder_directory_the_anchor_reads(llava_engine):
    encoder_dir = vision_encoder_dir(llava_engine)
    config = json.load(open(f"{encoder_dir}/config.json"))
    assert config["builder_config"]["model_type"] == "llava"
    assert config["num_image_tokens"] == 16 and config["llava"]["feature_layers"] == [2]
    assert json.load(open(f"{encoder_dir}/preprocessor_config.json"))["crop_size"] == {"height": 28, "width": 28}
    assert json.load(open(f"{llava_engine}/config.json"))["model"]["vocab_size"] == VOCAB


def test_image_features_equal_transformers(llava_engine):
    hf = hf_model()
    pixels = pixel_values(1, 2, 3)
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                               vision_feature_select_strategy="default")
    expected = getattr(expected, "pooler_output", expected)  # (transformers 5: an output object)
    expected = torch.stack(list(expected)) if isinstance(expected, (list, tuple)) else expected
    features = load_vision_encoder(vision_encoder_dir(llava_engine)).encode(pixels)
    assert features.shape == (3, 16, 64)
    torch.testing.assert_close(features, expected.reshape(3, 16, 64), atol=1e-5, rtol=1e-5)


def test_greedy_ids_through_encoder_and_engine_equal_transformers_generate(llava_engine):
    hf = hf_model()
    encoder = load_vision_encoder(vision_encoder_dir(llava_engine))
    seeds = [1, 2]
    features = encoder.encode(pixel_values(*seeds))  # one batch of images
    prompt = [1, 5, *range(VOCAB, VOCAB + 16), 7, 8, 9, 10, 11, 6]  # USER: <image> What is in the image? ASSISTANT:
    requests = [Request(prompt, 8, output=OutputConfig(exclude_input_from_output=True),
                        prompt_table=PromptTable(f)) for f in features]
    requests.append(Request([1, 5, 12, 13, 14, 6], 8, output=OutputConfig(exclude_input_from_output=True)))
    with Executor(llava_engine, ExecutorConfig(), device="cpu") as executor:
        with dense_table_steps_checked(executor) as checked:  # the prefill graphs' table twin, on the CPU
            ids = executor.enqueue_requests(requests)
            responses = collect(executor, ids)
        assert checked
    hf_prompt = torch.tensor([[t if t < VOCAB else IMAGE_TOKEN_INDEX for t in prompt]])
    for seed, request_id in zip(seeds, ids):
        expected = hf.generate(input_ids=hf_prompt, pixel_values=pixel_values(seed), max_new_tokens=8,
                               do_sample=False)[0, hf_prompt.shape[1]:]
        assert final_tokens(responses[request_id]) == expected.tolist()
    text_prompt = torch.tensor([[1, 5, 12, 13, 14, 6]])
    expected = hf.generate(input_ids=text_prompt, max_new_tokens=8, do_sample=False)[0, 6:]
    assert final_tokens(responses[ids[-1]]) == expected.tolist()
    outputs = [final_tokens(responses[i]) for i in ids[:2]]
    assert outputs[0] != outputs[1]  # the image matters
