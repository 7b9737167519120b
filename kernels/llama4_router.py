"""Llama 4's top-1 routing of a decode batch in ONE launch (engine/models/llama4.py Llama4Experts): the router
product, the top-1, the sigmoid score, the expert's input scaled by it, and (``quantize``) the same rows
quantized per token to E4M3 for an FP8 shared expert.

Shapes (T tokens, H hidden, E experts; top-1 only):
    x (T, H) model dtype, router weight (E, H) model dtype
    -> rows (T, H) model dtype: x * s, s = sigmoid(max_e logits[t, e]) rounded to the model dtype
       ids (T, 1) int32: the argmax (ties: the lowest expert index; torch.topk leaves their order open)
       weights (T, 1) float32: ones (the experts' kernels take a weight a row; the score is in the input)
       quantized (``quantize``): kernels/fp8.py QuantizedRows of x (e4m3_rows' scale and rounding)
with the roundings of the unfused torch path: the logits rounded to the model dtype (the router Linear's
output), the sigmoid in float32 rounded to the model dtype, x * s in float32 rounded to the model dtype.

Why: at batch 1 the unfused path was the router's skinny product, torch's top-k, a float cast, the sigmoid,
a cast back, the multiply, a fill of ones and (per-channel FP8) a quantize kernel before the shared expert:
eight launches of 1-4 us on the step's critical path, 48 times a step on Scout (H200, 2026-12-01).

Grid: one program per token; it reads the whole (E, H) router weight (Scout: 16 x 5,120 bf16, 160 KB) in
BLOCK_H columns at a time with its token's row, keeping the row's absolute maximum, then writes the scaled
(and quantized) row in a second pass over x (L1/L2-resident). For the few tokens of a decode step
(``ROUTE_ROWS``); longer batches keep the unfused path, whose product reads the weight once for all rows.
No host synchronisation: CUDA graphs capture it.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, QuantizedRows, quantize_rows

# Tokens a launch routes (one program each, each reading the whole router weight): decode steps.
ROUTE_ROWS = 16


def route_top1_ref(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, QuantizedRows | None]:
    """The module docstring's outputs in plain torch: the engine's unfused path (float32 product rounded to the
    model dtype, argmax with ties to the lowest index)."""
    logits = (x.float() @ router_weight.float().T).to(x.dtype)
    top, ids = logits.float().max(dim=-1, keepdim=True)  # (max returns the first of equal values)
    score = torch.sigmoid(top).to(x.dtype)
    rows = (x * score).to(x.dtype)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    quantized = QuantizedRows(*quantize_rows(x), x.dtype) if quantize else None
    return rows, ids.to(torch.int32), ones, quantized


@jit
def _route_top1_kernel(x_ptr, w_ptr, rows_ptr, ids_ptr, weights_ptr, q_ptr, scale_ptr, H, E, stride_x, stride_w,
                       stride_r, stride_q, E_PAD: tl.constexpr, BLOCK_H: tl.constexpr, QUANTIZE: tl.constexpr,
                       PDL: tl.constexpr):
    """Program t: token t's logits over the E experts, its top-1 and score, its scaled (and quantized) row."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    e_ok = experts < E
    cols = tl.arange(0, BLOCK_H)
    pdl_prologue(PDL)
    acc = tl.zeros([E_PAD, BLOCK_H], dtype=tl.float32)
    peak = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        h = start + cols
        h_ok = h < H
        x = tl.load(x_ptr + token * stride_x + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None] * stride_w + h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
        peak = tl.maximum(peak, tl.abs(x))
    logits = tl.sum(acc, 1).to(x_ptr.dtype.element_ty).to(tl.float32)  # the router Linear's rounding
    logits = tl.where(e_ok, logits, -float("inf"))
    top = tl.max(logits, 0)
    chosen = tl.min(tl.where(logits == top, experts, E_PAD), 0)
    score = (1.0 / (1.0 + tl.exp(-top))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(ids_ptr + token, chosen.to(tl.int32))
    tl.store(weights_ptr + token, 1.0)
    if QUANTIZE:
        scale = e4m3_row_scale(tl.max(peak, 0))
        tl.store(scale_ptr + token, scale)
    for start in range(0, H, BLOCK_H):
        h = start + cols
        h_ok = h < H
        x = tl.load(x_ptr + token * stride_x + h, mask=h_ok, other=0.0).to(tl.float32)
        tl.store(rows_ptr + token * stride_r + h, (x * score).to(rows_ptr.dtype.element_ty), mask=h_ok)
        if QUANTIZE:
            tl.store(q_ptr + token * stride_q + h, to_e4m3(x, scale), mask=h_ok)


def route_top1_triton(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, QuantizedRows | None]:
    """route_top1_ref's outputs in one launch (x's and the weight's last dims contiguous, T <= ROUTE_ROWS)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    assert x.stride(1) == 1 and router_weight.stride(1) == 1 and router_weight.shape[1] == hidden
    rows = torch.empty_like(x)
    ids = torch.empty(num_tokens, 1, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    values = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE, device=x.device) if quantize else rows
    scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device) if quantize else weights
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        _route_top1_kernel[(num_tokens,)](
            x, router_weight, rows, ids, weights, values, scale, hidden, num_experts, x.stride(0),
            router_weight.stride(0), rows.stride(0), values.stride(0), E_PAD=e_pad,
            BLOCK_H=max(64, min(1024, 8192 // e_pad)), QUANTIZE=quantize, num_warps=4, **pdl_options(x))
    return rows, ids, weights, QuantizedRows(values, scale, x.dtype) if quantize else None
