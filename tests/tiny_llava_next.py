"""Tiny random LLaVA-NeXT (CLIP + Llama) and LLaVA-OneVision (SigLIP + Qwen2) checkpoints made by
transformers, with tiny_llava's tokenizer and their own anyres image processors: tiles of 28 x 28
(4 x 4 feature rows), grids up to 2 x 2. OneVision's cap is anyres_max_1, so a 2 x 2 grid's map is
shrunk (the interpolation path runs). No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_INDEX, VOCAB, tokenizer

PINPOINTS = [[28, 56], [56, 28], [56, 56]]
KINDS = ("llava_next", "llava_onevision")


def hf_model(kind: str, seed: int = 0):
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=4)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 image_size=IMAGE_SIZE, patch_size=7)
    if kind == "llava_next":
        config = transformers.LlavaNextConfig(
            vision_config=transformers.CLIPVisionConfig(**tower, projection_dim=16),
            text_config=transformers.LlamaConfig(**text), image_token_index=IMAGE_TOKEN_INDEX,
            image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2, vision_feature_select_strategy="default")
        model_class = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaOnevisionConfig(
            vision_config=transformers.SiglipVisionConfig(**tower), text_config=transformers.Qwen2Config(**text),
            image_token_index=IMAGE_TOKEN_INDEX, image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_1")
        model_class = transformers.LlavaOnevisionForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # weights far from ties, so greedy decoding is stable across implementations
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 4
    return model


def image_processor(kind: str):
    import transformers

    if kind == "llava_next":
        return transformers.LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE}, image_grid_pinpoints=PINPOINTS,
                                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaOnevisionImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                     image_grid_pinpoints=PINPOINTS)


def write_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    hf_model(kind, seed).save_pretrained(path)
    tokenizer().save_pretrained(path)
    image_processor(kind).save_pretrained(path)
    return path
