"""LLaVA-NeXT (anyres tiles + image_newline over CLIP and Llama) and LLaVA-OneVision (SigLIP, Qwen2,
the anyres_max cap) through engine.build: for images of two sizes and aspect ratios in one encoder
batch, each image's rows number what the preprocessing computes from its size, and greedy ids
through encoder + engine equal transformers' generate (the rows themselves are held to transformers'
image features in tests/serving/test_multimodal_anyres.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from engine.build import main  # noqa: E402
from engine.executor import Executor, ExecutorConfig, OutputConfig, Request  # noqa: E402
from engine.executor.prompt_table import PromptTable  # noqa: E402
from engine.vision.encoder_dir import load_vision_encoder, read_encoder_config, vision_encoder_dir  # noqa: E402
from engine.vision.anyres import image_token_counts  # noqa: E402
from tests.executor.executor_testing import collect, final_tokens  # noqa: E402
from tiny_llava import IMAGE_TOKEN_INDEX, VOCAB, make_image  # noqa: E402
from tiny_llava_next import KINDS, hf_model, image_processor, write_checkpoint  # noqa: E402

SIZES = [(40, 52), (90, 30)]  # (width, height): a tall image (2 x 1 tiles) and a wide one (1 x 2)


@pytest.fixture(scope="module", params=KINDS)
def built(request, tmp_path_factory):
    """(kind, engine dir, transformers model)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    checkpoint = write_checkpoint(kind, root / "checkpoint")
    assert main(["--checkpoint", str(checkpoint), "--output", str(root / "engine"), "--dtype", "float32",
                 "--max_seq_len", "256", "--tokens_per_block", "4"]) == 0
    return kind, str(root / "engine"), hf_model(kind)


def processed(kind: str, seed: int, size: tuple[int, int]) -> dict:
    return image_processor(kind)([make_image(seed, size)], return_tensors="pt")


def test_greedy_ids_through_encoder_and_engine_equal_transformers_generate(built):
    kind, engine, hf = built
    encoder = load_vision_encoder(vision_encoder_dir(engine))
    inputs = [processed(kind, seed, size) for seed, size in enumerate(SIZES)]
    # both images' tiles in one encoder batch
    tables = encoder.image_features(torch.cat([i["pixel_values"][0] for i in inputs]),
                                    [i["image_sizes"][0].tolist() for i in inputs])
    config = read_encoder_config(vision_encoder_dir(engine))
    assert config["builder_config"]["model_type"] == kind
    assert [len(t) for t in tables] == [image_token_counts(config, i["image_sizes"].tolist(), 1)[0] for i in inputs]
    text = [7, 8, 9, 10, 11, 6]  # What is in the image? ASSISTANT:
    prompts = [[1, 5, *range(VOCAB, VOCAB + len(table)), *text] for table in tables]
    requests = [Request(prompt, 6, output=OutputConfig(exclude_input_from_output=True), prompt_table=PromptTable(table))
                for prompt, table in zip(prompts, tables)]
    with Executor(engine, ExecutorConfig()) as executor:
        ids = executor.enqueue_requests(requests)
        responses = collect(executor, ids)
    outputs = []
    for prompt, request_id, image in zip(prompts, ids, inputs):
        hf_prompt = torch.tensor([[t if t < VOCAB else IMAGE_TOKEN_INDEX for t in prompt]])
        expected = hf.generate(input_ids=hf_prompt, pixel_values=image["pixel_values"],
                               image_sizes=image["image_sizes"], max_new_tokens=6,
                               do_sample=False)[0, hf_prompt.shape[1]:]
        outputs.append(final_tokens(responses[request_id]))
        assert outputs[-1] == expected.tolist()
    assert outputs[0] != outputs[1]  # the image matters
