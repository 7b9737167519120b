"""Per-row symmetric INT8 quantization inside Triton kernels: the one definition of the scale and of
the rounding that kernels/int8_sq.py's row quantizer and the norm that quantizes its output
(kernels/rmsnorm.py) both use. Their results must equal kernels.int8_sq.quantize_rows_int8 bit for
bit: scale = max(max|row| / 127, 1e-12) in float32, codes = x / scale rounded half away from zero,
clamped to [-127, 127] (an all-zero row keeps the 1e-12 scale).

Both divisions are IEEE (div_rn), as torch divides: a plain ``/`` by the constant 127 compiled on sm_90
to a multiply by an approximate reciprocal (div.approx.f32 in the PTX), a scale an ulp off torch's.
"""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def int8_row_scale(peak):
    """The row's scale from its absolute maximum ``peak`` (float32 scalar)."""
    return tl.maximum(tl.math.div_rn(peak, tl.full([], 127.0, tl.float32)), 1e-12)


@jit
def to_int8(x, scale):
    """float32 values of a row (a 1-D block) -> int8 codes with that row's ``scale``."""
    v = tl.math.div_rn(x, scale + tl.zeros(x.shape, dtype=tl.float32))
    r = tl.where(v < 0, -tl.floor(-v + 0.5), tl.floor(v + 0.5))
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
