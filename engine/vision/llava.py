"""LLaVA-1.5's image path: CLIP tower -> chosen layers' hidden states -> 2-layer MLP projector.

``encode(pixel_values)``: (num_images, 3, S, S) -> image features (num_images, num_image_tokens,
text_hidden), which the language model takes in place of the image's placeholder tokens (one
table row per token, engine/executor/prompt_table.py). As transformers' LlavaModel.get_image_features:
the hidden states of ``vision_feature_layer`` (an index into [embeddings, layer 1, ..., layer L],
negative from the end; a list concatenates several along the hidden dim), without the class token
when ``vision_feature_select_strategy`` is "default" ("full" keeps it), then linear_1 -> act ->
linear_2. Only the layers up to the deepest chosen one are kept and run.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.vision.clip import ClipTowerConfig, ClipVisionTower, activation, first_found, tower_weights

MODEL_TYPE = "llava"  # builder_config.model_type, as the anchor's preprocessing reads it
SELECT_STRATEGIES = ("default", "full")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def feature_layers(vision_feature_layer, num_layers: int) -> list[int]:
    """vision_feature_layer (int or list) -> non-negative indices into hidden_states (length num_layers + 1)."""
    layers = vision_feature_layer if isinstance(vision_feature_layer, (list, tuple)) else [vision_feature_layer]
    resolved = [layer if layer >= 0 else num_layers + 1 + layer for layer in layers]
    if not resolved or any(not 0 <= layer <= num_layers for layer in resolved):
        raise CheckpointError(f"vision_feature_layer {vision_feature_layer!r} is out of range for a tower of "
                              f"{num_layers} layers")
    return resolved


class LlavaVisionEncoder(nn.Module):
    """The tower (only the layers the features need) and the projector, for one device."""

    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        llava = config["llava"]
        self.tower_config = ClipTowerConfig(**config["vision"])
        self.layers = llava["feature_layers"]
        # "default" drops each tile's first row (CLIP's class token), "full" keeps every row
        self.drop_first = llava["vision_feature_select_strategy"] == "default"
        self.tower = ClipVisionTower(self.tower_config, dtype, device)
        features_in = self.tower_config.hidden_size * len(self.layers)
        bias = llava.get("projector_bias", True)
        self.linear_1 = nn.Linear(features_in, llava["text_hidden_size"], bias=bias, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(llava["text_hidden_size"], llava["text_hidden_size"], bias=bias, dtype=dtype,
                                  device=device)
        self.act = activation(llava["projector_hidden_act"])
        self.num_image_tokens = config["num_image_tokens"]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, 3, S, S) -> (num_images, num_image_tokens, text_hidden) in the encoder's dtype."""
        states = self.tower.hidden_states(pixel_values, up_to=max(self.layers))
        chosen = [states[layer][:, 1:] if self.drop_first else states[layer] for layer in self.layers]
        features = torch.cat(chosen, dim=-1) if len(chosen) > 1 else chosen[0]
        return self.linear_2(self.act(self.linear_1(features)))

    def image_features(self, pixel_values: torch.Tensor, image_sizes=None, tiled=None) -> list[torch.Tensor]:
        """Every family's entry (engine/vision/registry.py): (num_images, 3, S, S) -> each image's
        rows (num_image_tokens, text_hidden); ``image_sizes`` and ``tiled`` (anyres families',
        llava_next.py) are not needed here."""
        return list(self.encode(pixel_values))


def encoder_config(hf_config) -> dict:
    """The vision-encoder directory's config (besides builder_config) of a LlavaConfig."""
    strategy = hf_config.vision_feature_select_strategy
    if strategy not in SELECT_STRATEGIES:
        raise CheckpointError(f"vision_feature_select_strategy {strategy!r} is not supported; "
                              f"supported: {', '.join(SELECT_STRATEGIES)}")
    tower = ClipTowerConfig.from_hf(hf_config.vision_config)
    layers = feature_layers(hf_config.vision_feature_layer, tower.num_layers)
    tower = replace(tower, num_layers=max(layers))  # deeper layers never reach the features
    return {
        "vision": tower.to_dict(),
        "llava": {"feature_layers": layers, "vision_feature_select_strategy": strategy,
                  "projector_hidden_act": hf_config.projector_hidden_act,
                  "projector_bias": getattr(hf_config, "multimodal_projector_bias", True),
                  "text_hidden_size": hf_config.text_config.hidden_size},
        "num_image_tokens": tower.num_patches + int(tower.class_token) - int(strategy == "default"),
        "image_token_index": getattr(hf_config, "image_token_index", getattr(hf_config, "image_token_id", None)),
        "image_size": tower.image_size,
    }


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    weights = {f"tower.{name}": tensor
               for name, tensor in tower_weights(get, ClipTowerConfig(**config["vision"])).items()}
    names = ["linear_1.weight", "linear_2.weight"]
    if config["llava"]["projector_bias"]:
        names += ["linear_1.bias", "linear_2.bias"]
    for name in names:
        weights[name] = first_found(get, [prefix + name for prefix in PROJECTOR_PREFIXES])
    return weights
