"""Rotary position embedding over packed tokens, driven by a precomputed cos/sin table.

``cos_sin_cache``: (max_positions, head_dim) float32, row p = [cos(p * inv_freq) | sin(p * inv_freq)]
with ``head_dim // 2`` frequencies each (times yarn's/longrope's attention factor). Build it with
``build_cos_sin_cache``, once per engine; partial rotary is expressed in the table (frequencies
0 for the pass-through pairs) and in the weights' dim order, so the kernels always rotate whole heads.

``apply_rotary(q, k, positions, cos_sin_cache, is_neox=True) -> (q, k)``:
q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim), positions:
(num_tokens,) int64. ``is_neox`` rotates the two halves of each head (Hugging Face's
``rotate_half``, used by Llama/Mistral/Qwen2 checkpoints in HF layout); otherwise adjacent
pairs (GPT-J style) are rotated. Math in fp32, results cast back to the input dtype.

On CUDA a Triton program per token rotates all of its q and k heads *in place* (q and k are
usually column views of the fused qkv output) and returns the same q and k tensors; callers
must not rely on the inputs staying unrotated.
"""
from __future__ import annotations

import math

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.paged_kv_math import cache_value, rotate_pair, slot_row


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) float32 with Hugging Face's rope scalings.

    ``head_dim`` is the rotated width (the rotary dims of a partial-rotary head). ``scaling``
    follows HF's layout, completed by engine.convert with ``original_max_position_embeddings``
    and ``max_position_embeddings`` where the type needs them. Static choices an engine makes
    where transformers recomputes per forward: ``dynamic`` (NTK) keeps the unscaled
    frequencies, which is what transformers uses for every sequence within
    max_position_embeddings (an engine never holds longer ones); ``longrope`` takes its short
    factors, or its long factors for engines built past original_max_position_embeddings
    (``use_long_factors``, see ``build_cos_sin_cache``).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "longrope":
        factors = scaling["long_factor" if scaling.get("use_long_factors") else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if rope_type not in ("default", "dynamic", None):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                         "supported: default, linear, llama3, yarn, dynamic, longrope")
    return inv_freq


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor yarn and longrope multiply cos and sin by (1.0 for the other types)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _scaling_factor(scaling)
    if rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _scaling_factor(scaling: dict) -> float:
    """``factor``, or (as transformers) max_position_embeddings / original_max_position_embeddings."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies rotating fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear ramp between."""
    factor = _scaling_factor(scaling)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by ``factor``, short kept."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    max_positions: int, head_dim: int, theta: float, scaling: dict | None = None, device=None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """The (max_positions, head_dim) float32 table of the module docstring.

    ``rotary_dim < head_dim`` (partial rotary): the table's last (head_dim - rotary_dim) // 2
    frequencies are 0, so cos 1 and sin 0 leave those dim pairs exactly as they are; the
    weights must order each q/k head as ``partial_rotary_order`` says. yarn's and longrope's
    attention factor scales the rotated pairs only.

    longrope: an engine whose ``max_positions`` exceeds original_max_position_embeddings uses the
    long factors at every position. transformers switches a sequence to them (recomputing its
    cache) once it grows past that length; a paged cache cannot re-rotate keys, so the choice
    is made once per engine, and equals transformers' for every sequence when the engine is
    built within original_max_position_embeddings.
    """
    rotary_dim = rotary_dim or head_dim
    if scaling and scaling.get("rope_type") == "longrope":
        scaling = {**scaling, "use_long_factors": max_positions > scaling["original_max_position_embeddings"]}
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    factor = rope_attention_factor(scaling)
    cos, sin = freqs.cos() * factor, freqs.sin() * factor
    unrotated = (head_dim - rotary_dim) // 2
    if unrotated:
        cos = torch.cat([cos, cos.new_ones(max_positions, unrotated)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(max_positions, unrotated)], dim=-1)
    return torch.cat([cos, sin], dim=-1).to(device)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Checkpoint dim of each engine dim of a q/k head when rope rotates only ``rotary_dim`` dims.

    HF rotates pairs (i, i + rotary_dim/2) of the first rotary_dim dims and passes the rest; the
    kernels rotate pairs (j, j + head_dim/2). Engine head = [rot first half | pass first half |
    rot second half | pass second half] puts each HF pair on a kernel pair, and the pass-through
    dims on pairs whose table entries are cos 1, sin 0. Example head_dim 8, rotary_dim 4:
    [0, 1, 4, 5, 2, 3, 6, 7].
    """
    half, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, rest = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat([rot[:half], rest[:passed], rot[half:], rest[passed:]])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x: (num_tokens, heads, head_dim); cos, sin: (num_tokens, 1, head_dim // 2) float32."""
    xf = x.float()
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


@jit
def _position_cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """(cos, sin) (1, HALF_PAD) float32 of the token's position from the cos/sin cache (position rows
    [cos | sin]), and (half_idx (HALF_PAD,), half_mask): the pair indices and which are real. Padded
    pairs read cos 1, sin 0."""
    position = tl.load(positions_ptr + token)
    half_idx = tl.arange(0, HALF_PAD)
    half_mask = half_idx < HALF
    cos = tl.load(cache_ptr + position * stride_cache + half_idx, mask=half_mask, other=1.0)[None, :]
    sin = tl.load(cache_ptr + position * stride_cache + HALF + half_idx, mask=half_mask, other=0.0)[None, :]
    return cos, sin, half_idx, half_mask


@jit
def _rotated_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, half_idx, half_mask,
                   HEADS_PAD: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The token's heads of x rotated, in float32: (heads (HEADS_PAD, 1), mask (HEADS_PAD, HALF_PAD),
    first, second (1, HALF_PAD): each pair's two dims (neox: j and j + HALF; else 2j and 2j + 1),
    out1, out2 (HEADS_PAD, HALF_PAD): the pairs' rotated values)."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    mask = (heads < num_heads) & half_mask[None, :]
    if IS_NEOX:
        first, second = half_idx[None, :], half_idx[None, :] + HALF
    else:
        first, second = 2 * half_idx[None, :], 2 * half_idx[None, :] + 1
    base = x_ptr + token * stride_t + heads * stride_h
    out1, out2 = rotate_pair(tl.load(base + first, mask=mask, other=0.0), tl.load(base + second, mask=mask, other=0.0),
                             cos, sin)
    return heads, mask, first, second, out1, out2


@jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, half_idx, half_mask,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The token's heads of x rotated in place."""
    heads, mask, first, second, out1, out2 = _rotated_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin,
                                                            half_idx, half_mask, HEADS_PAD, HALF, IS_NEOX)
    base = x_ptr + token * stride_t + heads * stride_h
    tl.store(base + first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + second, out2.to(x_ptr.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin, half_idx, half_mask = _position_cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF, HALF_PAD)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, half_idx, half_mask,
                  Q_HEADS_PAD, HALF, IS_NEOX)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, half_idx, half_mask,
                  K_HEADS_PAD, HALF, IS_NEOX)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (see the module docstring) and returns them."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert cos_sin_cache.shape[1] == head_dim, "partial rotary is not supported"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.dtype == torch.float32
    if num_tokens == 0:
        return q, k
    # The kernel reads token t's position at positions_ptr + t. A broadcast view (one position
    # expanded over a tree depth's rows: stride 0, storage of one element) read rows 1.. past its
    # storage: garbage positions, wrong rotations (EAGLE-3's one-sequence drafting windows on CUDA).
    positions, = dense(positions)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), num_q_heads, k.shape[1],
        HALF=half, HALF_PAD=triton.next_power_of_2(half), Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]), IS_NEOX=is_neox, num_warps=4,
    )
    return q, k


@jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cache_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    num_q_heads, num_kv_heads,
    PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr,
):
    """One program per token: rotate q in place; write rotated k and plain v to the token's cache slot
    (block slot // PAGE_SIZE, row slot % PAGE_SIZE: the pool's strides say where that is)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin, half_idx, half_mask = _position_cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF, HALF_PAD)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, half_idx, half_mask,
                  Q_HEADS_PAD, HALF, IS_NEOX)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # slot -1: CUDA-graph padding row, writes nothing
        heads, mask, first, second, out1, out2 = _rotated_heads(k_ptr, token, stride_kt, stride_kh, num_kv_heads, cos,
                                                                sin, half_idx, half_mask, K_HEADS_PAD, HALF, IS_NEOX)
        # Rounded to k's dtype first (the reference rotates k, then the KV write casts to the cache).
        out1 = cache_value(out1.to(k_ptr.dtype.element_ty), k_cache_ptr)
        out2 = cache_value(out2.to(k_ptr.dtype.element_ty), k_cache_ptr)
        k_slot = slot_row(k_cache_ptr, slot, stride_kc_block, stride_kc_slot, PAGE_SIZE) + heads * stride_kc_head
        tl.store(k_slot + first, out1, mask=mask)
        tl.store(k_slot + second, out2, mask=mask)
        dims = tl.arange(0, DIM_PAD)[None, :]
        v_mask = (heads < num_kv_heads) & (dims < 2 * HALF)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=v_mask)
        v_slot = slot_row(v_cache_ptr, slot, stride_vc_block, stride_vc_slot, PAGE_SIZE) + heads * stride_vc_head
        tl.store(v_slot + dims, cache_value(v, v_cache_ptr), mask=v_mask)


def rotary_and_write_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=True):
    from kernels.attention import write_kv_cache_ref

    q, k = apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_and_write_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox=True):
    """Rotates q in place and returns it; k is read, never modified; slots < 0 are skipped."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[1] == head_dim, "partial rotary is not supported"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1
    if num_tokens == 0:
        return q
    # read at positions_ptr + t and slot_ptr + t (apply_rotary_triton says why a view must not reach them)
    positions, slot_mapping = dense(positions, slot_mapping)
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], num_q_heads, num_kv_heads, PAGE_SIZE=k_cache.shape[1],
        HALF=half, HALF_PAD=triton.next_power_of_2(half), DIM_PAD=triton.next_power_of_2(head_dim),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox, num_warps=4, **pdl_options(q),
    )
    return q


def rotary_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, is_neox: bool = True,
) -> torch.Tensor:
    """Rotary on q and k, then k and v into their cache slots: ``apply_rotary`` + ``write_kv_cache``
    in one kernel on CUDA (one launch and one pass over k instead of three). Returns rotated q.

    q: (num_tokens, heads, dim); k, v: (num_tokens, kv_heads, dim); caches as in kernels/attention.py.
    """
    if use_triton(q):
        return rotary_and_write_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)
    return rotary_and_write_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos_sin_cache, is_neox)
    return apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
