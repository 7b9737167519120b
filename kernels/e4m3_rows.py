"""Per-row E4M3 quantization inside Triton kernels: the one definition of the scale and of the
rounding that kernels/fp8.py's quantize kernel and the norm and activation kernels that quantize
their output all use. Their results must equal kernels.fp8.quantize_rows bit for bit:
scale = max(max|row| / 448, 1e-12) in float32, values = clamp(x / scale, -448, 448) rounded to
the nearest E4M3 (448 is E4M3's largest finite value; an all-zero row keeps the 1e-12 scale).
"""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def e4m3_row_scale(peak):
    """The row's scale from its absolute maximum ``peak`` (float32 scalar)."""
    return tl.maximum(peak / 448.0, 1e-12)


@jit
def to_e4m3(x, scale):
    """float32 values of a row -> E4M3 with that row's ``scale``."""
    return tl.minimum(tl.maximum(x / scale, -448.0), 448.0).to(tl.float8e4nv)
