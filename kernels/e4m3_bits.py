"""E4M3 codes widened to bfloat16 / float16 by bit moves alone, inside Triton kernels: for the decode products
that stream FP8 weights into tensor-core dots with unquantized activations (kernels/moe_gemv.py's BITS tiles,
kernels/fp8_block_skinny.py's BITS variants).

Per 4-byte word of codes two PRMTs (each code's byte and its sign byte into a 16-bit lane), shifts and masks (inline
PTX): a code becomes the bfloat16 of its value times 2^-120 (the exponent field 0000eeee: E4M3's bias 7 read with
bfloat16's 127; subnormal codes become bfloat16 subnormals alike), or for float16 activations the float16 of its
value times 2^-8 (0eeee: bias 7 read with 15). The caller multiplies its float32 dot products back by
``bits_factor`` (2^120 / 2^8: exact).

Why: Triton widens E4M3 to bfloat16 as F2FP (a float16 pair) then F2F a value, and the H200's conversion unit issues
16 lanes a clock an SM (the FMA and ALU pipes 64-128): 1.5 conversions a weight bound a Qwen3-30B-A3B block-FP8
expert gate_up at one token (25 MB) to ~9 us of conversions alone; here 1.5 ALU instructions a weight (~2 us).

Numerics: the bfloat16 products are exact, summed in float32 at 2^-120 times their value: a product below 2^-6 (in
code x activation units) is a float32 subnormal there, within 2^-149 (x 2^120: 2^-29) of its value. float16: the
products at 2^-8, nothing near float32's subnormals.

Triton's interpreter runs no assembly: ``ASM=False`` builds the same bits as float32 (code << 20: the bfloat16 pattern
in a float32's upper half, the same value) for the interpreter's tests.

Where the widening runs: Triton moves a pure one-input inline asm that feeds a dot operand past the operand's layout
conversion (it loads the codes from shared memory straight into the MMA's operand layout, then widens there). That is
right for an operand whose K dimension is contiguous in memory, but an 8-bit operand read across it (attention's V,
keys by rows of dims) then comes out of shared memory a byte at a time (LDS.U8, and PRMTs to pack them: 128 LDS.U8
for a 32-key tile of 128 dims). ``PURE=False`` (and ``converted_f16``, which is never pure) keeps the widening in the
layout the codes were loaded in; the 16-bit tile then reaches the MMA through shared memory by ldmatrix (.trans).
"""
from __future__ import annotations

from kernels._triton import jit, tl


def _bits_asm(shift: int, mask: str) -> str:
    """PTX widening a 4-byte word of E4M3 codes ($2) into two registers of 16-bit values ($0: bytes 0 and 1, $1: 2
    and 3): each lane (sign byte, code) by prmt, shifted left by ``shift``, masked (widened_bits)."""
    lanes = "\n".join(f"prmt.b32 t, $2, 0, {selector};\nshl.b32 t, t, {shift};\nand.b32 ${out}, t, {mask};"
                      for out, selector in ((0, "0x9180"), (1, "0xB3A2")))
    return "{\n.reg .b32 t;\n" + lanes + "\n}"


_BF16_BITS_ASM = tl.constexpr(_bits_asm(4, "0x87F087F0"))  # bfloat16: s 0000 eeee mmm 0000 (value * 2^-120)
_FP16_BITS_ASM = tl.constexpr(_bits_asm(7, "0xBF80BF80"))  # float16: s 0 eeee mmm 0000000 (value * 2^-8)


@jit
def widened_bits(w, dtype: tl.constexpr, ASM: tl.constexpr, PURE: tl.constexpr = True):
    """E4M3 codes w as ``dtype``: bfloat16 (or float32, ASM=False only) of value * 2^-120, float16 of value * 2^-8
    (ASM=False: from the float32 bits, times 2^112). PURE=False: widened in w's own layout (module docstring).
    ASM: prmt.b32 replicates a selected byte's sign through the byte above it (selectors 8-11), so lane i of
    ``prmt t, word, 0, 0x9180`` holds (sign byte, code) of byte i (bytes 0, 1; 0xB3A2: bytes 2, 3); shifted left
    by 4 (7) the code's sign lands in bit 15 and its exponent and mantissa in bits 10-4 (13-7), and the mask clears
    the rest (the neighbour lane's spill included)."""
    if ASM:
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(_FP16_BITS_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                             dtype=tl.float16, is_pure=PURE, pack=4)
        else:
            return tl.inline_asm_elementwise(_BF16_BITS_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                             dtype=tl.bfloat16, is_pure=PURE, pack=4)
    else:  # (sign-extended code << 20) & 0x87F00000: bfloat16's pattern in a float32's upper half
        code = w.to(tl.int8, bitcast=True).to(tl.int32)
        value = ((code << 20) & -2014314496).to(tl.float32, bitcast=True)  # value * 2^-120
        if dtype == tl.float16:
            return (value * 5.192296858534828e+33).to(tl.float16)  # * 2^112: value * 2^-8, exact in float16
        else:
            return value.to(dtype)


@jit
def bits_factor(dtype: tl.constexpr):
    """What a dot of widened_bits(w, dtype) codes is multiplied by to give the codes' values' dot: 2^8 for float16,
    2^120 otherwise."""
    if dtype == tl.float16:
        return 256.0
    else:
        return 1.329227995784916e+36


# cvt.rn.f16x2.e4m3x2 widens two codes of a 16-bit half of $2 (the upper code to the upper half): bytes 0, 1 -> $0.
_CVT_F16_ASM = tl.constexpr("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\n"
                            "cvt.rn.f16x2.e4m3x2 $1, hi;\n}")


@jit
def converted_f16(w, ASM: tl.constexpr):
    """E4M3 codes w as float16 values (exact, unscaled) by the conversion unit (F2FP, two codes an instruction, as
    Triton's own widening), kept in w's layout: not pure, so Triton does not move it into a dot operand's layout
    (module docstring). ASM=False: Triton's conversion (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(_CVT_F16_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                         dtype=tl.float16, is_pure=False, pack=4)
    else:
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
