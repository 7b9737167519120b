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
def widened_bits(w, dtype: tl.constexpr, ASM: tl.constexpr):
    """E4M3 codes w as ``dtype``: bfloat16 (or float32, ASM=False only) of value * 2^-120, float16 of value * 2^-8
    (ASM=False: from the float32 bits, times 2^112).
    ASM: prmt.b32 replicates a selected byte's sign through the byte above it (selectors 8-11), so lane i of
    ``prmt t, word, 0, 0x9180`` holds (sign byte, code) of byte i (bytes 0, 1; 0xB3A2: bytes 2, 3); shifted left
    by 4 (7) the code's sign lands in bit 15 and its exponent and mantissa in bits 10-4 (13-7), and the mask clears
    the rest (the neighbour lane's spill included)."""
    if ASM:
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(_FP16_BITS_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                             dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_BF16_BITS_ASM, "=r,=r,r", [w.to(tl.uint8, bitcast=True)],
                                             dtype=tl.bfloat16, is_pure=True, pack=4)
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
