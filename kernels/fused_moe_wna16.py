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
from kernels.fused_moe import (
    block_rows,
    choose_block_m,
    gemm_config,
    moe_align,
    moe_forward,
    route_tokens,
    store_rows,
)
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
    for blocks of 32 and 64 rows. Measured on an H200 with Qwen3-30B-A3B's experts (int4, g128):
    swapped, 4096 tokens took 13.0 ms instead of 16.3 and 512 tokens 1.32 ms instead of 1.38;
    decode blocks of 16 were faster unswapped (one token 43 us instead of 48-61)."""
    config = gemm_config(block_m)
    block_k = config["BLOCK_K"] // 2 if bits == 4 else config["BLOCK_K"]
    return {**config, "BLOCK_K": block_k, "SWAP_AB": block_m > 16}


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
def _tile_dot(acc, w, a, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + w . a (SWAP_AB: w (BLOCK_N, BLOCK_K), a (BLOCK_K, BLOCK_M)) or acc + a . w.T."""
    if SWAP_AB:
        acc = tl.dot(w.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
    return acc


@jit
def _quantized_dot(acc, a, a_high, w_ptrs, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok, stored_k, num_rows,
                   group_size, BITS: tl.constexpr, ONE_GROUP: tl.constexpr, SWAP_AB: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """acc plus the product of a and the dequantized tile of weight rows ``rows``, stored columns k
    (w_ptrs: those rows' starts). 4 bits: the low nibbles are columns k (with a), the high ones
    columns stored_k + k (with a_high)."""
    packed = tl.load(w_ptrs + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
    if BITS == 4:
        w = _dequantize(packed & 0xF, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok, num_rows, group_size, ONE_GROUP)
        acc = _tile_dot(acc, w, a, SWAP_AB, DOT_PRECISION)
        w = _dequantize(packed >> 4, scale_ptr, zero_ptr, rows, row_ok, stored_k + k0, stored_k + k, k_ok, num_rows,
                        group_size, ONE_GROUP)
        acc = _tile_dot(acc, w, a_high, SWAP_AB, DOT_PRECISION)
    else:
        w = _dequantize(packed, scale_ptr, zero_ptr, rows, row_ok, k0, k, k_ok, num_rows, group_size, ONE_GROUP)
        acc = _tile_dot(acc, w, a, SWAP_AB, DOT_PRECISION)
    return acc


@jit
def _wna16_grouped_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_ids_ptr,
    topk_weights_ptr, logits_ptr, num_experts, N, stored_k, group_size, num_assignments,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    BITS: tl.constexpr, ONE_GROUP: tl.constexpr, TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
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
    block = tl.program_id(0)
    if not ONE_PER_BLOCK:
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return  # past the last expert's padded run (the grid covers the worst case)
    ids, row_ok, expert = block_rows(block, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr,
                                     logits_ptr, num_experts, num_assignments, TOP_K, ONE_PER_BLOCK,
                                     ROUTE_IN_KERNEL, RENORMALIZE, K_PAD, E_PAD, BLOCK_M)
    a_rows = (ids // TOP_K if ROWS_PER_TOKEN else ids).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    num_rows = 2 * N if GATED else N  # rows of an expert: scale / zero (groups, num_rows)
    w_base = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    scale_base = scale_ptr + expert * stride_se
    zero_base = zero_ptr + expert * stride_se
    if SWAP_AB:  # a tiles (BLOCK_K, BLOCK_M)
        a_base = a_ptr + a_rows[None, :] * stride_am
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # (BLOCK_M, BLOCK_K)
        a_base = a_ptr + a_rows[:, None] * stride_am
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
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
        acc = _quantized_dot(acc, a, a_high, w_base, scale_base, zero_base, cols, col_ok, k0, k, k_ok, stored_k,
                             num_rows, group_size, BITS, ONE_GROUP, SWAP_AB, DOT_PRECISION)
        if GATED:
            acc_up = _quantized_dot(acc_up, a, a_high, w_base + N * stride_wn, scale_base, zero_base, cols + N,
                                    col_ok, k0, k, k_ok, stored_k, num_rows, group_size, BITS, ONE_GROUP, SWAP_AB,
                                    DOT_PRECISION)
    if SWAP_AB:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, GATED, MUL_WEIGHT)


def _wna16_grouped_gemm(a, experts: WNA16Experts, out, blocks, topk_ids, topk_weights, *, n: int, top_k: int,
                        rows_per_token: bool, gated: bool, mul_weight: bool, block_m: int, config: dict,
                        router_logits: torch.Tensor | None = None, renormalize: bool = False) -> None:
    """kernels/fused_moe._grouped_gemm over quantized experts (same arguments)."""
    cfg = {"SWAP_AB": False, **config}
    block_n = cfg.pop("BLOCK_N")
    block_k, one_group = tile_k(cfg.pop("BLOCK_K"), experts.bits, experts.in_features, experts.group_size)
    weight, scale, zero = experts.kernel["weight"], experts.kernel["scale"], experts.kernel["zero"]
    assert a.shape[1] == experts.in_features and a.stride(1) == 1
    num_blocks = topk_ids.numel() if blocks is None else blocks[0].numel() // block_m
    sorted_ids, block_expert, num_padded = blocks if blocks is not None else (topk_ids,) * 3  # unread
    _wna16_grouped_gemm_kernel[(num_blocks, triton.cdiv(n, block_n))](
        a, weight, scale, zero, out, sorted_ids, block_expert, num_padded, topk_ids, topk_weights,
        router_logits if router_logits is not None else topk_weights, experts.num_experts,
        n, weight.shape[2], experts.group_size, out.shape[0],
        a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), out.stride(0),
        BITS=experts.bits, ONE_GROUP=one_group, TOP_K=top_k, ROWS_PER_TOKEN=rows_per_token, GATED=gated,
        MUL_WEIGHT=mul_weight, ONE_PER_BLOCK=blocks is None, ROUTE_IN_KERNEL=router_logits is not None,
        RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(experts.num_experts),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **cfg,
    )


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
    _wna16_grouped_gemm(x, gate_up, act, None, ids, weights, n=inter, top_k=top_k, rows_per_token=True, gated=True,
                        mul_weight=False, block_m=16, config=config or wna16_gemm_config(16, gate_up.bits),
                        router_logits=router_logits, renormalize=renormalize)
    out_k = torch.empty(top_k, down.out_features, dtype=x.dtype, device=x.device)
    _wna16_grouped_gemm(act, down, out_k, None, ids, weights, n=down.out_features, top_k=top_k,
                        rows_per_token=False, gated=False, mul_weight=True, block_m=16,
                        config=config or wna16_gemm_config(16, down.bits))
    return out_k.sum(dim=0, keepdim=True)


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

def moe_forward_wna16(x: torch.Tensor, router_logits: torch.Tensor, gate_up: WNA16Experts, down: WNA16Experts,
                      top_k: int, renormalize: bool) -> torch.Tensor:
    """kernels.fused_moe.moe_forward with quantized experts: x (T, H) -> (T, H) in x's dtype. The
    Triton kernels where the experts are in the kernel layout (CUDA), else the dequantized reference."""
    if not (use_triton(x) and gate_up.kernel):
        return moe_forward(x, router_logits, gate_up.dense, down.dense, top_k, renormalize)
    if x.shape[0] == 1:
        return moe_single_token_wna16_triton(x, router_logits, gate_up, down, top_k, renormalize)
    topk_weights, topk_ids = route_tokens(router_logits, top_k, renormalize)
    return fused_moe_wna16_triton(x, gate_up, down, topk_weights, topk_ids)
