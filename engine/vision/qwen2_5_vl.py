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

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf_checkpoint import TensorGetter
from engine.vision.clip import activation, first_found
from engine.vision.qwen2_vl import (PREFIXES, UNFUSED_ENV, embed_patches, language_fields, segment_attention, unfused,
                                    with_video)
from engine.vision.tower_fp8 import Fp8TowerLinear
from engine.vision.tower_layout import PatchRotary, Segments, tower_layout
from kernels._triton import use_triton
from kernels.activation import silu_and_mul
from kernels.fp8 import rms_norm_quantized, silu_and_mul_quantized
from kernels.rmsnorm import rms_norm
from kernels.window_attention import MAX_RUN, window_attention

MODEL_TYPE = "qwen2_5_vl"  # builder_config.model_type
# The window blocks' attention: "triton" (kernels/window_attention.py: rotary and attention of each window in one
# kernel reading the qkv product; the windows' rows rotated in registers, never written back) or "sdpa" (the
# rotary in place, then SDPA per window length: qwen2_vl.segment_attention). Unset: DEFAULT_WINDOW_KERNEL on CUDA,
# "sdpa" elsewhere (there "triton" runs the kernel's torch reference, for the tests). Full-frame blocks: always sdpa.
WINDOW_KERNEL_ENV = "TRITONLLM_TOWER_WINDOW_KERNEL"
WINDOW_KERNELS = ("triton", "sdpa")
DEFAULT_WINDOW_KERNEL = "sdpa"


# Where the blocks' residual adds happen: "norm" (each RMSNorm adds the last sublayer's output to the stream in its
# pass: reads two rows, writes two) or "product" (the proj and down products add into the stream themselves, cuBLAS
# with beta = 1 in place, and their biases ride in the next norms as a float32 shift: the norms read one row and
# write one). Unset: DEFAULT_RESIDUAL on CUDA, "norm" elsewhere (the CPU tower's rows stay bitwise the unfused
# blocks'). The FP8 tower (its products are not nn.Linear) always "norm".
RESIDUAL_ENV = "TRITONLLM_TOWER_RESIDUAL"
RESIDUALS = ("norm", "product")
DEFAULT_RESIDUAL = "norm"


def _switch(env: str, allowed: tuple[str, ...], cuda_default: str, cpu_default: str, x: torch.Tensor) -> str:
    """$env for rows ``x``, one of ``allowed``; unset: ``cuda_default`` on CUDA, ``cpu_default`` elsewhere. Read at
    each call, so a bench can A/B it in one process."""
    name = os.environ.get(env, cuda_default if x.is_cuda else cpu_default).lower()
    if name not in allowed:
        raise ValueError(f"{env}={name!r}: allowed {', '.join(allowed)}")
    return name


def residual_choice(x: torch.Tensor) -> str:
    """Where the residual adds happen for rows ``x`` (RESIDUAL_ENV), read per forward."""
    return _switch(RESIDUAL_ENV, RESIDUALS, DEFAULT_RESIDUAL, "norm", x)


def window_kernel(x: torch.Tensor) -> str:
    """The window blocks' attention for rows ``x`` (WINDOW_KERNEL_ENV), read per call."""
    return _switch(WINDOW_KERNEL_ENV, WINDOW_KERNELS, DEFAULT_WINDOW_KERNEL, "sdpa", x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * (s / rms(s) in float32, rounded to x's dtype), s) for s = x + residual (x without one),
        rounded to x's dtype as transformers' ``hidden + attn_out`` before its Qwen2RMSNorm; one Triton
        launch on CUDA (kernels/rmsnorm.py), the torch reference elsewhere. ``shift`` (dim,) float32: s + shift
        is normalized (the products' biases the stream lacks, RESIDUAL_ENV=product), s returned without it."""
        return rms_norm(x, self.weight, self.eps, residual, shift)


def _fuse_gate_up(module, state_dict, prefix, *args) -> None:
    """Load hook: the files' ``gate_proj`` and ``up_proj`` (encoder_weights; the format is unchanged) as
    the block's one ``gate_up`` of rows [gate | up]."""
    for part in ("weight", "bias"):
        gate, up = f"{prefix}gate_proj.{part}", f"{prefix}up_proj.{part}"
        if gate in state_dict and up in state_dict:
            state_dict[f"{prefix}gate_up.{part}"] = torch.cat([state_dict.pop(gate), state_dict.pop(up)])


class Qwen25VisionBlock(nn.Module):
    """x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x)), as transformers' Qwen2_5_VLVisionBlock.

    ``forward(x, residual, ...)`` takes the last sublayer's output and the running sum apart and returns
    them so: each RMSNorm adds the residual in its own pass (kernels/rmsnorm.py), no add kernel of its
    own. Per block on CUDA at P patches (dim 1280, MLP width 3,456 padded, 16 heads of 80): RMSNorm + add,
    qkv (P x 1280 -> 3,840), rotary of q and k in place (Triton), SDPA over the windows or frames (one call
    per run length), proj (-> 1,280), RMSNorm + add, gate_up (-> 2 x 3,456, one product), SiLU(gate) * up
    (one Triton pass), down (-> 1,280): 9 launches where the unfused block took 13 (two adds, gate and up
    apart, SiLU then the product), and ~0.9 GB less memory traffic at P = 32,768 (32 images at 448 x 448:
    the adds' 0.5 GB less the norms' residual writes, SiLU-and-product 0.45 GB, h read once for gate and up).
    Window blocks with TRITONLLM_TOWER_WINDOW_KERNEL=triton: rotary and attention in one kernel reading the qkv
    product (kernels/window_attention.py): 8 launches, and q and k never written back rotated."""

    def __init__(self, config: dict, dtype=None, device=None):
        super().__init__()
        dim, hidden = config["embed_dim"], config["intermediate_size"]
        self.num_heads = config["num_heads"]
        self.norm1 = RMSNorm(dim, dtype=dtype, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.norm2 = RMSNorm(dim, dtype=dtype, device=device)
        self.gate_up = nn.Linear(dim, 2 * hidden, dtype=dtype, device=device)  # rows [gate | up]
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.silu = config["hidden_act"] == "silu"
        self.act = activation(config["hidden_act"])
        self.register_load_state_dict_pre_hook(_fuse_gate_up)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: PatchRotary,
                runs: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """x (patches, dim): the last sublayer's output (the embeddings before the first block, with
        residual None); residual: the sum before it -> (this block's MLP output, the sum before it)."""
        h, residual = self._norm(self.norm1, x, residual, self.qkv)
        h, residual = self._norm(self.norm2, self.proj(self._attention(self.qkv(h), rotary, runs)), residual,
                                 self.gate_up)
        gate_up = self.gate_up(h)
        if isinstance(self.down_proj, Fp8TowerLinear) and self.silu and gate_up.dtype != torch.float32:
            return self.down_proj(silu_and_mul_quantized(gate_up)), residual  # (that kernel takes 16-bit rows)
        return self.down_proj(self._activated(gate_up)), residual

    def _activated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.silu and use_triton(gate_up):  # the checkpoints' act: one Triton pass (kernels/activation.py)
            return silu_and_mul(gate_up)
        width = gate_up.shape[-1] // 2
        # The gate contiguous, as transformers' gate_proj output: torch's CPU SiLU rounds some elements of a
        # strided view differently (an ulp), and where depends on the row stride (the padded width)
        return self.act(gate_up[:, :width].contiguous()) * gate_up[:, width:]

    def adds_in_products(self) -> bool:
        """Whether forward_stream can run: proj and down are plain linears (not the FP8 tower's)."""
        return type(self.proj) is nn.Linear and type(self.down_proj) is nn.Linear

    def forward_stream(self, stream: torch.Tensor, shifts: tuple[torch.Tensor, torch.Tensor], rotary: PatchRotary,
                       runs: Segments) -> torch.Tensor:
        """RESIDUAL_ENV=product: stream (patches, dim), the residual stream less every bias its products added so
        far, updated in place (proj and down add into it: ``addmm_``, one rounding of stream + product) and
        returned; shifts: (those biases' sum before norm1, before norm2) float32 (dim,), which the norms add to
        the row they normalize."""
        h = self.norm1(stream, shift=shifts[0])[0]
        stream.addmm_(self._attention(self.qkv(h), rotary, runs), self.proj.weight.t())
        h = self.norm2(stream, shift=shifts[1])[0]
        return stream.addmm_(self._activated(self.gate_up(h)), self.down_proj.weight.t())

    def _attention(self, qkv: torch.Tensor, rotary: PatchRotary, runs: Segments) -> torch.Tensor:
        """qkv (patches, 3 * dim) -> attention's output (patches, dim): rotary, then softmax within each run."""
        if runs.windows and window_kernel(qkv) == "triton":
            starts, lengths, longest = runs.runs()
            if longest <= MAX_RUN:
                return window_attention(qkv, self.num_heads, rotary.table, starts, lengths, longest)
        tokens = qkv.shape[0]
        q, k, v = qkv.view(tokens, 3, self.num_heads, -1).unbind(1)  # (patches, heads, d) views
        q, k = rotary(q, k)  # rotated in place on CUDA
        return segment_attention(q, k, v, runs).reshape(tokens, -1)

    @staticmethod
    def _norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, product: nn.Module):
        """norm(x, residual), its output quantized per row in the same kernel when ``product``, which reads
        it, is FP8 (engine/vision/tower_fp8.py)."""
        if isinstance(product, Fp8TowerLinear):
            return rms_norm_quantized(x, norm.weight, norm.eps, residual)
        return norm(x, residual)

    def forward_unfused(self, x: torch.Tensor, rotary: PatchRotary, runs: Segments) -> torch.Tensor:
        """The block as it ran before the fused path (qwen2_vl.UNFUSED_ENV): x -> x after the block."""
        if isinstance(self.gate_up, Fp8TowerLinear):  # (its MLP slices the bf16 gate_up weight)
            raise ValueError(f"{UNFUSED_ENV}=1 runs the bf16 blocks only; unset it for an FP8 tower")
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)[0]).view(tokens, 3, self.num_heads, -1).unbind(1)
        q, k = rotary(q, k)
        x = x + self.proj(segment_attention(q, k, v, runs).reshape(tokens, -1))
        h, width = self.norm2(x)[0], self.down_proj.in_features
        gate = F.linear(h, self.gate_up.weight[:width], self.gate_up.bias[:width])
        up = F.linear(h, self.gate_up.weight[width:], self.gate_up.bias[width:])
        return x + self.down_proj(self.act(gate) * up)


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
        dim, merge = c["embed_dim"], c["spatial_merge_size"]
        unit = merge * merge
        before = unfused()
        x = embed_patches(self.patch_embed, pixel_values, grids)
        # No host loop or host->device copy here once these grids were seen (engine/vision/tower_layout.py)
        layout = tower_layout(grids, merge, dim // c["num_heads"], c["rope_theta"], x.device,
                              window=c["window_size"] // merge // c["patch_size"], keep=not before)
        x = x.view(-1, unit, dim)[layout.order].view(-1, dim)  # the processor's order -> window-major
        full = set(c["fullatt_block_indexes"])
        if before:
            for i, block in enumerate(self.blocks):
                x = block.forward_unfused(x, layout.rotary, layout.frames if i in full else layout.windows)
            x = self.merger_norm(x)[0]
        elif residual_choice(x) == "product" and all(block.adds_in_products() for block in self.blocks):
            shifts = self._bias_shifts()
            for i, block in enumerate(self.blocks):  # x: the stream, updated in place
                x = block.forward_stream(x, shifts[i], layout.rotary, layout.frames if i in full else layout.windows)
            x = self.merger_norm(x, shift=shifts[-1][0])[0]
        else:
            residual = None
            for i, block in enumerate(self.blocks):
                x, residual = block(x, residual, layout.rotary, layout.frames if i in full else layout.windows)
            x = self.merger_norm(x, residual)[0]
        rows = self.merger_fc2(F.gelu(self.merger_fc1(x.view(-1, dim * unit))))
        rows = rows[layout.inverse]  # back to the processor's order
        return list(rows.split([t * h * w // unit for t, h, w in grids]))

    def _bias_shifts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block (the biases of every proj and down before its norm1, and before its norm2), then (all of
        them,) for the merger's norm: float32 (dim,) on the weights' device, summed in block order; made on first
        use and kept (the biases do not change after load)."""
        device = self.merger_norm.weight.device
        kept = getattr(self, "_shifts", None)
        if kept is not None and kept[-1][0].device == device:
            return kept
        total = torch.zeros(self.merger_norm.weight.shape[0], dtype=torch.float32, device=device)
        shifts = []
        for block in self.blocks:
            after_proj = total + (block.proj.bias.float() if block.proj.bias is not None else 0)
            shifts.append((total, after_proj))
            total = after_proj + (block.down_proj.bias.float() if block.down_proj.bias is not None else 0)
        shifts.append((total,))
        self._shifts = shifts
        return shifts


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
        **with_video(language_fields(hf_config), hf_config),
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
