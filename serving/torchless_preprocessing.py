"""A vision-language preprocessing stub's transformers without torch.

`from transformers import AutoImageProcessor` with torch installed imports torch and transformers'
modeling stack (processing_utils -> modeling_utils, activations -> integrations.hub_kernels ->
torch.distributed.tensor, torch._dynamo): ~4-5.5 of a preprocessing stub's ~5.5-7 CPU-s of start, for image
processors that are PIL and numpy code where torchvision is not installed (transformers picks its
*ImageProcessorPil class with torch or without, and preprocessing asks for numpy). With torch hidden
while transformers is first imported, the same classes load without it (start ~1.4-1.8 CPU-s) and give the
same pixels: the stub's outputs byte-identical with and without torch for every vision-language model type
the product serves (tests/serving/test_torchless_preprocessing.py runs the real stub on each type's tiny
checkpoint in a process with torch hidden and in one with torch: every output tensor and the image
processor's float32 outputs for images of several sizes, a tiling aspect ratio, a JPEG, a grayscale PNG, an
image larger than the processor's size, text only and OneVision's video; and once, 2026-11-30, the same classes
at transformers' default sizes on 640x360 to 500x1200 images: Qwen2-VL's patches and grids, LLaVA-NeXT's and
OneVision's anyres tiles, Gemma 3's pan-and-scan crops,
BLIP's, Mllama's and CLIP's). Stub start, the process's own CPU-s at initialize's end
(median of 3-5 runs, 2-core machine, 2026-11-30), with torch -> hidden: see WITHOUT_TORCH's comment.
tests/integration/test_multimodal_served.py holds the served text to transformers' generate on pixels made
with torch and checks the served LLaVA, Mllama and Qwen3-VL stubs never load torch. Where torchvision is
installed, transformers may pick its torchvision classes with torch and the PIL ones without (other
pixels), so torch stays visible there.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys

# builder_config.model_type of the vision encoders checked so (others load transformers with torch): every
# family of engine/vision/registry.py (tests/serving/test_torchless_preprocessing.py fails on a new one until it
# is checked and added here, or left out with its reason). Stub start CPU-s (tests/serving/
# preprocessing_stub_process.py: its own CPU-s when initialize returns), median of 5 runs (3 for the first
# four), with torch -> hidden: llava 5.8 -> 1.4, llava_onevision 5.6 -> 3.1 (its stub imports torch after
# transformers, for its video side), mllama 5.9 -> 1.5, qwen3_vl 5.9 -> 1.6, qwen2_vl 6.1 -> 1.8, qwen2_5_vl
# 5.6 -> 1.4, llava_next 6.3 -> 1.6, gemma3 7.0 -> 1.7, blip2-opt 7.2 -> 1.6. Served (tritonserver on `tritonllm
# serve`'s repository of the tiny engine, the stub's utime + stime once ready, median of 3, 16becf9 -> this):
# qwen2_vl 7.2 -> 1.8, qwen2_5_vl 7.1 -> 1.8, llava_next 6.3 -> 1.6, gemma3 6.9 -> 1.8, blip2-opt 7.2 -> 2.0.
WITHOUT_TORCH = ("llava", "llava_onevision", "mllama", "qwen3_vl", "qwen2_vl", "qwen2_5_vl", "llava_next", "gemma3",
                 "blip2-opt")


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
