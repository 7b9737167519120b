"""A batch-1 decode step's residual add + RMSNorm fused into the skinny product that reads the normed row.

A pre-norm layer at batch 1 runs ``h, residual = rms_norm(x, g, eps, residual)`` and then a
product of h: two launches, the first a few microseconds of latency around 4 KB of data. RMSNorm's
only statistic is a per-row scale, so it commutes with the product::

    out[m, n] = sum_k W[n, k] g[k] x[m, k] / rms(x[m])  =  inv_rms[m] * (W @ (g * x[m]))[n]

Each program streams its weight rows as kernels/linear.py's skinny kernel does (the weight tile
straight into a tensor-core dot, so Triton pipelines its loads) and, in the same K loop, sums x's
parts (the K weighted expert rows a MoE layer leaves unsummed, kernels/rmsnorm.py's NUM_PARTS), adds
the residual and accumulates the squares on (BLOCK_K,) vectors, and feeds g * x to the dot as row 0
of its 16 rows; the scale is applied in the epilogue. (sm_90 compiles: x's parts as 16-row tiles took
255 registers and spilled; a CUDA-core product was not pipelined at all.) No pass over x before the
product, so no dependent round trip is added. The programs of output tile 0 store the new residual
stream (their K range of it).

Rounding: the unfused path rounds x / rms to x's dtype, then g * that, then the product; here
g * x is rounded once and the float32 sums are scaled before the one rounding of the output. The
two agree to the dtype's rounding (float32: ~1e-6), not bit for bit.

Shapes: x (1, K) or (1, parts, K), unit stride along K; residual (1, K) or None; g (K,); weight (N, K)
row-major, bf16 / fp16 / float32 (not FP8); out (1, N) in x's dtype; new residual (1, K) (x itself when
nothing was added or summed, as rms_norm returns it). More rows keep the two launches (the load-time
choice times batch 1 only).
Tilings are kernels/linear.py's tuples (block_n, block_k, warps, stages[, split_k[, swap_ab[,
waves]]]); split-K programs also store their squared sums, and the last arrival of an output tile
adds both in split order (deterministic), as linear.py's kernel does.
``rms_norm_linear`` runs the kernel on CUDA (and under TRITON_INTERPRET=1) and
``rms_norm_linear_ref`` (the two unfused calls, plain torch) elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.linear import _arrival_counters, output_columns, variant_options
from kernels.rmsnorm import rms_norm_ref

# The tilings a model's load-time choice times against the unfused pair (engine/executor/decode_fusions.py):
# kernels/linear.py's best at one row for DeepSeek-V2-Lite's 3648 x 2048 first product on an H200
# (2026-11-29: (32, 128, 4, 6) 5.23 us, cuBLAS 5.25: 114 programs on 132 SMs), and two swapped, balanced
# one-wave tilings (28 features a program there): split-K 2 and whole rows.
TILINGS = ((32, 128, 4, 6), (64, 128, 4, 4, 2, 1, 1), (64, 128, 4, 6, 1, 1, 1))


def rms_norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused pair: (F.linear(rms_norm(x + residual) * g, weight), new residual)."""
    h, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(h, weight), new_residual


@jit
def _rms_norm_linear_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, out_ptr, res_out_ptr, part_ptr, sq_ptr, arrivals_ptr,
    N, K, K_PER_SPLIT, stride_xp, stride_wn, ROWS, eps,
    NUM_PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BALANCED: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, s): output features of tile i (output_columns) of the one row over K range s. The row
    is handled as (BLOCK_K,) vectors (parts, residual, squares) and enters the tensor-core dot as row 0 of
    a 16-row tile, the weight tile as kernels/linear.py's skinny kernel loads it (SWAP_AB: see there).
    part (SPLIT_K, N) and sq (tiles, SPLIT_K) float32 hold split-K partials (module docstring)."""
    cols, col_ok = output_columns(N, ROWS, BLOCK_N, BALANCED)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    split = tl.program_id(1)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    first_tile = (tl.arange(0, BLOCK_K) * 0 + tl.program_id(0)) == 0  # (as a vector: a mask's shape)
    pdl_prologue(PDL)
    row0 = (tl.arange(0, 16) == 0)[:, None]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    else:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        if NUM_PARTS > 1:  # summed in float32, rounded once (as x.sum(dim=1))
            total = tl.zeros([BLOCK_K], dtype=tl.float32)
            for part in tl.static_range(NUM_PARTS):
                total += tl.load(x_ptr + part * stride_xp + k, mask=k_ok, other=0.0).to(tl.float32)
            x = total.to(x_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        if HAS_RESIDUAL:  # rounded before the statistics, as the reference's x + residual
            x = (x.to(tl.float32) + tl.load(res_ptr + k, mask=k_ok, other=0.0).to(tl.float32))
            x = x.to(x_ptr.dtype.element_ty)
        if WRITE_RESIDUAL:
            tl.store(res_out_ptr + k, x, mask=k_ok & first_tile)
        xf = x.to(tl.float32)
        squares += xf * xf
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        h = tl.where(row0, (xf * g)[None, :], 0.0).to(x_ptr.dtype.element_ty)  # (16, BLOCK_K): the row, then 0s
        w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(h), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    out = tl.sum(tl.where(row0, acc, 0.0), axis=0)  # row 0 of the (16, BLOCK_N) sums
    sumsq = tl.sum(squares, axis=0)
    if SPLIT_K > 1:
        tl.store(part_ptr + split * N + cols, out, mask=col_ok)
        sq_tile = sq_ptr + tl.program_id(0) * SPLIT_K
        tl.store(sq_tile + split, sumsq)
        tl.debug_barrier()  # every thread's sums stored before the count goes up (kernels/linear.py)
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            out = tl.zeros([BLOCK_N], dtype=tl.float32)
            sumsq = 0.0
            for s in tl.static_range(SPLIT_K):  # in split order: deterministic
                out += tl.load(part_ptr + s * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
                sumsq += tl.load(sq_tile + s, cache_modifier=".cg")
            tl.store(out_ptr + cols, (out * tl.rsqrt(sumsq / K + eps)).to(out_ptr.dtype.element_ty), mask=col_ok)
            tl.store(arrivals_ptr + tl.program_id(0), 0)
    else:
        tl.store(out_ptr + cols, (out * tl.rsqrt(sumsq / K + eps)).to(out_ptr.dtype.element_ty), mask=col_ok)


def rms_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, variant: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_linear_ref's contract for ONE row in one launch at tiling ``variant`` (module docstring)."""
    m, k = x.shape[0], x.shape[-1]
    parts = x.shape[1] if x.dim() == 3 else 1
    n = weight.shape[0]
    assert m == 1 and x.stride(-1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    assert residual is None or (residual.shape == (m, k) and residual.stride(1) == 1)
    write_residual = residual is not None or parts > 1
    new_residual = torch.empty(m, k, dtype=x.dtype, device=x.device) if write_residual else x
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    opts = variant_options(variant)
    block_n, block_k, waves = opts["block_n"], opts["block_k"], opts["waves"]
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(1, min(opts["split_k"], k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no program without work
    rows_per_program = min(block_n, triton.cdiv(n, waves * num_sms(x.device))) if waves > 0 else block_n
    tiles = triton.cdiv(n, rows_per_program)
    if split_k > 1:
        part = torch.empty(split_k, n, dtype=torch.float32, device=x.device)
        squares = torch.empty(tiles, split_k, dtype=torch.float32, device=x.device)
        arrivals = _arrival_counters(x.device, tiles)
    else:
        part = squares = arrivals = out
    norm_weight, = dense(norm_weight)  # read at ptr + column
    _rms_norm_linear_kernel[(tiles, split_k)](
        x, residual if residual is not None else x, norm_weight, weight, out, new_residual, part, squares, arrivals,
        n, k, k_per_split, x.stride(1) if parts > 1 else 0, weight.stride(0), rows_per_program, float(eps),
        NUM_PARTS=parts, HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=write_residual, SWAP_AB=opts["swap_ab"],
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BALANCED=waves > 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=opts["num_warps"],
        num_stages=opts["num_stages"], **pdl_options(x),
    )
    return out, new_residual


def fuses(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The fused kernel takes these rows: Triton on x's device, one row with unit stride along K, and a
    weight in an activation dtype (FP8 and integer weights keep their own products)."""
    return (use_triton(x) and x.shape[0] == 1 and x.stride(-1) == 1 and weight.dtype == x.dtype
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32))


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, variant: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(product of the normed rows, new residual): the kernel where ``fuses``, else the reference."""
    if fuses(x, weight):
        return rms_norm_linear_triton(x, residual, norm_weight, eps, weight, variant)
    return rms_norm_linear_ref(x, residual, norm_weight, eps, weight)
