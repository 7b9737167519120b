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

``latent_rope_write_absorb``: the same launch also runs the decode layer's W_UK product (q_nope through
kernels/head_matmul.py's tiles, more programs of the one grid): independent work, one launch fewer.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.head_matmul import MAX_TOKENS as HEAD_MATMUL_MAX_TOKENS, head_matmul, head_matmul_launch, head_matmul_tile
from kernels.mla_attention import write_latent_cache_ref
from kernels.rmsnorm import _rms_normalized, rms_norm_ref
from kernels.rotary import _position_cos_sin, _rotate_heads, _rotated_heads, apply_rotary_ref
from kernels.paged_kv_math import cache_value, slot_row


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
    _latent_rope_write_row(tl.program_id(0), q_ptr, kv_ptr, w_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slots_ptr,
                           eps, stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, num_heads, RANK,
                           RANK_PAD, HALF, HALF_PAD, HEADS_PAD, PAGE)


@jit
def _latent_rope_write_absorb_kernel(q_ptr, kv_ptr, w_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slots_ptr, eps,
                                     stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, num_heads,
                                     num_tokens, q_nope_ptr, w_uk_ptr, q_lat_ptr, nope, rank, tiles,
                                     stride_nt, stride_nh, stride_wh, stride_wk, stride_wn,
                                     RANK: tl.constexpr, RANK_PAD: tl.constexpr, HALF: tl.constexpr,
                                     HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, PAGE: tl.constexpr,
                                     PDL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                     BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Programs 0..T-1: _latent_rope_write_kernel's rows; the next H x tiles: W_UK's per-head product
    of q_nope (kernels/head_matmul.py's tiles), which reads only the nope columns the rows leave alone."""
    pid = tl.program_id(0)
    pdl_prologue(PDL)
    if pid < num_tokens:
        _latent_rope_write_row(pid, q_ptr, kv_ptr, w_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slots_ptr, eps,
                               stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, num_heads, RANK,
                               RANK_PAD, HALF, HALF_PAD, HEADS_PAD, PAGE)
    else:
        tile = pid - num_tokens
        head_matmul_tile(q_nope_ptr, w_uk_ptr, q_lat_ptr, tile // tiles, tile % tiles, num_heads, num_tokens, nope,
                         rank, stride_nt, stride_nh, stride_wh, stride_wk, stride_wn, BLOCK_T, BLOCK_N, BLOCK_K,
                         DOT_PRECISION)


@jit
def _latent_rope_write_row(pid, q_ptr, kv_ptr, w_ptr, positions_ptr, cos_sin_ptr, cache_ptr, slots_ptr, eps,
                           stride_qt, stride_qh, stride_kv, stride_cos, stride_cb, stride_cs, num_heads,
                           RANK: tl.constexpr, RANK_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                           HEADS_PAD: tl.constexpr, PAGE: tl.constexpr):
    """Token pid's query heads rotated in place; its normed latent and rotated k_r into its slot."""
    token = pid.to(tl.int64)
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
                             slot_mapping: torch.Tensor, q_nope: torch.Tensor | None = None,
                             w_uk: torch.Tensor | None = None):
    """The one launch; with ``q_nope`` (T, H, N) and ``w_uk`` (H, N, R) (1..head_matmul.MAX_TOKENS tokens)
    it also computes q_latent = head_matmul(q_nope, w_uk) and returns (q_rope, q_latent)."""
    num_tokens, num_heads, rope = q_rope.shape
    rank = norm_weight.shape[0]
    assert kv.shape == (num_tokens, rank + rope) and kv.stride(1) == 1 and q_rope.stride(2) == 1
    assert cos_sin_cache.shape[1] == rope and cos_sin_cache.dtype == torch.float32 and cache.stride(-1) == 1
    # read at ptr + token (+ i): a view (a broadcast position: kernels/rotary.py) must not reach the kernel
    norm_weight, positions, slot_mapping = dense(norm_weight, positions, slot_mapping)
    args = (q_rope, kv, norm_weight, positions, cos_sin_cache, cache, slot_mapping, eps, q_rope.stride(0),
            q_rope.stride(1), kv.stride(0), cos_sin_cache.stride(0), cache.stride(0), cache.stride(1), num_heads)
    constexprs = dict(RANK=rank, RANK_PAD=triton.next_power_of_2(rank), HALF=rope // 2,
                      HALF_PAD=triton.next_power_of_2(rope // 2), HEADS_PAD=triton.next_power_of_2(num_heads),
                      PAGE=cache.shape[1], **pdl_options(kv))
    if q_nope is not None:
        q_latent, tiles, tile_constexprs = head_matmul_launch(q_nope, w_uk)
        _latent_rope_write_absorb_kernel[(num_tokens + num_heads * tiles,)](
            *args, num_tokens, q_nope, w_uk, q_latent, q_nope.shape[2], w_uk.shape[2], tiles, q_nope.stride(0),
            q_nope.stride(1), *w_uk.stride(), **constexprs, **tile_constexprs, num_warps=4, num_stages=2)
        return q_rope, q_latent
    if num_tokens:
        _latent_rope_write_kernel[(num_tokens,)](*args, **constexprs, num_warps=4)
    return q_rope


def latent_rope_write_absorb(q_nope: torch.Tensor, w_uk: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                             cos_sin_cache: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """latent_rope_write and q_latent = head_matmul(q_nope, w_uk) ((T, H, N) @ (H, N, R) -> (T, H, R)):
    one launch on CUDA for 1..head_matmul.MAX_TOKENS tokens (the two are independent: a decode layer's
    W_UK product rides in the latent write's launch), else the two calls. Returns (q_rope, q_latent)."""
    if use_triton(kv) and 1 <= kv.shape[0] <= HEAD_MATMUL_MAX_TOKENS and q_nope.stride(2) == 1:
        return latent_rope_write_triton(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping,
                                        q_nope, w_uk)
    q_rope = latent_rope_write(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping)
    return q_rope, head_matmul(q_nope, w_uk)


def latent_rope_write(q_rope: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """The module docstring's one launch on CUDA, else the reference; returns the rotated q_rope."""
    if use_triton(kv):
        return latent_rope_write_triton(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping)
    return latent_rope_write_ref(q_rope, kv, norm_weight, eps, positions, cos_sin_cache, cache, slot_mapping)
