"""LLaVA-OneVision video in the Triton pipeline and the OpenAI path: the preprocessing side of one
video (frames -> pixel values and its prompt slot) and the encoder side (pixel values -> rows).

A video takes one slot of ``F * ceil(p / 2) ** 2 + 1`` fake ids (engine/vision/onevision_video.py),
laid out as an image's: where the text holds ``<video>`` (the client wrote the chat template), else
the anchor's OneVision wrapper around the slot and the text (serving/multimodal.py). One video per
request, and not together with images (the anchor's preprocessing takes either): each is the
request's error naming video_bytes_input.

On the wire (preprocessing -> multimodal_encoders, as the anchor): PIXEL_VALUES (B, F, 3, S, S)
FP16 with IS_VIDEO_INPUT (B, 1) BOOL. When one Triton request's items have different frame or tile
counts, the shorter ones are zero-padded; a frame of zeros cannot come from the processor (no
uint8 value maps exactly to the mean), so trailing all-zero frames are padding and are dropped.
"""
from __future__ import annotations

import json
import os

import numpy as np

from serving.images import ImageLimits
from serving.videos import (FrameRequest, VideoFrames, VideoLimits, frames_from_bytes, uniform_sampler,
                            video_from_url)

NO_VIDEO = ("video_bytes_input: video is not supported for {model_type} models (only LLaVA-OneVision, Qwen2-VL, "
            "Qwen2.5-VL and Qwen3-VL take video{rebuild}); send images")
VIDEO_AND_IMAGES = ("video_bytes_input: a request takes one video or images, not both; send them in separate "
                    "requests")


def video_support_error(config: dict) -> str | None:
    """Why this vision-encoder directory takes no video (None: it does)."""
    if "video" in config or "qwen_video" in config:  # OneVision's; Qwen's (serving/qwen_video.py)
        return None
    model_type = config["builder_config"]["model_type"]
    rebuild = (": rebuild the engine with this version" if model_type in ("llava_onevision", "qwen2_vl", "qwen2_5_vl",
                                                                        "qwen3_vl")
               else "")
    return NO_VIDEO.format(model_type=model_type, rebuild=rebuild)


class VideoPrompts:
    """One OneVision vision-encoder directory's video side: frames -> (pixel values, rows)."""

    def __init__(self, encoder_dir: str, config: dict, tokenizer, limits: VideoLimits, image_limits: ImageLimits):
        from engine.vision.onevision_video import VIDEO_PROCESSOR_FILE

        with open(os.path.join(encoder_dir, VIDEO_PROCESSOR_FILE)) as f:
            self.processor = VideoFrames(json.load(f))
        self.side = config["video"]["side"]
        self.limits, self.image_limits = limits, image_limits
        token = config["video"]["video_token_index"]
        self.placeholder = (tokenizer.convert_ids_to_tokens(token) if token is not None and token < len(tokenizer)
                            else None) or "<video>"
        ids = tokenizer.encode(self.placeholder, add_special_tokens=False)
        self.placeholder_id = ids[0] if len(ids) == 1 else None

    def from_bytes(self, item: np.ndarray, request: FrameRequest = FrameRequest()) -> np.ndarray:
        """One item of video_bytes_input -> its pixel values (F, 3, S, S) float32 (a file's frames chosen
        uniformly, or as ``request`` asks)."""
        return self.processor(frames_from_bytes(item, self.limits, self.image_limits,
                                                sampler=uniform_sampler(self.limits, request)))

    def from_url(self, url: str, field: str, request: FrameRequest = FrameRequest()) -> np.ndarray:
        """A video URL -> its pixel values, its frames chosen uniformly (or as ``request`` asks)."""
        return self.processor(video_from_url(url, field, self.limits, self.image_limits,
                                             sampler=uniform_sampler(self.limits, request)))

    def rows(self, pixel_values: np.ndarray) -> int:
        from engine.vision.onevision_video import video_token_count

        return video_token_count(self.side, len(pixel_values))


def video_frames(pixel_values: np.ndarray) -> np.ndarray:
    """A video's pixel values as they arrive, (F, 3, S, S), without trailing all-zero (padding) frames."""
    pixel_values = np.asarray(pixel_values)
    real = np.flatnonzero(pixel_values.reshape(len(pixel_values), -1).any(axis=1))
    return pixel_values[:real[-1] + 1] if len(real) else pixel_values[:0]


def rows_video(is_video_input, num_rows: int) -> list[bool]:
    """multimodal_encoders' is_video_input (B, 1) BOOL (absent: no video) -> one flag per row."""
    if is_video_input is None or not np.asarray(is_video_input).size:
        return [False] * num_rows
    flags = np.asarray(is_video_input, bool).reshape(-1).tolist()
    if len(flags) != num_rows:
        raise ValueError(f"is_video_input has {len(flags)} rows; pixel_values has {num_rows}")
    return flags
