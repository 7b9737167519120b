"""Llama 3.2 Vision's (Mllama's) image path: a tiled ViT -> projector -> the text model's cross-attention states.

``image_features(pixel_values, aspect_ratio_ids, aspect_ratio_mask)``: each image's tiles (n, T, 3, S, S),
T = max_num_tiles (the processor pads every image to T tiles; ``aspect_ratio_mask`` (n, T) says which are
real), -> per image (T * P, text_hidden) rows, P = (S / patch)^2 + 1 (the class token first), tile-major: the
states the language model's cross-attention layers attend to (engine/encoder_decoder/mllama_model.py). As
transformers' MllamaVisionModel + multi_modal_projector:

1. patch embedding (a strided convolution, no bias), + tanh(g_pre) * the pre-tile embedding of the image's
   aspect ratio id (one (hidden,) row per tile), the class token, + (1 - tanh(g)) * the position table
   + tanh(g) * the tile-position table of the aspect ratio id, LayerNorm;
2. each tile's P tokens padded to a multiple of 8 (Pp); attention over all T * Pp tokens of an image with an
   additive mask that blocks exactly the pairs whose query AND key are padding (padded patches, padded tiles)
   -- transformers' (and Meta's) mask: real tokens attend to padding too;
3. the local layers (pre-norm ViT blocks, no q/k/v/o bias), keeping the outputs of ``intermediate_layers``;
   LayerNorm; + tanh(g_post) * the post-tile embedding; the global layers (the same blocks with tanh gates on
   the attention and MLP branches);
4. padding dropped; [global output | intermediate outputs interleaved per channel (torch.stack(dim=-1))],
   (T, P, hidden * (1 + k)) -> the projector (a linear with bias) -> (T * P, text_hidden).

Images are independent; a batch of images runs as one pass. Padded tiles are computed too (their rows are
part of the cross-attention states, which the text tokens' masks then skip).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.models.tables import uninitialized_table
from engine.vision.clip import activation, first_found

MODEL_TYPE = "mllama"  # builder_config.model_type, as the anchor's preprocessing and multimodal_encoders read it
VISION_PREFIXES = ("vision_model.", "model.vision_model.")  # transformers 4 / saved files, transformers 5 in memory
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


class MllamaVisionLayer(nn.Module):
    """Pre-norm block: x + g_a * attn(norm(x)), then x + g_f * mlp(norm(x)); g = tanh(gate) for the global
    layers, 1 for the local ones."""

    def __init__(self, config: dict, gated: bool, dtype=None, device=None):
        super().__init__()
        h, eps = config["hidden_size"], config["norm_eps"]
        self.num_heads = config["num_heads"]
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False, dtype=dtype, device=device)  # rows [q | k | v]
        self.out_proj = nn.Linear(h, h, bias=False, dtype=dtype, device=device)
        self.mlp_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)
        self.fc1 = nn.Linear(h, config["intermediate_size"], dtype=dtype, device=device)
        self.fc2 = nn.Linear(config["intermediate_size"], h, dtype=dtype, device=device)
        self.act = activation(config["hidden_act"])
        if gated:
            self.gate_attn = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
            self.gate_ffn = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.gated = gated

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: (n, tokens, hidden); mask: (n, 1, tokens, tokens) additive."""
        n, tokens, hidden = x.shape
        q, k, v = self.qkv_proj(self.attn_norm(x)).view(n, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = self.out_proj(attn.transpose(1, 2).reshape(n, tokens, hidden))
        x = x + (self.gate_attn.tanh() * attn if self.gated else attn)
        mlp = self.fc2(self.act(self.fc1(self.mlp_norm(x))))
        return x + (self.gate_ffn.tanh() * mlp if self.gated else mlp)


class MllamaVisionEncoder(nn.Module):
    """The tiled ViT and the projector, for one device (module docstring)."""

    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        v = config["vision"]
        h, tiles = v["hidden_size"], v["max_num_tiles"]
        self.hidden, self.max_tiles = h, tiles
        self.patches = (v["image_size"] // v["patch_size"]) ** 2 + 1  # P: with the class token
        self.intermediate = list(v["intermediate_layers"])
        ratios = v["max_aspect_ratio_id"] + 1
        self.patch_embed = nn.Conv2d(3, h, v["patch_size"], stride=v["patch_size"], bias=False, dtype=dtype,
                                     device=device)
        self.class_embed = nn.Parameter(torch.empty(h, dtype=dtype, device=device))
        self.position_embed = nn.Parameter(torch.empty(self.patches, h, dtype=dtype, device=device))
        self.position_gate = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        # Tables left uninitialized like the parameters above, the weights loaded over them
        # (engine.models.tables.uninitialized_table says why: ~2 CPU-s of a multimodal_encoders stub's start)
        def table(width: int) -> nn.Embedding:
            return uninitialized_table(ratios, width, dtype=dtype, device=device, frozen=False)

        self.tile_position_embed = table(tiles * self.patches * h)
        self.pre_tile_embed = table(tiles * h)
        self.pre_tile_gate = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.post_tile_embed = table(tiles * h)
        self.post_tile_gate = nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.pre_norm = nn.LayerNorm(h, dtype=dtype, device=device)  # transformers' default eps (1e-5)
        self.post_norm = nn.LayerNorm(h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(MllamaVisionLayer(v, False, dtype, device) for _ in range(v["num_layers"]))
        self.global_layers = nn.ModuleList(MllamaVisionLayer(v, True, dtype, device)
                                           for _ in range(v["num_global_layers"]))
        self.projector = nn.Linear(v["vision_output_dim"], config["text_hidden_size"], dtype=dtype, device=device)
        self.num_image_tokens = tiles * self.patches  # rows per image (padded tiles included)

    def _tile_embedding(self, table: nn.Embedding, gate: torch.Tensor, ratio_ids: torch.Tensor) -> torch.Tensor:
        """(n,) aspect ratio ids -> (n, T, 1, hidden) gated rows, one per tile."""
        return gate.tanh() * table(ratio_ids).view(-1, self.max_tiles, 1, self.hidden)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                       aspect_ratio_mask: torch.Tensor) -> torch.Tensor:
        """(n, T, 3, S, S), (n,), (n, T) -> (n, T * P, text_hidden) in the encoder's dtype."""
        n, T = pixel_values.shape[:2]
        dtype, P, h = self.patch_embed.weight.dtype, self.patches, self.hidden
        ratio_ids = aspect_ratio_ids.to(self.patch_embed.weight.device).long()
        pixels = pixel_values.flatten(0, 1).to(self.patch_embed.weight.device, dtype)
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # (n T, P - 1, h)
        x = x.view(n, T, P - 1, h) + self._tile_embedding(self.pre_tile_embed, self.pre_tile_gate, ratio_ids)
        x = torch.cat([self.class_embed.expand(n, T, 1, h), x], dim=2)  # (n, T, P, h)
        g = self.position_gate.tanh()
        x = x + (1 - g) * self.position_embed + g * self.tile_position_embed(ratio_ids).view(n, T, P, h)
        x = self.pre_norm(x)
        padded = P + (8 - P % 8) % 8
        x = F.pad(x, (0, 0, 0, padded - P)).view(n, T * padded, h)
        # padding tokens: padded patches of every tile, and every token of a padded tile
        real = aspect_ratio_mask.to(x.device).bool().view(n, T, 1).expand(n, T, padded).clone()
        real[:, :, P:] = False
        pad = ~real.view(n, T * padded)
        mask = torch.zeros(n, 1, T * padded, T * padded, dtype=dtype, device=x.device)
        mask.masked_fill_((pad[:, :, None] & pad[:, None, :]).unsqueeze(1), torch.finfo(dtype).min)
        kept = {}  # local layer index -> its output, for the intermediate features
        for index, layer in enumerate(self.layers):
            x = layer(x, mask)
            if index in self.intermediate:
                kept[index] = x
        x = self.post_norm(x).view(n, T, padded, h)
        x = (x + self._tile_embedding(self.post_tile_embed, self.post_tile_gate, ratio_ids)).view(n, T * padded, h)
        for layer in self.global_layers:
            x = layer(x, mask)
        inter = torch.stack([kept[i] for i in self.intermediate], dim=-1)  # (n, T Pp, h, k): interleaved
        features = torch.cat([x.view(n, T, padded, h)[:, :, :P],
                              inter.view(n, T, padded, -1)[:, :, :P]], dim=-1)  # (n, T, P, h (1 + k))
        return self.projector(features).view(n, T * P, -1)


def encoder_config(hf_config) -> dict:
    """The vision-encoder directory's config (besides builder_config) of a MllamaConfig."""
    v = hf_config.vision_config
    layers = list(v.intermediate_layers_indices)
    if any(not 0 <= i < v.num_hidden_layers for i in layers):
        raise CheckpointError(f"intermediate_layers_indices {layers} must index the {v.num_hidden_layers} local layers")
    if v.vision_output_dim != v.hidden_size * (1 + len(layers)):
        raise CheckpointError(f"vision_output_dim {v.vision_output_dim} must be hidden_size {v.hidden_size} x "
                              f"(1 + {len(layers)} intermediate layers)")
    patches = (v.image_size // v.patch_size) ** 2 + 1
    return {
        "vision": {"image_size": v.image_size, "patch_size": v.patch_size, "hidden_size": v.hidden_size,
                   "intermediate_size": v.intermediate_size, "num_layers": v.num_hidden_layers,
                   "num_global_layers": v.num_global_layers, "num_heads": v.attention_heads,
                   "norm_eps": v.norm_eps, "hidden_act": v.hidden_act, "max_num_tiles": v.max_num_tiles,
                   "max_aspect_ratio_id": len(v.supported_aspect_ratios),
                   "supported_aspect_ratios": [list(r) for r in v.supported_aspect_ratios],
                   "intermediate_layers": layers,
                   "vision_output_dim": v.vision_output_dim},
        "text_hidden_size": hf_config.text_config.hidden_size,
        "patches_per_tile": patches,
        "num_image_tokens": v.max_num_tiles * patches,
        "image_token_index": hf_config.image_token_index,
        "image_size": v.image_size,
    }


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    v = config["vision"]

    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in VISION_PREFIXES])

    weights = {"patch_embed.weight": hf("patch_embedding.weight"), "class_embed": hf("class_embedding"),
               "position_embed": hf("gated_positional_embedding.embedding"),
               "position_gate": hf("gated_positional_embedding.gate"),
               "tile_position_embed.weight": hf("gated_positional_embedding.tile_embedding.weight")}
    for ours, theirs in (("pre_tile", "pre_tile_positional_embedding"), ("post_tile", "post_tile_positional_embedding")):
        weights[f"{ours}_embed.weight"] = hf(f"{theirs}.embedding.weight")
        weights[f"{ours}_gate"] = hf(f"{theirs}.gate")
    for ours, theirs in (("pre_norm", "layernorm_pre"), ("post_norm", "layernorm_post")):
        weights.update({f"{ours}.{part}": hf(f"{theirs}.{part}") for part in ("weight", "bias")})
    stacks = [("layers", "transformer", v["num_layers"], False), ("global_layers", "global_transformer",
                                                                   v["num_global_layers"], True)]
    for ours, theirs, count, gated in stacks:
        for i in range(count):
            mine, layer = f"{ours}.{i}.", f"{theirs}.layers.{i}."
            weights[mine + "qkv_proj.weight"] = torch.cat([hf(f"{layer}self_attn.{p}_proj.weight") for p in "qkv"])
            weights[mine + "out_proj.weight"] = hf(f"{layer}self_attn.o_proj.weight")
            for name, hf_name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                                  ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                weights.update({f"{mine}{name}.{part}": hf(f"{layer}{hf_name}.{part}") for part in ("weight", "bias")})
            if gated:
                weights[mine + "gate_attn"] = hf(f"{layer}gate_attn")
                weights[mine + "gate_ffn"] = hf(f"{layer}gate_ffn")
    for part in ("weight", "bias"):
        weights[f"projector.{part}"] = first_found(get, [p + part for p in PROJECTOR_PREFIXES])
    return weights

