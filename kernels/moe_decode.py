"""Decode-sized routed experts (1-16 tokens) in ONE launch: routing, gate_up, the activation, down,
the routing weights and the sum over each token's experts, for experts in the model dtype, FP8 per
channel, FP8 in 128 x 128 blocks (weights dequantized in registers: W8A16) or 4-bit integers with a
scale and zero per group (W4A16, kernels/fused_moe_wna16.py's kernel layout: a row's byte j holds
columns j and K/2 + j; scale and zero (E, K / G, N)).

Shapes (T <= MAX_TOKENS tokens, H hidden, E experts, I expert width on this rank, K experts a token):
    x (T, H); router_logits (T, E) (or topk_ids / topk_weights (T, K) given);
    gate_up (E, 2I, H) rows [gate | up]; down (E, H, I); FP8 scales as kernels/fused_moe_fp8.py's:
    per channel (E, 2I) / (E, H), blocks (E, ceil(2I / 128), ceil(H / 128)) / (E, ceil(H / 128), ceil(I / 128))
    -> out (T, H) in x's dtype:

    out[t] = sum_k w[t, k] * (down[e] @ act(gate_e @ x[t], up_e @ x[t]) + down_bias[e]),  e = topk_ids[t, k]

Grid (T * K slots, ceil(I / BLOCK_I) tiles). Program (slot s, tile j):
1. routes all T tokens itself (softmax top-k of the (T, E) logits, lowest index on ties, as
   kernels/moe_routing.py ``_top_k_of_row``; a few thousand floats, nothing beside the weights);
2. takes expert e = topk_ids.flat[s] and returns at once unless s is e's first slot (a batch's
   tokens may share experts: each (expert, tile) is computed by exactly one program, which takes
   every token that chose e as a row of a BLOCK_M = 16 tile);
3. gate and up rows [j * BLOCK_I, (j + 1) * BLOCK_I) of e over all of H (tensor-core dots, float32
   accumulation; FP8 codes widened to x's dtype, the scale of each row or 128 x 128 block applied to
   the float32 products), the activation in registers (kernels/moe_epilogue.py ``gated_activation``),
   rounded to x's dtype: act (BLOCK_M, BLOCK_I);
4. down columns [j * BLOCK_I, ...) of e for every H chunk: the (BLOCK_M, BLOCK_H) partial product,
   e's down bias (tile 0 only), times each row's routing weight, atomically added (float32) into a
   (MAX_TOKENS, H) workspace;
5. counts itself done for each of its rows; the program whose count makes a token's total
   K * tiles is the last one touching that row: it reads the row back (an atomic add of zero) and
   zeroes it, so the workspace is clean for the next call; rounds it once to x's dtype into out, and resets the
   count. Workspace and counts persist per (device, H) and are zero between calls.

So a decode step's MoE layer is one launch with no host synchronisation (CUDA graphs capture it).
Each expert's weights are read once a step however many of the batch chose it. The float32 sum's
order depends on the programs' timing: results may differ from run to run in the last bits of
float32 (rarely in one bf16 rounding), unlike the grouped path (kernels/fused_moe.py), which the
engine keeps by default: ``MOE_DECODE_ENV`` = "fused" routes 1..MAX_TOKENS-token forwards here.

Numerics (``moe_decode_ref``): gate and up in float32 from x and the dequantized weights, rounded
to x's dtype, the activation as activate_ref, down in float32 plus the bias, times the routing
weight, summed over the K experts in float32 and rounded once. FP8 experts are W8A16 here: the
activations are not quantized (kernels/fused_moe_fp8.py's grouped path is W8A8), so a sequence's
rounding at batch <= 16 differs from its rounding in a larger batch by about an E4M3 step of the
activations.
"""
from __future__ import annotations

import os

import torch

from kernels._triton import jit, tl, triton, use_triton
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_block import BLOCK as SCALE_BLOCK
from kernels.moe_epilogue import ACTIVATIONS, PLAIN_SILU, ExpertEpilogue, activate_ref, gated_activation
from kernels.moe_routing import route_tokens_ref

MAX_TOKENS = 16  # one BLOCK_M tile of tokens
MOE_DECODE_ENV = "TRITONLLM_MOE_DECODE"  # "fused": this file at 1..MAX_TOKENS tokens; else the grouped path
W_MODEL_DTYPE, W_FP8_CHANNEL, W_FP8_BLOCK, W_INT4 = 0, 1, 2, 3

# Tiles by weight kind: (BLOCK_I, BLOCK_K, BLOCK_H, num_warps, num_stages). Not yet measured on a GPU
# (benchmarks/kernels/moe_decode_bench.py sweeps them); BLOCK_I 32 gives Qwen3-30B-A3B's one token
# 8 x 24 = 192 programs. Block-FP8 needs BLOCK_K = BLOCK_H = 128 and BLOCK_I dividing 128. INT4 counts BLOCK_K
# in stored bytes (two columns each) and needs one scale group per tile (``int4_tiles_fit``).
DECODE_TILES = {
    W_MODEL_DTYPE: (32, 128, 128, 4, 3),
    W_FP8_CHANNEL: (32, 128, 128, 4, 3),
    W_FP8_BLOCK: (32, 128, 128, 4, 3),
    W_INT4: (32, 64, 128, 4, 3),
}

# What benchmarks/kernels/moe_decode_bench.py --sweep times (and the sm_90 compile test compiles).
# (INT4 experts count BLOCK_K in bytes: those of 64 are its candidates.)
DECODE_TILE_CANDIDATES = ((16, 128, 128, 4, 3), (32, 128, 128, 4, 3), (64, 128, 128, 4, 3), (32, 128, 128, 8, 3),
                          (64, 128, 128, 8, 2), (128, 128, 128, 8, 2), (32, 256, 128, 4, 2), (16, 64, 128, 4, 3),
                          (64, 64, 128, 4, 3))


def fused_decode_enabled() -> bool:
    """Whether the engine's MoE layers take this file's kernel at 1..MAX_TOKENS tokens (read per call:
    benchmarks flip it between runs)."""
    return os.environ.get(MOE_DECODE_ENV, "grouped") == "fused"


def weight_kind(gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None) -> int:
    """W_MODEL_DTYPE, W_FP8_CHANNEL, W_FP8_BLOCK or W_INT4 from the experts' dtype and scale shape."""
    if gate_up_scale is None:
        return W_MODEL_DTYPE
    if gate_up.dtype == torch.uint8:
        return W_INT4
    if gate_up.dtype != FP8_DTYPE:
        raise ValueError(f"scaled experts must be {FP8_DTYPE}, got {gate_up.dtype}")
    return W_FP8_CHANNEL if gate_up_scale.dim() == 2 else W_FP8_BLOCK


def decode_supported(x: torch.Tensor, epilogue: ExpertEpilogue = PLAIN_SILU) -> bool:
    """1..MAX_TOKENS tokens, a gated activation (relu2's up-only experts take the grouped path)."""
    return 1 <= x.shape[0] <= MAX_TOKENS and epilogue.gated


def int4_tiles_fit(hidden: int, inter: int, group_size_gate_up: int, group_size_down: int,
                   tiles: tuple | None = None) -> bool:
    """Whether 4-bit experts suit the tiles: each K step of gate_up (BLOCK_K bytes: columns kb and
    hidden / 2 + kb) and each program's BLOCK_I columns of down lie in one scale group and in one
    half of the row's columns (kernels/fused_moe_wna16.py's layout: a byte's two nibbles are the halves)."""
    block_i, block_k = (tiles or DECODE_TILES[W_INT4])[:2]
    return (hidden % 2 == 0 and inter % 2 == 0 and group_size_gate_up % block_k == 0 and (hidden // 2) % block_k == 0
            and group_size_down % block_i == 0 and (inter // 2) % block_i == 0)


# ---- reference -------------------------------------------------------------------------------

def _dequantized(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:  # (FP8 experts; INT4: .dense)
    """One expert's weight (N, K) in float32 (FP8 codes times their row or 128 x 128 block scale)."""
    if scale is None:
        return weight.float()
    if scale.dim() == 1:
        return weight.float() * scale.float()[:, None]
    rows, cols = weight.shape
    full = scale.float().repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
    return weight.float() * full[:rows, :cols]


def moe_decode_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """The module docstring's numerics in plain torch, one (token, expert) at a time."""
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    for t in range(num_tokens):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            w_gu = _dequantized(gate_up[e], None if gate_up_scale is None else gate_up_scale[e])
            h = x[t].float() @ w_gu.T
            if epilogue.gate_up_bias is not None:
                h = h + epilogue.gate_up_bias[e].float()
            act = activate_ref(h.to(x.dtype)[None], epilogue)[0]
            y = act.float() @ _dequantized(down[e], None if down_scale is None else down_scale[e]).T
            if epilogue.down_bias is not None:
                y = y + epilogue.down_bias[e].float()
            out[t] += float(topk_weights[t, k]) * y
    return out.to(x.dtype)


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _route_tile(logits_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, stride_l, rows, row_in,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
                RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(chosen_id (BLOCK_M, K_PAD) int32, -1 where no expert; chosen_w (BLOCK_M, K_PAD) float32) of the
    tokens ``rows``: routed here from the logits (kernels/moe_routing.py _top_k_of_row, row-wise), or read."""
    slots = tl.arange(0, K_PAD)
    if ROUTE_IN_KERNEL:
        experts = tl.arange(0, E_PAD)
        e_ok = experts < num_experts
        safe_rows = tl.where(row_in, rows, 0)  # padding rows route like row 0 and are dropped below
        logits = tl.load(logits_ptr + safe_rows[:, None] * stride_l + experts[None, :], mask=e_ok[None, :],
                         other=-float("inf")).to(tl.float32)
        probs = tl.exp(logits - tl.max(logits, 1)[:, None])
        probs = probs / tl.sum(probs, 1)[:, None]
        probs = tl.where(e_ok[None, :], probs, -1.0)
        chosen_w = tl.zeros([BLOCK_M, K_PAD], dtype=tl.float32)
        chosen_id = tl.full([BLOCK_M, K_PAD], -1, dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            best = tl.max(probs, 1)
            best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), 1)
            chosen_w = tl.where(slots[None, :] == k, best[:, None], chosen_w)
            chosen_id = tl.where(slots[None, :] == k, best_id[:, None], chosen_id)
            probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)
        if RENORMALIZE:
            chosen_w = chosen_w / tl.sum(chosen_w, 1)[:, None]
        chosen_id = tl.where(row_in[:, None], chosen_id, -1)
    else:
        ok = row_in[:, None] & (slots < TOP_K)[None, :]
        offsets = rows[:, None] * TOP_K + slots[None, :]
        chosen_id = tl.load(ids_ptr + offsets, mask=ok, other=-1).to(tl.int32)
        chosen_w = tl.load(weights_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    return chosen_id, chosen_w


@jit
def _int4_dot(acc, a, codes, scale_ptr, zero_ptr, rows, row_ok, DOT_PRECISION: tl.constexpr):
    """acc + a . w.T for 4-bit codes (N, BLOCK) of weight rows ``rows`` inside one scale group:
    w = (code - zero[row]) * scale[row] in float32 rounded to a's dtype (kernels/wna16.dequantize's rounding).
    scale_ptr / zero_ptr: the group's values, one a weight row."""
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    zero = tl.load(zero_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    w = ((codes.to(tl.float32) - zero) * scale).to(a.dtype)
    return tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)


@jit
def _moe_decode_kernel(
    x_ptr, logits_ptr, ids_ptr, weights_ptr, gu_ptr, gu_scale_ptr, gu_zero_ptr, d_ptr, d_scale_ptr, d_zero_ptr,
    gu_bias_ptr, d_bias_ptr, ws_ptr, count_ptr, out_ptr, num_tokens, num_experts, hidden, inter,
    group_size, group_down,
    stride_x, stride_l, stride_o, stride_gue, stride_gun, stride_de, stride_dn,
    stride_guse, stride_gusn, stride_dse, stride_dsn, stride_gube, stride_dbe,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
    RENORMALIZE: tl.constexpr, W_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (slot program_id(0), tile program_id(1)): the module docstring's steps 1-5."""
    slot = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_in = rows < num_tokens
    slots = tl.arange(0, K_PAD)
    chosen_id, chosen_w = _route_tile(logits_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, stride_l, rows,
                                      row_in, TOP_K, K_PAD, E_PAD, ROUTE_IN_KERNEL, RENORMALIZE, BLOCK_M)
    flat = rows[:, None] * TOP_K + slots[None, :]
    expert = tl.sum(tl.sum(tl.where(flat == slot, chosen_id, 0), 1), 0)
    hit = (chosen_id == expert) & (slots < TOP_K)[None, :]
    first = tl.min(tl.min(tl.where(hit, flat, BLOCK_M * K_PAD), 1), 0)
    if first != slot:  # another program covers this expert
        return
    row_ok = tl.max(hit.to(tl.int32), 1) > 0
    row_w = tl.sum(tl.where(hit, chosen_w, 0.0), 1)
    e64 = expert.to(tl.int64)
    act_dtype = x_ptr.dtype.element_ty

    # 3. gate and up rows of this tile over all of H
    icols = tile * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = icols < inter
    x_rows = x_ptr + rows[:, None] * stride_x
    gate_w = gu_ptr + e64 * stride_gue + icols.to(tl.int64)[:, None] * stride_gun
    up_w = gate_w + inter * stride_gun
    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    if W_KIND == 3:  # stored bytes: low nibbles columns kb, high nibbles hidden / 2 + kb
        half_k = hidden // 2
        gu_s = gu_scale_ptr + e64 * stride_guse
        gu_z = gu_zero_ptr + e64 * stride_guse
        for kb0 in range(0, half_k, BLOCK_K):
            kb = kb0 + tl.arange(0, BLOCK_K)
            kb_ok = kb < half_k
            a_ok = row_ok[:, None] & kb_ok[None, :]
            a_lo = tl.load(x_rows + kb[None, :], mask=a_ok, other=0.0)
            a_hi = tl.load(x_rows + half_k + kb[None, :], mask=a_ok, other=0.0)
            w_ok = i_ok[:, None] & kb_ok[None, :]
            g_lo = (kb0 // group_size) * stride_gusn
            g_hi = ((half_k + kb0) // group_size) * stride_gusn
            packed = tl.load(gate_w + kb[None, :], mask=w_ok, other=0)
            acc_g = _int4_dot(acc_g, a_lo, packed & 0xF, gu_s + g_lo, gu_z + g_lo, icols, i_ok, DOT_PRECISION)
            acc_g = _int4_dot(acc_g, a_hi, packed >> 4, gu_s + g_hi, gu_z + g_hi, icols, i_ok, DOT_PRECISION)
            packed = tl.load(up_w + kb[None, :], mask=w_ok, other=0)
            acc_u = _int4_dot(acc_u, a_lo, packed & 0xF, gu_s + g_lo, gu_z + g_lo, icols + inter, i_ok, DOT_PRECISION)
            acc_u = _int4_dot(acc_u, a_hi, packed >> 4, gu_s + g_hi, gu_z + g_hi, icols + inter, i_ok, DOT_PRECISION)
    else:
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = i_ok[:, None] & k_ok[None, :]
            wg = tl.load(gate_w + k[None, :], mask=w_ok, other=0.0).to(act_dtype)
            wu = tl.load(up_w + k[None, :], mask=w_ok, other=0.0).to(act_dtype)
            if W_KIND == 2:  # one scale per 128 x 128 block: this K step is one block column
                scale_col = gu_scale_ptr + e64 * stride_guse + k0 // BLOCK_K
                sg = tl.load(scale_col + (icols // BLOCK_K) * stride_gusn, mask=i_ok, other=0.0)
                su = tl.load(scale_col + ((icols + inter) // BLOCK_K) * stride_gusn, mask=i_ok, other=0.0)
                acc_g += tl.dot(a, tl.trans(wg), input_precision=DOT_PRECISION) * sg[None, :]
                acc_u += tl.dot(a, tl.trans(wu), input_precision=DOT_PRECISION) * su[None, :]
            else:
                acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
    if W_KIND == 1:  # one scale per row over all of H
        scale_row = gu_scale_ptr + e64 * stride_guse
        acc_g *= tl.load(scale_row + icols * stride_gusn, mask=i_ok, other=0.0)[None, :]
        acc_u *= tl.load(scale_row + (icols + inter) * stride_gusn, mask=i_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias_row = gu_bias_ptr + e64 * stride_gube
        acc_g += tl.load(bias_row + icols, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_row + inter + icols, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(acc_g, acc_u, act_dtype, ACTIVATION, SWIGLU_LIMIT).to(act_dtype)

    # 4. down columns of this tile, every H chunk, into the float32 workspace
    if W_KIND == 3:  # this tile's columns: low nibbles of bytes icols, or high ones of bytes icols - inter / 2
        high = tile * BLOCK_I >= inter // 2
        d_cols = d_ptr + e64 * stride_de + (icols - high.to(tl.int32) * (inter // 2))[None, :]
        d_group = ((tile * BLOCK_I) // group_down) * stride_dsn
    else:
        d_cols = d_ptr + e64 * stride_de + icols[None, :]
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        d_ok = h_ok[:, None] & i_ok[None, :]
        if W_KIND == 3:
            wd = tl.load(d_cols + h.to(tl.int64)[:, None] * stride_dn, mask=d_ok, other=0)
            codes = tl.where(high, wd >> 4, wd & 0xF)
            part = _int4_dot(tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32), act, codes,
                             d_scale_ptr + e64 * stride_dse + d_group, d_zero_ptr + e64 * stride_dse + d_group, h, h_ok,
                             DOT_PRECISION)
        else:
            wd = tl.load(d_cols + h.to(tl.int64)[:, None] * stride_dn, mask=d_ok, other=0.0)
            part = tl.dot(act, tl.trans(wd.to(act_dtype)), input_precision=DOT_PRECISION)
        if W_KIND == 2:  # this tile's columns lie in one 128-column block (BLOCK_I divides 128)
            part *= tl.load(d_scale_ptr + e64 * stride_dse + (h // BLOCK_H) * stride_dsn + (tile * BLOCK_I) // BLOCK_H,
                            mask=h_ok, other=0.0)[None, :]
        if W_KIND == 1:
            part *= tl.load(d_scale_ptr + e64 * stride_dse + h * stride_dsn, mask=h_ok, other=0.0)[None, :]
        if HAS_BIAS:
            if tile == 0:  # added once, by tile 0
                part += tl.load(d_bias_ptr + e64 * stride_dbe + h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        part *= row_w[:, None]
        tl.atomic_add(ws_ptr + rows[:, None] * hidden + h[None, :], part, mask=row_ok[:, None] & h_ok[None, :],
                      sem="relaxed")

    # 5. the last program of each token rounds its row into out and cleans up
    tl.debug_barrier()  # every thread's adds are issued before the count's release
    done = tl.atomic_add(count_ptr + rows, tl.full([BLOCK_M], 1, tl.int32), mask=row_ok, sem="acq_rel")
    last = row_ok & (done == TOP_K * tl.num_programs(1) - 1)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = last[:, None] & (h < hidden)[None, :]
        # read where the adds landed (an atomic add of zero: L2, never a stale L1 line), then cleared
        zero = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        total = tl.atomic_add(ws_ptr + rows[:, None] * hidden + h[None, :], zero, mask=ok, sem="relaxed")
        tl.store(ws_ptr + rows[:, None] * hidden + h[None, :], zero, mask=ok)
        tl.store(out_ptr + rows[:, None] * stride_o + h[None, :], total.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(count_ptr + rows, tl.zeros([BLOCK_M], tl.int32), mask=last)


_WORKSPACES: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums (MAX_TOKENS, hidden) float32, counts (MAX_TOKENS,) int32), zero between calls (the kernel
    leaves them so). Made on first use: the engine's warm-up runs before its graphs are captured."""
    key = (device, hidden)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros(MAX_TOKENS, hidden, dtype=torch.float32, device=device),
                            torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def moe_decode_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, top_k: int,
                      router_logits: torch.Tensor | None = None, renormalize: bool = False,
                      topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                      gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                      gate_up_zero: torch.Tensor | None = None, down_zero: torch.Tensor | None = None,
                      epilogue: ExpertEpilogue = PLAIN_SILU, tiles: tuple | None = None) -> torch.Tensor:
    """The one launch. Routing from ``router_logits`` (T, E) in the kernel, or ``topk_weights`` /
    ``topk_ids`` (T, K) given. ``tiles``: (BLOCK_I, BLOCK_K, BLOCK_H, num_warps, num_stages), else
    DECODE_TILES'. 4-bit experts: gate_up / down uint8 (E, 2I, H / 2) / (E, H, I / 2), their scales
    (float32) and zeros (uint8) (E, K / G, N), kernels/fused_moe_wna16.py's kernel layout."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    kind = weight_kind(gate_up, gate_up_scale)
    assert 1 <= num_tokens <= MAX_TOKENS and epilogue.gated and x.stride(1) == 1
    stored_inter = inter // 2 if kind == W_INT4 else inter
    assert gate_up.is_contiguous() and down.is_contiguous() and down.shape == (num_experts, hidden, stored_inter)
    block_i, block_k, block_h, warps, stages = tiles or DECODE_TILES[kind]
    if kind == W_FP8_BLOCK:
        assert block_k == block_h == SCALE_BLOCK and SCALE_BLOCK % block_i == 0, "block-FP8 tiles: see DECODE_TILES"
    group_size = group_down = 1  # (INT4 only: the columns of a scale group in gate_up and in down)
    if kind == W_INT4:
        assert gate_up_zero is not None and down_zero is not None and epilogue.gate_up_bias is None
        group_size, group_down = hidden // gate_up_scale.shape[1], inter // down_scale.shape[1]
        assert int4_tiles_fit(hidden, inter, group_size, group_down, (block_i, block_k)), "4-bit experts: int4_tiles_fit"
    route = router_logits is not None
    if route:
        assert router_logits.shape == (num_tokens, num_experts) and router_logits.stride(1) == 1
    else:
        topk_ids = topk_ids.to(torch.int32).contiguous()
        topk_weights = topk_weights.float().contiguous()
    ws, counts = _workspace(x.device, hidden)
    out = torch.empty_like(x)
    gu_s, d_s = (gate_up_scale, down_scale) if kind != W_MODEL_DTYPE else (x, x)  # (unread)
    gu_s3 = gu_s if kind != W_FP8_CHANNEL else gu_s[..., None]  # (INT4: (E, groups, N): the group stride)
    d_s3 = d_s if kind != W_FP8_CHANNEL else d_s[..., None]
    gu_b, d_b = epilogue.gate_up_bias, epilogue.down_bias
    has_bias = gu_b is not None
    assert has_bias == (d_b is not None), "the decode kernel takes both expert biases or neither"
    grid = (num_tokens * top_k, triton.cdiv(inter, block_i))
    _moe_decode_kernel[grid](
        x, router_logits if route else x, topk_ids if not route else x, topk_weights if not route else x,
        gate_up, gu_s, gate_up_zero if kind == W_INT4 else x, down, d_s, down_zero if kind == W_INT4 else x,
        gu_b if has_bias else x, d_b if has_bias else x, ws, counts, out, num_tokens, num_experts, hidden, inter,
        group_size, group_down,
        x.stride(0), router_logits.stride(0) if route else 0, out.stride(0),
        gate_up.stride(0), gate_up.stride(1), down.stride(0), down.stride(1),
        gu_s3.stride(0) if kind else 0, gu_s3.stride(1) if kind else 0,
        d_s3.stride(0) if kind else 0, d_s3.stride(1) if kind else 0,
        gu_b.stride(0) if has_bias else 0, d_b.stride(0) if has_bias else 0,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        ROUTE_IN_KERNEL=route, RENORMALIZE=renormalize, W_KIND=kind, HAS_BIAS=has_bias,
        ACTIVATION=ACTIVATIONS[epilogue.activation], SWIGLU_LIMIT=float(epilogue.swiglu_limit or 0.0),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=MAX_TOKENS, BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_H=block_h, num_warps=warps, num_stages=stages,
    )
    return out


def moe_decode(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
               renormalize: bool, *, gate_up_scale: torch.Tensor | None = None,
               down_scale: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """Routing then the experts (T, H): the one launch on CUDA, else route_tokens_ref + moe_decode_ref."""
    if use_triton(x):
        return moe_decode_triton(x, gate_up, down, top_k=top_k, router_logits=router_logits,
                                 renormalize=renormalize, gate_up_scale=gate_up_scale, down_scale=down_scale,
                                 epilogue=epilogue)
    topk_weights, topk_ids = route_tokens_ref(router_logits, top_k, renormalize)
    return moe_decode_ref(x, gate_up, down, topk_weights, topk_ids, gate_up_scale=gate_up_scale,
                          down_scale=down_scale, epilogue=epilogue)
