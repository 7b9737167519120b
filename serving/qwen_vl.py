"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL in the Triton pipeline: what preprocessing and multimodal_encoders add.

preprocessing: the checkpoint's image processor gives each image's patches (patches, C * T * P * P)
and its (t, h, w) patch grid; the image takes t * h * w / merge**2 table rows (fake ids), with
``<|vision_start|>`` / ``<|vision_end|>`` around them when preprocessing lays the prompt out (no
placeholder in the text: Qwen2-VL's chat template with its default system prompt, as the anchor's
preprocessing applies it; Qwen3-VL's, which has none). Outputs beside INPUT_ID: PIXEL_VALUES
(B, 1, 1, patches, dim), IMAGE_GRID_THW (B, 3) (the anchor's [3]: one image per request) and
VISION_INPUT_ID (B, L): the prompt with each fake id replaced by the image token (the anchor's raw ids). PIXEL_VALUES is 5-D with the batch
dimension, as multimodal_encoders' pixel_values ([-1, -1, -1, -1] per item) takes it: (B, 1, 1, patches, dim).

multimodal_encoders: the table (Qwen3-VL: rows with the DeepStack levels beside each image row,
engine/vision/qwen3_vl.py), and from VISION_INPUT_ID + IMAGE_GRID_THW the M-RoPE pair
(engine/vision/mrope.py request_mrope) in the anchor's layout (serving/mrope.py to_wire):
MROPE_ROTARY_COS_SIN (B, L * head_dim) FP32 and MROPE_POSITION_DELTAS (B, 1) INT64.

A Qwen2.5-VL / Qwen2-VL video (serving/qwen_video.py) travels the same way, its frame pairs' patches and grid
as an image's, with IS_VIDEO_INPUT and VIDEO_SECOND_PER_GRID (multimodal_encoders' second_per_grid_ts): its
M-RoPE time axis.
"""
from __future__ import annotations

import numpy as np

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# (pre-prompt, after the image slots, post-prompt): Qwen2-VL's chat template for one user turn
CHAT_WRAPPER = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n", "",
                "<|im_end|>\n<|im_start|>assistant\n")
# Qwen3-VL's chat template writes a system turn only when the messages hold one
CHAT_WRAPPERS = {"qwen2_vl": CHAT_WRAPPER, "qwen2_5_vl": CHAT_WRAPPER,
                 "qwen3_vl": ("<|im_start|>user\n", "", "<|im_end|>\n<|im_start|>assistant\n")}
ONE_IMAGE = ("{n} images were sent; Qwen2-VL models take one image per request here (IMAGE_GRID_THW is one "
             "(t, h, w) per item, as the anchor's); send one image")
NO_PIXELS = ("image_input: Qwen2-VL models take images as image_bytes_input or image_url_input (preprocessing "
             "makes the processor's patches and image_grid_thw); send the image that way")


def image_patches(image_processor, images: list) -> tuple[np.ndarray, np.ndarray]:
    """Decoded images -> ((1, 1, patches, dim) float32, (n, 3) int64 grids) by the checkpoint's processor."""
    batch = image_processor(images, return_tensors="np")
    return (np.asarray(batch["pixel_values"], np.float32)[None, None],
            np.asarray(batch["image_grid_thw"], np.int64).reshape(-1, 3))


def grid_rows(grids: np.ndarray, merge: int) -> list[int]:
    """Table rows of each image: t * h * w / merge**2."""
    return [int(t * h * w) // merge ** 2 for t, h, w in np.asarray(grids).reshape(-1, 3).tolist()]


def vision_input_ids(input_ids: np.ndarray, vocab_size: int, image_token: int) -> np.ndarray:
    """VISION_INPUT_ID: INPUT_ID (B, L) with every fake id (>= vocab_size) replaced by the image token."""
    ids = np.asarray(input_ids, np.int32)
    return np.where(ids >= vocab_size, np.int32(image_token), ids)


def mrope_outputs(ids: np.ndarray, grids: np.ndarray, config: dict, second_per_grid=None) -> dict[str, np.ndarray]:
    """multimodal_encoders' MROPE_ROTARY_COS_SIN (B, L * head_dim) and MROPE_POSITION_DELTAS (B, 1) from
    VISION_INPUT_ID (B, L) and IMAGE_GRID_THW (B, 3) (items without an image: a zero grid). Padding after
    a prompt counts as text: its rows are extra (the executor reads the prompt's), the delta unchanged.
    A prompt whose image-token run does not match its grid is a ValueError naming vision_input_id.
    ``second_per_grid`` (B, 1) or None: per item a video's second_per_grid_t, 0 for an image (its grid's
    time axis then counts frames of one)."""
    from engine.vision.mrope import request_mrope
    from serving.mrope import to_wire

    ids = np.asarray(ids).reshape(len(ids), -1)
    grids = np.asarray(grids, np.int64).reshape(len(ids), 3)
    seconds = (np.zeros(len(ids)) if second_per_grid is None or not np.asarray(second_per_grid).size
               else np.asarray(second_per_grid, np.float32).reshape(len(ids)))
    wires, deltas = [], []
    for row, grid, second in zip(ids.tolist(), grids.tolist(), seconds.tolist()):
        try:
            rows, delta = request_mrope(row, [grid] if any(grid) else [], config,
                                        second_per_grid=[second or None] if any(grid) else None)
        except ValueError as error:
            raise ValueError(f"vision_input_id / image_grid_thw: {error}") from None
        wires.append(to_wire(rows.numpy(), ids.shape[1]))
        deltas.append([delta])
    return {"MROPE_ROTARY_COS_SIN": np.stack(wires), "MROPE_POSITION_DELTAS": np.array(deltas, np.int64)}
