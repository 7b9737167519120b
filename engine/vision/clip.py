"""The CLIP ViT vision tower (LLaVA-1.5's encoder) and SigLIP's (LLaVA-OneVision's), which differs
only in details: no class token, no norm before the layers, a bias on the patch embedding.

Batch layout: ``pixel_values`` (num_images, 3, image_size, image_size) -> hidden states after
each layer, (num_images, [1 +] num_patches, hidden): the class token (CLIP), then the patches row by row.
Plain torch: the patch embedding is a strided convolution, attention is bidirectional over one
image's tokens (torch SDPA; images are independent and equally long, so no masks or packing).

Weights (engine names; ``tower_weights`` maps a checkpoint's): ``patch_embed.weight`` (hidden, 3,
p, p), ``class_embed`` (hidden,), ``position_embed`` (1 + num_patches, hidden), ``pre_norm.*``,
per layer ``layers.i.{attn_norm, qkv_proj, out_proj, mlp_norm, fc1, fc2}``, q/k/v fused to
``qkv_proj`` with rows [q | k | v].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,  # Qwen2.5-VL's SwiGLU blocks
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise CheckpointError(f"activation {name!r} is not supported by the vision encoders; "
                              f"supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass
class ClipTowerConfig:
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    class_token: bool = True  # CLIP's; SigLIP has none
    pre_norm: bool = True  # CLIP's pre_layrnorm over the embeddings; SigLIP has none
    patch_bias: bool = False  # SigLIP's patch embedding has a bias

    @classmethod
    def from_hf(cls, vision_config) -> "ClipTowerConfig":
        kind = getattr(vision_config, "model_type", "clip_vision_model")
        if kind not in TOWER_KINDS:
            raise CheckpointError(f"a {kind} vision tower is not supported; supported: {', '.join(TOWER_KINDS)}")
        clip = kind == "clip_vision_model"
        return cls(image_size=vision_config.image_size, patch_size=vision_config.patch_size,
                   hidden_size=vision_config.hidden_size, intermediate_size=vision_config.intermediate_size,
                   num_layers=vision_config.num_hidden_layers, num_heads=vision_config.num_attention_heads,
                   layer_norm_eps=vision_config.layer_norm_eps, hidden_act=vision_config.hidden_act,
                   class_token=clip, pre_norm=clip, patch_bias=not clip)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


TOWER_KINDS = ("clip_vision_model", "siglip_vision_model")


class ClipLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ClipTowerConfig, dtype=None, device=None):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_heads
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)
        self.qkv_proj = nn.Linear(h, 3 * h, dtype=dtype, device=device)
        self.out_proj = nn.Linear(h, h, dtype=dtype, device=device)
        self.mlp_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)
        self.fc1 = nn.Linear(h, config.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(config.intermediate_size, h, dtype=dtype, device=device)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(batch, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # (batch, heads, tokens, head_dim), no mask
        x = x + self.out_proj(attn.transpose(1, 2).reshape(batch, tokens, hidden))
        return x + self.fc2(self.act(self.fc1(self.mlp_norm(x))))


class ClipVisionTower(nn.Module):
    def __init__(self, config: ClipTowerConfig, dtype=None, device=None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.patch_embed = nn.Conv2d(3, h, config.patch_size, stride=config.patch_size, bias=config.patch_bias,
                                     dtype=dtype, device=device)
        if config.class_token:
            self.class_embed = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
        tokens = config.num_patches + int(config.class_token)
        self.position_embed = nn.Parameter(torch.empty(tokens, h, dtype=dtype, device=device))
        self.pre_norm = (nn.LayerNorm(h, eps=config.layer_norm_eps, dtype=dtype, device=device) if config.pre_norm
                         else nn.Identity())
        self.layers = nn.ModuleList(ClipLayer(config, dtype, device) for _ in range(config.num_layers))

    def hidden_states(self, pixel_values: torch.Tensor, up_to: int) -> list[torch.Tensor]:
        """[embeddings, after layer 1, ..., after layer ``up_to``] (transformers' hidden_states[:up_to + 1]),
        each (num_images, [1 +] num_patches, hidden); layers past ``up_to`` are not run."""
        patches = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        if self.config.class_token:
            patches = torch.cat([self.class_embed.expand(patches.shape[0], 1, -1), patches], dim=1)
        x = self.pre_norm(patches + self.position_embed)
        states = [x]
        for layer in self.layers[:up_to]:
            x = layer(x)
            states.append(x)
        return states


# Where checkpoints keep the tower: transformers 5 in memory, its saved files and transformers 4's.
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                  "model.vision_tower.")


def first_found(get: TensorGetter, names: list[str]) -> torch.Tensor:
    for name in names[:-1]:
        try:
            return get(name)
        except CheckpointError:
            continue
    return get(names[-1])  # its error names the last layout tried


def norm_and_mlp_weights(get, hf_layer: str, ours: str) -> dict[str, torch.Tensor]:
    """One ViT layer's two LayerNorms and MLP, named as CLIP's, SigLIP's and BLIP-2's vision models name
    them (``get``: HF name -> tensor; ``hf_layer`` and ``ours``: the layer's prefix in each naming)."""
    return {f"{ours}{mine}.{part}": get(f"{hf_layer}{theirs}.{part}")
            for mine, theirs in (("attn_norm", "layer_norm1"), ("mlp_norm", "layer_norm2"),
                                 ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"))
            for part in ("weight", "bias")}


def tower_weights(get: TensorGetter, config: ClipTowerConfig, prefixes=TOWER_PREFIXES) -> dict[str, torch.Tensor]:
    """The engine's tower weights from a checkpoint's CLIP vision model (HF names)."""
    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in prefixes])

    weights = {"patch_embed.weight": hf("embeddings.patch_embedding.weight"),
               "position_embed": hf("embeddings.position_embedding.weight")}
    if config.class_token:
        weights["class_embed"] = hf("embeddings.class_embedding")
    if config.pre_norm:
        weights.update({"pre_norm.weight": hf("pre_layrnorm.weight"), "pre_norm.bias": hf("pre_layrnorm.bias")})
    if config.patch_bias:
        weights["patch_embed.bias"] = hf("embeddings.patch_embedding.bias")
    for i in range(config.num_layers):
        layer = f"encoder.layers.{i}."
        for part in ("weight", "bias"):
            weights[f"layers.{i}.qkv_proj.{part}"] = torch.cat(
                [hf(f"{layer}self_attn.{p}_proj.{part}") for p in ("q", "k", "v")])
            weights[f"layers.{i}.out_proj.{part}"] = hf(f"{layer}self_attn.out_proj.{part}")
        weights.update(norm_and_mlp_weights(hf, layer, f"layers.{i}."))
    return weights
