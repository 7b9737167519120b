"""LLaVA-NeXT and LLaVA-OneVision: LLaVA-1.5's tower and projector over the tiles of an "anyres"
image, then the tiles' features laid out with ``image_newline`` rows (engine/vision/anyres.py).

``image_features(pixel_values, image_sizes, tiled)``: the tiles of every image, (total tiles, 3,
S, S), base tile first per image, and each image's (height, width) before processing -> each
image's rows (token_count, text_hidden). Every tile of every image runs through the tower as one
batch. OneVision differs by its SigLIP tower (clip.py), the ``anyres_max_N`` cap, and one untiled
tile per image when a request holds several images (as its processor makes them); the number of
tiles of an image is a function of its size (anyres.num_tiles), so the tiles need no other index.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.vision import anyres, llava, onevision_video
from engine.vision.clip import first_found

NEXT_MODEL_TYPE = "llava_next"  # builder_config.model_type; OneVision's is anyres.ONEVISION_MODEL_TYPE
NEWLINE_NAMES = ("image_newline", "model.image_newline")


class LlavaNextVisionEncoder(llava.LlavaVisionEncoder):
    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__(config, dtype, device)
        self.anyres = config["anyres"]
        self.config = config
        self.image_newline = nn.Parameter(torch.empty(config["llava"]["text_hidden_size"], dtype=dtype, device=device))

    def tiles(self, image_size, tiled: bool = True) -> int:
        """Tiles the processor makes of an image of (height, width) ``image_size``."""
        return anyres.num_tiles(image_size, self.anyres["pinpoints"], self.anyres["tile"]) if tiled else 1

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, image_sizes, tiled: bool | list[bool] = True
                       ) -> list[torch.Tensor]:
        """``tiled``: per image (or for all), whether its processor cut it into tiles (anyres.is_tiled)."""
        sizes = [tuple(int(v) for v in size) for size in image_sizes]
        tiled = tiled if isinstance(tiled, list) else [tiled] * len(sizes)
        counts = [self.tiles(size, t) for size, t in zip(sizes, tiled)]
        if sum(counts) != pixel_values.shape[0]:
            raise ValueError(f"pixel values hold {pixel_values.shape[0]} tiles, but images of sizes {sizes} make "
                             f"{sum(counts)}; send each image's tiles as its image processor made them")
        features = self.encode(pixel_values).split(counts)  # (tiles, side * side, hidden) per image
        return [anyres.pack(tiles, size, self.anyres["pinpoints"], self.anyres["tile"], self.image_newline,
                            self.anyres["max_tiles"]) for tiles, size in zip(features, sizes)]

    @torch.inference_mode()
    def video_features(self, frames: torch.Tensor, frame_counts: list[int]) -> list[torch.Tensor]:
        """OneVision videos (engine/vision/onevision_video.py): every video's frames one after another,
        (sum(frame_counts), 3, S, S), in one tower batch -> each video's rows
        (video_token_count(side, frames), text_hidden)."""
        if "video" not in self.config:
            raise ValueError(f"{self.model_type} encoders take no video (only LLaVA-OneVision's do); send images")
        if sum(frame_counts) != frames.shape[0]:
            raise ValueError(f"pixel values hold {frames.shape[0]} frames, but the videos have {frame_counts}")
        side = self.config["video"]["side"]
        return [onevision_video.video_rows(features, side, self.image_newline)
                for features in self.encode(frames).split(frame_counts)]


def encoder_config(hf_config) -> dict:
    """The vision-encoder directory's config of a LlavaNextConfig or LlavaOnevisionConfig: LLaVA's,
    plus ``anyres`` (pinpoints, tile side in pixels, feature rows per tile side, OneVision's cap)."""
    config = llava.encoder_config(hf_config)
    tower = config["vision"]
    side = tower["image_size"] // tower["patch_size"]
    if config["num_image_tokens"] != side * side:
        raise CheckpointError(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} leaves "
                              f"{config['num_image_tokens']} rows per tile, not the {side}x{side} grid anyres lays "
                              "out; supported: default for a CLIP tower, full for SigLIP")
    aspect = getattr(hf_config, "vision_aspect_ratio", None)
    max_tiles = None
    if aspect is not None:
        match = re.fullmatch(r"anyres_max_(\d+)", aspect)
        if match is None:
            raise CheckpointError(f"vision_aspect_ratio {aspect!r} is not supported; supported: anyres_max_<N>")
        max_tiles = int(match.group(1))
    config["anyres"] = {"pinpoints": [list(p) for p in hf_config.image_grid_pinpoints], "tile": tower["image_size"],
                        "side": side, "max_tiles": max_tiles}
    return config


def onevision_encoder_config(hf_config) -> dict:
    """LLaVA-NeXT's, plus OneVision's ``video`` entry (onevision_video.video_settings)."""
    config = encoder_config(hf_config)
    config["video"] = onevision_video.video_settings(hf_config, config["anyres"]["side"])
    return config


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    weights = llava.encoder_weights(get, config)
    weights["image_newline"] = first_found(get, list(NEWLINE_NAMES))
    return weights
