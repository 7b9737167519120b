"""A tiny random Qwen3-VL (or Qwen3-VL-MoE) checkpoint made by transformers: a ViT of 2 blocks of width 32 with a 4 x 4 learned
position grid (resampled to each image), DeepStack taps after blocks 0 and 1, a 2 x 2 merger; a 3-layer Qwen3
of width 64 (q/k norms, head_dim 16) with interleaved M-RoPE sections [4, 2, 2]; tiny_llava's tokenizer and
Qwen2-VL's image processor at 7-pixel patches (as tiny_qwen2_vl), Qwen3-VL's video processor settings
(VIDEO_PROCESSOR). No network."""
from __future__ import annotations

from pathlib import Path

from tiny_llava import VOCAB, WORDS, word_level_tokenizer
from tiny_qwen2_vl import IMAGE_TOKEN, VISION_END, VISION_START, image_processor, seeded  # noqa: F401 (tests import them here)

VIDEO_TOKEN = VOCAB - 4
# ids VOCAB - 6 .. VOCAB - 1: the chat turns' markers, then <|video_pad|>, <|vision_start|>, <|vision_end|>, <|image_pad|>
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# Qwen3-VL's layout: no default system turn; an image part as <|vision_start|><|image_pad|><|vision_end|>, a
# video part as <|vision_start|><|video_pad|><|vision_end|>
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                 "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'video' %}"
                 "<|vision_start|><|video_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the words of the timestamps a video's prompt holds (<0.1 seconds> ... <3.0 seconds>), so that they are ids
# of their own (the word-level tokenizer splits at spaces)
TIMESTAMP_WORDS = ["seconds>"] + [f"<{tenths / 10:.1f}" for tenths in range(31)]
SECTIONS = [4, 2, 2]
DEEPSTACK = [0, 1]


def hf_model(seed: int = 0, moe: bool = False):
    """``moe``: Qwen3-VL-MoE, its language model with 4 experts of width 24 (top 2) in layers 0 and 2
    and a dense MLP in layer 1."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTIONS,
                                 "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    config_class, model_class = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
                                 if moe else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    config = config_class(
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4,
                           patch_size=7, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=DEEPSTACK),
        text_config=text, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)
    if moe:
        config.text_config._experts_implementation = "eager"  # grouped_mm needs 16-byte-aligned widths
    return seeded(model_class, config, seed)


def tokenizer():
    words = WORDS + TIMESTAMP_WORDS
    words += [f"w{i}" for i in range(len(words), VOCAB - len(SPECIAL))] + SPECIAL
    return word_level_tokenizer(words, VOCAB, additional_special_tokens=SPECIAL, chat_template=CHAT_TEMPLATE)


# Qwen3VLVideoProcessor's saved settings at this tower's 7-pixel patches (written as JSON: the class needs
# torchvision): a video's pixels within [4, 32] merged rows of 14 x 14 (frames rounded to pairs, times h x w),
# frames sampled at 2 fps (at least 4)
VIDEO_PROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                   "do_sample_frames": True, "fps": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "max_frames": 768, "max_video_tokens": 768, "merge_size": 2, "min_frames": 4, "patch_size": 7,
                   "resample": 3, "rescale_factor": 1 / 255, "return_metadata": False,
                   "size": {"longest_edge": 32 * 14 * 14, "shortest_edge": 4 * 14 * 14}, "temporal_patch_size": 2,
                   "video_processor_type": "Qwen3VLVideoProcessor"}


def write_checkpoint(path: Path, seed: int = 0, moe: bool = False) -> Path:
    import json

    hf_model(seed, moe).save_pretrained(path)
    tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))
    return path
