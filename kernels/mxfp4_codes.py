"""MXFP4 codes as Triton kernels read them (kernels/fused_moe_mxfp4.py's grouped kernels and
kernels/moe_gemv.py's GEMV launches): an E2M1 code placed in float16 bits is its value times 2^-14
(normal or, for 0.5, subnormal: exact either way), and an E8M0 exponent s becomes the float32
2^(s - 113), so that (code bits as float16, widened to float32) * 2^(s - 113) = value * 2^(s - 127)
exactly. Valid for s <= 240 (kernels/fused_moe_mxfp4.py MAX_KERNEL_EXPONENT)."""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def exponent_factor(scales):
    """E8M0 exponents s (any integer type) -> 2^(s - 113) as float32 bits (s <= MAX_KERNEL_EXPONENT)."""
    return ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@jit
def low_codes(packed):
    """The low nibbles' E2M1 codes of ``packed`` (uint16) as float16 bits: sign -> 15, the rest -> 11-9."""
    return ((packed & 0x8) << 12) | ((packed & 0x7) << 9)


@jit
def high_codes(packed):
    """The high nibbles' codes of ``packed`` (uint16, a byte a lane) as float16 bits."""
    return ((packed & 0x80) << 8) | ((packed & 0x70) << 5)
