"""A vision-language preprocessing stub's transformers without torch.

`from transformers import AutoImageProcessor` with torch installed imports torch and transformers'
modeling stack (processing_utils -> modeling_utils, activations -> integrations.hub_kernels ->
torch.distributed.tensor, torch._dynamo): ~4 of a preprocessing stub's ~5.5 CPU-s of start, for image
processors that are PIL and numpy code where torchvision is not installed (transformers picks its
*ImageProcessorPil class with torch or without, and preprocessing asks for numpy). With torch hidden
while transformers is first imported, the same classes load without it (start ~1.3 CPU-s) and give the
same pixels: prepare_batch's outputs byte-identical with and without torch for these model types
(checked on tests/integration/test_multimodal_served.py's tiny LLaVA, LLaVA-OneVision (images and a
video), Mllama and Qwen3-VL engines, 2026-11-30); that test holds the served text to transformers'
generate on pixels made with torch. Where torchvision is installed, transformers may pick its
torchvision classes with torch and the PIL ones without (other pixels), so torch stays visible there.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys

# builder_config.model_type of the vision encoders checked so (others load transformers with torch)
WITHOUT_TORCH = ("llava", "llava_onevision", "mllama", "qwen3_vl")


@contextlib.contextmanager
def transformers_without_torch(encoder_dir: str | None):
    """Within it torch cannot be imported (``sys.modules["torch"] = None``), so that transformers, imported
    for the first time inside it, settles on "no torch" for the process (its is_torch_available is cached):
    for a vision encoder whose model type is in WITHOUT_TORCH, in a process that has imported neither yet,
    where torchvision is not installed (transformers' choice of image processor class is then the same).
    Afterwards torch imports again for this code's own use (serving/videos.py resizes video frames with it;
    preprocessing imports it at start for a model that takes video). A no-op otherwise (``encoder_dir`` None:
    a text model)."""
    hide = (encoder_dir is not None and "torch" not in sys.modules and "transformers" not in sys.modules
            and importlib.util.find_spec("torchvision") is None)
    if hide:
        with open(os.path.join(encoder_dir, "config.json")) as f:
            hide = json.load(f)["builder_config"]["model_type"] in WITHOUT_TORCH
    if hide:
        sys.modules["torch"] = None
    try:
        yield
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
