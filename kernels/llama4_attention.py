"""What Llama 4's attention layers run between their qkv product and their o_proj (engine/models/llama4.py).

Rope layers: rotary on q and k (neox halves, kernels/rotary.py), then (``l2_eps``) each head of q and k
divided by its RMS in float32, no weight (transformers' Llama4TextL2Norm: after the rotation, each step
rounded to the model dtype), the new k and v into the paged cache, and attention within chunks of C
positions (kernels/chunked_attention.py). NoPE layers: q scaled by the attention temperature
``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` of its position p (``temperature``, or none),
the new k and v into the cache, and attention over the whole context.

Why one entry each: at decode the paged attention kernel (kernels/triton_attention.py, ``new_kv``) does all
of it in one launch: the rotation, the norm and the temperature on its query rows, the new token's K and V
written by the split that holds its slot, the chunk as the start of its key walk. Unfused that was, per
layer at batch 1, two copies and the rotary kernel, ten small torch kernels of the two norms, the KV write
(rope layers) or eight of the temperature and the KV write (NoPE layers), each a few microseconds of the
step's critical path (Scout on an H200, 2026-12-01). Other batches, CPU and heads that are not a power of
two take the unfused path: the references below, kernels/rotary.py, the KV write and the attention.
"""
from __future__ import annotations

import torch

from kernels.attention import paged_attention, write_kv_cache
from kernels.attention_metadata import AttentionMetadata
from kernels.chunked_attention import chunked_attention
from kernels.rope_attention import fuses_rotary_into_attention
from kernels.rotary import apply_rotary
from kernels.triton_attention import paged_attention_triton


def l2_normed_heads(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., head_dim) -> each head over its RMS in float32, rounded to x's dtype (no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention_temperature(q: torch.Tensor, positions: torch.Tensor, floor_scale: float,
                          attn_scale: float) -> torch.Tensor:
    """q (T, heads, D) times 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) of its token's position p
    (positions (T,)), in float32, rounded to q's dtype."""
    factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * factor[:, None, None]).to(q.dtype)


def rope_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, chunk_size: int | None,
                           l2_eps: float | None) -> torch.Tensor:
    """A rope layer (module docstring): q (T, heads, D), k and v (T, kv_heads, D) unrotated, last dim contiguous
    (views of the qkv output are fine) -> (T, heads, D). ``chunk_size`` None: the whole context; ``l2_eps``
    None: no norm. Nothing is promised about q and k afterwards."""
    if fuses_rotary_into_attention(q, meta, is_neox=True):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, new_kv=(k, v, positions, cos_sin_cache),
                                      chunk_size=chunk_size, qk_l2_eps=l2_eps)
    q, k = apply_rotary(q.contiguous(), k.contiguous(), positions, cos_sin_cache)
    if l2_eps is not None:
        q, k = l2_normed_heads(q, l2_eps), l2_normed_heads(k, l2_eps)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    if chunk_size is None:
        return paged_attention(q, k_cache, v_cache, meta, scale)
    return chunked_attention(q, k_cache, v_cache, meta, scale, chunk_size)


def nope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                   temperature: tuple[float, float] | None) -> torch.Tensor:
    """A NoPE layer (module docstring), shapes as rope_chunked_attention's; ``temperature`` (floor_scale,
    attn_scale) or None. The one decode kernel takes an integral floor_scale (Scout's 8192): its floor is an
    integer division (equal to the float one's below 2^24 positions)."""
    integral = temperature is None or float(temperature[0]).is_integer()
    if fuses_rotary_into_attention(q, meta, is_neox=True) and integral:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, new_kv=(k, v, positions, None),
                                      temperature=temperature)
    if temperature is not None:
        q = attention_temperature(q, positions, *temperature)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale)
