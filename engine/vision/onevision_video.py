"""LLaVA-OneVision's video path: a video's frames through the image tower and projector, each
frame's feature map pooled 2x2 bilinearly, then one ``image_newline`` row for the whole video.

As transformers' LlavaOnevisionModel.get_video_features / apply_pooling: the frames (F, 3, S, S)
run through the same tower, feature layer(s) and projector as an image tile, giving (F, p * p,
hidden) with p = S / patch size; each frame's (p, p) map is resized bilinearly (align_corners
False, no antialias) to (ceil(p / 2), ceil(p / 2)); the frames' rows follow one another row by
row, and the newline vector comes once, after the last frame. So a video of F frames is
``F * ceil(p / 2) ** 2 + 1`` rows (``video_token_count``, which its processor gives the ``<video>``
token too). No anyres tiling and no unpadding: every frame is one S x S tile.

The counting half imports no torch (the preprocessing model lays out prompts with it).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pooled_side(side: int) -> int:
    """Rows and columns of a frame's feature map after the 2x2 pooling."""
    return math.ceil(side / 2)


def video_token_count(side: int, num_frames: int) -> int:
    """Rows of a video of ``num_frames`` frames whose unpooled feature map is ``side`` x ``side``."""
    return num_frames * pooled_side(side) ** 2 + 1


def video_settings(hf_config, side: int) -> dict:
    """The encoder directory's ``video`` entry of a LlavaOnevisionConfig: the ``<video>`` token id
    and the frame map's side before pooling."""
    return {"video_token_index": getattr(hf_config, "video_token_index", getattr(hf_config, "video_token_id", None)),
            "side": side}


def pool_frames(frames: torch.Tensor, side: int) -> torch.Tensor:
    """(F, side * side, hidden) projected frame features -> (F * pooled_side ** 2, hidden)."""
    import torch.nn.functional as F

    num_frames, rows, hidden = frames.shape
    if rows != side * side:
        raise ValueError(f"a frame has {rows} feature rows; the {side} x {side} map needs {side * side}")
    maps = frames.view(num_frames, side, side, hidden).permute(0, 3, 1, 2)  # (F, hidden, side, side)
    pooled = F.interpolate(maps, size=[pooled_side(side)] * 2, mode="bilinear")
    return pooled.permute(0, 2, 3, 1).reshape(-1, hidden)


def video_rows(frames: torch.Tensor, side: int, newline: torch.Tensor) -> torch.Tensor:
    """One video's projected frame features (F, side * side, hidden) -> its rows
    (video_token_count(side, F), hidden): the pooled frames, then the newline."""
    import torch

    return torch.cat([pool_frames(frames, side), newline[None].to(frames.dtype)])


# LlavaOnevisionVideoProcessor's class defaults in transformers 5 (resample 3 = bicubic; OpenAI
# CLIP's mean and std): what a checkpoint's video processor config leaves out takes these.
VIDEO_PROCESSOR_DEFAULTS = {
    "video_processor_type": "LlavaOnevisionVideoProcessor", "size": {"height": 384, "width": 384},
    "resample": 3, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True, "do_center_crop": None, "do_sample_frames": False,
}
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"  # transformers' name for a video processor's settings
SETTING_KEYS = ("size", "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                "image_std", "do_convert_rgb", "do_center_crop", "do_sample_frames")


def video_processor_settings(source: str) -> dict:
    """The checkpoint's video processor settings, found where transformers' AutoVideoProcessor looks
    (processor_config.json's ``video_processor``, then video_preprocessor_config.json, then the
    image processor's preprocessor_config.json), over the class defaults. Read as JSON: transformers'
    video processors need torchvision, which the serving machines may lack."""
    import json
    import os

    def read(name: str) -> dict | None:
        path = os.path.join(source, name) if source else ""
        if not path or not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    found = (read("processor_config.json") or {}).get("video_processor")
    found = found or read(VIDEO_PROCESSOR_FILE) or read("preprocessor_config.json") or {}
    return {**VIDEO_PROCESSOR_DEFAULTS, **{key: found[key] for key in SETTING_KEYS if key in found}}
