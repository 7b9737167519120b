"""ALiBi slopes: one per attention head, the weight of each query-key distance in its scores.

The bias itself is added inside the paged attention kernels (kernels/attention.py,
kernels/triton_attention.py); this module only makes the (num_heads,) float32 slopes, for any head
count, the way each family's checkpoints were trained:

- ``bloom``: for the largest power of two n <= num_heads, slopes ``2^(-8 i / n)``, i = 1..n; the
  heads past n take every other slope of 2n heads, ``2^(-8 j / 2n)`` for j = 1, 3, 5, ...
- ``mpt``: for the smallest power of two n >= num_heads, slopes ``2^(-bias_max i / n)``, i = 1..n;
  with fewer heads than n, the odd-indexed slopes come first, then the even ones, and the first
  num_heads are kept.

For a power-of-two head count and bias_max 8 both give the same slopes.
"""
from __future__ import annotations

import math

import torch

from kernels._triton import power_of_2_floor


def _power_of_two_slopes(n: int, bias_max: float) -> torch.Tensor:
    exponents = torch.arange(1, n + 1, dtype=torch.float64) * (bias_max / n)
    return torch.pow(2.0, -exponents)


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    closest = power_of_2_floor(num_heads)
    slopes = _power_of_two_slopes(closest, 8.0)
    if closest < num_heads:
        extra = _power_of_two_slopes(2 * closest, 8.0)[0::2][:num_heads - closest]
        slopes = torch.cat([slopes, extra])
    return slopes.float()


def mpt_alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = _power_of_two_slopes(padded, bias_max)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[0::2]])[:num_heads]
    return slopes.float()


def alibi_slopes(num_heads: int, kind: str, bias_max: float = 8.0) -> torch.Tensor:
    """(num_heads,) float32 slopes of every head of the model; a tensor-parallel rank takes its
    heads' contiguous slice."""
    if kind == "bloom":
        return bloom_alibi_slopes(num_heads)
    if kind == "mpt":
        return mpt_alibi_slopes(num_heads, bias_max)
    raise ValueError(f"unknown ALiBi slope kind {kind!r}; allowed: bloom, mpt")
