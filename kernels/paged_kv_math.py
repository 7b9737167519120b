"""Triton helpers the paged-KV kernels share (kernels/triton_attention.py, kernels/keys_major_decode.py,
kernels/rotary.py, ...): where a slot of a pool starts, a value as the pool stores it, and the rotary rotation, each in
one place so every kernel that writes or rotates a key computes it alike (the same bytes in the pool)."""
from __future__ import annotations

from kernels._triton import jit, tl


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
