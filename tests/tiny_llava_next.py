"""Tiny random LLaVA-NeXT (CLIP + Llama) and LLaVA-OneVision (SigLIP + Qwen2) checkpoints made by
transformers, with tiny_llava's tokenizer and their own anyres image processors: tiles of 28 x 28
(4 x 4 feature rows), grids up to 2 x 2. OneVision's cap is anyres_max_1, so a 2 x 2 grid's map is
shrunk (the interpolation path runs). OneVision's tokenizer adds ``<video>`` (id 19) and its
checkpoint a video processor config (frames resized to 28 x 28: 2 x 2 pooled rows per frame);
``make_clip`` writes a video file with PyAV. No network."""
from __future__ import annotations

from pathlib import Path

import torch

from tiny_llava import CHAT_TEMPLATE, IMAGE_SIZE, IMAGE_TOKEN_INDEX, VOCAB, WORDS, tokenizer, word_level_tokenizer

PINPOINTS = [[28, 56], [56, 28], [56, 56]]
KINDS = ("llava_next", "llava_onevision")
VIDEO_TOKEN_INDEX = len(WORDS)  # OneVision's <video>, after tiny_llava's words
# OneVision's video processor settings as transformers writes them (video_preprocessor_config.json);
# SigLIP's mean and std, as the Hub's OneVision checkpoints
VIDEO_PROCESSOR = {"video_processor_type": "LlavaOnevisionVideoProcessor", "processor_class": "LlavaOnevisionProcessor",
                   "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3, "do_resize": True,
                   "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_sample_frames": False}


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
            image_token_index=IMAGE_TOKEN_INDEX, video_token_index=VIDEO_TOKEN_INDEX, image_grid_pinpoints=PINPOINTS,
            vision_aspect_ratio="anyres_max_1")
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


def kind_tokenizer(kind: str):
    """tiny_llava's tokenizer; OneVision's with <video> too."""
    if kind == "llava_next":
        return tokenizer()
    return word_level_tokenizer(WORDS + ["<video>"], VOCAB, additional_special_tokens=["<image>", "<video>"],
                                chat_template=ONEVISION_TEMPLATE)


# tiny_llava's template, with "<video>\n" for each video part (as OneVision's Hub templates write <video>)
ONEVISION_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% for part in message['content'] if part['type'] == 'text' %}",
    "{% for part in message['content'] if part['type'] == 'video' %}{{ '<video>\n' }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}")


def write_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    import json

    hf_model(kind, seed).save_pretrained(path)
    kind_tokenizer(kind).save_pretrained(path)
    image_processor(kind).save_pretrained(path)
    if kind == "llava_onevision":
        (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))
    return path


def make_clip(seed: int, frames: int = 8, size: tuple[int, int] = (52, 40), codec: str = "mpeg4",
              container: str = "mp4", gop: int | None = None) -> bytes:
    """A video file of ``frames`` frames of random blocks (width x height = size), written with PyAV;
    ``gop``: a keyframe every ``gop`` frames and none between (unset: the encoder's choice, which for
    random blocks is often a keyframe at a scene change)."""
    import io

    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format=container) as video:
        # the encoders put a keyframe at a scene change (random blocks: often) unless told not to: mpeg4 with
        # a threshold out of reach, libx264 with 0 (off), libvpx with keyframes no nearer than gop
        no_scene_cuts = {"mpeg4": {"sc_threshold": "1000000000"}, "libx264": {"sc_threshold": "0"}}
        options = no_scene_cuts.get(codec, {"keyint_min": str(gop)}) if gop else {}
        stream = video.add_stream(codec, rate=8, options=options)
        if gop:
            stream.gop_size = gop
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            blocks = rng.integers(0, 256, (size[1] // 4 + 1, size[0] // 4 + 1, 3), dtype=np.uint8)
            pixels = np.repeat(np.repeat(blocks, 4, axis=0), 4, axis=1)[:size[1], :size[0]]
            video.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")))
        video.mux(stream.encode())
    return out.getvalue()
