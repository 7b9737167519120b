"""A tiny random BLIP-2 checkpoint made by transformers: a 2-layer ViT of width 32 (28 x 28 images, 7-pixel
patches), a 2-layer Q-Former with 8 queries (cross-attention in layer 0 only: cross_attention_frequency 2),
a 2-layer OPT of width 64; tiny_llava's words as a tokenizer that adds <s> (its ``<image>`` is the image
token) and a BLIP image processor, saved together as Blip2Processor writes them. No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_INDEX, VOCAB, WORDS, word_level_tokenizer

NUM_QUERY_TOKENS = 8


def hf_model(seed: int = 0):
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=7)
    qformer = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   cross_attention_frequency=2, encoder_hidden_size=32, vocab_size=VOCAB)
    text = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=4)
    config = transformers.Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text,
                                      num_query_tokens=NUM_QUERY_TOKENS, image_token_index=IMAGE_TOKEN_INDEX)
    torch.manual_seed(seed)
    model = transformers.Blip2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights far from ties, so greedy decoding is stable across implementations
        for name, p in model.named_parameters():
            norm = ("norm" in name or "LayerNorm" in name) and name.endswith("weight")
            p.copy_((1.0 if norm else 0.0) + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine without end_id
    model.generation_config.pad_token_id = 4
    return model


def tokenizer():
    """tiny_llava's words, adding <s> before a text as OPT's tokenizer adds its BOS (so the prompt
    layout's BOS after the image slot is checked)."""
    from tokenizers import processors

    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return word_level_tokenizer(WORDS, VOCAB, post_processor=bos, additional_special_tokens=["<image>"])


def processor():
    from transformers import BlipImageProcessor, Blip2Processor

    images = BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Blip2Processor(image_processor=images, tokenizer=tokenizer(), num_query_tokens=NUM_QUERY_TOKENS)


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    hf_model(seed).save_pretrained(path)
    processor().save_pretrained(path)
    return path
