"""BLIP-2's image path: ViT tower -> Q-Former (learned queries cross-attending to the image) -> a
linear projection into the language model (OPT).

``image_features(pixel_values)``: (num_images, 3, S, S) -> per image (num_query_tokens, text_hidden)
rows, which take the place of the image's slot in the prompt (one table row per query token,
engine/executor/prompt_table.py), as transformers' Blip2ForConditionalGeneration.get_image_features:

- tower: CLIP's layer (engine/vision/clip.py) with a class token, no norm before the layers, a bias on
  the patch embedding, q/v biases only (k's is zero), and a LayerNorm after the last layer;
- Q-Former: the queries (num_query_tokens, qformer_hidden) through a LayerNorm, then per layer a
  BERT-style post-norm block: self-attention over the queries; in every
  ``cross_attention_frequency``-th layer (layer index % frequency == 0) cross-attention from the
  queries to the tower's (num_patches + 1) outputs; the queries' feed-forward. No masks (an image's
  rows all count);
- ``language_projection``: qformer_hidden -> text_hidden.

The Q-Former and the queries stay float32 whatever the engine's dtype (transformers keeps them so:
``_keep_in_fp32_modules``); the tower's outputs are widened into it and its outputs narrowed back
before the projection, as transformers does.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.vision.clip import ClipTowerConfig, ClipVisionTower, activation, norm_and_mlp_weights

MODEL_TYPE = "blip2-opt"  # builder_config.model_type, as the anchor's preprocessing asserts it
LANGUAGE_MODELS = ("opt",)  # the text_config.model_type BLIP-2 builds over (the anchor's blip2-opt)
FLOAT32_PREFIXES = ("query_tokens", "qformer.")  # weights kept float32 in the encoder directory


@dataclass
class QFormerConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    cross_attention_frequency: int
    encoder_hidden_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config) -> "QFormerConfig":
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   cross_attention_frequency=config.cross_attention_frequency,
                   encoder_hidden_size=config.encoder_hidden_size, layer_norm_eps=config.layer_norm_eps,
                   hidden_act=config.hidden_act)


class QFormerAttention(nn.Module):
    """Multi-head attention of ``x`` (n, q, hidden) to ``context`` (n, k, context width), then
    dense + LayerNorm over the residual (BERT's post-norm)."""

    def __init__(self, config: QFormerConfig, context_size: int, device=None):
        super().__init__()
        h, kw = config.hidden_size, {"dtype": torch.float32, "device": device}
        self.num_heads = config.num_heads
        self.query = nn.Linear(h, h, **kw)
        self.key = nn.Linear(context_size, h, **kw)
        self.value = nn.Linear(context_size, h, **kw)
        self.dense = nn.Linear(h, h, **kw)
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps, **kw)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        n, q, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (n, len, h) -> (n, heads, len, head_dim)
            return t.view(n, t.shape[1], self.num_heads, -1).transpose(1, 2)

        attn = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(context)),
                                              heads(self.value(context)))
        return self.norm(self.dense(attn.transpose(1, 2).reshape(n, q, h)) + x)


class QFormerLayer(nn.Module):
    def __init__(self, config: QFormerConfig, cross: bool, device=None):
        super().__init__()
        kw = {"dtype": torch.float32, "device": device}
        self.attention = QFormerAttention(config, config.hidden_size, device)
        self.cross = QFormerAttention(config, config.encoder_hidden_size, device) if cross else None
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, **kw)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, **kw)
        self.act = activation(config.hidden_act)

    def forward(self, queries: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.attention(queries, queries)
        if self.cross is not None:
            x = self.cross(x, image)
        return self.norm(self.fc2(self.act(self.fc1(x))) + x)


class Blip2VisionEncoder(nn.Module):
    """The tower, the Q-Former and the language projection, for one device."""

    float32_prefixes = FLOAT32_PREFIXES  # engine/vision/encoder_dir.py keeps these weights float32

    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        blip2 = config["blip2"]
        self.tower_config = ClipTowerConfig(**config["vision"])
        self.tower = ClipVisionTower(self.tower_config, dtype, device)
        self.post_norm = nn.LayerNorm(self.tower_config.hidden_size, eps=self.tower_config.layer_norm_eps,
                                      dtype=dtype, device=device)
        qformer = QFormerConfig(**blip2["qformer"])
        self.query_tokens = nn.Parameter(torch.empty(blip2["num_query_tokens"], qformer.hidden_size,
                                                     dtype=torch.float32, device=device))
        self.qformer_norm = nn.LayerNorm(qformer.hidden_size, eps=qformer.layer_norm_eps, dtype=torch.float32,
                                         device=device)
        self.qformer = nn.ModuleList(QFormerLayer(qformer, i % qformer.cross_attention_frequency == 0, device)
                                     for i in range(qformer.num_layers))
        self.language_projection = nn.Linear(qformer.hidden_size, blip2["text_hidden_size"], dtype=dtype,
                                             device=device)
        self.num_image_tokens = config["num_image_tokens"]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, 3, S, S) -> (num_images, num_query_tokens, text_hidden) in the encoder's dtype."""
        image = self.post_norm(self.tower.hidden_states(pixel_values, up_to=self.tower_config.num_layers)[-1])
        x = self.qformer_norm(self.query_tokens.expand(len(image), -1, -1))
        context = image.float()
        for layer in self.qformer:
            x = layer(x, context)
        return self.language_projection(x.to(image.dtype))

    def image_features(self, pixel_values: torch.Tensor, image_sizes=None, tiled=None) -> list[torch.Tensor]:
        """Every family's entry (engine/vision/registry.py): each image's rows (num_query_tokens, text_hidden)."""
        return list(self.encode(pixel_values))


def text_config(hf_config):
    """The language model's config; BLIP-2 over anything but OPT (Flan-T5's encoder-decoder) refused
    by name before any weight is read."""
    text = hf_config.text_config
    if not getattr(hf_config, "use_decoder_only_language_model", True) or text.model_type not in LANGUAGE_MODELS:
        raise CheckpointError(f"BLIP-2 over a {text.model_type} language model is not supported; supported: BLIP-2 "
                              f"over {', '.join(LANGUAGE_MODELS).upper()} (Blip2ForConditionalGeneration, "
                              "Salesforce/blip2-opt-*)")
    return text


def encoder_config(hf_config) -> dict:
    """The vision-encoder directory's config (besides builder_config) of a Blip2Config."""
    text = text_config(hf_config)
    vision = hf_config.vision_config
    tower = ClipTowerConfig(image_size=vision.image_size, patch_size=vision.patch_size,
                            hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                            num_layers=vision.num_hidden_layers, num_heads=vision.num_attention_heads,
                            layer_norm_eps=vision.layer_norm_eps, hidden_act=vision.hidden_act,
                            class_token=True, pre_norm=False, patch_bias=True)
    qformer = QFormerConfig.from_hf(hf_config.qformer_config)
    if qformer.encoder_hidden_size != tower.hidden_size:
        raise CheckpointError(f"qformer_config.encoder_hidden_size {qformer.encoder_hidden_size} differs from the "
                              f"vision tower's hidden_size {tower.hidden_size}")
    return {
        "vision": tower.to_dict(),
        "blip2": {"num_query_tokens": hf_config.num_query_tokens, "qformer": asdict(qformer),
                  "qkv_bias": bool(getattr(vision, "qkv_bias", True)), "text_hidden_size": text.hidden_size},
        "num_image_tokens": hf_config.num_query_tokens,
        "image_token_index": getattr(hf_config, "image_token_index", getattr(hf_config, "image_token_id", None)),
        "image_size": tower.image_size,
    }


# Where checkpoints keep the parts (transformers 4 and 5 write the same names).
_VISION = "vision_model."
_QFORMER = "qformer."


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    tower = ClipTowerConfig(**config["vision"])
    qformer = QFormerConfig(**config["blip2"]["qformer"])
    h = tower.hidden_size
    weights = {"tower.patch_embed.weight": get(_VISION + "embeddings.patch_embedding.weight"),
               "tower.patch_embed.bias": get(_VISION + "embeddings.patch_embedding.bias"),
               "tower.class_embed": get(_VISION + "embeddings.class_embedding").reshape(h),
               "tower.position_embed": get(_VISION + "embeddings.position_embedding").reshape(-1, h),
               "post_norm.weight": get(_VISION + "post_layernorm.weight"),
               "post_norm.bias": get(_VISION + "post_layernorm.bias"),
               "query_tokens": get("query_tokens").reshape(-1, qformer.hidden_size),
               "qformer_norm.weight": get(_QFORMER + "layernorm.weight"),
               "qformer_norm.bias": get(_QFORMER + "layernorm.bias"),
               "language_projection.weight": get("language_projection.weight"),
               "language_projection.bias": get("language_projection.bias")}
    for i in range(tower.num_layers):
        hf, ours = f"{_VISION}encoder.layers.{i}.", f"tower.layers.{i}."
        weights[ours + "qkv_proj.weight"] = get(hf + "self_attn.qkv.weight")
        # q and v biases only (BLIP-2's qkv_bias); without them, none at all: zeros either way for k
        weights[ours + "qkv_proj.bias"] = (get(hf + "self_attn.qkv.bias") if config["blip2"]["qkv_bias"]
                                           else torch.zeros(3 * h))
        for part in ("weight", "bias"):
            weights[ours + f"out_proj.{part}"] = get(hf + f"self_attn.projection.{part}")
        weights.update(norm_and_mlp_weights(get, hf, ours))
    for i in range(qformer.num_layers):
        hf, ours = f"{_QFORMER}encoder.layer.{i}.", f"qformer.{i}."
        blocks = [("attention", "attention")]
        if i % qformer.cross_attention_frequency == 0:
            blocks.append(("crossattention", "cross"))
        for part in ("weight", "bias"):
            for theirs, mine in blocks:
                for name in ("query", "key", "value"):
                    weights[f"{ours}{mine}.{name}.{part}"] = get(f"{hf}{theirs}.attention.{name}.{part}")
                weights[f"{ours}{mine}.dense.{part}"] = get(f"{hf}{theirs}.output.dense.{part}")
                weights[f"{ours}{mine}.norm.{part}"] = get(f"{hf}{theirs}.output.LayerNorm.{part}")
            weights[f"{ours}fc1.{part}"] = get(f"{hf}intermediate_query.dense.{part}")
            weights[f"{ours}fc2.{part}"] = get(f"{hf}output_query.dense.{part}")
            weights[f"{ours}norm.{part}"] = get(f"{hf}output_query.LayerNorm.{part}")
    return weights

