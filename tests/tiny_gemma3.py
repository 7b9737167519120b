"""A tiny random Gemma 3 vision-language checkpoint made by transformers: a 2-layer SigLIP of width 32
(28 x 28 images, 7-pixel patches: 4 x 4 patches, pooled 2 x 2 to mm_tokens_per_image 4), a 2-layer
Gemma 3 text model (one sliding layer of window 8, then a global one); a word-level tokenizer with
``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>`` as special tokens and a Gemma 3 image
processor, saved as Gemma3Processor writes them. No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import IMAGE_SIZE, VOCAB, WORDS, word_level_tokenizer

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOI_ID, EOI_ID, IMAGE_TOKEN_ID = len(WORDS), len(WORDS) + 1, len(WORDS) + 2
MM_TOKENS = 4
WINDOW = 8


def tokenizer():
    from tokenizers import processors

    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return word_level_tokenizer(WORDS + [BOI, EOI, IMAGE_TOKEN], VOCAB, post_processor=bos,
                                additional_special_tokens=[BOI, EOI, IMAGE_TOKEN],
                                extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN})


def hf_model(seed: int = 0):
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                bos_token_id=1, eos_token_id=2, pad_token_id=4, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=7, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS,
                                       image_token_index=IMAGE_TOKEN_ID, boi_token_index=BOI_ID,
                                       eoi_token_index=EOI_ID, tie_word_embeddings=False)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights far from ties, so greedy decoding is stable across implementations
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if "layer_norm" in name and name.endswith("weight") else 0.0))
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine without end_id
    model.generation_config.pad_token_id = 4
    return model


def processor():
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    images = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer(), image_seq_length=MM_TOKENS)


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    hf_model(seed).save_pretrained(path)
    processor().save_pretrained(path)
    return path
