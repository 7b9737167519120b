"""Where an engine directory keeps its vision encoder (no torch: the OpenAI frontend asks at every
start whether the engine has one; engine/vision/encoder_dir.py writes and loads it)."""
from __future__ import annotations

import os

VISION_ENCODER_DIR = "vision_encoder"  # under the engine directory


def vision_encoder_dir(engine_dir: str) -> str | None:
    """The engine's vision-encoder directory, or None for a text-only engine."""
    path = os.path.join(engine_dir, VISION_ENCODER_DIR)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None
