"""A vision-language preprocessing stub's transformers without torch.

`from transformers import AutoImageProcessor` with torch installed imports torch and transformers'
modeling stack (processing_utils -> modeling_utils, activations -> integrations.hub_kernels ->
torch.distributed.tensor, torch._dynamo): ~4 of a preprocessing stub's ~5.5 CPU-s of start, for image
processors that are PIL and numpy code (transformers picks its *ImageProcessorPil class either way, and
preprocessing asks for numpy). With torch hidden before transformers' first import, the same classes
load without it (start ~1.3 CPU-s) and give the same pixels: prepare_batch's outputs byte-identical
with and without torch for these model types (checked on tests/integration/test_multimodal_served.py's
tiny LLaVA, LLaVA-OneVision, Mllama and Qwen3-VL engines, 2026-11-30); that test holds the served
text to transformers' generate on pixels made with torch.
"""
from __future__ import annotations

import sys

# builder_config.model_type of the vision encoders checked so (others keep torch until checked)
WITHOUT_TORCH = ("llava", "llava_onevision", "mllama", "qwen3_vl")


def hide_torch_for_image_processors(encoder_config: dict) -> bool:
    """Make torch unimportable in this process (``sys.modules["torch"] = None``: transformers then sees
    no torch) when preprocessing of this vision encoder needs none: its model type is in WITHOUT_TORCH
    and it takes no video (serving/videos.py resizes frames with torch). Only before transformers' and
    torch's first import (a process that holds either is left as it is). Whether it hid torch."""
    if "video" in encoder_config or encoder_config["builder_config"]["model_type"] not in WITHOUT_TORCH:
        return False
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None
    return True
