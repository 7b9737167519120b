"""The cross-attention K/V of an encoder pass: projected once and written into the cross-KV pool.

``fuse_cross_kv`` makes each decoder layer's cross-attention K and V weights the two halves of one
(2 * heads * head_dim, d_model) tensor (their parameters become views of it: state dicts unchanged,
memory not doubled), so ``project_into_pool`` takes ONE product per decoder layer for every request
of the pass ([sum(T_i), d] x [d, 2 * kv_dim]; was a K and a V product) and ONE write of that
layer's K and V rows into each request's cross blocks (kernels/attention.py write_kv_cache reads
the product's K and V halves through their strides). A key without a bias (Whisper) gets zeros in
the fused bias: x + 0 is x, so the K rows are the unfused product's. FP8 engines (E4M3 weights with
per-output-channel scales, model.py Fp8Linear) fuse the same way: the scales are per row, so
[k's | v's] scales are the fused weight's (``kv_scale``) and the product is model.py's ``product``
(fp8_linear), the unfused products' values exactly.

The cross pool's element type: ``cross_kv_cache_dtype`` "fp8" keeps it in E4M3 (scale 1, clamped
at +-448, as the FP8 self pool: kernels/attention.py to_cache_dtype) whatever the self pool's type;
"auto"/None gives it the self pool's type (so the executor's ``kv_cache_dtype fp8`` makes both
E4M3). Every cross-attention kernel reads the pool by its dtype and widens in registers, so an
FP8 pool halves the bytes each decode step reads. FP8 needs E4M3 conversions: on a CUDA GPU below
compute capability 8.9 either switch is refused by name at start.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.encoder_decoder.model import Fp8Linear, product
from kernels.attention import KV_FP8_DTYPE, write_kv_cache

CROSS_KV_DTYPES = ("auto", "fp8")
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with E4M3 conversions


def fuse_cross_kv(decoder: nn.Module) -> nn.Module:
    """Every decoder layer's cross_attn gets ``kv_weight`` (2 * inner, d) = [k; v], ``kv_bias``
    (2 * inner, or None when neither has a bias) and ``kv_scale`` (2 * inner,) float32 for FP8
    weights (else None); k and v's weights (biases, scales) become views of them. Idempotent;
    returns ``decoder``."""
    for layer in decoder.layers:
        attn = layer.cross_attn
        if getattr(attn, "kv_weight", None) is not None:
            continue
        k, v = attn.k, attn.v
        inner = k.weight.shape[0]
        fused = torch.cat([k.weight.detach(), v.weight.detach()])
        k.weight = nn.Parameter(fused[:inner], requires_grad=False)
        v.weight = nn.Parameter(fused[inner:], requires_grad=False)
        scale = None
        if isinstance(k, Fp8Linear):
            scale = torch.cat([k.weight_scale.detach(), v.weight_scale.detach()])
            k.weight_scale = nn.Parameter(scale[:inner], requires_grad=False)
            v.weight_scale = nn.Parameter(scale[inner:], requires_grad=False)
        bias = None
        if k.bias is not None or v.bias is not None:
            given = k.bias if k.bias is not None else v.bias  # (its dtype: the weights' may be E4M3)
            bias = torch.cat([b.detach() if b is not None else torch.zeros(inner, dtype=given.dtype, device=given.device)
                              for b in (k.bias, v.bias)])
            for index, proj in enumerate((k, v)):
                if proj.bias is not None:
                    proj.bias = nn.Parameter(bias[index * inner:(index + 1) * inner], requires_grad=False)
        attn.kv_weight, attn.kv_bias, attn.kv_scale = fused, bias, scale
    return decoder


def project_into_pool(decoder: nn.Module, rows: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """rows: (sum T_i, d_model) encoder outputs of a pass; slots: (sum T_i,) each row's cross-pool
    slot; pool: (layers, 2, blocks, tokens_per_block, heads, head_dim) any strides. Per layer one
    product and one write (module docstring); ``fuse_cross_kv`` ran on ``decoder`` at load."""
    for index, layer in enumerate(decoder.layers):
        attn = layer.cross_attn
        if attn.kv_scale is None:
            kv = F.linear(rows, attn.kv_weight, attn.kv_bias)
        else:  # FP8 weights: fp8_linear (model.py product)
            kv = product(rows, attn.kv_weight, attn.kv_bias, attn.kv_scale)
        kv = kv.view(rows.shape[0], 2, attn.heads, attn.head_dim)
        write_kv_cache(kv[:, 0], kv[:, 1], pool[index, 0], pool[index, 1], slots)


def require_fp8(device: torch.device, what: str) -> None:
    """Refuse ``what`` ('kv_cache_dtype fp8' / 'cross_kv_cache_dtype fp8') by name on a CUDA GPU
    without E4M3 conversions (the kernels' loads would not compile there)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ValueError(f"{what}: this GPU (sm_{capability[0]}{capability[1]}) has no FP8 (E4M3) conversions; "
                         f"needs compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                         f"(Ada, Hopper); use auto")


def cross_pool_dtype(cross_kv_cache_dtype: str | None, self_pool_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cross pool's element type (module docstring); a value outside CROSS_KV_DTYPES is refused by name."""
    name = cross_kv_cache_dtype or "auto"
    if name not in CROSS_KV_DTYPES:
        raise ValueError(f"cross_kv_cache_dtype {cross_kv_cache_dtype!r} is not supported; allowed: "
                         f"{', '.join(CROSS_KV_DTYPES)}")
    if name == "fp8":
        require_fp8(device, "cross_kv_cache_dtype fp8")
        return KV_FP8_DTYPE
    return self_pool_dtype
