"""Llama 4's top-1 routing of a decode batch in ONE launch (engine/models/llama4.py Llama4Experts): (``norm``) the
post-attention residual add and RMSNorm, the router product, the top-1, the sigmoid score, the expert's input
scaled by it, and (``quantize``) the expert block's input quantized per token to E4M3 for an FP8 shared expert.

Shapes (T tokens, H hidden, E experts; top-1 only):
    x (T, H) model dtype (the attention's output with ``norm``), router weight (E, H) model dtype,
    norm = (residual (T, H), norm weight (H,), eps) or None
    -> Top1Routing: h = rms_norm(x + residual) (kernels/rmsnorm.py's roundings) with ``norm``, else x;
       rows (T, H) model dtype: h * s, s = sigmoid(max_e logits[t, e]) rounded to the model dtype
       ids (T, 1) int32: the argmax (ties: the lowest expert index; torch.topk leaves their order open)
       weights (T, 1) float32: ones (the experts' kernels take a weight a row; the score is in the input)
       shared_input: the shared expert's input: h, or (``quantize``) kernels/fp8.py QuantizedRows of h
       residual: x + residual (``norm``), else None
``shared_slot`` S (a shared expert stacked as expert S of the routed experts' stacks: engine/models/llama4.py):
rows, ids and weights hold 2T rows, the T routed ones then the shared expert's: rows[T + t] = h[t], ids[T + t] = S,
and shared_input is that half of rows (the experts' one launch pair then runs both, and nothing is quantized).
All with the roundings of the unfused torch path: the logits rounded to the model dtype (the router Linear's
output), the sigmoid in float32 rounded to the model dtype, h * s in float32 rounded to the model dtype.

Why: at batch 1 the unfused path was the post-attention norm, the router's skinny product, torch's top-k, a
float cast, the sigmoid, a cast back, the multiply, a fill of ones and (per-channel FP8) a quantize kernel
before the shared expert: nine launches of 1-4 us on the step's critical path, 48 times a step on Scout
(H200, 2026-12-01).

Grid: one program per token. With ``norm`` it first holds its whole row (the residual add, the norm: H
values in registers, as kernels/rmsnorm.py's kernel), writes h and the new residual, and waits on a block
barrier (its later loads read h back, written by other threads of the program). Then it reads the whole
(E, H) router weight (Scout: 16 x 5,120 bf16, 160 KB) in BLOCK_H columns at a time with h, keeping h's
absolute maximum, and writes the scaled (and quantized) row in a last pass over h (L1/L2-resident). For the
few tokens of a decode step (``ROUTE_ROWS``); longer batches keep the unfused path, whose product reads the
weight once for all rows. No host synchronisation: CUDA graphs capture it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, QuantizedRows, quantize_rows
from kernels.rmsnorm import _rms_normalized, rms_norm_ref

# Tokens a launch routes (one program each, each reading the whole router weight): decode steps.
ROUTE_ROWS = 16


class Top1Routing(NamedTuple):
    """route_top1's outputs (module docstring)."""

    rows: torch.Tensor  # (T, H) model dtype: h * s; with a shared slot (2T, H): then h
    ids: torch.Tensor  # (T, 1) int32; with a shared slot (2T, 1): then the slot
    weights: torch.Tensor  # (T, 1) float32 ones; with a shared slot (2T, 1)
    shared_input: torch.Tensor | QuantizedRows  # h (with a shared slot: rows' second half), or its E4M3 rows
    residual: torch.Tensor | None  # x + residual (with a norm)


def route_top1_ref(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = False,
                   norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   shared_slot: int | None = None) -> Top1Routing:
    """The module docstring's outputs in plain torch: the engine's unfused path (kernels/rmsnorm.py's reference,
    a float32 product rounded to the model dtype, argmax with ties to the lowest index)."""
    residual = None
    if norm is not None:
        x, residual = rms_norm_ref(x, norm[1], norm[2], norm[0])
    logits = (x.float() @ router_weight.float().T).to(x.dtype)
    top, ids = logits.float().max(dim=-1, keepdim=True)  # (max returns the first of equal values)
    score = torch.sigmoid(top).to(x.dtype)
    rows = (x * score).to(x.dtype)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    ids = ids.to(torch.int32)
    if shared_slot is not None:
        assert not quantize
        rows, ids = torch.cat([rows, x]), torch.cat([ids, torch.full_like(ids, shared_slot)])
        return Top1Routing(rows, ids, torch.cat([ones, ones]), rows[x.shape[0]:], residual)
    shared = QuantizedRows(*quantize_rows(x), x.dtype) if quantize else x
    return Top1Routing(rows, ids, ones, shared, residual)


@jit
def _route_top1_kernel(x_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, w_ptr, rows_ptr, ids_ptr, weights_ptr,
                       q_ptr, scale_ptr, H, E, eps, stride_x, stride_res, stride_h, stride_ro, stride_w, stride_r,
                       stride_q, shared_slot, E_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ROW_BLOCK: tl.constexpr,
                       HAS_NORM: tl.constexpr, QUANTIZE: tl.constexpr, STACKED: tl.constexpr, PDL: tl.constexpr):
    """Program t: (HAS_NORM) token t's residual add and norm into h_ptr, then its logits over the E experts, its
    top-1 and score, its scaled (and quantized) row. Without HAS_NORM, h_ptr is x. STACKED: row T + t of rows (and
    of ids, weights) is h's own for expert ``shared_slot`` (with HAS_NORM, h_ptr is that row already)."""
    token = tl.program_id(0).to(tl.int64)
    num_tokens = tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    e_ok = experts < E
    cols = tl.arange(0, BLOCK_H)
    pdl_prologue(PDL)
    if HAS_NORM:  # kernels/rmsnorm.py _rms_norm_kernel's roundings, the whole row at once
        row = tl.arange(0, ROW_BLOCK)
        row_ok = row < H
        summed = tl.load(x_ptr + token * stride_x + row, mask=row_ok, other=0.0).to(tl.float32)
        summed += tl.load(res_ptr + token * stride_res + row, mask=row_ok, other=0.0).to(tl.float32)
        summed = summed.to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + token * stride_ro + row, summed, mask=row_ok)
        normed = _rms_normalized(summed, H, eps, 0)
        weight = tl.load(norm_w_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + token * stride_h + row, (weight * normed).to(h_ptr.dtype.element_ty), mask=row_ok)
        tl.debug_barrier()  # h is read back below by other threads of this program
    acc = tl.zeros([E_PAD, BLOCK_H], dtype=tl.float32)
    peak = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        col = start + cols
        col_ok = col < H
        x = tl.load(h_ptr + token * stride_h + col, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None] * stride_w + col[None, :], mask=e_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
        peak = tl.maximum(peak, tl.abs(x))
    logits = tl.sum(acc, 1).to(h_ptr.dtype.element_ty).to(tl.float32)  # the router Linear's rounding
    logits = tl.where(e_ok, logits, -float("inf"))
    top = tl.max(logits, 0)
    chosen = tl.min(tl.where(logits == top, experts, E_PAD), 0)
    score = (1.0 / (1.0 + tl.exp(-top))).to(h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(ids_ptr + token, chosen.to(tl.int32))
    tl.store(weights_ptr + token, 1.0)
    if STACKED:
        tl.store(ids_ptr + num_tokens + token, shared_slot)
        tl.store(weights_ptr + num_tokens + token, 1.0)
    if QUANTIZE:
        scale = e4m3_row_scale(tl.max(peak, 0))
        tl.store(scale_ptr + token, scale)
    for start in range(0, H, BLOCK_H):
        col = start + cols
        col_ok = col < H
        x = tl.load(h_ptr + token * stride_h + col, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(rows_ptr + token * stride_r + col, (x * score).to(rows_ptr.dtype.element_ty), mask=col_ok)
        if STACKED and not HAS_NORM:  # h is x: copied into the shared expert's row
            tl.store(rows_ptr + (num_tokens + token) * stride_r + col, x.to(rows_ptr.dtype.element_ty), mask=col_ok)
        if QUANTIZE:
            tl.store(q_ptr + token * stride_q + col, to_e4m3(x, scale), mask=col_ok)


def route_top1_triton(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = False,
                      norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                      shared_slot: int | None = None) -> Top1Routing:
    """route_top1_ref's outputs in one launch (x's, the residual's and the weights' last dims contiguous,
    T <= ROUTE_ROWS)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert x.stride(1) == 1 and router_weight.stride(1) == 1 and router_weight.shape[1] == hidden
    assert shared_slot is None or not quantize
    stacked_rows = num_tokens if shared_slot is None else 2 * num_tokens
    all_rows = torch.empty(stacked_rows, hidden, dtype=x.dtype, device=x.device)
    rows = all_rows[:num_tokens]
    ids = torch.empty(stacked_rows, 1, dtype=torch.int32, device=x.device)
    weights = torch.empty(stacked_rows, 1, dtype=torch.float32, device=x.device)
    values = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE, device=x.device) if quantize else rows
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device) if quantize else weights
    if norm is not None:
        residual, norm_weight, eps = norm
        assert residual.shape == x.shape and residual.stride(1) == 1 and norm_weight.is_contiguous()
        h = torch.empty_like(x) if shared_slot is None else all_rows[num_tokens:]
        residual_out = torch.empty_like(x)
    else:
        residual = norm_weight = h = residual_out = x  # unread (h: read as x)
        eps = 0.0
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        _route_top1_kernel[(num_tokens,)](
            x, residual, norm_weight, h, residual_out, router_weight, rows, ids, weights, values, scale, hidden,
            num_experts, float(eps), x.stride(0), residual.stride(0), h.stride(0), residual_out.stride(0),
            router_weight.stride(0), rows.stride(0), values.stride(0), -1 if shared_slot is None else shared_slot,
            E_PAD=e_pad, BLOCK_H=max(64, min(1024, 8192 // e_pad)), ROW_BLOCK=triton.next_power_of_2(hidden),
            HAS_NORM=norm is not None, QUANTIZE=quantize, STACKED=shared_slot is not None,
            num_warps=8 if norm is not None else 4, **pdl_options(x))
    residual_out = residual_out if norm is not None else None
    if shared_slot is not None:
        return Top1Routing(all_rows, ids, weights, all_rows[num_tokens:], residual_out)
    shared = QuantizedRows(values, scale, x.dtype) if quantize else h
    return Top1Routing(rows, ids, weights, shared, residual_out)
