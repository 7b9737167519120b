"""Triton helpers the paged-KV kernels share (kernels/triton_attention.py, kernels/keys_major_decode.py,
kernels/rotary.py, ...): where a slot of a pool starts, a value as the pool stores it, the rotary rotation, and a
decode tile of keys read from the pool and widened, each in one place so every kernel that writes, rotates or reads a
key computes it alike (the same bytes in the pool, the same values in the products)."""
from __future__ import annotations

from kernels._triton import jit, tl
from kernels.e4m3_bits import converted_f16, widened_bits


@jit
def cache_value(x, cache_ptr):
    """x as the pool stores it; an FP8 pool saturates at +-448 (E4M3 has no infinity)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0).to(tl.float8e4nv)
    return x.to(cache_ptr.dtype.element_ty)


@jit
def slot_row(cache_ptr, slot, stride_block, stride_row, PAGE_SIZE: tl.constexpr):
    """Where slot ``slot`` of a pool (block slot // PAGE_SIZE, row slot % PAGE_SIZE) starts, through
    the pool's strides (the runner's pool is a head-major view); its KV heads follow at the head stride."""
    return cache_ptr + slot // PAGE_SIZE * stride_block + slot % PAGE_SIZE * stride_row


@jit
def rotate_pair(x1, x2, cos, sin):
    """One rotary rotation in fp32: the pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Every
    rotary kernel (kernels/rotary.py's and the decode attention's) computes it here, so they round alike."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@jit
def rotate_neox(x, partner, cos, sin, first_half):
    """Rotary on whole heads laid out as two halves (``kernels/rotary.py``, is_neox): ``x`` and
    ``partner`` (the element HEAD_DIM / 2 away) of any shape [..., HEAD_DIM], cos / sin fp32
    broadcastable to it. A first-half element is its pair's x1, a second-half one its pair's x2."""
    as_first, _ = rotate_pair(x, partner, cos, sin)
    _, as_second = rotate_pair(partner, x, cos, sin)
    return tl.where(first_half, as_first, as_second).to(x.dtype)


@jit
def paged_kv_tile(k_cache_ptr, v_cache_ptr, block_row, kv_head, k_pos, kv_hi, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The keys at positions ``k_pos`` (BLOCK_N,) of one sequence's KV head ``kv_head``, through its block-table row
    ``block_row``: (k, v) (BLOCK_N, DIM_PAD) as the pool stores them, and k_valid (BLOCK_N,). MASKED: keys at or past
    ``kv_hi`` read nothing (zeros; k_valid False); else every key is below it (k_valid all True) and only padded
    dims (HEAD_DIM < DIM_PAD) are masked."""
    dims = tl.arange(0, DIM_PAD)
    if MASKED:
        k_valid = k_pos < kv_hi
        block_id = tl.load(block_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
    else:
        k_valid = tl.arange(0, BLOCK_N) < BLOCK_N
        block_id = tl.load(block_row + k_pos // PAGE_SIZE).to(tl.int64)
    kv_mask = k_valid[:, None] & (dims < HEAD_DIM)[None, :]
    k_rows = block_id[:, None] * stride_kb + (k_pos % PAGE_SIZE)[:, None] * stride_ks + kv_head * stride_kh
    v_rows = block_id[:, None] * stride_vb + (k_pos % PAGE_SIZE)[:, None] * stride_vs + kv_head * stride_vh
    if MASKED or HEAD_DIM != DIM_PAD:
        k = tl.load(k_cache_ptr + k_rows + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows + dims[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows + dims[None, :])
        v = tl.load(v_cache_ptr + v_rows + dims[None, :])
    return k, v, k_valid


@jit
def widened_kv(k, v, dtype: tl.constexpr, K_BITS: tl.constexpr, V_WIDEN: tl.constexpr, ASM: tl.constexpr):
    """A decode tile's K and V for the products in ``dtype`` (the queries'): a 16/32-bit pool as it is (a no-op cast),
    an FP8 pool's E4M3 codes widened to float16 as triton_attention.fp8_widening chose: K_BITS, K by bit moves
    (value * 2^-8: the caller multiplies the scores by bits_factor) else by Triton's conversion; V_WIDEN 1 (V_BY_BITS,
    value * 2^-8, kept in its loaded layout: the caller scales the sum back), 2 (V_BY_CVT, the conversion unit in its
    loaded layout) or 0 (Triton's conversion) (kernels/e4m3_bits.py)."""
    if K_BITS:
        k = widened_bits(k, tl.float16, ASM)
    else:
        k = k.to(dtype)  # an FP8 pool is widened here (a no-op otherwise)
    if V_WIDEN == 1:
        v = widened_bits(v, tl.float16, ASM, False)
    elif V_WIDEN == 2:
        v = converted_f16(v, ASM)
    else:
        v = v.to(dtype)
    return k, v
