"""The vision-encoder directory, written beside the language engine by ``engine.build``.

    <engine_dir>/vision_encoder/
      config.json                {"format_version", "builder_config": {"model_type", "precision",
                                  "architecture"}, family fields (engine/vision/<family>.py)}
      model.safetensors          the encoder's weights in the engine's dtype
      preprocessor_config.json   the checkpoint's own image processor (transformers), for the
                                 preprocessing model
      video_preprocessor_config.json   LLaVA-OneVision: its video processor's settings; Qwen2(.5)-VL: the
                                 checkpoint's own, when it has one

``builder_config.model_type`` is what the anchor's preprocessing and multimodal_encoders read
(``llava``, ...). ``load_vision_encoder`` gives the encoder module on a device; a wrong or
incomplete directory is an EngineFormatError naming the file.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.config import EngineFormatError
from engine.hf_checkpoint import TensorGetter
from engine.vision.mlp_width import pad_mlp_widths
from engine.vision.encoder_path import VISION_ENCODER_DIR, vision_encoder_dir  # noqa: F401 (build.py, tests)
from engine.vision.registry import FAMILIES_BY_MODEL_TYPE, VisionFamily
from engine.vision.tower_fp8 import quantize_loaded_tower, tower_fp8_scope

FORMAT_VERSION = 1
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def write_vision_encoder(family: VisionFamily, hf_config, get: TensorGetter, output_dir: str, dtype: str,
                         source: str = "") -> str:
    """Write ``output_dir`` for ``family``'s checkpoint (``source``: its directory, for the image processor)."""
    config = family.encoder_config(hf_config)
    # An encoder may keep some weights float32 in any engine dtype (BLIP-2's Q-Former, as transformers)
    float32 = getattr(family.encoder_class, "float32_prefixes", ())
    weights = {name: tensor.to(torch.float32 if name.startswith(float32) else TORCH_DTYPES[dtype]).contiguous()
               for name, tensor in family.encoder_weights(get, config).items()}
    if os.path.isdir(output_dir):
        shutil.rmtree(output_dir)
    os.makedirs(output_dir)
    save_file(weights, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    _image_processor(source, config).save_pretrained(output_dir)
    if "video" in config:  # LLaVA-OneVision: its video processor's settings (onevision_video.py)
        from engine.vision.onevision_video import VIDEO_PROCESSOR_FILE, video_processor_settings

        with open(os.path.join(output_dir, VIDEO_PROCESSOR_FILE), "w") as f:
            json.dump(video_processor_settings(source), f, indent=2)
    video_settings = os.path.join(source, "video_preprocessor_config.json") if source else ""
    if "qwen_video" in config and os.path.isfile(video_settings):  # Qwen video: serving/qwen_video.py reads it
        shutil.copy(video_settings, output_dir)
    config = {"format_version": FORMAT_VERSION,
              "builder_config": {"model_type": family.model_type, "precision": dtype,
                                 "architecture": family.architecture},
              **config}
    with open(os.path.join(output_dir, "config.json"), "w") as f:  # last: a directory with config.json is complete
        json.dump(config, f, indent=2)
    return output_dir


def _image_processor(source: str, config: dict):
    """The checkpoint's image processor (its preprocessor_config.json, or the image_processor of the
    processor_config.json transformers 5 writes); without one, CLIP's at the tower's resolution (with a warning)."""
    from transformers import AutoImageProcessor, CLIPImageProcessor

    if source and any(os.path.isfile(os.path.join(source, name))
                      for name in ("preprocessor_config.json", "processor_config.json")):
        return AutoImageProcessor.from_pretrained(source)
    size = config["image_size"]
    print(f"warning: {source or 'the checkpoint'} has no preprocessor_config.json; the vision encoder gets "
          f"CLIP's image processor at {size}x{size}", file=sys.stderr)
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def read_encoder_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise EngineFormatError(f"cannot read the vision encoder's {config_path}: {err}") from None
    model_type = config.get("builder_config", {}).get("model_type")
    if model_type not in FAMILIES_BY_MODEL_TYPE:
        raise EngineFormatError(f"{config_path}: builder_config.model_type {model_type!r} is not supported; "
                                f"supported: {', '.join(FAMILIES_BY_MODEL_TYPE)}")
    return config


def load_vision_encoder(path: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The encoder of directory ``path`` on ``device``, in eval mode, with ``encode(pixel_values)``,
    ``num_image_tokens`` and ``model_type``; on CUDA its blocks' MLP widths zero-padded to multiples of 128."""
    config = read_encoder_config(path)
    family = FAMILIES_BY_MODEL_TYPE[config["builder_config"]["model_type"]]
    dtype = TORCH_DTYPES[config["builder_config"]["precision"]]
    weights_path = os.path.join(path, "model.safetensors")
    try:
        weights = load_file(weights_path, device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise EngineFormatError(f"cannot read {weights_path}: {err}") from None
    encoder = family.encoder_class(config, dtype=dtype, device="meta")
    try:
        encoder.load_state_dict(weights, assign=True, strict=True)
    except RuntimeError as err:
        raise EngineFormatError(f"{weights_path} does not match its config.json: {err}") from None
    encoder.model_type = family.model_type
    if torch.device(device).type == "cuda":  # MLP widths to tensor-core tilings, exact (engine/vision/mlp_width.py)
        pad_mlp_widths(encoder)
    scope = tower_fp8_scope()
    if scope is not None:  # $TRITONLLM_TOWER_FP8=1 or mlp: linears in E4M3, an approximation
        quantize_loaded_tower(encoder, family.model_type, device, config["builder_config"]["precision"], scope)
    return encoder.eval()
