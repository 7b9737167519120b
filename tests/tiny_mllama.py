"""A tiny random Llama 3.2 Vision (Mllama) checkpoint made by transformers: a tiled ViT of width 32 (28 x 28
tiles, 7-pixel patches: 16 patches + a class token per tile, up to 4 tiles an image), 3 local layers (layers 1
and 3 also go to the output) and 2 gated global ones, a projector to a 5-layer text model of width 64 whose
layers 1 and 3 are gated cross-attention layers; a word-level tokenizer with ``<|image|>`` at id VOCAB (past the
output vocabulary, as Llama 3.2 Vision's 128256) and a Mllama image processor, saved as MllamaProcessor writes
them. The gates are far from zero (transformers initialises them at 0, which would hide the cross-attention).
No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import VOCAB, WORDS, word_level_tokenizer

IMAGE_TOKEN = "<|image|>"
IMAGE_TOKEN_ID = VOCAB  # the first of the 8 embedding rows past the output vocabulary
TILE_SIZE, MAX_TILES = 28, 4
PATCHES_PER_TILE = (TILE_SIZE // 7) ** 2 + 1  # 17: 4 x 4 patches and the class token
CROSS_LAYERS = [1, 3]


# Llama 3.2 Vision's layout of content parts, in the tiny vocabulary: each image part is <|image|>, then the text
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
                 "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                 "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<|image|>' }}"
                 "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ ' ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def tokenizer():
    tok = word_level_tokenizer(WORDS, VOCAB, chat_template=CHAT_TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return tok


def hf_model(seed: int = 0):
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_global_layers=2, attention_heads=4,
                  image_size=TILE_SIZE, patch_size=7, max_num_tiles=MAX_TILES, intermediate_layers_indices=[1, 3],
                  vision_output_dim=32 * 3, norm_eps=1e-5)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                cross_attention_layers=CROSS_LAYERS, bos_token_id=1, eos_token_id=2, pad_token_id=4,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights far from ties, gates far from 0, so the images change the greedy ids
        for name, p in model.named_parameters():
            if "gate" in name:
                p.copy_(torch.full_like(p, 0.6) + 0.3 * torch.randn_like(p))
            else:
                base = 1.0 if ("norm" in name or "layernorm" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine without end_id
    model.generation_config.pad_token_id = 4
    return model


def processor():
    from transformers import MllamaImageProcessor, MllamaProcessor

    images = MllamaImageProcessor(size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES)
    return MllamaProcessor(image_processor=images, tokenizer=tokenizer())


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    hf_model(seed).save_pretrained(path)
    processor().save_pretrained(path)
    return path
