"""Rotary position embedding over packed tokens, driven by a precomputed cos/sin table.

``cos_sin_cache``: (max_positions, rotary_dim) float32, row p = [cos(p * inv_freq) | sin(p * inv_freq)]
with ``rotary_dim // 2`` frequencies each. Build it with ``build_cos_sin_cache``.

``apply_rotary(q, k, positions, cos_sin_cache, is_neox=True) -> (q, k)``:
q: (num_tokens, num_heads, head_dim), k: (num_tokens, num_kv_heads, head_dim), positions:
(num_tokens,) int64. ``is_neox`` rotates the two halves of each head (Hugging Face's
``rotate_half``, used by Llama/Mistral/Qwen2 checkpoints in HF layout); otherwise adjacent
pairs (GPT-J style) are rotated. Math in fp32, results cast back to the input dtype.
"""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) float32, with HF's 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type not in ("default", None):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3")
    return inv_freq


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
    max_positions: int, head_dim: int, theta: float, scaling: dict | None = None, device=None
) -> torch.Tensor:
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


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


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_ref(q, k, positions, cos_sin_cache, is_neox)
