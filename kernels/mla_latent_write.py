"""An MLA layer's new latent rows in ONE launch: kv_a_layernorm of the latent, rope of the queries'
rope parts and of the shared rope key, and the row [c | k_r] into its slot of the latent pool.

Shapes (T new tokens, H heads, R = kv_lora_rank, P = qk_rope_head_dim):
    q_rope (T, H, P) (a strided view of the q projection: rotated in place and returned);
    kv (T, R + P) kv_a_proj's output [latent | k_r] (read only); norm_weight (R,);
    positions (T,) int64; cos_sin_cache (max_positions, P) float32 (kernels/rotary.py);
    cache (num_blocks, tokens_per_block, R + P) (kernels/mla_attention.py's pool); slot_mapping (T,).

The same values as its reference, the three launches it replaces (engine/models/deepseek.py before):
``rms_norm`` of the latent (float32 statistics, the normalised value rounded to the latent's dtype
before the weight multiplies it), ``apply_rotary`` (neox halves, float32, rounded to the input dtype)
and ``write_latent_cache`` (the pool's dtype; an FP8 pool saturates at +-448). Nothing else reads the
normalised latent or the rotated k_r: attention reads them from the pool. A slot < 0 (a CUDA graph's
padding row) writes nothing; its query is still rotated.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.mla_attention import write_latent_cache_ref
from kernels.rmsnorm import _rms_normalized, rms_norm_ref
from kernels.rotary import _position_cos_sin, _rotate_heads, _rotated_heads, apply_rotary_ref
from kernels.triton_attention import cache_value, slot_row


def latent_rope_write_ref(q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """rms_norm + apply_rotary + write_latent_cache in plain torch; returns the rotated q_rope."""
    rank = norm_weight.shape[0]
    latent, k_rope = kv[:, :rank], kv[:, rank:]
    latent = rms_norm_ref(latent, norm_weight, eps)[0]
    q_rope, k_rope = apply_rotary_ref(q_rope, k_rope.unsqueeze(1), positions, cos_sin_cache)
    write_latent_cache_ref(latent, k_rope.squeeze(1), cache, slot_mapping)
    return q_rope


@jit
def _latent_rope_write_kernel(q_ptr, kv_ptr, w_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slots_ptr, eps,
                              stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, num_heads,
                              RANK: tl.constexpr, RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                              HEADS_PAD: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's query heads rotated in place; its normed latent and rotated k_r into its slot."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin, half_idx, half_mask = _position_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos, HALF, HALF_PAD)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_heads, cos, sin, half_idx, half_mask, HEADS_PAD, HALF, True)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        row = slot_row(cache_ptr, slot, stride_cb, stride_cs, PAGE)
        r = tl.arange(0, RANK_PAD)
        r_ok = r < RANK
        c = tl.load(kv_ptr + token * stride_kv + r, mask=r_ok, other=0.0)
        normed = _rms_normalized(c, RANK, eps, 0) * tl.load(w_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(row + r, cache_value(normed.to(kv_ptr.dtype.element_ty), cache_ptr), mask=r_ok)
        # k_r: one "head" at column RANK of the kv row (rounded to kv's dtype first, as the reference rotates
        # k and the write then casts it to the pool)
        heads, mask, first, second, out1, out2 = _rotated_heads(kv_ptr + RANK, token, stride_kv, 0, 1, cos, sin,
                                                                half_idx, half_mask, 1, HALF, True)
        dest = row + RANK + heads * 0
        tl.store(dest + first, cache_value(out1.to(kv_ptr.dtype.element_ty), cache_ptr), mask=mask)
        tl.store(dest + second, cache_value(out2.to(kv_ptr.dtype.element_ty), cache_ptr), mask=mask)


def latent_rope_write_triton(q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, rope = q_rope.shape
    rank = norm_weight.shape[0]
    assert kv.shape == (num_tokens, rank + rope) and kv.stride(1) == 1 and q_rope.stride(2) == 1
    assert cos_sin_cache.shape[1] == rope and cos_sin_cache.dtype == torch.float32 and cache.stride(-1) == 1
    if num_tokens:
        _latent_rope_write_kernel[(num_tokens,)](
            q_rope, kv, norm_weight, positions, cos_sin_cache, cache, slot_mapping, eps,
            q_rope.stride(0), q_rope.stride(1), kv.stride(0), cos_sin_cache.stride(0), cache.stride(0),
            cache.stride(1), num_heads, RANK=rank, RANK_PAD=triton.next_power_of_2(rank), HALF=rope // 2,
            HALF_PAD=triton.next_power_of_2(rope // 2), HEADS_PAD=triton.next_power_of_2(num_heads),
            PAGE=cache.shape[1], num_warps=4, **pdl_options(kv))
    return q_rope


def latent_rope_write(q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """The module docstring's one launch on CUDA, else the reference; returns the rotated q_rope."""
    if use_triton(kv):
        return latent_rope_write_triton(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping)
    return latent_rope_write_ref(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping)
