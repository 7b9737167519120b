"""Qwen2.5-VL (and Qwen2-VL) video: a video's frames -> the tower's patches, its (t, h, w) grid and
second_per_grid_t, as transformers' Qwen2VLVideoProcessor and Qwen2_5_VLProcessor make them.

The frames (F, H, W, 3) uint8 are resized together to smart_resize's size (a multiple of patch_size *
merge_size, its pixels within the processor's bounds), bicubic with antialias on the uint8 frames (the
torchvision path, done in torch: transformers' video processors need torchvision, which these machines
may lack), rescaled and normalized (fused: mean and std scaled by 1 / rescale_factor), then cut into
temporal_patch_size x patch_size x patch_size patches, the last frame repeated when F is odd: grid
(F / temporal_patch_size, h / patch, w / patch), one table row per merge x merge patches of a frame pair.

second_per_grid_t = temporal_patch_size / the sampled frames' fps (transformers' VideoMetadata.sampled_fps:
24 for frames sent as pixels, which carry no fps); the M-RoPE time axis steps by tokens_per_second *
second_per_grid_t per grid frame (engine/vision/mrope.py).

The settings are the encoder directory's video_preprocessor_config.json (engine.build copies the
checkpoint's), or, without one, its image processor's (the same patch geometry and normalization).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

QWEN_VIDEO_FILE = "video_preprocessor_config.json"
DEFAULT_FPS = 24.0  # transformers' VideoMetadata.sampled_fps when a video carries no fps (frames as pixels)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: the nearest size with both sides multiples of ``factor`` and
    its pixels within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the video's aspect ratio must be under 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pixel_bounds(settings: dict) -> tuple[int, int]:
    size = settings.get("size") or {}
    low = settings.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 128 * 28 * 28
    high = settings.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 768
    return int(low), int(high)


def read_settings(encoder_dir: str) -> tuple[dict, bool]:
    """(the encoder directory's video processor settings, whether they are its own): its
    video_preprocessor_config.json, else its image processor's (the same patches and normalization)."""
    path = os.path.join(encoder_dir, QWEN_VIDEO_FILE)
    own = os.path.isfile(path)
    with open(path if own else os.path.join(encoder_dir, "preprocessor_config.json")) as f:
        return json.load(f), own


class QwenVideoFrames:
    """One Qwen encoder directory's video processor: frames -> (patches (n, dim) float32, grid [t, h, w])."""

    def __init__(self, encoder_dir: str, settings: dict | None = None):
        s = settings if settings is not None else read_settings(encoder_dir)[0]
        self.patch, self.merge = int(s.get("patch_size", 14)), int(s.get("merge_size", 2))
        self.temporal = int(s.get("temporal_patch_size", 2))
        self.min_pixels, self.max_pixels = _pixel_bounds(s)
        # resize, rescale and normalize as serving/videos.py's VideoFrames does them (the torchvision path)
        self.settings = {"do_resize": s.get("do_resize", True), "resample": s.get("resample", 3),
                         "do_center_crop": False, "do_rescale": s.get("do_rescale", True),
                         "rescale_factor": s.get("rescale_factor", 1 / 255),
                         "do_normalize": s.get("do_normalize", True),
                         "image_mean": s.get("image_mean"), "image_std": s.get("image_std")}

    def second_per_grid(self, fps: float | None) -> float:
        """second_per_grid_t of a video whose sampled frames run at ``fps`` (None: transformers' 24)."""
        return self.temporal / (fps or DEFAULT_FPS)

    def frame_size(self, count: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) ``count`` frames of height x width are resized to."""
        return smart_resize(height, width, self.patch * self.merge, self.min_pixels, self.max_pixels)

    def __call__(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        import torch

        from serving.videos import VideoFrames

        size = self.frame_size(*frames.shape[:3])
        video = torch.from_numpy(VideoFrames({**self.settings, "size": {"height": size[0], "width": size[1]}})(frames))
        if pad := -len(video) % self.temporal:  # the last frame repeated
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        count, channels, h, w = video.shape
        p, m, tp = self.patch, self.merge, self.temporal
        t, gh, gw = count // tp, h // p, w // p
        # (t, tp, c, h / p / m, m, p, w / p / m, m, p) -> t, merged rows, merged columns, m, m, then c, tp, p, p
        patches = video.reshape(t, tp, channels, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(t * gh * gw, channels * tp * p * p).numpy(), [t, gh, gw]
