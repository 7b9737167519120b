"""What the frontend reads from a filled model repository: the tokenizer directory and the
``add_special_tokens`` flag of ``preprocessing`` (so prompts are counted as they are encoded),
whether the engine's model takes LoRA adapters (so ``--lora_modules`` over a model with LoRA off is
refused at start, by the frontend and by the launcher, not answered with a 500 per request), and a
vision-language engine's encoder and image limits (``preprocessing``'s, so both paths share them)."""
from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

PARAMETER = re.compile(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def model_parameters(repo: str, model: str) -> dict[str, str] | None:
    """Every ``parameters { key: "..." value: { string_value: "..." } }`` of
    ``<repo>/<model>/config.pbtxt``, as written (placeholders included); None without that file."""
    path = Path(repo) / model / "config.pbtxt"
    if not path.is_file():
        return None
    return dict(PARAMETER.findall(path.read_text()))


def model_parameter(repo: str, model: str, key: str) -> str | None:
    """``parameters { key: "<key>" value: { string_value: "..." } }`` of ``<repo>/<model>/config.pbtxt``;
    None when absent or still a ``${placeholder}``."""
    value = (model_parameters(repo, model) or {}).get(key)
    if not value or value.startswith("${"):
        return None
    return value


def lora_off_reason(repo: str, model: str) -> str | None:
    """Why ``--lora_modules`` cannot be served by ``<repo>/<model>`` (the model holding the engine),
    naming the setting to change; None when LoRA is on, or when the repository does not say (no
    such model, or an LLM-API model.yaml that does not load: the server reports that itself)."""
    from serving.executor_config import lora_enabled

    model_dir = Path(repo) / model
    model_yaml = model_dir / "1" / os.environ.get("LLM_CONFIG_PATH", "model.yaml")
    if model_yaml.is_file():  # the LLM-API repository (all_models/llmapi): model.yaml holds the settings
        from serving.llmapi_yaml import load_llmapi_config

        try:
            parameters = load_llmapi_config(str(model_yaml)).parameters
        except ValueError:
            return None
        if lora_enabled(parameters):
            return None
        return (f"--lora_modules: LoRA is not enabled on the model {model} of {repo}; set enable_lora: true "
                f"in {model_yaml}")
    parameters = model_parameters(repo, model)
    if parameters is None or lora_enabled(parameters):
        return None
    return (f"--lora_modules: LoRA is not enabled on the model {model} of {repo}; set the {model} parameter "
            f"enable_lora to true in {model_dir / 'config.pbtxt'} (fill_template: enable_lora:true; "
            "`tritonllm serve --lora_modules ...` fills it so)")


def tokenizer_settings(repo: str) -> tuple[str, bool]:
    """(tokenizer_dir, add_special_tokens) of the repository's preprocessing model."""
    tokenizer_dir = model_parameter(repo, "preprocessing", "tokenizer_dir")
    if tokenizer_dir is None:
        raise ValueError(f"{repo}/preprocessing/config.pbtxt has no filled tokenizer_dir; "
                         "pass --tokenizer_dir")
    add_special = model_parameter(repo, "preprocessing", "add_special_tokens")
    return tokenizer_dir, (add_special or "true").lower() in ("true", "1", "yes")


def vision_settings(repo: str | None, tokenizer_dir: str, local_media_path: str | None = None):
    """The vision encoder the frontend runs for image parts (openai_frontend/vision.py), or None for a
    text-only engine: preprocessing's multimodal_model_path and image limits when ``repo`` fills them,
    else the engine's own ``vision_encoder/`` (``tokenizer_dir`` is the engine directory) with the
    defaults (one image per request, data: URLs only); ``local_media_path``: --allowed_local_media_path."""
    from engine.vision.encoder_path import vision_encoder_dir  # (no torch: encoder_dir.py's module has it)
    from openai_frontend.vision import VisionSettings

    def number(key: str) -> int | None:
        value = model_parameter(repo, "preprocessing", key) if repo else None
        return int(value) if value and value.strip().isdigit() else None

    encoder_dir = (model_parameter(repo, "preprocessing", "multimodal_model_path") if repo else None) or \
        vision_encoder_dir(tokenizer_dir)
    if not encoder_dir:
        return None
    settings = VisionSettings(encoder_dir, max_image_pixels=number("max_image_pixels"),
                              allowed_image_url_hosts=model_parameter(repo, "preprocessing", "allowed_image_url_hosts")
                              if repo else None)
    return replace(settings, max_num_images=number("max_num_images") or settings.max_num_images,
                   max_num_frames=number("max_num_frames"), max_decoded_frames=number("max_decoded_frames"),
                   allowed_local_media_path=local_media_path)
