"""Qwen2-VL's vision tower: dynamic-resolution patches, 2-D rotary attention within each image, and
the 2 x 2 patch merger into the language model's width.

``image_features(pixel_values, image_grid_thw)``: the patches of every image as the image
processor flattens them, (total patches, channels * temporal_patch * patch * patch), and each image's
(t, h, w) grid of patches -> each image's rows (t * h * w / merge**2, text_hidden), as transformers'
Qwen2VLModel.get_image_features. The processor orders an image's patches block-major over merge x
merge blocks, so four consecutive patches are one merged row.

Per block: x + attn(LayerNorm(x)), x + mlp(LayerNorm(x)); attention is bidirectional within one
image frame (the images' frames are sequences of their own), with rotary over the head dims: the
first half of the frequencies from the patch's row, the second from its column
(engine/vision/tower_layout.py ``axial_angles``).

The language model is built as a plain Qwen2 engine (``text_config``): its M-RoPE is the request's,
rows of rotary cos/sin per prompt token and a position delta for what follows
(engine/vision/mrope.py computes them from the encoder config's ``mrope``; the executor applies them,
engine/executor/mrope_rotary.py).

Qwen2.5-VL's tower (window attention, RMSNorm, SwiGLU) is engine/vision/qwen2_5_vl.py.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.hf_checkpoint import TensorGetter
from engine.planless_attention import PLANLESS_BACKENDS
from engine.vision.clip import activation, first_found
from engine.vision.tower_layout import PatchRotary, Segments, tower_layout
from kernels.layernorm import layer_norm

MODEL_TYPE = "qwen2_vl"  # builder_config.model_type, as the anchor names it
PREFIXES = ("visual.", "model.visual.")


# "1": the Qwen towers' blocks as before their fused path (each residual add a kernel of its own; Qwen2.5-VL's
# MLP as two products, torch's SiLU and product) and the layout made afresh each forward: vlm_bench's "before"
UNFUSED_ENV = "TRITONLLM_TOWER_UNFUSED"
# The towers' attention backend: planless (the default: torch's choice among flash, memory-efficient and math, never
# cuDNN), auto (torch's choice, cuDNN included), cudnn, flash, efficient, math. Why not cuDNN: it builds and tunes a
# plan for each new shape, and a tower forward's shapes follow its image count and sizes. On the H200 (2026-11-30,
# vlm_bench offline, benchmarks/results/engine.md session 22) a forward of an image count not seen before took
# 115-657 ms of host time to launch on cuDNN (2, 4, 5, 27, 28 and 30 images), against 13-48 ms for counts seen before
# and 23-44 ms for the same new counts on flash; those launches held the encode queue's tables back and cost the run
# 0.77x against 0.84x text-only speed. In steady state flash and cuDNN measured the same (0.83x against 0.84x in the
# same process).
SDPA_ENV = "TRITONLLM_TOWER_SDPA"
WINDOW_SDPA_ENV = "TRITONLLM_TOWER_WINDOW_SDPA"  # Qwen2.5-VL's window blocks only (default: SDPA_ENV's)
SDPA_BACKENDS = ("planless", "auto", "cudnn", "flash", "efficient", "math")


def sdpa_backend(windows: bool = False) -> str:
    """The backend the towers' attention asks torch for: ``TRITONLLM_TOWER_SDPA``, for window runs
    ``TRITONLLM_TOWER_WINDOW_SDPA`` if set; read per call, so a bench can A/B them in one process. Which is
    fastest at head_dim 80 is a GPU question: over 1,024-patch frames, and over Qwen2.5-VL's 64-patch
    windows, which fill half of a flash kernel's 128-row tile (under "auto" torch 2.11 picks cuDNN for both on
    an H200; the 13:08 profile: 7.0 ms of 82 for 32 images, ~140 TFLOPS). The default is "planless" (SDPA_ENV's
    comment says why)."""
    name = os.environ.get(SDPA_ENV, "planless").lower()
    if windows:
        name = os.environ.get(WINDOW_SDPA_ENV, name).lower()
    if name not in SDPA_BACKENDS:
        raise ValueError(f"{WINDOW_SDPA_ENV if windows else SDPA_ENV}={name!r} is not a backend; "
                         f"allowed: {', '.join(SDPA_BACKENDS)}")
    return name


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windows: bool) -> torch.Tensor:
    name = sdpa_backend(windows)
    if name == "auto" or not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v)
    backends = PLANLESS_BACKENDS if name == "planless" else [
        {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]]
    # sdpa_kernel sets torch's process-wide backend flags for the call and restores them after, so another thread's
    # SDPA call in that window sees this choice too. Accepted: a process runs one tower thread (the encode queue's
    # worker, engine/vision/encode_queue.py; Triton's multimodal_encoders instances are processes of their own), and
    # another SDPA caller caught in the window (EAGLE-3 drafts, DeepSeek's expanded prefill with its mask, Whisper's
    # alignment heads) still finds a kernel under the planless flags (memory-efficient takes masks, math takes
    # anything); only a forced single backend (TRITONLLM_TOWER_SDPA=flash, for A/B runs) could leave one without.
    with sdpa_kernel(backends):  # (planless: flash for 16-bit rows, memory-efficient for float32 ones)
        return F.scaled_dot_product_attention(q, k, v)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> torch.Tensor:
    """q, k, v (patches, heads, head_dim) -> (patches, heads, head_dim): softmax attention within each
    run of ``lengths`` (a list, or Segments), both ways, one SDPA call per run length (no loop over
    images or windows: every run of a length is one batch of the call)."""
    segments = lengths if isinstance(lengths, Segments) else Segments(lengths, q.device)
    out = None if segments.groups[0][1] is None else torch.empty_like(q)
    for n, rows in segments.groups:
        pick = (lambda t: t.view(-1, n, *t.shape[1:])) if rows is None else (lambda t: t[rows])  # noqa: E731
        # (runs, heads, n, head_dim) for SDPA, back to (runs, n, heads, head_dim)
        got = _sdpa(*(pick(t).transpose(1, 2) for t in (q, k, v)), segments.windows).transpose(1, 2)
        if rows is None:
            return got.reshape(q.shape)
        out[rows] = got
    return out


def unfused() -> bool:
    return os.environ.get(UNFUSED_ENV) == "1"


def frame_attention(grids: list[list[int]], config: dict, device=None) -> tuple[PatchRotary, Segments]:
    """What full-frame blocks take: the patches' axial rotary and the frames as Segments (attention
    stays within a frame), for a tower config with embed_dim, num_heads, spatial_merge_size, rope_theta
    (engine/vision/tower_layout.py: made from per-grid pieces kept on the device)."""
    layout = tower_layout(grids, config["spatial_merge_size"], config["embed_dim"] // config["num_heads"],
                          config["rope_theta"], device, keep=not unfused())
    return layout.rotary, layout.frames


def norm_adding(norm: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for s = x + residual (x without one), the sum rounded to x's dtype as transformers'
    ``hidden + out``: one Triton pass on CUDA (kernels/layernorm.py), the torch reference elsewhere."""
    out, stream, _ = layer_norm(x, norm.weight, norm.bias, norm.eps, () if residual is None else (residual,))
    return out, stream


def embed_patches(patch_embed: nn.Linear, pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
    """The processor's flattened patches (patches, channels * temporal * patch * patch) -> (patches, dim),
    after checking that the (t, h, w) grids account for every patch."""
    if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
        raise ValueError(f"pixel values hold {pixel_values.shape[0]} patches, but the grids {grids} make "
                         f"{sum(t * h * w for t, h, w in grids)}; send them as the image processor made them")
    return patch_embed(pixel_values.to(patch_embed.weight.dtype).reshape(pixel_values.shape[0], -1))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        # Qwen3-VL gives the MLP width itself; Qwen2-VL as a ratio
        dim, hidden = config["embed_dim"], config.get("intermediate_size") or int(config["embed_dim"] * config["mlp_ratio"])
        self.num_heads = config["num_heads"]
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.act = activation(config["hidden_act"])

    def forward(self, x: torch.Tensor, rotary: PatchRotary, lengths: Segments) -> torch.Tensor:
        """x: (patches, dim); rotary: the patches' (PatchRotary); lengths: each frame's (or window's) patches,
        in order, as a list or as Segments (made once per forward: the blocks share its gather indices)."""
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.num_heads, -1).unbind(1)  # (patches, heads, d)
        q, k = rotary(q, k)  # views of the qkv output, rotated in place on CUDA
        x = x + self.proj(segment_attention(q, k, v, lengths).reshape(tokens, -1))
        return x + self.feed_forward(self.norm2(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: PatchRotary,
                      runs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the residual stream kept apart: x (patches, dim) the last sublayer's output (the
        embeddings, residual None, before the first block) -> (this block's MLP output, the sum before it).
        Each LayerNorm adds the residual in its own pass: no add kernel of its own (2 launches a block fewer)."""
        h, residual = norm_adding(self.norm1, x, residual)
        tokens = h.shape[0]
        q, k, v = self.qkv(h).view(tokens, 3, self.num_heads, -1).unbind(1)
        q, k = rotary(q, k)
        h, residual = norm_adding(self.norm2, self.proj(segment_attention(q, k, v, runs).reshape(tokens, -1)), residual)
        return self.feed_forward(h), residual

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class Qwen2VisionEncoder(nn.Module):
    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        vision = config["qwen2_vl"]
        self.config = vision
        dim = vision["embed_dim"]
        patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        # The Conv3d of kernel = stride = the patch, on one flattened patch: a linear map (no bias)
        self.patch_embed = nn.Linear(patch, dim, bias=False, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(vision, dtype, device) for _ in range(vision["depth"]))
        merged = dim * vision["spatial_merge_size"] ** 2
        self.merger_norm = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.merger_fc1 = nn.Linear(merged, merged, dtype=dtype, device=device)
        self.merger_fc2 = nn.Linear(merged, vision["hidden_size"], dtype=dtype, device=device)
        self.num_image_tokens = None  # depends on each image's grid

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw, tiled=None) -> list[torch.Tensor]:
        grids = [[int(v) for v in grid] for grid in image_grid_thw]
        c = self.config
        merge = c["spatial_merge_size"]
        x = embed_patches(self.patch_embed, pixel_values, grids)
        rotary, lengths = frame_attention(grids, c, x.device)
        if unfused():
            for block in self.blocks:
                x = block(x, rotary, lengths)
            x = self.merger_norm(x)
        else:
            residual = None
            for block in self.blocks:
                x, residual = block.forward_fused(x, residual, rotary, lengths)
            x = norm_adding(self.merger_norm, x, residual)[0]
        x = x.view(-1, c["embed_dim"] * merge ** 2)
        rows = self.merger_fc2(F.gelu(self.merger_fc1(x)))
        return list(rows.split([t * h * w // merge ** 2 for t, h, w in grids]))


def _text_rope(text) -> dict:
    """The text model's rope settings as transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling
    of type "mrope") spell them."""
    return {**({"rope_theta": getattr(text, "rope_theta", None)} if getattr(text, "rope_theta", None) else {}),
            **(getattr(text, "rope_scaling", None) or {}), **(getattr(text, "rope_parameters", None) or {})}


def text_config(hf_config, architecture: str = "Qwen2ForCausalLM"):
    """The language model's config as a plain Qwen2's (Qwen3-VL: ``architecture`` Qwen3's): rope without its
    M-RoPE sections (the engine's own rotary table is plain RoPE; a request's image rows bring their own rows)."""
    text = copy.deepcopy(hf_config.text_config)
    text.architectures = [architecture]
    name = "rope_parameters" if getattr(text, "rope_parameters", None) else "rope_scaling"  # transformers 5, 4
    rope = getattr(text, name, None)
    if rope:
        rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        if rope.get("rope_type", rope.get("type")) == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        setattr(text, name, rope)
    return text


def encoder_config(hf_config) -> dict:
    vision = hf_config.vision_config
    rope = getattr(vision, "rope_parameters", None) or {}
    return {
        "qwen2_vl": {"embed_dim": vision.embed_dim, "depth": vision.depth, "num_heads": vision.num_heads,
                     "mlp_ratio": vision.mlp_ratio, "hidden_act": vision.hidden_act, "in_channels": vision.in_channels,
                     "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                     "spatial_merge_size": vision.spatial_merge_size, "hidden_size": vision.hidden_size,
                     "rope_theta": rope.get("rope_theta", 10000.0)},
        **with_video(language_fields(hf_config), hf_config),
    }


def language_fields(hf_config) -> dict:
    """What the encoder directory says of the language side (Qwen2-VL and Qwen2.5-VL alike): the image
    token ids, and the M-RoPE settings a request's rotary rows are made with."""
    text = hf_config.text_config
    text_rope = _text_rope(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {
        "num_image_tokens": None,  # rows per image: t * h * w / merge**2 of its grid
        "image_token_index": getattr(hf_config, "image_token_id", None),
        "vision_start_token_id": getattr(hf_config, "vision_start_token_id", None),
        "vision_end_token_id": getattr(hf_config, "vision_end_token_id", None),
        # The language model's M-RoPE: a request's rotary rows (engine/vision/mrope.py request_mrope)
        "mrope": {"sections": list(text_rope.get("mrope_section") or []), "head_dim": head_dim,
                  "theta": float(text_rope.get("rope_theta", 10000.0)),
                  "merge": hf_config.vision_config.spatial_merge_size},
    }


def with_video(fields: dict, hf_config) -> dict:
    """Qwen2-VL / Qwen2.5-VL video (serving/qwen_video.py): ``qwen_video`` with the <|video_pad|> id, and in
    ``mrope`` that id (its rows' M-RoPE runs as an image's) and Qwen2.5-VL's tokens_per_second (the time
    axis' step per second of video). A config without video_token_id takes no video."""
    video = getattr(hf_config, "video_token_id", None)
    if video is None:
        return fields
    fields["qwen_video"] = {"video_token_index": video}
    fields["mrope"]["video_token_index"] = video
    per_second = getattr(hf_config.vision_config, "tokens_per_second", None)
    if per_second is not None:
        fields["mrope"]["tokens_per_second"] = per_second
    return fields


def encoder_weights(get: TensorGetter, config: dict) -> dict[str, torch.Tensor]:
    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in PREFIXES])

    weights = {"patch_embed.weight": hf("patch_embed.proj.weight").flatten(1),
               "merger_norm.weight": hf("merger.ln_q.weight"), "merger_norm.bias": hf("merger.ln_q.bias")}
    for part in ("weight", "bias"):
        weights[f"merger_fc1.{part}"] = hf(f"merger.mlp.0.{part}")
        weights[f"merger_fc2.{part}"] = hf(f"merger.mlp.2.{part}")
        for i in range(config["qwen2_vl"]["depth"]):
            for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
                                 ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
                weights[f"blocks.{i}.{ours}.{part}"] = hf(f"blocks.{i}.{theirs}.{part}")
    return weights
