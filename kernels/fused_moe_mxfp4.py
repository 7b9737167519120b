"""Mixture-of-experts MLPs with MXFP4 experts (gpt-oss, W4A16): the experts stay 4-bit codes with
power-of-two scales, and the grouped kernels widen each weight tile in registers.

Storage per projection (the engine directory's tensors, byte for byte the checkpoint's):
``codes`` uint8 (E, N, K/2), two FP4 E2M1 codes a byte along K, value 2j of a row in byte j's low
nibble and 2j + 1 in its high one; ``scales`` uint8 (E, N, K/32), E8M0 exponents, one per 32
values along K:

    w[e, n, k] = e2m1(code of k) * 2^(scales[e, n, k // 32] - 127)

E2M1 codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 the same negated (bit 3 the sign, bits 2-1
the exponent, bit 0 the mantissa). Every such value has at most two significant bits, so float32
and bfloat16 hold it exactly (below 2^128; the build refuses more, engine/mxfp4.py): the
reference widens the experts exactly to the activations' dtype (``dense``) and runs
kernels/fused_moe.py's reference on them, i.e. the dequantized model's MLP, biases and
activation included (kernels/moe_epilogue.py). gate_up is (E, 2I, H) with rows [gate_e | up_e],
down (E, H, I), as for model-dtype experts.

On CUDA no widened copy is kept: ``kernel_layout`` reorders the codes once at load, and the
grouped GEMMs of kernels/fused_moe.py (same routing, same blocks of assignments sorted by expert,
same epilogue: kernels/moe_blocks.py) widen each weight tile in registers before its tensor-core dot:

- K is padded to K_pad, a multiple of 64 (zero codes), and byte j of a row holds columns j (low
  nibble) and K_pad/2 + j (high nibble): a row's halves, not neighbours. A step reads 32 or 64
  bytes a row (BLOCK_K), two tiles of contiguous columns, k0 + [0, BLOCK_K) and K_pad/2 + k0 +
  [0, BLOCK_K), each met by its own slice of the activations: no interleaving in registers, and
  each 32 columns of a tile lie in one scale group (K_pad/2 is a multiple of 32), so a group's
  scale is one number a row. Worked example, K = 96 (3 groups; K_pad = 128, a half of 64):

      byte j (j < 64):      low nibble column j,   high nibble column 64 + j
      step k0 = 0, 32 b:    columns 0-31 (group 0) and 64-95 (group 2)
      step k0 = 32, 32 b:   columns 32-63 (group 1) and 96-127 (padding: zero codes, x masked)

- scales transposed to (E, K_pad/32, N), so one group's exponents over a tile's BLOCK_N rows are
  contiguous.
- a code becomes its value exactly in two steps: its bits placed in a float16 (sign -> bit 15,
  exponent and mantissa -> bits 11-9) are the value times 2^-14, normal or (code 0.5) subnormal;
  widened to float32 and multiplied by 2^(s - 113) (built as float32 bits) it is value * 2^(s - 127),
  exactly, then rounded to the activations' dtype as the reference rounds (exact in bfloat16 and
  float32). 2^(s - 113) is a float32 for s <= 240: larger exponents (weights of 2^113 and more) are
  refused at load (``MAX_KERNEL_EXPONENT``).
- prefill blocks (32 or 64 rows) compute the transposed product, out.T = w . a.T, so the widened
  tile is the tensor cores' register operand (SWAP_AB, as kernels/fused_moe_wna16.py does).

Few assignments (decode: up to ``FMA_MAX_ASSIGNMENTS``) take ``_mxfp4_fma_kernel`` instead: one
program per (assignment, column tile), the weight read as int32 words, each code widened and
multiplied on the FMA units (one row: no tensor-core tile to fill). A single token (batch-1
decode) routes inside the gate_up launch, as moe_single_token_triton does, and reads only its K
experts' bytes. No host synchronisation anywhere (grids from T, K, E only), so the whole routed
MLP is captured in CUDA graphs.

From ``DEQUANTIZE_MIN_ROWS_PER_EXPERT`` rows an expert on average (long prefill chunks, where the
GEMMs are compute-bound), the experts are widened into a scratch buffer in the activations' dtype
(``dequantize_mxfp4_triton``, one pass) and kernels/fused_moe.py's grouped GEMMs run on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels._triton import dense, jit, tl, triton, use_triton
from kernels.fused_moe import choose_block_m, fused_moe, fused_moe_ref, moe_align, moe_forward, route_tokens, \
    warm_up_token_counts
from kernels.moe_blocks import (activation_tiles, block_rows, expert_block_launch, expert_block_tile,
                                 past_padded_blocks, routing_tensors, store_rows, tile_dot)
from kernels.moe_epilogue import ACTIVATIONS, PLAIN_SILU, ExpertEpilogue
from kernels.moe_gemv import gemv_tiles, moe_gemv_triton
from kernels.mxfp4_codes import exponent_factor, high_codes, low_codes
from kernels.mxfp4_gemv import is_word_mark, mxfp4_words_triton

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
VALUES_PER_SCALE = 32
K_ALIGN = 64  # K_pad: K rounded up to this (two groups), so each half of a row starts on a group
MAX_KERNEL_EXPONENT = 240  # 2^(s - 113) must be a float32 (module docstring)


@dataclass
class MXFP4Experts:
    """One projection's MXFP4 experts, prepared at load (``prepare_mxfp4_experts``).

    ``dense``: the experts widened to the activations' dtype (E, N, K) (reference path).
    ``kernel``: the CUDA kernels' layout (``kernel_layout``): ``codes`` uint8 (E, N, K_pad/2) and
    ``scales`` uint8 (E, K_pad/32, N); empty where the reference path runs."""

    num_experts: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    dense: torch.Tensor | None = None
    kernel: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def half_k(self) -> int:
        """K_pad / 2: bytes a row in the kernel layout, and the column of the first high nibble."""
        return -(-self.in_features // K_ALIGN) * K_ALIGN // 2


def check_stored(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless codes (E, N, K/2) and scales (E, N, K/32) are uint8 MXFP4 experts."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8 or codes.dim() != 3:
        raise ValueError(f"MXFP4 experts are uint8 codes (E, N, K/2) and scales (E, N, K/32), got {codes.dtype} "
                         f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if scales.shape != (*codes.shape[:2], codes.shape[2] * 2 // VALUES_PER_SCALE) or codes.shape[2] % 16:
        raise ValueError(f"MXFP4 codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not pair up: "
                         "one scale per 16 bytes (32 values) of a row")


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8) -> 2^(s - 127) as float32, exactly (2^-127, the subnormal, for s = 0)."""
    exponents = scales.to(torch.int32)
    return torch.where(exponents > 0, exponents << 23, torch.full_like(exponents, 1 << 22)).view(torch.float32)


def dequantize_mxfp4_experts(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (E, N, K/2), scales (E, N, K/32) -> the experts (E, N, K) in ``dtype``: each value
    exact in float32, then one rounding to ``dtype`` (none in bfloat16 and float32). One expert at
    a time, so the float32 temporary is one expert's."""
    check_stored(codes, scales)
    num_experts, rows, half = codes.shape
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    out = torch.empty(num_experts, rows, 2 * half, dtype=dtype, device=codes.device)
    for expert in range(num_experts):
        byte = codes[expert].long()
        pairs = torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1).view(rows, -1, VALUES_PER_SCALE)
        out[expert] = (pairs * scale_factors(scales[expert])[..., None]).view(rows, -1).to(dtype)
    return out


def kernel_layout(codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stored experts -> the kernels' tensors (module docstring): ``codes`` uint8 (E, N, K_pad/2),
    byte j holding columns j and K_pad/2 + j; ``scales`` uint8 (E, K_pad/32, N), padding groups 127.
    One expert at a time, so the only temporaries are one expert's codes."""
    check_stored(codes, scales)
    num_experts, rows, half = codes.shape
    if bool((scales > MAX_KERNEL_EXPONENT).any()):
        raise ValueError(f"MXFP4 scales up to {int(scales.max())}: the kernels take exponents up to "
                         f"{MAX_KERNEL_EXPONENT} (weights below 2^113); widen such experts instead")
    half_pad = -(-2 * half // K_ALIGN) * K_ALIGN // 2
    halves = torch.zeros(num_experts, rows, half_pad, dtype=torch.uint8, device=codes.device)
    for expert in range(num_experts):
        unpacked = torch.zeros(rows, 2 * half_pad, dtype=torch.uint8, device=codes.device)
        unpacked[:, 0:2 * half:2] = codes[expert] & 0xF
        unpacked[:, 1:2 * half:2] = codes[expert] >> 4
        halves[expert] = unpacked[:, :half_pad] | (unpacked[:, half_pad:] << 4)
    padded = torch.full((num_experts, rows, 2 * half_pad // VALUES_PER_SCALE), 127, dtype=torch.uint8,
                        device=codes.device)
    padded[:, :, :scales.shape[2]] = scales
    return {"codes": halves, "scales": padded.transpose(1, 2).contiguous()}


def prepare_mxfp4_experts(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *,
                          for_kernel: bool | None = None) -> MXFP4Experts:
    """Stored experts of one projection (module docstring) -> MXFP4Experts for activations of
    ``dtype``: the kernels' layout (``for_kernel``; default: on CUDA) or the widened experts."""
    check_stored(codes, scales)
    num_experts, rows, half = codes.shape
    shape = dict(num_experts=num_experts, out_features=rows, in_features=2 * half, dtype=dtype)
    if use_triton(codes) if for_kernel is None else for_kernel:
        return MXFP4Experts(**shape, kernel=kernel_layout(codes, scales))
    return MXFP4Experts(**shape, dense=dequantize_mxfp4_experts(codes, scales, dtype))


def fused_moe_mxfp4_ref(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor],
                        down: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """The routed experts' output (T, H) with stored experts (codes, scales): the experts widened
    exactly to x's dtype, then kernels/fused_moe.py's reference (the dequantized model's MLP)."""
    widened = [dequantize_mxfp4_experts(*stored, x.dtype) for stored in (gate_up, down)]
    return fused_moe_ref(x, *widened, topk_weights, topk_ids, epilogue)


# ---- widening a tile in registers ------------------------------------------------------------

@jit
def _widen(bits, factor, dtype: tl.constexpr):
    """float16 bits of codes (value * 2^-14) times factor (2^(s - 113)) -> the weights in ``dtype``."""
    return (bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * factor).to(dtype)


@jit
def _tile_factors(scale_base, first_group, rows, row_ok, num_rows, num_groups, BLOCK_K: tl.constexpr):
    """Each row's factor over a tile of BLOCK_K (32 or 64) columns from group ``first_group``:
    (BLOCK_N, 1), or (BLOCK_N, 64) for two groups (the first 32 columns one, the rest the other;
    past the row's num_groups groups, an unread factor)."""
    f0 = exponent_factor(tl.load(scale_base + first_group * num_rows + rows, mask=row_ok, other=0))[:, None]
    if BLOCK_K == 64:
        second = first_group + 1
        f1 = exponent_factor(tl.load(scale_base + second * num_rows + rows, mask=row_ok & (rows * 0 + second < num_groups),
                                      other=0))
        return tl.where((tl.arange(0, BLOCK_K) < 32)[None, :], f0, f1[:, None])
    else:
        return f0


@jit
def _mxfp4_dot(acc, a_lo, a_hi, w_rows, scale_base, rows, row_ok, k0, k, half_k, num_rows,
               SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus the product of the activations and the tile of weight rows ``rows`` (w_rows: their
    starts) at bytes k: the low nibbles are columns k (with a_lo), the high ones half_k + k (a_hi)."""
    packed = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < half_k)[None, :], other=0).to(tl.uint16)
    f_lo = _tile_factors(scale_base, k0 // 32, rows, row_ok, num_rows, half_k // 16, BLOCK_K)
    f_hi = _tile_factors(scale_base, (half_k + k0) // 32, rows, row_ok, num_rows, half_k // 16, BLOCK_K)
    acc = tile_dot(acc, _widen(low_codes(packed), f_lo, a_lo.dtype), a_lo, SWAP_AB, DOT_PRECISION)
    acc = tile_dot(acc, _widen(high_codes(packed), f_hi, a_lo.dtype), a_hi, SWAP_AB, DOT_PRECISION)
    return acc


@jit
def _mxfp4_grouped_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_ids_ptr,
    topk_weights_ptr, logits_ptr, bias_ptr, num_experts, N, K, half_k, num_assignments,
    stride_am, stride_we, stride_wn, stride_se, stride_om, stride_be,
    TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr,
    K_PAD: tl.constexpr, E_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """kernels/fused_moe._grouped_gemm_kernel (blocks, routing, epilogue: the same flags) with the
    expert's weight in the kernel layout (module docstring): BLOCK_K bytes a row per step (2 BLOCK_K
    columns), each tile widened in registers. K: the activations' columns; half_k: K_pad / 2.
    SWAP_AB: the transposed product, out.T = w . a.T, accumulated (BLOCK_N, BLOCK_M): the widened
    tile is the dot's first operand, which Hopper's tensor cores (wgmma) take from registers."""
    if past_padded_blocks(num_padded_ptr, ONE_PER_BLOCK, BLOCK_M):
        return
    ids, row_ok, expert, a_rows, cols, col_ok, num_rows, w_base = expert_block_tile(
        w_ptr, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N,
        num_assignments, stride_we, stride_wn, TOP_K, ROWS_PER_TOKEN, GATED, ONE_PER_BLOCK, ROUTE_IN_KERNEL,
        RENORMALIZE, K_PAD, E_PAD, BLOCK_M, BLOCK_N)
    scale_base = scale_ptr + expert * stride_se
    a_base, acc, acc_up = activation_tiles(a_ptr, a_rows, stride_am, SWAP_AB, BLOCK_M, BLOCK_N)
    for k0 in range(0, half_k, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if SWAP_AB:
            a_lo = tl.load(a_base + k[:, None], mask=(k < K)[:, None] & row_ok[None, :], other=0.0)
            a_hi = tl.load(a_base + half_k + k[:, None], mask=(half_k + k < K)[:, None] & row_ok[None, :], other=0.0)
        else:
            a_lo = tl.load(a_base + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            a_hi = tl.load(a_base + half_k + k[None, :], mask=row_ok[:, None] & (half_k + k < K)[None, :], other=0.0)
        acc = _mxfp4_dot(acc, a_lo, a_hi, w_base, scale_base, cols, col_ok, k0, k, half_k, num_rows, SWAP_AB,
                         DOT_PRECISION, BLOCK_K)
        if GATED:
            acc_up = _mxfp4_dot(acc_up, a_lo, a_hi, w_base + N * stride_wn, scale_base, cols + N, col_ok, k0, k,
                                half_k, num_rows, SWAP_AB, DOT_PRECISION, BLOCK_K)
    if SWAP_AB:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, bias_ptr, expert,
               stride_be, N, GATED, MUL_WEIGHT, HAS_BIAS, ACTIVATION, SWIGLU_LIMIT)


def mxfp4_gemm_config(block_m: int) -> dict:
    """The grouped GEMM's tiles by block_m: BLOCK_K in bytes a row (2 BLOCK_K columns a step);
    SWAP_AB (the widened tile from registers) for prefill blocks, as kernels/fused_moe_wna16.py.
    From benchmarks/quantization/moe_mxfp4_bench.py --sweep on an H200 (gpt-oss-20b's experts, 2026-11-26): blocks
    of 16, (64, 32) tiles: 8 tokens 280 us against 298-328 with the others, 64 tokens 405 against
    450-478; blocks of 32 and 64 swapped (64, 32): 512 tokens 965 us against 1,101-1,670, 2,048
    tokens 2,162 against 2,808-3,548 (one scale group a step: two groups' select costs more than the
    longer loop saves)."""
    if block_m <= 16:
        return {"BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": False, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": True, "num_warps": 4, "num_stages": 4}


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(bias, its row stride) as the kernels read it (expert * stride + column), or the unread fallback."""
    if bias is None:
        return fallback, 0
    bias, = dense(bias)
    return bias, bias.stride(0)


def _mxfp4_grouped_gemm(a, experts: MXFP4Experts, out, blocks, topk_ids, topk_weights, *, n: int, top_k: int,
                        rows_per_token: bool, gated: bool, mul_weight: bool, block_m: int, config: dict,
                        router_logits: torch.Tensor | None = None, renormalize: bool = False,
                        bias: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU) -> None:
    """kernels/fused_moe._grouped_gemm over MXFP4 experts (same arguments)."""
    cfg = {"SWAP_AB": False, **config}
    block_n = cfg.pop("BLOCK_N")
    assert cfg["BLOCK_K"] in (32, 64) and a.shape[1] == experts.in_features and a.stride(1) == 1
    codes, scales = experts.kernel["codes"], experts.kernel["scales"]
    launch = expert_block_launch(blocks, topk_ids, topk_weights, n=n, num_experts=experts.num_experts, top_k=top_k,
                                 rows_per_token=rows_per_token, gated=gated, mul_weight=mul_weight, block_m=block_m,
                                 block_n=block_n, router_logits=router_logits, renormalize=renormalize)
    bias, stride_be = _bias_args(bias, topk_weights)
    _mxfp4_grouped_gemm_kernel[launch.grid](
        a, codes, scales, out, *launch.pointers, bias, experts.num_experts,
        n, experts.in_features, experts.half_k, out.shape[0],
        a.stride(0), codes.stride(0), codes.stride(1), scales.stride(0), out.stride(0), stride_be,
        HAS_BIAS=bias is not topk_weights, ACTIVATION=ACTIVATIONS[epilogue.activation],
        SWIGLU_LIMIT=float(epilogue.swiglu_limit or 0.0), DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **launch.constexprs, **cfg,
    )


# ---- few assignments: the FMA kernel ---------------------------------------------------------

@jit
def _field_bits(words, I: tl.constexpr):
    """Field I (bits 4I..4I+3, an E2M1 code) of int32 ``words`` as float16 bits (value * 2^-14):
    the sign bit moved to bit 15, exponent and mantissa to bits 11-9."""
    if 4 * I + 3 <= 15:
        sign = (words << (12 - 4 * I)) & 0x8000
    else:
        sign = (words >> (4 * I - 12)) & 0x8000
    if 4 * I <= 9:
        magnitude = (words << (9 - 4 * I)) & 0x0E00
    else:
        magnitude = (words >> (4 * I - 9)) & 0x0E00
    return (sign | magnitude).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _fma_partial(w_rows, scale_base, a_row, rows, row_ok, wk, wk_ok, groups, half_k, num_rows, K):
    """(BLOCK_N, G, 8) products of weight rows ``rows`` (w_rows: their starts, in int32 words) at
    words wk (G, 8): each group's 8 words are 32 bytes, one scale group of the low nibbles
    (columns 4w + b) and one of the high nibbles (half_k + 4w + b); ``groups`` (G,) the low one's."""
    ok = row_ok[:, None, None] & wk_ok[None, :, :]
    words = tl.load(w_rows[:, :, None] + wk[None, :, :], mask=ok, other=0)
    f_ok = row_ok[:, None] & (groups < half_k // 32)[None, :]
    f_lo = exponent_factor(tl.load(scale_base + groups[None, :] * num_rows + rows[:, None], mask=f_ok, other=0))
    f_hi = exponent_factor(tl.load(scale_base + (half_k // 32 + groups)[None, :] * num_rows + rows[:, None],
                                    mask=f_ok, other=0))
    part_lo = tl.zeros(words.shape, dtype=tl.float32)
    part_hi = tl.zeros(words.shape, dtype=tl.float32)
    for b in tl.static_range(4):  # byte b of each word: field 2b the low nibble, 2b + 1 the high one
        col = 4 * wk + b
        x_lo = tl.load(a_row + col, mask=wk_ok & (col < K), other=0.0).to(tl.float32)[None, :, :]
        x_hi = tl.load(a_row + half_k + col, mask=wk_ok & (half_k + col < K), other=0.0).to(tl.float32)[None, :, :]
        part_lo += _field_bits(words, 2 * b) * x_lo
        part_hi += _field_bits(words, 2 * b + 1) * x_hi
    return part_lo * f_lo[:, :, None] + part_hi * f_hi[:, :, None]


@jit
def _mxfp4_fma_kernel(
    a_ptr, w_ptr, scale_ptr, out_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, bias_ptr, num_experts, N, K,
    half_k, stride_am, stride_we, stride_wn, stride_se, stride_om, stride_be,
    TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr,
    K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):
    """Program (assignment slot, column tile): out[slot, cols] = a_row . w[expert, cols, :] on the
    FMA units, with _mxfp4_grouped_gemm_kernel's ONE_PER_BLOCK blocks, routing and epilogue
    (gate_up: row slot // TOP_K of x; down: act's row slot). The weight is read as int32 words
    (stride_we, stride_wn in words), GROUPS groups of 8 words a step; each code is widened exactly
    (value * 2^-14, _field_bits) and its scale applied once a group and row."""
    slot = tl.program_id(0)
    _, _, expert = block_rows(slot, topk_ids_ptr, topk_ids_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr,
                              num_experts, 1, TOP_K, True, ROUTE_IN_KERNEL, RENORMALIZE, K_PAD, E_PAD, 16)
    a_row = a_ptr + (slot // TOP_K if GATED else slot).to(tl.int64) * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    num_rows = 2 * N if GATED else N
    w_base = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    scale_base = scale_ptr + expert * stride_se
    half_words = half_k // 4
    acc = tl.zeros([BLOCK_N, GROUPS, 8], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, GROUPS, 8], dtype=tl.float32)
    for w0 in range(0, half_words, 8 * GROUPS):
        groups = w0 // 8 + tl.arange(0, GROUPS)
        wk = groups[:, None] * 8 + tl.arange(0, 8)[None, :]
        wk_ok = wk < half_words
        acc += _fma_partial(w_base, scale_base, a_row, cols, col_ok, wk, wk_ok, groups, half_k, num_rows, K)
        if GATED:
            acc_up += _fma_partial(w_base + N * stride_wn, scale_base, a_row, cols + N, col_ok, wk, wk_ok, groups,
                                   half_k, num_rows, K)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    out_up = tl.sum(tl.sum(acc_up, axis=2), axis=1)[None, :]
    ids = tl.zeros([1], dtype=tl.int32) + slot
    store_rows(out, out_up, out_ptr, ids, ids == slot, cols, col_ok, topk_weights_ptr, stride_om, bias_ptr, expert,
               stride_be, N, GATED, MUL_WEIGHT, HAS_BIAS, ACTIVATION, SWIGLU_LIMIT)


# FMA kernel tiles (BLOCK_N rows, groups a step, warps) of gate_up and down: the fastest of a sweep on
# an H200 (benchmarks/quantization/moe_mxfp4_bench.py --sweep, gpt-oss-20b's experts, one token: 70.5 us, others
# 76.8-97.9, the grouped GEMM 86.3-118.3).
FMA_TILES = {"gate_up": (16, 2, 2), "down": (16, 2, 2)}
# Up to this many assignments (T * K) every assignment is a program of the FMA kernel, reading its
# expert's weight on its own, instead of the grouped GEMM: one token of top-4. (8 tokens, 32
# assignments, on the same H200: the FMA kernel 392-512 us, the grouped GEMM 280.)
FMA_MAX_ASSIGNMENTS = 4
# From this many rows an expert on average, widen the experts into a scratch buffer and run the
# model-dtype grouped GEMMs (module docstring); None: never. The same H200: at 64 rows an expert
# (512 tokens) widening costs 1,428 us against the grouped GEMM's 965; at 256 (2,048 tokens) 1,946
# against 2,162; at 1,024 (8,192 tokens) 3,705 against 8,735.
DEQUANTIZE_MIN_ROWS_PER_EXPERT: int | None = 128


def _mxfp4_fma(a, experts: MXFP4Experts, out, topk_ids, topk_weights, *, n: int, top_k: int, gated: bool,
               mul_weight: bool, tiles: tuple, slots: int, router_logits=None, renormalize: bool = False,
               bias: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU) -> None:
    block_n, groups, warps = tiles
    words = experts.kernel["codes"].view(torch.int32)
    scales = experts.kernel["scales"]
    assert a.is_contiguous() and a.shape[1] == experts.in_features
    topk_ids, topk_weights, router_logits = routing_tensors(topk_ids, topk_weights, router_logits)
    bias, stride_be = _bias_args(bias, topk_weights)
    _mxfp4_fma_kernel[(slots, triton.cdiv(n, block_n))](
        a, words, scales, out, topk_ids, topk_weights, router_logits if router_logits is not None else topk_weights,
        bias, experts.num_experts, n, experts.in_features, experts.half_k, a.stride(0), words.stride(0),
        words.stride(1), scales.stride(0), out.stride(0), stride_be,
        TOP_K=top_k, GATED=gated, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not topk_weights,
        ACTIVATION=ACTIVATIONS[epilogue.activation], SWIGLU_LIMIT=float(epilogue.swiglu_limit or 0.0),
        ROUTE_IN_KERNEL=router_logits is not None, RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(experts.num_experts), BLOCK_N=block_n, GROUPS=groups, num_warps=warps)


def _pair(x, gate_up: MXFP4Experts, down: MXFP4Experts, assignments: int, ids, weights, *, top_k: int,
          epilogue: ExpertEpilogue, fma_tiles: dict | None, blocks=None, block_m: int = 16,
          config: dict | None = None, router_logits=None, renormalize: bool = False) -> torch.Tensor:
    """The two products of ``assignments`` routed rows (T * K, H): gate_up with its activation,
    then down scaled by the routing weights; the FMA kernel where ``fma_tiles`` is given, else the
    grouped GEMM over ``blocks`` (None: one block per assignment)."""
    inter, hidden = gate_up.out_features // 2, down.out_features
    act = torch.empty(assignments, inter, dtype=x.dtype, device=x.device)
    out_k = torch.empty(assignments, hidden, dtype=x.dtype, device=x.device)
    common = dict(top_k=top_k, epilogue=epilogue)
    if fma_tiles is not None:
        _mxfp4_fma(x.contiguous(), gate_up, act, ids, weights, n=inter, gated=True, mul_weight=False,
                   tiles=fma_tiles["gate_up"], slots=assignments, router_logits=router_logits,
                   renormalize=renormalize, bias=epilogue.gate_up_bias, **common)
        _mxfp4_fma(act, down, out_k, ids, weights, n=hidden, gated=False, mul_weight=True, tiles=fma_tiles["down"],
                   slots=assignments, bias=epilogue.down_bias, **common)
        return out_k
    config = config or mxfp4_gemm_config(block_m)
    _mxfp4_grouped_gemm(x, gate_up, act, blocks, ids, weights, n=inter, rows_per_token=True, gated=True,
                        mul_weight=False, block_m=block_m, config=config, router_logits=router_logits,
                        renormalize=renormalize, bias=epilogue.gate_up_bias, **common)
    _mxfp4_grouped_gemm(act, down, out_k, blocks, ids, weights, n=hidden, rows_per_token=False, gated=False,
                        mul_weight=True, block_m=block_m, config=config, bias=epilogue.down_bias, **common)
    return out_k


def moe_single_token_mxfp4_triton(x: torch.Tensor, router_logits: torch.Tensor, gate_up: MXFP4Experts,
                                  down: MXFP4Experts, top_k: int, renormalize: bool, *, config: dict | None = None,
                                  epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """kernels/fused_moe.moe_single_token_triton with MXFP4 experts: routing inside the gate_up
    launch, then down, then the sum over the K experts; only the K chosen experts' bytes are read.
    config: {"fma": tiles or None (the grouped GEMM), "gemm": the grouped GEMM's options}."""
    assert x.shape[0] == 1 and router_logits.is_contiguous()
    config = config or {}
    ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    out_k = _pair(x, gate_up, down, top_k, ids, weights, top_k=top_k, epilogue=epilogue,
                  fma_tiles=config.get("fma", FMA_TILES), config=config.get("gemm"), router_logits=router_logits,
                  renormalize=renormalize)
    return out_k.sum(dim=0, keepdim=True)


@jit
def _dequantize_kernel(w_ptr, scale_ptr, out_ptr, num_rows, K, half_k, stride_we, stride_wn, stride_se,
                       stride_oe, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (expert, row tile, byte tile): BLOCK_K bytes of BLOCK_N rows -> their columns k and half_k + k."""
    expert = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    k0 = tl.program_id(2) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    packed = tl.load(w_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn + k[None, :],
                     mask=row_ok[:, None] & (k < half_k)[None, :], other=0).to(tl.uint16)
    scale_base = scale_ptr + expert * stride_se
    f_lo = _tile_factors(scale_base, k0 // 32, rows, row_ok, num_rows, half_k // 16, BLOCK_K)
    f_hi = _tile_factors(scale_base, (half_k + k0) // 32, rows, row_ok, num_rows, half_k // 16, BLOCK_K)
    out_rows = out_ptr + expert * stride_oe + rows.to(tl.int64)[:, None] * stride_on
    dtype = out_ptr.dtype.element_ty
    in_half = row_ok[:, None] & (k < half_k)[None, :]
    tl.store(out_rows + k[None, :], _widen(low_codes(packed), f_lo, dtype), mask=in_half & (k < K)[None, :])
    tl.store(out_rows + half_k + k[None, :], _widen(high_codes(packed), f_hi, dtype),
             mask=in_half & (half_k + k < K)[None, :])


# (BLOCK_N rows, BLOCK_K bytes: 32 or 64, warps) of _dequantize_kernel. On an H200 (benchmarks/
# moe_mxfp4_bench.py --widen_sweep, both projections of gpt-oss-20b's experts, 1.6 GB written) every
# tiling of 64 bytes took 1,009-1,019 us and every one of 32 bytes 1,256-1,273.
WIDEN_TILES = (32, 64, 4)


def dequantize_mxfp4_triton(experts: MXFP4Experts, dtype: torch.dtype, tiles: tuple = WIDEN_TILES) -> torch.Tensor:
    """The experts widened to (E, N, K) in ``dtype`` from the kernel layout (as dequantize_mxfp4_experts
    widens the stored ones): one pass, a scratch buffer for the model-dtype GEMMs."""
    codes, scales = experts.kernel["codes"], experts.kernel["scales"]
    num_experts, rows, half = codes.shape
    out = torch.empty(num_experts, rows, experts.in_features, dtype=dtype, device=codes.device)
    block_n, block_k, warps = tiles
    _dequantize_kernel[(num_experts, triton.cdiv(rows, block_n), triton.cdiv(half, block_k))](
        codes, scales, out, rows, experts.in_features, half, codes.stride(0), codes.stride(1), scales.stride(0),
        out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def fused_moe_mxfp4_triton(x: torch.Tensor, gate_up: MXFP4Experts, down: MXFP4Experts, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, *, block_m: int | None = None, config: dict | None = None,
                           epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """kernels/fused_moe.fused_moe_triton with MXFP4 experts (routing given). config: {"fma": tiles
    or None, "fma_max_assignments", "gemm": the grouped GEMM's options, "dequantize_min_rows": rows
    an expert or None}; each left out: this file's defaults."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    assert down.out_features == hidden and down.in_features == gate_up.out_features // 2
    assert topk_weights.shape == topk_ids.shape
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    config = config or {}
    dequantize_rows = config.get("dequantize_min_rows", DEQUANTIZE_MIN_ROWS_PER_EXPERT)
    if dequantize_rows is not None and num_assignments >= dequantize_rows * gate_up.num_experts:
        return fused_moe(x, dequantize_mxfp4_triton(gate_up, x.dtype), dequantize_mxfp4_triton(down, x.dtype),
                         topk_weights, topk_ids, gate_up_bias=epilogue.gate_up_bias, down_bias=epilogue.down_bias,
                         activation=epilogue.activation, swiglu_limit=epilogue.swiglu_limit)
    flat_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    fma_tiles = config.get("fma", FMA_TILES)
    if fma_tiles is not None and block_m is None and num_assignments <= config.get("fma_max_assignments",
                                                                                   FMA_MAX_ASSIGNMENTS):
        out_k = _pair(x, gate_up, down, num_assignments, flat_ids, weights, top_k=top_k, epilogue=epilogue,
                      fma_tiles=fma_tiles)
    else:
        block_m = block_m or choose_block_m(num_assignments, gate_up.num_experts)
        blocks = None if num_tokens == 1 else moe_align(topk_ids, gate_up.num_experts, block_m)
        out_k = _pair(x, gate_up, down, num_assignments, flat_ids, weights, top_k=top_k, epilogue=epilogue,
                      fma_tiles=None, blocks=blocks, block_m=block_m, config=config.get("gemm"))
    return out_k.view(num_tokens, top_k, hidden).sum(dim=1)


def mxfp4_warm_up_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """kernels.fused_moe.warm_up_token_counts and the first count that widens the experts
    (DEQUANTIZE_MIN_ROWS_PER_EXPERT), up to ``max_tokens``."""
    counts = set(warm_up_token_counts(num_experts, top_k, max_tokens))
    if DEQUANTIZE_MIN_ROWS_PER_EXPERT is not None:
        counts.add(-(-DEQUANTIZE_MIN_ROWS_PER_EXPERT * num_experts // top_k))
    return sorted(count for count in counts if count <= max_tokens)


# ---- public entry ------------------------------------------------------------------------------

def moe_forward_mxfp4(x: torch.Tensor, router_logits: torch.Tensor, gate_up: MXFP4Experts, down: MXFP4Experts,
                      top_k: int, renormalize: bool, *, gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None, activation: str = "silu",
                      swiglu_limit: float | None = None) -> torch.Tensor:
    """kernels.fused_moe.moe_forward with MXFP4 experts: x (T, H) -> (T, H) in x's dtype; biases and
    activation as there. The Triton kernels where the experts are in the kernel layout (CUDA), else
    the widened experts through kernels/fused_moe.py (on CPU its reference). At the token counts the load-time
    choice marked on the codes (kernels/moe_gemv_choice.py), kernels/moe_gemv.py's two GEMV launches, or
    kernels/mxfp4_gemv.py's word path where the mark is its (mxfp4_gemv.word_mark)."""
    if not (use_triton(x) and gate_up.kernel):
        return moe_forward(x, router_logits, gate_up.dense, down.dense, top_k, renormalize, gate_up_bias=gate_up_bias,
                           down_bias=down_bias, activation=activation, swiglu_limit=swiglu_limit)
    epilogue = ExpertEpilogue(gate_up_bias, down_bias, activation, swiglu_limit)
    if (tiles := gemv_tiles(gate_up.kernel["codes"], x.shape[0])) is not None and is_word_mark(tiles):
        return mxfp4_words_triton(x, gate_up.kernel["codes"], down.kernel["codes"], gate_up.kernel["scales"],
                                  down.kernel["scales"], top_k=top_k, epilogue=epilogue, router_logits=router_logits,
                                  renormalize=renormalize, tiles=tuple(tiles[1:]))
    if tiles is not None:  # chosen at load
        return moe_gemv_triton(x, gate_up.kernel["codes"], down.kernel["codes"], top_k=top_k,
                               router_logits=router_logits, renormalize=renormalize, tiles=tiles,
                               gate_up_scale=gate_up.kernel["scales"], down_scale=down.kernel["scales"],
                               epilogue=epilogue)
    if x.shape[0] == 1:
        return moe_single_token_mxfp4_triton(x, router_logits, gate_up, down, top_k, renormalize, epilogue=epilogue)
    topk_weights, topk_ids = route_tokens(router_logits, top_k, renormalize)
    return fused_moe_mxfp4_triton(x, gate_up, down, topk_weights, topk_ids, epilogue=epilogue)
