"""Qwen3-VL video: frames -> the tower's patches and grid (as Qwen2-VL's, serving/qwen_video.py) with
Qwen3-VL's own resize rule, frame choice and the timestamps its prompt puts between frame pairs, as
transformers' Qwen3VLVideoProcessor and Qwen3VLProcessor make them.

- Resize: qwen3_vl's smart_resize counts the frames: the video's total pixels (frames rounded to
  temporal_patch_size, times h x w) within size's [shortest_edge, longest_edge]; sides under
  patch_size * merge_size are scaled up first; fewer than temporal_patch_size frames is an error.
  ``cap_pixels_per_frame`` (when the config sets it) caps each frame's share as the processor does.
- Frames of an encoded file: the processor's sample_frames: ``int(total / source fps * fps)`` frames
  (``fps`` from its config, 2 in the released ones; or the request's fps / num_frames), clipped to
  [min_frames, max_frames] and the video's length, at ``linspace(0, total - 1, n).round()``; never more
  than the server's max_num_frames. Frames sent as pixels are taken as they are.
- Prompt: frame pair k (grid t = k) is ``<{seconds:.1f} seconds><|vision_start|>`` + its h x w / merge^2
  rows + ``<|vision_end|>``, where seconds is the mean of the pair's first and last frame times
  (frame index / the source's fps; 24 fps and indices 0, 1, ... for frames sent as pixels, as
  transformers assumes). The whole text replaces the <|video_pad|> the chat template wrote (inside its
  <|vision_start|> ... <|vision_end|>, as this transformers' processor replaces only the pad).
- M-RoPE (engine/vision/mrope.py): each frame pair is an image of grid (1, h, w): positions restart their
  time axis at the run's start, and text after a run resumes at start + max(h, w) / merge.
"""
from __future__ import annotations

import math

import numpy as np

from serving.qwen_video import QwenVideoFrames, read_settings
from serving.videos import ASSUMED_FPS, FrameRequest, VideoError, VideoLimits, requested_count

# Qwen3VLVideoProcessor's class defaults, for an encoder directory without its own video settings
DEFAULTS = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "fps": 2, "min_frames": 4,
            "max_frames": 768, "max_video_tokens": 768, "do_sample_frames": True}


def smart_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """transformers' qwen3_vl video smart_resize: (height, width), multiples of ``factor``, with
    round(frames / temporal) * temporal * height * width within [min_pixels, max_pixels]."""
    if frames < temporal:
        raise VideoError(f"the video has {frames} frame(s); Qwen3-VL needs at least {temporal} "
                         "(temporal_patch_size); send a longer video")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoError(f"the video's aspect ratio must be under 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pair_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Seconds of each frame pair: its first and last frame's index / fps, averaged (the last index
    repeated to fill the last pair), as Qwen3VLProcessor._calculate_timestamps."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


class Qwen3VideoFrames(QwenVideoFrames):
    """One Qwen3-VL encoder directory's video processor."""

    def __init__(self, encoder_dir: str):
        settings, own = read_settings(encoder_dir)
        if not own:  # the image processor's patches and normalization, the video processor's budgets
            settings = {**settings, **DEFAULTS}
        super().__init__(encoder_dir, settings)
        self.fps = settings.get("fps", DEFAULTS["fps"])
        self.num_frames = settings.get("num_frames")
        self.min_frames = int(settings.get("min_frames", DEFAULTS["min_frames"]))
        self.max_frames = int(settings.get("max_frames", DEFAULTS["max_frames"]))
        self.sample = settings.get("do_sample_frames", True)
        self.cap_pixels_per_frame = bool(settings.get("cap_pixels_per_frame"))
        self.max_video_tokens = int(settings.get("max_video_tokens", DEFAULTS["max_video_tokens"]))

    def frame_size(self, count: int, height: int, width: int) -> tuple[int, int]:
        factor, max_pixels = self.patch * self.merge, self.max_pixels
        if self.cap_pixels_per_frame:  # each frame's share of the budget, as the processor caps it
            share = max(min(self.max_video_tokens * factor * factor, max_pixels // count), int(self.min_pixels * 1.05))
            max_pixels = share * count
        return smart_resize(count, height, width, self.temporal, factor, self.min_pixels, max_pixels)

    def sampler(self, limits: VideoLimits, request: FrameRequest = FrameRequest()):
        """decode_video's frame choice: (total, source fps) -> indices by the processor's sample_frames
        (the request's fps or num_frames in place of its own), at most ``limits.max_frames``."""
        def choose(total: int, source_fps: float | None) -> list[int]:
            if request.num_frames is not None:
                count = request.num_frames
            elif request or (self.sample and self.num_frames is None):
                fps = request.fps if request.fps is not None else self.fps
                count = requested_count(total, source_fps, FrameRequest(fps=fps), total)
                count = max(count, self.min_frames)
            else:
                count = self.num_frames or total
            count = min(count, self.max_frames, total, limits.max_frames)
            return np.linspace(0, total - 1, count).round().astype(int).tolist()
        return choose

    def timestamps(self, count: int, meta: dict) -> list[float]:
        """Each frame pair's seconds for ``count`` frames: a decoded file's (``meta``: decode_video's
        indices and source fps) or, for frames sent as pixels (``meta`` empty), frames 0, 1, ... at 24 fps."""
        indices = meta.get("indices") or list(range(count))
        return pair_timestamps(indices, meta.get("source_fps") or ASSUMED_FPS, self.temporal)
