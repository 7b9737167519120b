"""Qwen2-VL's parts (the built family through the executor: tests/engine/test_qwen2_vl.py): the vision
tower's rows equal transformers' image features for images of two sizes in one batch; M-RoPE prompt positions and mrope_position_delta equal
transformers' get_rope_index; the per-token rotary tables equal its rotary embedding, and reduce to
plain RoPE wherever the three positions agree (all text, every decode step)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from engine.hf_checkpoint import CheckpointError  # noqa: E402
from engine.vision.mrope import mrope_cos_sin, rope_positions  # noqa: E402
from engine.vision.qwen2_vl import Qwen2VisionEncoder, encoder_config, encoder_weights  # noqa: E402
from tiny_llava import make_image  # noqa: E402

IMAGE_TOKEN = 3
SECTIONS = [2, 3, 3]  # of head_dim / 2 = 8


@pytest.fixture(scope="module")
def hf():
    import transformers

    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=7,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTIONS}),
        image_token_id=IMAGE_TOKEN)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    return model


def processed(*sizes):
    import transformers

    processor = transformers.Qwen2VLImageProcessor(patch_size=7, merge_size=2, temporal_patch_size=2,
                                                   min_pixels=14 * 14, max_pixels=56 * 56)
    return processor([make_image(seed, size) for seed, size in enumerate(sizes)], return_tensors="pt")


def test_tower_rows_equal_transformers_image_features(hf):
    state = hf.state_dict()

    def get(name):
        if name not in state:
            raise CheckpointError(f"no tensor {name}")
        return state[name]

    config = encoder_config(hf.config)
    encoder = Qwen2VisionEncoder(config)
    encoder.load_state_dict(encoder_weights(get, config), strict=True)
    inputs = processed((40, 52), (56, 28))
    with torch.no_grad():
        expected = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                               image_grid_thw=inputs["image_grid_thw"])
    expected = getattr(expected, "pooler_output", expected)
    rows = encoder.image_features(inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    assert [r.shape for r in rows] == [e.shape for e in expected]
    for got, want in zip(rows, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prompt_positions_and_delta_equal_get_rope_index(hf):
    grids = processed((40, 52), (56, 28))["image_grid_thw"]
    rows = (grids.prod(-1) // 4).tolist()
    ids = [1, 5, *[IMAGE_TOKEN] * rows[0], 7, 8, *[IMAGE_TOKEN] * rows[1], 9, 10, 11]
    input_ids = torch.tensor([ids])
    expected, delta = hf.model.get_rope_index(input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=grids)
    positions, our_delta = rope_positions(ids, IMAGE_TOKEN, grids.tolist(), 2)
    assert torch.equal(positions, expected[:, 0]) and our_delta == int(delta)
    with pytest.raises(ValueError, match="does not match its grid"):
        rope_positions(ids[:-5] + ids[-4:], IMAGE_TOKEN, grids.tolist(), 2)  # one image row short


def test_rotary_tables_equal_transformers_and_reduce_to_plain_rope(hf):
    grids = processed((40, 52))["image_grid_thw"].tolist()
    ids = [1, 5, *[IMAGE_TOKEN] * (grids[0][0] * grids[0][1] * grids[0][2] // 4), 7, 8]
    positions, delta = rope_positions(ids, IMAGE_TOKEN, grids, 2)
    rotary = hf.model.language_model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[:, None])
    ours = mrope_cos_sin(positions, 16, 10000.0, SECTIONS)
    torch.testing.assert_close(ours[0], cos[0])
    torch.testing.assert_close(ours[1], sin[0])
    # a decode step after the prompt: all three positions len(ids) + delta, i.e. plain RoPE there
    step = torch.full((3, 1), len(ids) + delta)
    plain = (step[0].float()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))).repeat(1, 2)
    torch.testing.assert_close(mrope_cos_sin(step, 16, 10000.0, SECTIONS)[0], plain.cos())
