"""Qwen2.5-VL's vision tower: Qwen2-VL's (engine/vision/qwen2_vl.py: patches, 2-D rotary, 2 x 2 merger)
with RMSNorm, SwiGLU MLPs with bias, and window attention.

Window attention: the patches of each frame are regrouped window by window, a window being
``window_size // merge // patch_size`` merged rows on a side (windows at the right and bottom edges
are cut short), windows in row-major order within a frame, merged units in row-major order within
a window, the merge x merge patches of a unit kept together. Blocks listed in
``fullatt_block_indexes`` attend over the whole frame (its patches are still contiguous), the others
within their window only; the merger's rows go back to the processor's order at the end. This is
transformers' Qwen2_5_VisionTransformerPretrainedModel; the language model and its M-RoPE are
Qwen2-VL's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import TensorGetter
from kernels.rmsnorm import rms_norm
from engine.vision.clip import activation, first_found
from engine.vision.qwen2_vl import (PREFIXES, PatchRotary, Qwen2VisionBlock, Segments, axial_cos_sin, embed_patches,
                                    language_fields)

MODEL_TYPE = "qwen2_5_vl"  # builder_config.model_type


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (x / rms(x) in float32, rounded to x's dtype), as transformers' Qwen2RMSNorm; one
        Triton launch on CUDA (kernels/rmsnorm.py), the torch reference elsewhere."""
        return rms_norm(x, self.weight, self.eps)[0]


class Qwen25VisionBlock(Qwen2VisionBlock):
    def __init__(self, config: dict, dtype=None, device=None):
        nn.Module.__init__(self)
        dim, hidden = config["embed_dim"], config["intermediate_size"]
        self.num_heads = config["num_heads"]
        self.norm1 = RMSNorm(dim, dtype=dtype, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.norm2 = RMSNorm(dim, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.act = activation(config["hidden_act"])

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


def window_order(grids: list[list[int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(order (merged units,): the processor's unit index at each place of the window-major order,
    each window's length in merged units, in that order). ``window``: merged units per window side."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, columns = h // merge, w // merge
        units = torch.arange(t * rows * columns).view(t, rows, columns) + base
        for frame in units:
            for top in range(0, rows, window):
                for left in range(0, columns, window):
                    block = frame[top:top + window, left:left + window].flatten()
                    order.append(block)
                    lengths.append(block.numel())
        base += t * rows * columns
    return torch.cat(order), lengths


class Qwen25VisionEncoder(nn.Module):
    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        vision = config["qwen2_5_vl"]
        self.config = vision
        dim = vision["embed_dim"]
        patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        self.patch_embed = nn.Linear(patch, dim, bias=False, dtype=dtype, device=device)  # the Conv3d, per patch
        self.blocks = nn.ModuleList(Qwen25VisionBlock(vision, dtype, device) for _ in range(vision["depth"]))
        merged = dim * vision["spatial_merge_size"] ** 2
        self.merger_norm = RMSNorm(dim, dtype=dtype, device=device)
        self.merger_fc1 = nn.Linear(merged, merged, dtype=dtype, device=device)
        self.merger_fc2 = nn.Linear(merged, vision["out_hidden_size"], dtype=dtype, device=device)
        self.num_image_tokens = None  # depends on each image's grid

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw, tiled=None) -> list[torch.Tensor]:
        grids = [[int(v) for v in grid] for grid in image_grid_thw]
        c = self.config
        merge, unit = c["spatial_merge_size"], c["spatial_merge_size"] ** 2
        order, windows = window_order(grids, merge, c["window_size"] // merge // c["patch_size"])
        order = order.to(pixel_values.device)

        def windowed(rows: torch.Tensor) -> torch.Tensor:  # (patches, d) in the processor's order -> window-major
            return rows.view(-1, unit, rows.shape[-1])[order].view(-1, rows.shape[-1])

        x = windowed(embed_patches(self.patch_embed, pixel_values, grids))
        cos, sin = axial_cos_sin(grids, merge, c["embed_dim"] // c["num_heads"], c["rope_theta"], x.device)
        rotary = PatchRotary(windowed(cos), windowed(sin))
        frames = Segments([h * w for t, h, w in grids for _ in range(t)], x.device)
        windows = Segments([n * unit for n in windows], x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, frames if i in c["fullatt_block_indexes"] else windows)
        x = self.merger_norm(x).view(-1, c["embed_dim"] * unit)
        rows = self.merger_fc2(F.gelu(self.merger_fc1(x)))
        rows = rows[torch.argsort(order)]  # back to the processor's order
        return list(rows.split([t * h * w // unit for t, h, w in grids]))


def encoder_config(hf_config) -> dict:
    vision = hf_config.vision_config
    rope = getattr(vision, "rope_parameters", None) or {}
    return {
        "qwen2_5_vl": {"embed_dim": vision.hidden_size, "depth": vision.depth, "num_heads": vision.num_heads,
                       "intermediate_size": vision.intermediate_size, "hidden_act": vision.hidden_act,
                       "in_channels": vision.in_channels, "patch_size": vision.patch_size,
                       "temporal_patch_size": vision.temporal_patch_size, "spatial_merge_size": vision.spatial_merge_size,
                       "out_hidden_size": vision.out_hidden_size, "window_size": vision.window_size,
                       "fullatt_block_indexes": list(vision.fullatt_block_indexes),
                       "rope_theta": rope.get("rope_theta", 10000.0)},
        **language_fields(hf_config),
    }


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in PREFIXES])

    weights = {"patch_embed.weight": hf("patch_embed.proj.weight").flatten(1),
               "merger_norm.weight": hf("merger.ln_q.weight")}
    for part in ("weight", "bias"):
        weights[f"merger_fc1.{part}"] = hf(f"merger.mlp.0.{part}")
        weights[f"merger_fc2.{part}"] = hf(f"merger.mlp.2.{part}")
    for i in range(config["qwen2_5_vl"]["depth"]):
        weights[f"blocks.{i}.norm1.weight"] = hf(f"blocks.{i}.norm1.weight")
        weights[f"blocks.{i}.norm2.weight"] = hf(f"blocks.{i}.norm2.weight")
        for ours, theirs in (("qkv", "attn.qkv"), ("proj", "attn.proj"), ("gate_proj", "mlp.gate_proj"),
                             ("up_proj", "mlp.up_proj"), ("down_proj", "mlp.down_proj")):
            for part in ("weight", "bias"):
                weights[f"blocks.{i}.{ours}.{part}"] = hf(f"blocks.{i}.{theirs}.{part}")
    return weights
