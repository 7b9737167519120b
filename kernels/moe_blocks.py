"""What the four grouped expert GEMMs share (kernels/fused_moe.py in the model dtype,
fused_moe_fp8.py, fused_moe_mxfp4.py, fused_moe_wna16.py): their prologue, the block of
assignments and the column tile a program covers (``past_padded_blocks``, ``expert_block_tile``,
``activation_tiles``); their epilogue, the rows it stores (``store_rows``); and the launch
arguments that say how the blocks are made (``expert_block_launch``). The FMA kernels of a few
assignments (fused_moe_mxfp4.py, fused_moe_wna16.py) take ``block_rows`` and ``store_rows`` too.

A program (block b, column tile n) of a grouped GEMM multiplies the BLOCK_M assignment rows of
block b by column tile n of the weight of the block's expert. Blocks come from moe_align
(kernels/moe_align.py: sorted_ids (num_blocks * BLOCK_M,), block_expert (num_blocks,), num_padded
(1,)), or with ONE_PER_BLOCK (a single token: its K experts are distinct) block b is assignment b
alone, of expert topk_ids[b], and no alignment runs at all. ROUTE_IN_KERNEL (with ONE_PER_BLOCK):
every program finds the token's top-k from its router logits itself (E values: nothing next to
the weight tiles) and takes the b-th; program (0, 0) writes them to topk_weights / topk_ids for
the down GEMM, so the single token's routing costs no launch of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._triton import dense, jit, require_dense, tl, triton
from kernels.moe_epilogue import gated_activation
from kernels.moe_routing import _top_k_of_row


@jit
def block_rows(block, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts,
               num_assignments, TOP_K: tl.constexpr, ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
               RENORMALIZE: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(ids (BLOCK_M,) int32 assignments, row_ok (BLOCK_M,), expert int64) of block ``block`` (the
    module docstring's ONE_PER_BLOCK and ROUTE_IN_KERNEL). With moe_align's blocks, a block past
    num_padded reads the unused tail of sorted_ids / block_expert: its ids and expert are not to
    be used (``past_padded_blocks``)."""
    if ONE_PER_BLOCK:
        ids = block + tl.arange(0, BLOCK_M) * 0
        row_ok = tl.arange(0, BLOCK_M) == 0
        if ROUTE_IN_KERNEL:
            chosen_w, chosen_id = _top_k_of_row(logits_ptr, num_experts, TOP_K, K_PAD, E_PAD, RENORMALIZE)
            slots = tl.arange(0, K_PAD)
            expert = tl.sum(tl.where(slots == block, chosen_id, 0), 0).to(tl.int64)
            write = (slots < TOP_K) & (slots * 0 + block + tl.program_id(1) == 0)  # program (0, 0) only
            tl.store(topk_weights_ptr + slots, chosen_w, mask=write)
            tl.store(topk_ids_ptr + slots, chosen_id, mask=write)
        else:
            expert = tl.load(topk_ids_ptr + block).to(tl.int64)
    else:
        ids = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = ids < num_assignments
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
    return ids, row_ok, expert


@jit
def past_padded_blocks(num_padded_ptr, ONE_PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Whether block program_id(0) lies past the last expert's padded run (moe_align's num_padded;
    the grid covers the worst case): the grouped GEMMs return at once there, before reading or
    storing anything. Never with ONE_PER_BLOCK (the grid is the assignments)."""
    if ONE_PER_BLOCK:
        past = False
    else:
        past = tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr)
    return past


@jit
def expert_block_tile(w_ptr, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr,
                      num_experts, N, num_assignments, stride_we, stride_wn,
                      TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr,
                      ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr,
                      K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The grouped GEMMs' prologue, after ``past_padded_blocks``: what program (block program_id(0),
    column tile program_id(1)) covers. Returns (ids, row_ok, expert, a_rows, cols, col_ok, num_rows, w_base):

    - ids (BLOCK_M,) int32 assignments, row_ok (BLOCK_M,), expert int64: ``block_rows``;
    - a_rows (BLOCK_M,) int64: the rows of ``a`` the assignments read, ids // TOP_K when
      ROWS_PER_TOKEN (x: one row per token), else ids (act: one row per assignment);
    - cols (BLOCK_N,), col_ok: the output columns; num_rows: the rows of an expert's weight, 2N when
      GATED ([gate | up]: up's row of column c is N + c), else N; w_base (BLOCK_N, 1): the expert's
      weight rows ``cols`` (w_ptr + expert * stride_we + cols * stride_wn)."""
    ids, row_ok, expert = block_rows(tl.program_id(0), sorted_ids_ptr, block_expert_ptr, topk_ids_ptr,
                                     topk_weights_ptr, logits_ptr, num_experts, num_assignments, TOP_K,
                                     ONE_PER_BLOCK, ROUTE_IN_KERNEL, RENORMALIZE, K_PAD, E_PAD, BLOCK_M)
    a_rows = (ids // TOP_K if ROWS_PER_TOKEN else ids).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    num_rows = 2 * N if GATED else N
    w_base = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    return ids, row_ok, expert, a_rows, cols, col_ok, num_rows, w_base


@jit
def activation_tiles(a_ptr, a_rows, stride_am, SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """(a_base, acc, acc_up) of a grouped GEMM: a_base the rows ``a_rows`` of ``a`` as (BLOCK_M, 1),
    for activation tiles (BLOCK_M, BLOCK_K); with SWAP_AB (the transposed product, out.T = w . a.T)
    as (1, BLOCK_M), for tiles (BLOCK_K, BLOCK_M). acc and acc_up: float32 zeros (BLOCK_M, BLOCK_N),
    or (BLOCK_N, BLOCK_M) with SWAP_AB (the caller transposes them before ``store_rows``)."""
    if SWAP_AB:
        a_base = a_ptr + a_rows[None, :] * stride_am
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_base = a_ptr + a_rows[:, None] * stride_am
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return a_base, acc, tl.zeros_like(acc)


@jit
def tile_dot(acc, w, a, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + w . a (SWAP_AB: w (BLOCK_N, BLOCK_K), a (BLOCK_K, BLOCK_M)) or acc + a . w.T, with w
    (widened or dequantized in registers) in a's dtype."""
    if SWAP_AB:
        acc = tl.dot(w.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
    return acc


@jit
def store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, bias_ptr, expert,
               stride_be, N, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr):
    """A grouped GEMM's epilogue: acc (BLOCK_M, BLOCK_N) float32 (and acc_up when GATED) -> out rows
    ``ids``, columns ``cols``. GATED: w has 2N rows per expert [gate | up]; out = act(gate, up),
    rounded as the unfused path rounds (each product to the output dtype, then the activation).
    MUL_WEIGHT: each row is scaled by topk_weights[a] (float32) before the one rounding to out.
    HAS_BIAS: expert ``expert``'s bias row (bias_ptr + expert * stride_be; GATED: [gate (N) | up (N)])
    joins the products first. ACTIVATION (GATED): kernels/moe_epilogue.py ACTIVATIONS, as
    activate_ref computes it; not GATED, ACTIVATION 2 (relu2) is applied to the products (the caller
    passes it for an up GEMM only, never for a down GEMM)."""
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be
        acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = gated_activation(acc, acc_up, out_ptr.dtype.element_ty, ACTIVATION, SWIGLU_LIMIT)
    elif ACTIVATION == 2:  # relu2 (not gated): relu(h)^2, h rounded to the output dtype first, as activate_ref
        acc = tl.maximum(acc.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        acc = acc * acc
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + ids, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class BlockLaunch:
    """A grouped GEMM's launch over expert blocks (``expert_block_launch``): ``grid`` (blocks, column
    tiles); ``pointers`` the kernels' (sorted_ids, block_expert, num_padded, topk_ids, topk_weights,
    logits) arguments, in that order; ``constexprs`` the block flags every grouped kernel takes by
    name (TOP_K, ROWS_PER_TOKEN, GATED, MUL_WEIGHT, ONE_PER_BLOCK, ROUTE_IN_KERNEL, RENORMALIZE,
    K_PAD, E_PAD, BLOCK_M, BLOCK_N)."""

    grid: tuple[int, int]
    pointers: tuple[torch.Tensor, ...]
    constexprs: dict


def routing_tensors(topk_ids: torch.Tensor, topk_weights: torch.Tensor, router_logits: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(topk_ids, topk_weights, router_logits) as the expert kernels address them, flat at ptr + token * K + k
    (router_logits: ptr + expert): dense copies of views where the kernel reads them; where it routes
    itself (router_logits given) it writes topk_ids / topk_weights, so those must be dense already."""
    if router_logits is None:
        return (*dense(topk_ids, topk_weights), None)
    require_dense(topk_ids=topk_ids, topk_weights=topk_weights)
    return (topk_ids, topk_weights, *dense(router_logits))


def expert_block_launch(blocks, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, n: int, num_experts: int,
                        top_k: int, rows_per_token: bool, gated: bool, mul_weight: bool, block_m: int, block_n: int,
                        router_logits: torch.Tensor | None = None, renormalize: bool = False) -> BlockLaunch:
    """blocks: moe_align's (sorted_ids, block_expert, num_padded), or None for one block per
    assignment (a single token). router_logits (1, E) (with blocks None): route in the kernel and
    write topk_weights / topk_ids (flat, K) instead of reading them. n: the output columns (the
    GEMM's N; gated: the width of each of gate and up)."""
    topk_ids, topk_weights, router_logits = routing_tensors(topk_ids, topk_weights, router_logits)
    num_blocks = topk_ids.numel() if blocks is None else blocks[0].numel() // block_m
    sorted_ids, block_expert, num_padded = blocks if blocks is not None else (topk_ids,) * 3  # unread
    logits = router_logits if router_logits is not None else topk_weights  # unread without routing
    return BlockLaunch(
        grid=(num_blocks, triton.cdiv(n, block_n)),
        pointers=(sorted_ids, block_expert, num_padded, topk_ids, topk_weights, logits),
        constexprs=dict(TOP_K=top_k, ROWS_PER_TOKEN=rows_per_token, GATED=gated, MUL_WEIGHT=mul_weight,
                        ONE_PER_BLOCK=blocks is None, ROUTE_IN_KERNEL=router_logits is not None,
                        RENORMALIZE=renormalize, K_PAD=triton.next_power_of_2(top_k),
                        E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, BLOCK_N=block_n))
