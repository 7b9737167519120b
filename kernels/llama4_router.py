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
``shared_slot`` S (the shared expert as the experts' id S, kernels/moe_gemv.py SharedExpert: engine/models/llama4.py):
rows, ids and weights hold 2T rows, the T routed ones then the shared expert's: rows[T + t] = h[t], ids[T + t] = S,
and shared_input is that half of rows (the experts' one launch pair then runs both, and nothing is quantized).
All with the roundings of the unfused torch path: the logits rounded to the model dtype (the router Linear's
output), the sigmoid in float32 rounded to the model dtype, h * s in float32 rounded to the model dtype.

Why: at batch 1 the unfused path was the post-attention norm, the router's skinny product, torch's top-k, a
float cast, the sigmoid, a cast back, the multiply, a fill of ones and (per-channel FP8) a quantize kernel
before the shared expert: nine launches of 1-4 us on the step's critical path, 48 times a step on Scout
(H200, 2026-12-01).

Grid: one program per BLOCK_H columns of the hidden size (Scout: 20 of 256), all T tokens each: its columns of
the router weight (loaded before its PDL wait: no kernel of the step writes them) against its columns of h, a
(16, BLOCK_H) x (BLOCK_H, E) product on the tensor cores into a partial logit per token and expert in a device
workspace, with its columns' absolute maxima per token (the E4M3 scale's); with ``norm`` it first takes each token's
statistics over the whole row (every program alike: the same float32 sums), writes its columns of h and of the new
residual. The program whose count completes the grid (kernels/linear.py last_arrival: an acq_rel atomic, which
resets the count for the next call) sums the partials in program order, rounds them to the model dtype, takes the
top-1 and the score, and writes each token's rows from h (read back through L2: other programs wrote it). (One
program reading the whole weight, the first version, took 13.3 us a call on an H200: its 10 loads one after
another.) For the few tokens of a decode step (``ROUTE_ROWS``); longer batches keep the unfused path, whose product
reads the weight once for all rows. No host synchronisation: CUDA graphs capture it; the workspace is made before
(``reserve_route_workspace``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, QuantizedRows, quantize_rows
from kernels.linear import last_arrival
from kernels.rmsnorm import rms_norm_ref

# Tokens a launch routes at most (decode steps): every program takes them all as one 16-row tensor-core tile.
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


# Columns a program covers, and the most programs a launch has (the workspace's partial rows).
BLOCK_H = 256
MAX_SPLITS = 64


@jit
def _route_top1_kernel(x_ptr, res_ptr, norm_w_ptr, h_ptr, res_out_ptr, w_ptr, rows_ptr, ids_ptr, weights_ptr,
                       q_ptr, scale_ptr, part_ptr, peak_ptr, count_ptr, num_tokens, H, E, eps, stride_x, stride_res,
                       stride_h, stride_ro, stride_w, stride_r, stride_q, shared_slot, E_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ROW_BLOCK: tl.constexpr, S_PAD: tl.constexpr,
                       HAS_NORM: tl.constexpr, QUANTIZE: tl.constexpr, STACKED: tl.constexpr,
                       PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program p: columns p * BLOCK_H ... of every token (module docstring, "Grid"); the last program routes.
    h_ptr: where h goes (HAS_NORM) or x itself. STACKED: row T + t of rows (ids, weights) is h's own for expert
    ``shared_slot`` (with HAS_NORM, h_ptr is that row already; else this program copies its columns of x there).
    part_ptr (S_PAD, BLOCK_T, E_PAD) / peak_ptr (S_PAD, BLOCK_T) float32, count_ptr (1,) int32 (0 between calls)."""
    split = tl.program_id(0)
    cols = split * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    experts = tl.arange(0, E_PAD)
    e_ok = experts < E
    w = tl.load(w_ptr + experts[None, :].to(tl.int64) * stride_w + cols[:, None],
                mask=col_ok[:, None] & e_ok[None, :], other=0.0)  # (BLOCK_H, E_PAD), before the wait
    pdl_prologue(PDL)
    tokens = tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    tile_ok = t_ok[:, None] & col_ok[None, :]
    tile = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_x + cols[None, :], mask=tile_ok, other=0.0)
    if HAS_NORM:  # kernels/rmsnorm.py _rms_norm_kernel's roundings
        row = tl.arange(0, ROW_BLOCK)
        row_ok = row < H
        inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
        for t in range(num_tokens):  # each token's statistics over its whole row
            summed = tl.load(x_ptr + t * stride_x + row, mask=row_ok, other=0.0).to(tl.float32)
            summed += tl.load(res_ptr + t * stride_res + row, mask=row_ok, other=0.0).to(tl.float32)
            summed = summed.to(x_ptr.dtype.element_ty).to(tl.float32)
            inv = tl.rsqrt(tl.sum(summed * summed, 0) / H + eps)
            inv_rms = tl.where(tokens == t, inv, inv_rms)
        tile = (tile.to(tl.float32) + tl.load(res_ptr + tokens[:, None].to(tl.int64) * stride_res + cols[None, :],
                                               mask=tile_ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + tokens[:, None].to(tl.int64) * stride_ro + cols[None, :], tile, mask=tile_ok)
        normed = (tile.to(tl.float32) * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        tile = (weight[None, :] * normed).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + tokens[:, None].to(tl.int64) * stride_h + cols[None, :], tile, mask=tile_ok)
    elif STACKED:  # h is x: its copy is the shared expert's row
        tl.store(rows_ptr + (num_tokens + tokens[:, None]).to(tl.int64) * stride_r + cols[None, :], tile, mask=tile_ok)
    partial = tl.dot(tile.to(w.dtype), w, input_precision=PRECISION)  # (BLOCK_T, E_PAD) float32
    tl.store(part_ptr + (split * BLOCK_T + tokens[:, None]) * E_PAD + experts[None, :], partial)
    if QUANTIZE:
        tl.store(peak_ptr + split * BLOCK_T + tokens, tl.max(tl.abs(tile.to(tl.float32)), 1))
    if last_arrival(count_ptr, 0, tl.num_programs(0)):  # the last program: every partial (and h) is written
        splits = tl.arange(0, S_PAD)
        s_ok = splits < tl.num_programs(0)
        parts = tl.load(part_ptr + (splits[:, None, None] * BLOCK_T + tokens[None, :, None]) * E_PAD
                        + experts[None, None, :], mask=s_ok[:, None, None], other=0.0, cache_modifier=".cg")
        logits = tl.sum(parts, 0).to(x_ptr.dtype.element_ty).to(tl.float32)  # the router Linear's rounding
        logits = tl.where(e_ok[None, :], logits, -float("inf"))
        top = tl.max(logits, 1)
        chosen = tl.min(tl.where(logits == top[:, None], experts[None, :], E_PAD), 1)
        scores = (1.0 / (1.0 + tl.exp(-top))).to(x_ptr.dtype.element_ty).to(tl.float32)  # (BLOCK_T,)
        tl.store(ids_ptr + tokens, chosen.to(tl.int32), mask=t_ok)
        tl.store(weights_ptr + tokens, tl.zeros([BLOCK_T], dtype=tl.float32) + 1.0, mask=t_ok)
        if STACKED:
            tl.store(ids_ptr + num_tokens + tokens, tl.zeros([BLOCK_T], dtype=tl.int32) + shared_slot, mask=t_ok)
            tl.store(weights_ptr + num_tokens + tokens, tl.zeros([BLOCK_T], dtype=tl.float32) + 1.0, mask=t_ok)
        scales = tl.zeros([BLOCK_T], dtype=tl.float32)
        if QUANTIZE:
            peaks = tl.load(peak_ptr + splits[:, None] * BLOCK_T + tokens[None, :], mask=s_ok[:, None], other=0.0,
                            cache_modifier=".cg")
            scales = e4m3_row_scale(tl.max(peaks, 0))
            tl.store(scale_ptr + tokens, scales, mask=t_ok)
        row = tl.arange(0, ROW_BLOCK)
        row_ok = row < H
        for t in range(num_tokens):  # each token's rows from h (written by every program: read through L2)
            h = tl.load(h_ptr + t * stride_h + row, mask=row_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            score = tl.sum(tl.where(tokens == t, scores, 0.0), 0)
            tl.store(rows_ptr + t * stride_r + row, (h * score).to(rows_ptr.dtype.element_ty), mask=row_ok)
            if QUANTIZE:
                scale = tl.sum(tl.where(tokens == t, scales, 0.0), 0)
                tl.store(q_ptr + t * stride_q + row, to_e4m3(h, scale), mask=row_ok)


_WORKSPACES: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def reserve_route_workspace(device: torch.device, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial logits (MAX_SPLITS, 16, E_PAD), partial peaks (MAX_SPLITS, 16) float32, count (1,) int32 zero between
    calls: the kernel leaves it so) of ``device``, made once: call it before a CUDA graph captures the router (the
    model's init_buffers does). The layers of a step run one after another on one stream, so they share it."""
    e_pad = _experts_pad(num_experts)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one key for "cuda" and the tensors' "cuda:i"
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, e_pad)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.empty(MAX_SPLITS, ROUTE_ROWS, e_pad, dtype=torch.float32, device=device),
                            torch.empty(MAX_SPLITS, ROUTE_ROWS, dtype=torch.float32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def _experts_pad(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))  # (a tl.dot's N is at least 16)


# The last program's (splits, 16 tokens, experts) float32 partials, loaded at once, at most (32 a thread of 8 warps).
MAX_PARTIALS = 8192


def route_top1_fits(num_experts: int, hidden: int) -> bool:
    """Whether the one launch takes a router of ``num_experts`` over ``hidden``: Scout's 16 experts over 5,120 (20
    splits) fit; Maverick's 128 experts do not (their partials would spill), and keep the unfused path."""
    splits = triton.cdiv(hidden, BLOCK_H)
    return splits <= MAX_SPLITS and (
        triton.next_power_of_2(splits) * ROUTE_ROWS * _experts_pad(num_experts) <= MAX_PARTIALS)


def route_top1_triton(x: torch.Tensor, router_weight: torch.Tensor, quantize: bool = False,
                      norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                      shared_slot: int | None = None) -> Top1Routing:
    """route_top1_ref's outputs in one launch (x's, the residual's and the weights' last dims contiguous,
    T <= ROUTE_ROWS, route_top1_fits)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    splits = triton.cdiv(hidden, BLOCK_H)
    assert x.stride(1) == 1 and router_weight.stride(1) == 1 and router_weight.shape[1] == hidden
    assert shared_slot is None or not quantize
    assert num_tokens <= ROUTE_ROWS and route_top1_fits(num_experts, hidden)
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
        parts, peaks, count = reserve_route_workspace(x.device, num_experts)
        _route_top1_kernel[(splits,)](
            x, residual, norm_weight, h, residual_out, router_weight, rows, ids, weights, values, scale, parts, peaks,
            count, num_tokens, hidden, num_experts, float(eps), x.stride(0), residual.stride(0), h.stride(0),
            residual_out.stride(0), router_weight.stride(0), rows.stride(0), values.stride(0),
            -1 if shared_slot is None else shared_slot, E_PAD=parts.shape[2], BLOCK_T=ROUTE_ROWS, BLOCK_H=BLOCK_H,
            ROW_BLOCK=triton.next_power_of_2(hidden), S_PAD=triton.next_power_of_2(splits), HAS_NORM=norm is not None,
            QUANTIZE=quantize, STACKED=shared_slot is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=8, **pdl_options(x))
    residual_out = residual_out if norm is not None else None
    if shared_slot is not None:
        return Top1Routing(all_rows, ids, weights, all_rows[num_tokens:], residual_out)
    shared = QuantizedRows(values, scale, x.dtype) if quantize else h
    return Top1Routing(rows, ids, weights, shared, residual_out)
