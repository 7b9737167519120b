"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints made by transformers (2 ViT blocks of width 32, 2 x 2
merger; Qwen2.5-VL's first block attends in windows of 2 x 2 merged rows, its second over the whole
image; a 2-layer Qwen2 of width 64 with M-RoPE sections [2, 3, 3] of head_dim / 2 = 8), tiny_llava's
tokenizer and Qwen2-VL's image processor at 7-pixel patches (an image of up to 56 x 56 pixels: at
most 4 x 4 merged rows). No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import VOCAB, tokenizer

IMAGE_TOKEN = VOCAB - 1  # <|image_pad|>: the id each image row takes in transformers' prompts
VISION_START, VISION_END = VOCAB - 3, VOCAB - 2
VIDEO_TOKEN = VOCAB - 4  # <|video_pad|>: a video's rows
TOKENS_PER_SECOND = 50  # Qwen2.5-VL's M-RoPE time step per second of video: 50 * 2 / 24 fps = 4.17 per frame pair
SECTIONS = [2, 3, 3]
KINDS = ("qwen2_vl", "qwen2_5_vl")


def hf_model(kind: str = "qwen2_vl", seed: int = 0):
    import transformers

    if kind == "qwen2_vl":
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=7,
                      spatial_merge_size=2, temporal_patch_size=2)
    else:
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=7,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=28, fullatt_block_indexes=[1],
                      tokens_per_second=TOKENS_PER_SECOND)
    config = config_class(
        vision_config=vision,
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTIONS}),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    return seeded(model_class, config, seed)


def seeded(model_class, config, seed: int):
    """``model_class(config)`` with random weights of scale 0.2 (norm weights about 1), greedy without EOS."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # weights far from ties, so greedy decoding is stable across implementations
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 4
    return model


def image_processor():
    import transformers

    return transformers.Qwen2VLImageProcessor(patch_size=7, merge_size=2, temporal_patch_size=2,
                                              min_pixels=14 * 14, max_pixels=56 * 56)


def write_checkpoint(path: Path, kind: str = "qwen2_vl", seed: int = 0) -> Path:
    hf_model(kind, seed).save_pretrained(path)
    tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return path
