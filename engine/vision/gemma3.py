"""Gemma 3's image path: SigLIP tower -> average pool to ``mm_tokens_per_image`` rows -> Gemma RMSNorm ->
projection into the language model.

``image_features(pixel_values)``: (num_images, 3, S, S) -> per image (mm_tokens_per_image, text_hidden)
rows, as transformers' Gemma3Model.get_image_features: the tower's last hidden state after its
post-LayerNorm, (n, P * P, vision_hidden) with P = S / patch_size patches a side, laid out as a
(P, P) map and average-pooled in (P / T) x (P / T) windows to T x T rows (T^2 = mm_tokens_per_image,
row-major), normed by RMSNorm with weight (1 + w) in float32, then multiplied by
``mm_input_projection_weight`` (vision_hidden, text_hidden).

In the prompt an image is ``<start_of_image>``, its rows, ``<end_of_image>``; the rows of one image
attend to each other in both directions during prefill (engine/executor/image_spans.py), as
transformers' token_type_ids mask. Pan-and-scan (extra crops of large images) is not built: the
serving side refuses an image processor that has it on (serving/multimodal.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.vision.clip import TOWER_PREFIXES, ClipTowerConfig, ClipVisionTower, first_found, tower_weights

MODEL_TYPE = "gemma3"  # builder_config.model_type of the encoder directory (no anchor name: ours)
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class Gemma3VisionEncoder(nn.Module):
    """The SigLIP tower, its post-LayerNorm and the multimodal projector, for one device."""

    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        gemma3 = config["gemma3"]
        self.tower_config = ClipTowerConfig(**config["vision"])
        h = self.tower_config.hidden_size
        self.tower = ClipVisionTower(self.tower_config, dtype, device)
        self.post_norm = nn.LayerNorm(h, eps=self.tower_config.layer_norm_eps, dtype=dtype, device=device)
        self.soft_emb_norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device))  # the RMSNorm's w
        self.projection = nn.Parameter(torch.empty(h, gemma3["text_hidden_size"], dtype=dtype, device=device))
        self.patches_per_side = self.tower_config.image_size // self.tower_config.patch_size
        self.pool = self.patches_per_side // gemma3["tokens_per_side"]
        self.num_image_tokens = config["num_image_tokens"]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, 3, S, S) -> (num_images, mm_tokens_per_image, text_hidden) in the encoder's dtype."""
        states = self.post_norm(self.tower.hidden_states(pixel_values, up_to=self.tower_config.num_layers)[-1])
        n, _, h = states.shape
        grid = states.transpose(1, 2).reshape(n, h, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)  # (n, T * T, h)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.tower_config.layer_norm_eps)
        normed = (x * (1.0 + self.soft_emb_norm.float())).to(states.dtype)
        return torch.matmul(normed, self.projection)

    def image_features(self, pixel_values: torch.Tensor, image_sizes=None, tiled=None) -> list[torch.Tensor]:
        """Every family's entry (engine/vision/registry.py): each image's rows (mm_tokens_per_image, text_hidden)."""
        return list(self.encode(pixel_values))


def encoder_config(hf_config) -> dict:
    """The vision-encoder directory's config (besides builder_config) of a Gemma3Config."""
    tower = ClipTowerConfig.from_hf(hf_config.vision_config)
    tokens = hf_config.mm_tokens_per_image
    side = math.isqrt(tokens)
    patches = tower.image_size // tower.patch_size
    if side * side != tokens or patches % side:
        raise CheckpointError(f"mm_tokens_per_image {tokens} must be a square whose side divides the tower's "
                              f"{patches} patches a side")
    return {
        "vision": tower.to_dict(),
        "gemma3": {"tokens_per_side": side, "text_hidden_size": hf_config.text_config.hidden_size,
                   "boi_token_index": hf_config.boi_token_index, "eoi_token_index": hf_config.eoi_token_index},
        "num_image_tokens": tokens,
        "image_token_index": getattr(hf_config, "image_token_index", getattr(hf_config, "image_token_id", None)),
        "image_size": tower.image_size,
    }


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    weights = {f"tower.{name}": tensor
               for name, tensor in tower_weights(get, ClipTowerConfig(**config["vision"])).items()}
    for part in ("weight", "bias"):
        weights[f"post_norm.{part}"] = first_found(get, [p + f"post_layernorm.{part}" for p in TOWER_PREFIXES])
    weights["soft_emb_norm"] = first_found(get, [p + "mm_soft_emb_norm.weight" for p in PROJECTOR_PREFIXES])
    weights["projection"] = first_found(get, [p + "mm_input_projection_weight" for p in PROJECTOR_PREFIXES])
    return weights

