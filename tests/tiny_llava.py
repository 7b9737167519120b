"""A tiny random LLaVA-1.5 checkpoint made by transformers (CLIP tower + projector + Llama), with a
word-level tokenizer that has an ``<image>`` token and a CLIP image processor, and test images.
No network: everything is made here. Shared by the engine, serving and integration tests."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

IMAGE_TOKEN_INDEX = 3
IMAGE_SIZE = 28  # 4 x 4 patches of 7 pixels: 16 image tokens per image
WORDS = ["<unk>", "<s>", "</s>", "<image>", "<pad>", "USER:", "ASSISTANT:", "What", "is", "in", "the", "image?",
         "Describe", "this", "picture", "Question:", "which", "city", "Answer:"]
VOCAB = 128  # WORDS, then filler words w19 .. w127


def word_level_tokenizer(words: list[str], vocab: int, post_processor=None, **special_tokens):
    """A word-level tokenizer of ``words`` then filler words w<i> up to ``vocab`` (<s>, </s>, <unk>
    and <pad> are its special tokens; ``special_tokens``: more tokenizer arguments). SentencePiece-style
    words ("\u2581" marks a space before them), so text decodes the same whole or a few tokens at a
    time, as streams decode it; special tokens (<...>) have no mark. Also used by tests/tiny_encdec.py."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [w if w.startswith("<") and w.endswith(">") else "\u2581" + w
             for w in words + [f"w{i}" for i in range(len(words), vocab)]]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")])
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    if post_processor is not None:
        core.post_processor = post_processor
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", **special_tokens)


def tokenizer():
    return word_level_tokenizer(WORDS, VOCAB, additional_special_tokens=["<image>"], chat_template=CHAT_TEMPLATE)


# LLaVA-1.5's prompt layout as the Hub's llava-hf templates write it from content parts: "USER: "
# then each image's placeholder and a newline, then the text; "ASSISTANT:" to generate.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
                 "{% for part in message['content'] if part['type'] == 'image' %}{{ '<image>\n' }}{% endfor %}"
                 "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endfor %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def hf_model(seed: int = 0):
    import transformers

    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=7,
                                           projection_dim=16)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=4)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_INDEX,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights far from ties, so greedy decoding is stable across implementations
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine without end_id
    model.generation_config.pad_token_id = 4
    return model


def image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """The checkpoint directory (config, safetensors, tokenizer, preprocessor_config.json)."""
    model = hf_model(seed)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return path


def make_image(seed: int, size: tuple[int, int] = (40, 52)):
    """A PIL RGB image of random blocks (width x height = size)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (size[1] // 4 + 1, size[0] // 4 + 1, 3), dtype=np.uint8)
    pixels = np.repeat(np.repeat(blocks, 4, axis=0), 4, axis=1)[:size[1], :size[0]]
    return Image.fromarray(pixels, "RGB")


def encoded(image, format: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=format)
    return out.getvalue()
