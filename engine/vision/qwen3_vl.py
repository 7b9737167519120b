"""Qwen3-VL's vision tower and what its language model takes from it (DeepStack).

The tower is Qwen2-VL's (engine/vision/qwen2_vl.py: the processor's flattened patches, 2-D rotary
attention within each frame, LayerNorm blocks, a 2 x 2 merger) with three changes, as transformers'
Qwen3VLVisionModel:

- the patch embedding has a bias, and a learned (S x S, dim) position table is added to it,
  resampled to each image's (h, w) patch grid by bilinear interpolation with aligned corners
  (``grid_position_embeddings``), taken in the processor's block-major patch order;
- the MLP is fc1 -> act (gelu_pytorch_tanh) -> fc2 of width ``intermediate_size``;
- DeepStack: after each block listed in ``deepstack_visual_indexes``, a merger of its own
  (LayerNorm over the merged 4 * dim, fc1, GELU, fc2) turns the hidden states into rows of the
  language model's width; level j is added to the language model's hidden states at the image's
  positions after its decoder layer j (engine/models/qwen3_vl.py).

``image_features`` returns each image's rows as (rows, hidden * (1 + k)) for k DeepStack levels:
[merger output | level 0 | ... | level k-1]. That one wide row is what a prompt-embedding table
carries for Qwen3-VL (the table's width is the engine's ``prompt_table_width``), so the levels
travel through every path a table does (Triton's prompt_embedding_table, chunked prefill, preemption,
the prefix cache's image digests) and stay aligned with the image's fake ids.

The language model is Qwen3's (q/k RMSNorm per head) built with ``deepstack_layers = k``
(``text_config``); its M-RoPE is Qwen2-VL's positions with the frequencies interleaved
(engine/vision/mrope.py, ``mrope["interleaved"]``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import TensorGetter
from engine.vision.clip import first_found
from engine.vision.qwen2_vl import (PREFIXES, Qwen2VisionBlock, embed_patches, frame_attention, language_fields, unfused,
                                    with_video)
from engine.vision.qwen2_vl import text_config as qwen2_vl_text_config

# builder_config.model_type of both Qwen3-VL and Qwen3-VL-MoE (the same tower; the anchor has no Qwen3-VL)
MODEL_TYPE = "qwen3_vl"
MOE_MODEL_TYPE = "qwen3_vl_moe"  # the MoE checkpoint's config.model_type


def grid_position_embeddings(table: torch.Tensor, grids: list[list[int]], merge: int) -> torch.Tensor:
    """table (S * S, dim) -> (total patches, dim) float32: per image, the S x S grid resampled to its (h, w)
    (bilinear, corners aligned: patch (r, c) reads table point (r (S-1)/(h-1), c (S-1)/(w-1))), in the
    processor's block-major order, repeated over its t frames."""
    side = int(table.shape[0] ** 0.5)
    square = table.float().T.reshape(1, -1, side, side)  # (1, dim, S, S)
    pieces = []
    for t, h, w in grids:
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # (dim, h, w)
        blocks = grid.reshape(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        pieces.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(pieces)


class PatchMerger(nn.Module):
    """merge x merge patches -> one row of ``out`` width. ``after_shuffle``: the LayerNorm runs over the
    concatenated patches (DeepStack's mergers) instead of over each patch (the main merger)."""

    def __init__(self, dim: int, merge: int, out: int, after_shuffle: bool, dtype=None, device=None):
        super().__init__()
        self.merged, self.after_shuffle = dim * merge ** 2, after_shuffle
        self.norm = nn.LayerNorm(self.merged if after_shuffle else dim, eps=1e-6, dtype=dtype, device=device)
        self.fc1 = nn.Linear(self.merged, self.merged, dtype=dtype, device=device)
        self.fc2 = nn.Linear(self.merged, out, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (patches, dim), each merge x merge block consecutive -> (patches / merge**2, out)."""
        x = self.norm(x.view(-1, self.merged)) if self.after_shuffle else self.norm(x).view(-1, self.merged)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen3VisionEncoder(nn.Module):
    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        vision = config["qwen3_vl"]
        self.config = vision
        dim, merge, out = vision["embed_dim"], vision["spatial_merge_size"], vision["out_hidden_size"]
        patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        self.patch_embed = nn.Linear(patch, dim, dtype=dtype, device=device)  # the Conv3d (with bias), per patch
        self.pos_embed = nn.Parameter(torch.empty(vision["num_position_embeddings"], dim, dtype=dtype, device=device))
        self.blocks = nn.ModuleList(Qwen2VisionBlock(vision, dtype, device) for _ in range(vision["depth"]))
        self.merger = PatchMerger(dim, merge, out, False, dtype, device)
        self.deepstack_mergers = nn.ModuleList(PatchMerger(dim, merge, out, True, dtype, device)
                                               for _ in vision["deepstack_visual_indexes"])
        self.num_image_tokens = None  # depends on each image's grid

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw, tiled=None) -> list[torch.Tensor]:
        """-> per image (t * h * w / merge**2, out_hidden * (1 + DeepStack levels)): the table rows."""
        grids = [[int(v) for v in grid] for grid in image_grid_thw]
        c = self.config
        merge = c["spatial_merge_size"]
        x = embed_patches(self.patch_embed, pixel_values, grids)
        x = x + grid_position_embeddings(self.pos_embed, grids, merge).to(x.dtype)
        rotary, lengths = frame_attention(grids, c, x.device)
        levels, residual, fused = [], None, not unfused()
        for i, block in enumerate(self.blocks):
            if fused:  # the residual added in the next block's first norm (engine/vision/qwen2_vl.py)
                x, residual = block.forward_fused(x, residual, rotary, lengths)
            else:
                x = block(x, rotary, lengths)
            if i in c["deepstack_visual_indexes"]:
                if residual is not None:  # DeepStack reads the sum itself
                    x, residual = x + residual, None
                levels.append(self.deepstack_mergers[c["deepstack_visual_indexes"].index(i)](x))
        if residual is not None:
            x = x + residual
        rows = torch.cat([self.merger(x), *levels], dim=-1)
        return list(rows.split([t * h * w // merge ** 2 for t, h, w in grids]))


def text_config(hf_config):
    """Qwen3 (Qwen3-VL-MoE: Qwen3-MoE) with plain rope and ``deepstack_layers``: the number of DeepStack
    levels, which engine.convert puts in the ModelConfig (engine/models/qwen3_vl.py adds them)."""
    moe = hf_config.model_type == MOE_MODEL_TYPE
    text = qwen2_vl_text_config(hf_config, "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    text.deepstack_layers = len(hf_config.vision_config.deepstack_visual_indexes)
    # transformers ties lm_head by the top-level flag (Qwen3-VL-MoE's text config defaults to True, its top to False)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    if moe:  # Qwen3VLMoeTextTopKRouter always renormalises the top-k weights (its config has no flag)
        text.norm_topk_prob = True
    return text


# Qwen3-VL-MoE keeps each layer's experts fused: mlp.experts.gate_up_proj and mlp.experts.down_proj. Qwen's
# released files hold them as (E, hidden, 2I) and (E, I, hidden); transformers' modules (and the files its
# save_pretrained writes) as (E, 2I, hidden) and (E, hidden, I) (transformers transposes the released ones
# on load: its conversion mapping for qwen3_vl_moe). The pair tells them apart: in the modules' layout
# down's dim 1 equals gate_up's dim 2 (hidden); in the released one they are I and 2I.
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def moe_language_tensors(get: TensorGetter) -> TensorGetter:
    """A getter giving the fused experts in the modules' layout, what engine.hf_checkpoint.stacked_experts
    reads, from either file layout; every other tensor as it is."""
    def get_text(name: str) -> torch.Tensor:
        tensor = get(name)
        if not name.endswith(_FUSED_EXPERTS):
            return tensor
        layer = name[:-len(next(suffix for suffix in _FUSED_EXPERTS if name.endswith(suffix)))]
        gate_up, down = (tensor, get(layer + _FUSED_EXPERTS[1])) if name.endswith(_FUSED_EXPERTS[0]) \
            else (get(layer + _FUSED_EXPERTS[0]), tensor)
        return tensor if down.shape[1] == gate_up.shape[2] else tensor.transpose(1, 2)
    return get_text


def encoder_config(hf_config) -> dict:
    vision = hf_config.vision_config
    rope = getattr(vision, "rope_parameters", None) or {}
    fields = with_video(language_fields(hf_config), hf_config)
    fields["mrope"]["interleaved"] = True  # Qwen3VLTextRotaryEmbedding always interleaves (transformers 5)
    if "qwen_video" in fields:  # each frame pair its own run after a timestamp (serving/qwen3_video.py)
        fields["qwen_video"]["timestamps"] = True
    return {
        "qwen3_vl": {"embed_dim": vision.hidden_size, "depth": vision.depth, "num_heads": vision.num_heads,
                     "intermediate_size": vision.intermediate_size, "hidden_act": vision.hidden_act,
                     "in_channels": vision.in_channels, "patch_size": vision.patch_size,
                     "temporal_patch_size": vision.temporal_patch_size, "spatial_merge_size": vision.spatial_merge_size,
                     "out_hidden_size": vision.out_hidden_size,
                     "num_position_embeddings": vision.num_position_embeddings,
                     "deepstack_visual_indexes": list(vision.deepstack_visual_indexes),
                     "rope_theta": rope.get("rope_theta", 10000.0)},
        # DeepStack levels ride in the table rows: (1 + k) * hidden wide (engine/models/qwen3_vl.py)
        "deepstack_layers": len(vision.deepstack_visual_indexes),
        **fields,
    }


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in PREFIXES])

    vision = config["qwen3_vl"]
    weights = {"patch_embed.weight": hf("patch_embed.proj.weight").flatten(1),
               "patch_embed.bias": hf("patch_embed.proj.bias"), "pos_embed": hf("pos_embed.weight")}
    mergers = [("merger", "merger")] + [(f"deepstack_mergers.{j}", f"deepstack_merger_list.{j}")
                                        for j in range(len(vision["deepstack_visual_indexes"]))]
    for part in ("weight", "bias"):
        for ours, theirs in mergers:
            for layer in ("norm", "linear_fc1", "linear_fc2"):
                weights[f"{ours}.{layer.removeprefix('linear_')}.{part}"] = hf(f"{theirs}.{layer}.{part}")
        for i in range(vision["depth"]):
            for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
                                 ("fc1", "mlp.linear_fc1"), ("fc2", "mlp.linear_fc2")):
                weights[f"blocks.{i}.{ours}.{part}"] = hf(f"blocks.{i}.{theirs}.{part}")
    return weights
