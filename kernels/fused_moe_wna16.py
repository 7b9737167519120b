"""Mixture-of-experts MLPs with weight-only integer experts (W4A16, W8A16): the stacked experts of
one projection in the layout the grouped kernels read, and the fused-MoE entry that takes them.

Storage per projection (the engine directory's tensors; the scheme of kernels/wna16.py applied to
each expert): ``weight`` uint8 (E, N, stored K) — 4-bit codes two a byte along K (column 2j low
nibble), 8-bit one a byte; ``scale`` (E, N, K // G) float32; ``zero`` (E, N, K // G) uint8, with
expert e's weight[n, k] ~= (code - zero[e, n, k // G]) * scale[e, n, k // G].

gate_up is (E, 2I, H) with rows [gate_e | up_e], down (E, H, I), as for model-dtype experts
(kernels/fused_moe.py). On CPU the reference dequantizes the experts once (``dense``) and runs
kernels/fused_moe.py's reference on them: the dequantized model's MLP.

On CUDA no dequantized copy is kept: ``kernel_layout`` reorders the stored tensors once at load,
and the grouped GEMMs of kernels/fused_moe.py (same routing, same blocks of assignments sorted by
expert, same epilogues) dequantize each weight tile in registers before its tensor-core dot:

- 4 bits: byte j of a row holds columns j (low nibble) and K/2 + j (high nibble), the row's two
  halves rather than neighbours, so a (BLOCK_N, BLOCK_K) tile of bytes is two tiles of contiguous
  columns, k0 + [0, BLOCK_K) and K/2 + k0 + [0, BLOCK_K), each met by its own slice of the
  activations: no interleaving in registers. 8 bits: as stored.
- scale and zero transposed to (E, K // G, N), so one group's values over a tile's BLOCK_N rows
  are contiguous. A tile's BLOCK_K is chosen so it lies within one group (``tile_k``): one scale
  and zero per row of the tile; odd group sizes fall back to a per-element lookup.
- a tile is (code - zero) * scale in float32 rounded once to the activations' dtype, as
  kernels/wna16.dequantize rounds: the kernel multiplies exactly the reference's weights, and the
  two differ only in the order of accumulation.
- prefill blocks (32 or 64 rows) compute the transposed product, out.T = w . a.T, so the
  dequantized tile is the tensor cores' register operand (SWAP_AB, wna16_gemm_config).

A single token (batch-1 decode) routes inside the gate_up launch and reads only its K experts'
bytes, as moe_single_token_triton does. No host synchronisation anywhere (grids from T, K, E
only), so the whole routed MLP is captured in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels._triton import jit, tl, triton, use_triton
from kernels.fused_moe import choose_block_m, gemm_config, moe_align, moe_forward, route_tokens
from kernels.moe_decode import (DECODE_TILES, MAX_TOKENS, W_INT4, fused_decode_enabled, int4_tiles_fit,
                                moe_decode_triton)
from kernels.moe_gemv import gemv_tiles, moe_gemv_triton
from kernels.moe_blocks import (activation_tiles, block_rows, expert_block_launch, expert_block_tile,
                                 past_padded_blocks, routing_tensors, store_rows, tile_dot)
from kernels.wna16 import dequantize, unpack_codes, unpack_int4


@dataclass
class WNA16Experts:
    """One projection's quantized experts, prepared at load (``prepare_wna16_experts``).

    ``dense``: the dequantized experts (E, N, K) in the activations' dtype (reference path).
    ``kernel``: the CUDA kernels' layout, by name (``kernel_layout``); empty where the reference path runs."""

    num_experts: int
    out_features: int
    in_features: int
    bits: int
    group_size: int
    dtype: torch.dtype
    dense: torch.Tensor | None = None
    kernel: dict[str, torch.Tensor] = field(default_factory=dict)


def kernel_layout(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Stored experts -> the grouped kernels' tensors (module docstring): ``weight`` uint8 (E, N, stored K),
    4-bit bytes holding a row's halves; ``scale`` float32 and ``zero`` uint8 (E, K // G, N).
    Repacked one expert at a time, so the only temporary is one expert's codes."""
    if bits == 4:
        halves = torch.empty_like(weight)
        for expert in range(weight.shape[0]):
            codes = unpack_int4(weight[expert])
            half = codes.shape[-1] // 2
            halves[expert] = codes[:, :half] | (codes[:, half:] << 4)
        weight = halves
    return {"weight": weight.contiguous(), "scale": scale.float().transpose(1, 2).contiguous(),
            "zero": zero.to(torch.uint8).transpose(1, 2).contiguous()}


def prepare_wna16_experts(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          dtype: torch.dtype, *, for_kernel: bool | None = None) -> WNA16Experts:
    """Stored experts of one projection (module docstring) -> WNA16Experts for activations of ``dtype``:
    the kernels' layout (``for_kernel``; default: on CUDA) or the dequantized experts."""
    experts, n, groups = scale.shape
    k = unpack_codes(weight[:1, :1], bits).shape[-1]
    shape = dict(num_experts=experts, out_features=n, in_features=k, bits=bits, group_size=k // groups, dtype=dtype)
    if use_triton(weight) if for_kernel is None else for_kernel:
        return WNA16Experts(**shape, kernel=kernel_layout(weight, scale, zero, bits))
    return WNA16Experts(**shape, dense=dequantize(weight, scale, zero, bits, dtype))


# ---- grouped GEMM over quantized experts ---------------------------------------------------------

def tile_k(block_k: int, bits: int, in_features: int, group_size: int) -> tuple[int, bool]:
    """(BLOCK_K, one group per tile): the largest power of two <= ``block_k``, at least 16 (a dot's
    depth), whose tiles each lie within one scale group: it divides the group size and, for 4 bits,
    K/2 (where the high nibbles' columns start). Per-channel (one group a row) keeps ``block_k``.
    Where none does (group sizes not a multiple of 16), ``block_k`` with a per-element lookup."""
    if group_size == in_features:
        return block_k, True
    size = block_k
    while size >= 16:
        if group_size % size == 0 and (bits == 8 or (in_features // 2) % size == 0):
            return size, True
        size //= 2
    return block_k, False


def wna16_gemm_config(block_m: int, bits: int) -> dict:
    """kernels/fused_moe.gemm_config with BLOCK_K counted in stored bytes a row (4 bits: two codes
    a byte), so a step covers as many columns as the model-dtype kernel's; SWAP_AB (the kernel's)
    for blocks of 32 and 64 rows; FACTORED off: on an H200 (Qwen3-30B-A3B int4 g128) the factored
    inner product (_factored_dot) was slower at every size and tiling tried (8 tokens 174-250 us
    against 145 us dequantizing, 512 tokens 1375-1546 against 1344, 4096 tokens 14.0-15.3 ms
    against 13.6): its per-tile correction costs more than it saves on tiles this thin. Measured on an H200 with Qwen3-30B-A3B's experts (int4, g128):
    swapped, 4096 tokens took 13.0 ms instead of 16.3 and 512 tokens 1.32 ms instead of 1.38;
    decode blocks of 16 were faster unswapped (one token 43 us instead of 48-61)."""
    config = gemm_config(block_m)
    block_k = config["BLOCK_K"] // 2 if bits == 4 else config["BLOCK_K"]
    return {**config, "BLOCK_K": block_k, "SWAP_AB": block_m > 16, "FACTORED": False}


def factored_magic(dtype: torch.dtype, bits: int) -> int:
    """The 16-bit pattern whose mantissa takes a code exactly (_codes_as): bfloat16 128 (7 bits of
    mantissa: 4-bit codes), float16 1024 (10 bits: 4- and 8-bit codes); 0: the code through float32."""
    if dtype == torch.bfloat16 and bits == 4:
        return 0x4300
    return 0x6400 if dtype == torch.float16 else 0


@jit
def _dequantize(codes, scale_ptr, zero_ptr, rows, row_ok, first_col, cols, col_ok, num_rows, group_size,
                ONE_GROUP: tl.constexpr):
    """codes (BLOCK_N, BLOCK_K) of weight rows ``rows``, columns ``cols`` (first_col = cols[0]) ->
    (code - zero) * scale in float32. scale_ptr / zero_ptr: the expert's (groups, num_rows).
    ONE_GROUP: the tile lies within first_col's group: one scale and zero a row."""
    if ONE_GROUP:
        at = (first_col // group_size) * num_rows + rows
        scale = tl.load(scale_ptr + at, mask=row_ok, other=0.0)[:, None]
        zero = tl.load(zero_ptr + at, mask=row_ok, other=0)[:, None]
    else:
        at = (cols // group_size)[None, :] * num_rows + rows[:, None]
        ok = row_ok[:, None] & col_ok[None, :]
        scale = tl.load(scale_ptr + at, mask=ok, other=0.0)
        zero = tl.load(zero_ptr + at, mask=ok, other=0)
    return (codes.to(tl.float32) - zero.to(tl.float32)) * scale


@jit
def _codes_as(codes, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """Integer codes -> ``dtype`` exactly: OFF + code by OR-ing the code into the mantissa of OFF
    (MAGIC 0x4300: bfloat16 128, 4-bit codes; 0x6400: float16 1024, 4- or 8-bit codes), else the
    code itself through float32 (MAGIC 0: float32 activations, or 8 bits with bfloat16)."""
    if MAGIC != 0:
        return (codes.to(tl.int16) | MAGIC).to(dtype, bitcast=True)
    else:
        return codes.to(tl.float32).to(dtype)


@jit
def _factored_dot(acc, codes, a, a_sum, scale_ptr, zero_ptr, rows, row_ok, first_col, num_rows, group_size,
                  MAGIC: tl.constexpr, OFF: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + the product of a and the tile of codes (one group a row: the tile lies within
    first_col's group), scale and zero factored out of the dot:
    sum_k (q - z) s x_k = s * (sum_k (OFF + q) x_k - (OFF + z) * sum_k x_k), the dot over the exact
    16-bit OFF + q, the correction in float32 once per tile and row. a_sum: a's sums over the tile."""
    at = (first_col // group_size) * num_rows + rows
    scale = tl.load(scale_ptr + at, mask=row_ok, other=0.0)
    zoff = tl.load(zero_ptr + at, mask=row_ok, other=0).to(tl.float32) + OFF
    w = _codes_as(codes, MAGIC, a.dtype)
    if SWAP_AB:
        part = tl.dot(w, a, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        acc += scale[:, None] * (part - zoff[:, None] * a_sum[None, :])
    else:
        part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        acc += scale[None, :] * (part - a_sum[:, None] * zoff[None, :])
    return acc


@jit
def _quantized_dot(acc, a, a_high, a_sum, a_high_sum, w_ptrs, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok,
                   stored_k, num_rows, group_size, BITS: tl.constexpr, ONE_GROUP: tl.constexpr,
                   FACTORED: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, SWAP_AB: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """acc plus the product of a and the tile of weight rows ``rows``, stored columns k (w_ptrs:
    those rows' starts). 4 bits: the low nibbles are columns k (with a), the high ones columns
    stored_k + k (with a_high). FACTORED (needs ONE_GROUP): _factored_dot; else each weight
    dequantized in float32 and rounded to a's dtype before the dot."""
    packed = tl.load(w_ptrs + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
    if FACTORED:
        if BITS == 4:
            acc = _factored_dot(acc, packed & 0xF, a, a_sum, scale_ptr, zero_ptr, rows, row_ok, k0, num_rows,
                                group_size, MAGIC, OFF, SWAP_AB, DOT_PRECISION)
            acc = _factored_dot(acc, packed >> 4, a_high, a_high_sum, scale_ptr, zero_ptr, rows, row_ok,
                                stored_k + k0, num_rows, group_size, MAGIC, OFF, SWAP_AB, DOT_PRECISION)
        else:
            acc = _factored_dot(acc, packed, a, a_sum, scale_ptr, zero_ptr, rows, row_ok, k0, num_rows, group_size,
                                MAGIC, OFF, SWAP_AB, DOT_PRECISION)
    elif BITS == 4:
        w = _dequantize(packed & 0xF, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok, num_rows, group_size, ONE_GROUP)
        acc = tile_dot(acc, w, a, SWAP_AB, DOT_PRECISION)
        w = _dequantize(packed >> 4, scale_ptr, zero_ptr, rows, row_ok, stored_k + k0, stored_k + k, k_ok, num_rows,
                        group_size, ONE_GROUP)
        acc = tile_dot(acc, w, a_high, SWAP_AB, DOT_PRECISION)
    else:
        w = _dequantize(packed, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok, num_rows, group_size, ONE_GROUP)
        acc = tile_dot(acc, w, a, SWAP_AB, DOT_PRECISION)
    return acc


@jit
def _wna16_grouped_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_ids_ptr,
    topk_weights_ptr, logits_ptr, num_experts, N, stored_k, group_size, num_assignments,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    BITS: tl.constexpr, ONE_GROUP: tl.constexpr, FACTORED: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr,
    TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
    RENORMALIZE: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """kernels/fused_moe._grouped_gemm_kernel (blocks, routing, epilogue: the same flags) with the
    expert's weight in the kernel layout (module docstring): BLOCK_K stored bytes a row per step,
    each tile dequantized in registers. stored_k: bytes a row (4 bits: K/2).
    SWAP_AB: the transposed product, out.T = w . a.T, accumulated (BLOCK_N, BLOCK_M): the dequantized
    tile is the dot's first operand, which Hopper's tensor cores (wgmma) take from registers (the
    second must go through shared memory). Faster for prefill blocks (wna16_gemm_config)."""
    if past_padded_blocks(num_padded_ptr, ONE_PER_BLOCK, BLOCK_M):
        return
    ids, row_ok, expert, a_rows, cols, col_ok, num_rows, w_base = expert_block_tile(
        w_ptr, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N,
        num_assignments, stride_we, stride_wn, TOP_K, ROWS_PER_TOKEN, GATED, ONE_PER_BLOCK, ROUTE_IN_KERNEL,
        RENORMALIZE, K_PAD, E_PAD, BLOCK_M, BLOCK_N)
    scale_base = scale_ptr + expert * stride_se
    zero_base = zero_ptr + expert * stride_se
    a_base, acc, acc_up = activation_tiles(a_ptr, a_rows, stride_am, SWAP_AB, BLOCK_M, BLOCK_N)
    for k0 in range(0, stored_k, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < stored_k
        if SWAP_AB:
            a_at = a_base + k[:, None]
            a_ok = k_ok[:, None] & row_ok[None, :]
        else:
            a_at = a_base + k[None, :]
            a_ok = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_at, mask=a_ok, other=0.0)
        a_high = tl.load(a_at + stored_k, mask=a_ok, other=0.0) if BITS == 4 else a
        if FACTORED:  # the tiles' sums over k, per row of a
            a_sum = tl.sum(a.to(tl.float32), axis=0 if SWAP_AB else 1)
            a_high_sum = tl.sum(a_high.to(tl.float32), axis=0 if SWAP_AB else 1) if BITS == 4 else a_sum
        else:
            a_sum = 0.0
            a_high_sum = 0.0
        acc = _quantized_dot(acc, a, a_high, a_sum, a_high_sum, w_base, scale_base, zero_base, cols, col_ok, k0, k,
                             k_ok, stored_k, num_rows, group_size, BITS, ONE_GROUP, FACTORED, MAGIC, OFF, SWAP_AB,
                             DOT_PRECISION)
        if GATED:
            acc_up = _quantized_dot(acc_up, a, a_high, a_sum, a_high_sum, w_base + N * stride_wn, scale_base,
                                    zero_base, cols + N, col_ok, k0, k, k_ok, stored_k, num_rows, group_size, BITS,
                                    ONE_GROUP, FACTORED, MAGIC, OFF, SWAP_AB, DOT_PRECISION)
    if SWAP_AB:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, topk_weights_ptr, expert,
               0, N, GATED, MUL_WEIGHT, False, 0, 0.0)  # no biases; silu


def _wna16_grouped_gemm(a, experts: WNA16Experts, out, blocks, topk_ids, topk_weights, *, n: int, top_k: int,
                        rows_per_token: bool, gated: bool, mul_weight: bool, block_m: int, config: dict,
                        router_logits: torch.Tensor | None = None, renormalize: bool = False) -> None:
    """kernels/fused_moe._grouped_gemm over quantized experts (same arguments)."""
    cfg = {"SWAP_AB": False, "FACTORED": False, **config}
    block_n = cfg.pop("BLOCK_N")
    block_k, one_group = tile_k(cfg.pop("BLOCK_K"), experts.bits, experts.in_features, experts.group_size)
    factored = cfg.pop("FACTORED") and one_group
    magic = factored_magic(a.dtype, experts.bits) if factored else 0
    weight, scale, zero = experts.kernel["weight"], experts.kernel["scale"], experts.kernel["zero"]
    assert a.shape[1] == experts.in_features and a.stride(1) == 1
    launch = expert_block_launch(blocks, topk_ids, topk_weights, n=n, num_experts=experts.num_experts, top_k=top_k,
                                 rows_per_token=rows_per_token, gated=gated, mul_weight=mul_weight, block_m=block_m,
                                 block_n=block_n, router_logits=router_logits, renormalize=renormalize)
    _wna16_grouped_gemm_kernel[launch.grid](
        a, weight, scale, zero, out, *launch.pointers, experts.num_experts,
        n, weight.shape[2], experts.group_size, out.shape[0],
        a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), out.stride(0),
        BITS=experts.bits, ONE_GROUP=one_group, FACTORED=factored, MAGIC=magic,
        OFF={0x4300: 128.0, 0x6400: 1024.0}.get(magic, 0.0), BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **launch.constexprs, **cfg,
    )


@jit
def _nibble_field(half, zero, I: tl.constexpr):
    """Field I (bits 4I..4I+3) of each 16-bit half (the low 16 bits of ``half``) minus ``zero``, times
    2^(4I), as float32, exactly: the field masked in place and OR-ed into the mantissa of 2^23 is
    2^23 + q 2^(4I); 2^23 + z 2^(4I) (built as bits) subtracted."""
    c = ((zero << (4 * I)) | 0x4B000000).to(tl.float32, bitcast=True)
    return ((half & (0xF << (4 * I))) | 0x4B000000).to(tl.float32, bitcast=True) - c


@jit
def _single_token_int4_kernel(
    a_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N,
    stored_words, group_size, stride_am, stride_we, stride_wn, stride_se, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
    RENORMALIZE: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """A few tokens' products with their 4-bit experts on the FMA units (one row: no tensor-core tile
    to fill), program (assignment slot, column tile): out[slot, cols] = a_row . w[expert, cols, :] with
    the blocks, routing and epilogue of _wna16_grouped_gemm_kernel's ONE_PER_BLOCK (gate_up: row
    slot // TOP_K of x). The weight is read
    as int32 words (four stored bytes: columns 4w + b in the low nibbles, K/2 + 4w + b in the high
    ones); a 16-bit half holds four fields, each made (q - z) 2^(4I) exactly (_nibble_field: one
    LOP3 and one FADD a weight) and multiplied by an activation scaled by 2^-(4I) (FFMA); the scale
    is applied per word column once per tile (BLOCK_W words, 4 BLOCK_W bytes, inside one group of
    the low and one of the high nibbles)."""
    slot = tl.program_id(0)
    _, _, expert = block_rows(slot, topk_ids_ptr, topk_ids_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr,
                              num_experts, 1, TOP_K, True, ROUTE_IN_KERNEL, RENORMALIZE, K_PAD, E_PAD, 16)
    if GATED:  # gate_up: the token's row of x
        a_row = a_ptr + (slot // TOP_K) * stride_am
    else:  # down: act's row `slot`
        a_row = a_ptr + slot * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    num_rows = 2 * N if GATED else N
    stored_k = 4 * stored_words
    w_base = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    scale_base = scale_ptr + expert * stride_se
    zero_base = zero_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, stored_words, BLOCK_W):
        wk = w0 + tl.arange(0, BLOCK_W)
        wk_ok = wk < stored_words
        ok = col_ok[:, None] & wk_ok[None, :]
        words = tl.load(w_base + wk[None, :], mask=ok, other=0)
        at_lo = ((4 * w0) // group_size) * num_rows + cols
        at_hi = ((stored_k + 4 * w0) // group_size) * num_rows + cols
        s_lo = tl.load(scale_base + at_lo, mask=col_ok, other=0.0)[:, None]
        s_hi = tl.load(scale_base + at_hi, mask=col_ok, other=0.0)[:, None]
        z_lo = tl.load(zero_base + at_lo, mask=col_ok, other=0).to(tl.int32)[:, None]
        z_hi = tl.load(zero_base + at_hi, mask=col_ok, other=0).to(tl.int32)[:, None]
        part_lo = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        part_hi = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        if GATED:
            up_words = tl.load(w_base + N * stride_wn + wk[None, :], mask=ok, other=0)
            up_s_lo = tl.load(scale_base + at_lo + N, mask=col_ok, other=0.0)[:, None]
            up_s_hi = tl.load(scale_base + at_hi + N, mask=col_ok, other=0.0)[:, None]
            up_z_lo = tl.load(zero_base + at_lo + N, mask=col_ok, other=0).to(tl.int32)[:, None]
            up_z_hi = tl.load(zero_base + at_hi + N, mask=col_ok, other=0).to(tl.int32)[:, None]
            up_lo = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            up_hi = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for h in tl.static_range(2):
            for i in tl.static_range(4):
                # field i of half h: byte 2h + i // 2, low nibble (i even: column 4w + b) or high (K/2 + 4w + b)
                x = tl.load(a_row + (i % 2) * stored_k + 4 * wk + (2 * h + i // 2), mask=wk_ok, other=0.0)
                x = (x.to(tl.float32) * (1.0 / (1 << (4 * i))))[None, :]
                half = words if h == 0 else words >> 16
                if i % 2 == 0:
                    part_lo += _nibble_field(half, z_lo, i) * x
                else:
                    part_hi += _nibble_field(half, z_hi, i) * x
                if GATED:
                    up_half = up_words if h == 0 else up_words >> 16
                    if i % 2 == 0:
                        up_lo += _nibble_field(up_half, up_z_lo, i) * x
                    else:
                        up_hi += _nibble_field(up_half, up_z_hi, i) * x
        acc += part_lo * s_lo + part_hi * s_hi
        if GATED:
            acc_up += up_lo * up_s_lo + up_hi * up_s_hi
    out = tl.sum(acc, axis=1)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = out.to(dtype).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    if MUL_WEIGHT:
        out *= tl.load(topk_weights_ptr + slot)
    tl.store(out_ptr + slot * stride_om + cols, out.to(dtype), mask=col_ok)


# FMA kernel tiles (BLOCK_N rows, BLOCK_W words, warps) of gate_up and down, the fastest of a sweep on
# an H200 (benchmarks/quantization/moe_wna16_bench.py --sweep, Qwen3-30B-A3B int4 g128, one token: 25.7 us, the
# grouped GEMM 43.6 us, bf16 28.6 us).
SINGLE_TOKEN_TILES = {"gate_up": (8, 32, 2), "down": (16, 32, 2)}
# Up to this many assignments (T * K) every assignment is a program of the FMA kernel, reading its
# expert's weight on its own (few tokens: most experts chosen once), instead of the grouped GEMM.
FMA_MAX_ASSIGNMENTS = 64


def single_token_words(experts: WNA16Experts, block_w: int) -> int:
    """BLOCK_W of the single-token FMA kernel for these experts, 0 where it does not apply (8 bits,
    odd widths, or tiles of 4 BLOCK_W bytes that straddle groups)."""
    if experts.bits != 4 or experts.in_features % 8:
        return 0
    size, one_group = tile_k(4 * block_w, 4, experts.in_features, experts.group_size)
    return size // 4 if one_group else 0


def _single_token_int4(a, experts: WNA16Experts, out, topk_ids, topk_weights, *, n: int, top_k: int, gated: bool,
                       mul_weight: bool, tiles: tuple, router_logits=None, renormalize: bool = False,
                       slots: int | None = None) -> None:
    block_n, block_w, warps = tiles
    block_w = single_token_words(experts, block_w)
    weight = experts.kernel["weight"]
    words = weight.view(torch.int32)
    scale, zero = experts.kernel["scale"], experts.kernel["zero"]
    assert a.is_contiguous() and a.shape[1] == experts.in_features
    topk_ids, topk_weights, router_logits = routing_tensors(topk_ids, topk_weights, router_logits)
    _single_token_int4_kernel[(slots or top_k, triton.cdiv(n, block_n))](
        a, words, scale, zero, out, topk_ids, topk_weights,
        router_logits if router_logits is not None else topk_weights, experts.num_experts, n,
        words.shape[2], experts.group_size, a.stride(0), words.stride(0), words.stride(1), scale.stride(0), out.stride(0),
        TOP_K=top_k, GATED=gated, MUL_WEIGHT=mul_weight, ROUTE_IN_KERNEL=router_logits is not None,
        RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(experts.num_experts), BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps)


def moe_single_token_wna16_triton(x: torch.Tensor, router_logits: torch.Tensor, gate_up: WNA16Experts,
                                  down: WNA16Experts, top_k: int, renormalize: bool, *,
                                  config: dict | None = None) -> torch.Tensor:
    """kernels/fused_moe.moe_single_token_triton with quantized experts: routing inside the gate_up
    launch, then down, then the sum over the K experts; only the K chosen experts' bytes are read."""
    assert x.shape[0] == 1 and router_logits.is_contiguous()
    inter = gate_up.out_features // 2
    ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    out_k = torch.empty(top_k, down.out_features, dtype=x.dtype, device=x.device)
    tiles = SINGLE_TOKEN_TILES if config is None else config.get("single_token", {})
    if "gate_up" in tiles and single_token_words(gate_up, tiles["gate_up"][1]):
        _single_token_int4(x.contiguous(), gate_up, act, ids, weights, n=inter, top_k=top_k, gated=True,
                           mul_weight=False, tiles=tiles["gate_up"], router_logits=router_logits,
                           renormalize=renormalize)
    else:
        _wna16_grouped_gemm(x, gate_up, act, None, ids, weights, n=inter, top_k=top_k, rows_per_token=True,
                            gated=True, mul_weight=False, block_m=16, config=_config(config, 16, gate_up.bits),
                            router_logits=router_logits, renormalize=renormalize)
    if "down" in tiles and single_token_words(down, tiles["down"][1]):
        _single_token_int4(act, down, out_k, ids, weights, n=down.out_features, top_k=top_k, gated=False,
                           mul_weight=True, tiles=tiles["down"])
    else:
        _wna16_grouped_gemm(act, down, out_k, None, ids, weights, n=down.out_features, top_k=top_k,
                            rows_per_token=False, gated=False, mul_weight=True, block_m=16,
                            config=_config(config, 16, down.bits))
    return out_k.sum(dim=0, keepdim=True)


def _config(config: dict | None, block_m: int, bits: int) -> dict:
    """The grouped GEMM's options: ``config`` where given (its single-token tiles dropped), else the table's."""
    if config is None:
        return wna16_gemm_config(block_m, bits)
    return {key: value for key, value in config.items() if key != "single_token"}


def fused_moe_wna16_triton(x: torch.Tensor, gate_up: WNA16Experts, down: WNA16Experts, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, *, block_m: int | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """kernels/fused_moe.fused_moe_triton with quantized experts (routing given)."""
    num_tokens, hidden = x.shape
    inter, top_k = gate_up.out_features // 2, topk_ids.shape[1]
    assert down.out_features == hidden and down.in_features == inter and topk_weights.shape == topk_ids.shape
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    tiles = SINGLE_TOKEN_TILES if config is None else config.get("single_token", {})
    if (num_assignments <= FMA_MAX_ASSIGNMENTS and block_m is None and "gate_up" in tiles and "down" in tiles
            and single_token_words(gate_up, tiles["gate_up"][1]) and single_token_words(down, tiles["down"][1])):
        flat_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
        act = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
        _single_token_int4(x.contiguous(), gate_up, act, flat_ids, weights, n=inter, top_k=top_k, gated=True,
                           mul_weight=False, tiles=tiles["gate_up"], slots=num_assignments)
        out_k = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
        _single_token_int4(act, down, out_k, flat_ids, weights, n=hidden, top_k=top_k, gated=False, mul_weight=True,
                           tiles=tiles["down"], slots=num_assignments)
        return out_k.view(num_tokens, top_k, hidden).sum(dim=1)
    config = None if config is None else _config(config, 0, 0)
    block_m = block_m or choose_block_m(num_assignments, gate_up.num_experts)
    blocks = None if num_tokens == 1 else moe_align(topk_ids, gate_up.num_experts, block_m)
    flat_ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
    _wna16_grouped_gemm(x, gate_up, act, blocks, flat_ids, weights, n=inter, top_k=top_k, rows_per_token=True,
                        gated=True, mul_weight=False, block_m=block_m,
                        config=config or wna16_gemm_config(block_m, gate_up.bits))
    out_k = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
    _wna16_grouped_gemm(act, down, out_k, blocks, flat_ids, weights, n=hidden, top_k=top_k, rows_per_token=False,
                        gated=False, mul_weight=True, block_m=block_m,
                        config=config or wna16_gemm_config(block_m, down.bits))
    return out_k.view(num_tokens, top_k, hidden).sum(dim=1)


# ---- public entry ------------------------------------------------------------------------------

def decode_fits(x: torch.Tensor, gate_up: WNA16Experts, down: WNA16Experts) -> bool:
    """Whether kernels/moe_decode.py's one launch takes these experts: 4 bits, 1-16 tokens, groups that
    hold whole tiles (int4_tiles_fit)."""
    return (gate_up.bits == down.bits == 4 and 1 <= x.shape[0] <= MAX_TOKENS
            and int4_tiles_fit(gate_up.in_features, down.in_features, gate_up.group_size, down.group_size,
                               DECODE_TILES[W_INT4]))


def gemv_quantization(gate_up: WNA16Experts, down: WNA16Experts) -> dict:
    """moe_gemv_triton's (and moe_decode_triton's) scale and zero keywords for 4-bit experts in the kernel layout."""
    return dict(gate_up_scale=gate_up.kernel["scale"], down_scale=down.kernel["scale"],
                gate_up_zero=gate_up.kernel["zero"], down_zero=down.kernel["zero"])


def moe_forward_wna16(x: torch.Tensor, router_logits: torch.Tensor, gate_up: WNA16Experts, down: WNA16Experts,
                      top_k: int, renormalize: bool) -> torch.Tensor:
    """kernels.fused_moe.moe_forward with quantized experts: x (T, H) -> (T, H) in x's dtype. The
    Triton kernels where the experts are in the kernel layout (CUDA), else the dequantized reference.
    With TRITONLLM_MOE_DECODE=fused, 4-bit experts at 1-16 tokens take kernels/moe_decode.py's one launch; else
    the token counts the load-time choice marked on gate_up's codes take kernels/moe_gemv.py's GEMV launches."""
    if not (use_triton(x) and gate_up.kernel):
        return moe_forward(x, router_logits, gate_up.dense, down.dense, top_k, renormalize)
    if fused_decode_enabled() and decode_fits(x, gate_up, down):  # opt-in: kernels/moe_decode.py's one launch
        return moe_decode_triton(x, gate_up.kernel["weight"], down.kernel["weight"], top_k=top_k,
                                 router_logits=router_logits, renormalize=renormalize,
                                 **gemv_quantization(gate_up, down))
    if gate_up.bits == 4 and (tiles := gemv_tiles(gate_up.kernel["weight"], x.shape[0])) is not None:  # chosen at load
        return moe_gemv_triton(x, gate_up.kernel["weight"], down.kernel["weight"], top_k=top_k,
                               router_logits=router_logits, renormalize=renormalize, tiles=tiles,
                               **gemv_quantization(gate_up, down))
    if x.shape[0] == 1:
        return moe_single_token_wna16_triton(x, router_logits, gate_up, down, top_k, renormalize)
    topk_weights, topk_ids = route_tokens(router_logits, top_k, renormalize)
    return fused_moe_wna16_triton(x, gate_up, down, topk_weights, topk_ids)
