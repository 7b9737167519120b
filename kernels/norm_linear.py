"""A decode step's skinny product with the LayerNorm before it and the residual add after it, one kernel.

A pre-norm LayerNorm decoder layer (Whisper's, mBART's) at batch 1 is launch-bound: each of its
three sub-layers is LayerNorm -> product(s) -> ... -> product -> residual add, and at a few rows
every one of those is a kernel of a few microseconds around a weight read of about one. Here:

- ``norm``: the product's input rows are first layer-normalized, then scaled and shifted by the
  norm's weight and bias and rounded to x's dtype, exactly as ``F.layer_norm`` (float32 math, one
  rounding) feeds the unfused product. The rows' mean and variance come either from ``row_stats``,
  the partials the product that wrote x emitted (one load of (3, tiles, M) floats, independent of
  the load of x), or, without them, from x itself (each program two passes over the whole K:
  dependent round trips, ~4 us on an H200);
- ``emit_stats`` (with ``residual``: the kernel that writes a pre-norm layer's residual stream):
  each output tile also stores, per row, its column count, sum and squared deviations from the
  tile's mean, of the rounded values it stored; a consumer merges them (Chan et al.'s pairwise
  formula, as accurate as two passes) -- no atomics, no extra pass, deterministic;
- the epilogue adds the product's bias, applies ``activation`` (one of kernels/linear.py's
  ACTIVATIONS) after rounding the product as F.linear does, and with ``residual`` adds the
  rounded result to the residual rows and rounds again, as ``residual + linear(...)`` does.

Tilings are kernels/linear.py's (block_n, block_k, warps, stages[, split_k[, swap_ab[, waves]]]);
split-K programs write float32 partial sums and the last arrival of an output tile adds them in
split order and runs the epilogue (linear.py's arrival counters), so the result is deterministic.

Shapes: x (M, K) rows with unit column stride, M <= MAX_ROWS (a load-time tiling tuple: at most
MAX_SKINNY_ROWS, the tilings' 16-row dot); weight (N, K) row-major;
bias (N,) or None; norm weight/bias (K,); residual (M, N) or None; out (M, N) in x's dtype.
``norm_linear`` runs the kernel on CUDA and ``norm_linear_ref`` (plain torch) elsewhere.

Measured (H200, 2026-11-29, Whisper large-v3's 1280-wide rows, one row, weights hot in L2): with a
residual epilogue as fast as the plain skinny product (1280 x 1280: 3.7 us against 3.9); with the
LayerNorm prologue about 4 us slower (7.7 against 3.8; the statistics' dependent round trips), which
is what ``row_stats`` removes (not yet measured on a GPU; engine/encoder_decoder/fused_decode.py,
its user, stays opt-in until it is).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.linear import (ACTIVATIONS, MAX_SKINNY_ROWS, _activation, _arrival_counters, activation_ref, output_columns,
                            variant_options)

PRELOAD = "preload"  # a tiling (preload_options): each program one K tile, loaded before the PDL wait
# "1": norm_linear takes PRELOAD over the weight's load-time tiling (opt-in: on an H200, 2026-11-29,
# Whisper large-v3's decode steps were slower with it, batch 1 and 64 alike)
PRELOAD_ENV = "TRITONLLM_NORM_LINEAR_PRELOAD"


MAX_ROWS = 64  # rows the PRELOAD tiling takes (a decode graph bucket of up to 64 sequences)


def preload_options(k: int, m_pad: int) -> dict:
    """The PRELOAD tiling for a reduction of ``k`` over ``m_pad`` (16, 32 or 64) padded rows: the
    reduction in tiles of 256 split over programs, one tile each. Up to 16 rows: 16 output features
    a program, tiles of 512 past K 2,560 (at most ~10 partial sums meet): Whisper large-v3's 1280 x
    1280 product is 80 x 5 programs of 8 KB of weight, its fc2 (K 5,120) 80 x 10 of 16 KB, every
    program's weight tile in flight at once and read while the kernel before runs (PDL). More rows:
    64 features a program over 8 warps (fewer programs, each re-reading x's rows for its statistics)."""
    if m_pad <= 16:
        block_n, block_k, warps = 16, (256 if k <= 2560 else 512), 4
    else:
        block_n, block_k, warps = 64, 256, 8
    return {"block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": 1,
            "split_k": triton.cdiv(k, block_k), "swap_ab": False, "waves": 0}


@jit(do_not_specialize=["M"])
def _norm_linear_kernel(
    x_ptr, norm_w_ptr, norm_b_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, arrivals_ptr, stats_in_ptr,
    stats_out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_rm, stride_om, eps, ROWS, STATS_TILES,
    NORM_K: tl.constexpr, STATS_IN: tl.constexpr, STATS_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    SWAP_AB: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, BALANCED: tl.constexpr, PRELOAD: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (i, s): output features of tile i for all M rows over K range s (see the module
    docstring; the tiling as kernels/linear.py's _skinny_gemm_kernel). NORM_K > 0: layer-normalize
    x's rows (NORM_K == K): with STATS_IN > 0 (a power of two >= STATS_TILES) from the producer's
    per-tile partials at stats_in_ptr, else from x itself. STATS_OUT: write this tile's partials of
    the output rows to stats_out_ptr (``row_stats``). PRELOAD: the program's K range is one BLOCK_K tile, and its weight tile
    (and the norm's weight and bias there) is loaded before the PDL wait, while the kernel before
    it still runs: weights are never written by a step's kernels."""
    cols, col_ok = output_columns(N, ROWS, BLOCK_N, BALANCED)
    rows = tl.arange(0, M_PAD)
    row_ok = rows < M
    x_base = x_ptr + rows[:, None] * stride_xm
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if PRELOAD:
        k_one = k_begin + tl.arange(0, BLOCK_K)
        k_one_ok = k_one < k_end
        w_one = tl.load(w_base + k_one[None, :], mask=col_ok[:, None] & k_one_ok[None, :], other=0.0)
        if NORM_K > 0:
            g_one = tl.load(norm_w_ptr + k_one, mask=k_one_ok, other=0.0).to(tl.float32)
            b_one = tl.load(norm_b_ptr + k_one, mask=k_one_ok, other=0.0).to(tl.float32)
    pdl_prologue(PDL)
    mean = tl.zeros([M_PAD], dtype=tl.float32)
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if NORM_K > 0 and STATS_IN > 0:  # the producer's partials: one load, no pass over x
        mean, rstd = _merged_row_stats(stats_in_ptr, STATS_TILES, M, rows, row_ok, NORM_K, eps, STATS_IN)
    elif NORM_K > 0:  # the rows' statistics over the whole K (unrolled: the loads go out together)
        total = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in tl.static_range(0, NORM_K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_base + k[None, :], mask=row_ok[:, None] & (k < NORM_K)[None, :], other=0.0).to(tl.float32)
            total += tl.sum(xs, axis=1)
        mean = total / NORM_K
        total = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in tl.static_range(0, NORM_K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (k < NORM_K)[None, :]
            xs = tl.load(x_base + k[None, :], mask=ok, other=0.0).to(tl.float32)
            d = tl.where(ok, xs - mean[:, None], 0.0)
            total += tl.sum(d * d, axis=1)
        rstd = 1.0 / tl.sqrt(total / NORM_K + eps)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    if PRELOAD:
        ok = row_ok[:, None] & k_one_ok[None, :]
        x = tl.load(x_base + k_one[None, :], mask=ok, other=0.0)
        if NORM_K > 0:
            h = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g_one[None, :] + b_one[None, :]
            x = tl.where(ok, h, 0.0).to(x_ptr.dtype.element_ty)  # rounded once, as F.layer_norm's output
        acc = _tile_dot(x, w_one, acc, SWAP_AB, PRECISION)
    else:
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            ok = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_base + k[None, :], mask=ok, other=0.0)
            if NORM_K > 0:
                g = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                b = tl.load(norm_b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                h = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
                x = tl.where(ok, h, 0.0).to(x_ptr.dtype.element_ty)
            w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _tile_dot(x, w, acc, SWAP_AB, PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        part = part_ptr + (tl.program_id(1) * M + rows)[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=mask)
        tl.debug_barrier()  # every thread's sums stored before the count goes up (see linear.py)
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in split order: deterministic
                acc += tl.load(part_ptr + (split * M + rows)[:, None] * N + cols[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")
            _norm_linear_epilogue(acc, rows, cols, col_ok, mask, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                                  stats_out_ptr, M, HAS_BIAS, RESIDUAL, ACTIVATION, STATS_OUT)
            tl.store(arrivals_ptr + tl.program_id(0), 0)
    else:
        _norm_linear_epilogue(acc, rows, cols, col_ok, mask, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                              stats_out_ptr, M, HAS_BIAS, RESIDUAL, ACTIVATION, STATS_OUT)


@jit
def _tile_dot(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x @ w.T (SWAP_AB: acc += w @ x.T, see kernels/linear.py); float32 engines get IEEE
    float32 dots (PRECISION "ieee"), not TF32, so that they match the float32 reference."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@jit
def _merged_row_stats(stats_ptr, TILES, M, rows, row_ok, K: tl.constexpr, eps, T_PAD: tl.constexpr):
    """(mean, rstd) of each row from the (3, TILES, M) partials (count, sum, squared deviations from
    the tile's mean) a producer wrote: Chan et al.'s pairwise merge, M2 = sum_t M2_t + n_t (mean_t -
    mean)^2, which keeps the two-pass formula's accuracy (no E[x^2] - mean^2 cancellation)."""
    tiles = tl.arange(0, T_PAD)
    ok = (tiles < TILES)[:, None] & row_ok[None, :]
    at = stats_ptr + tiles[:, None] * M + rows[None, :]
    count = tl.load(at, mask=ok, other=0.0)
    total = tl.load(at + TILES * M, mask=ok, other=0.0)
    m2 = tl.load(at + 2 * TILES * M, mask=ok, other=0.0)
    mean = tl.sum(total, axis=0) / K
    d = tl.where(ok, total / tl.where(ok, count, 1.0) - mean[None, :], 0.0)
    var = tl.sum(m2 + count * d * d, axis=0) / K
    return mean, 1.0 / tl.sqrt(var + eps)


@jit
def _norm_linear_epilogue(acc, rows, cols, col_ok, mask, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                          stats_ptr, M, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
                          STATS_OUT: tl.constexpr):
    """Bias; the product rounded, then the activation rounded; then residual + that, rounded.
    STATS_OUT: this tile's (count, sum, squared deviations from the tile mean) of each stored row,
    of the rounded values a consumer will read, at (plane, program_id(0), row) of (3, tiles, M)."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0:
        acc = _activation(acc.to(dtype).to(tl.float32), ACTIVATION)
    if RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) + res
    y = acc.to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=mask)
    if STATS_OUT:
        y = tl.where(mask, y.to(tl.float32), 0.0)
        count = tl.sum(col_ok.to(tl.float32), axis=0)
        total = tl.sum(y, axis=1)
        d = tl.where(mask, y - (total / count)[:, None], 0.0)
        at = stats_ptr + tl.program_id(0) * M + rows
        plane = tl.num_programs(0) * M
        row_ok = rows < M
        tl.store(at, tl.zeros_like(total) + count, mask=row_ok)
        tl.store(at + plane, total, mask=row_ok)
        tl.store(at + 2 * plane, tl.sum(d * d, axis=1), mask=row_ok)


def norm_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, activation: str | None = None,
                       residual: torch.Tensor | None = None, variant: tuple | str = PRELOAD,
                       row_stats: torch.Tensor | None = None, emit_stats: bool = False):
    """The kernel (module docstring); ``norm`` = (weight, bias, eps) of the LayerNorm over K; ``variant``
    a kernels/linear.py tiling tuple or PRELOAD. ``row_stats``: x's rows' partial statistics as the
    product that wrote x emitted them (the norm then reads them instead of x); ``emit_stats``: return
    (out, stats), stats the (3, tiles, M) float32 partials of out's rows (``row_stats``)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= (MAX_ROWS if variant == PRELOAD else MAX_SKINNY_ROWS) and x.stride(1) == 1 and weight.stride(1) == 1
    assert activation is None or activation in ACTIVATIONS
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1)
    assert row_stats is None or (norm is not None and row_stats.shape[0] == 3 and row_stats.shape[2] == m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return (out, torch.zeros(3, 1, 0, dtype=torch.float32, device=x.device)) if emit_stats else out
    m_pad = max(16, triton.next_power_of_2(m)) if variant == PRELOAD else 16
    opts = variant_options(variant) if variant != PRELOAD else preload_options(k, m_pad)
    block_n, block_k, waves = opts["block_n"], opts["block_k"], opts["waves"]
    k_tiles = triton.cdiv(k, block_k)
    split_k = max(1, min(opts["split_k"], k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no program without work
    preload = k_per_split == block_k
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    rows_per_program = min(block_n, triton.cdiv(n, waves * num_sms(x.device))) if waves > 0 else block_n
    tiles = triton.cdiv(n, rows_per_program)
    arrivals = _arrival_counters(x.device, tiles) if split_k > 1 else part
    norm_w, norm_b, eps = norm if norm is not None else (weight, weight, 0.0)
    # read at ptr + column (row_stats: + (part * tiles + tile) * M + row)
    norm_w, norm_b, bias, row_stats = dense(norm_w, norm_b, bias, row_stats)
    stats = torch.empty(3, tiles, m, dtype=torch.float32, device=x.device) if emit_stats else None
    stats_tiles = row_stats.shape[1] if row_stats is not None else 0
    _norm_linear_kernel[(tiles, split_k)](
        x, norm_w, norm_b, weight, bias if bias is not None else weight, residual if residual is not None else out,
        out, part, arrivals, row_stats if row_stats is not None else part, stats if emit_stats else part,
        m, n, k, k_per_split, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), float(eps), rows_per_program, stats_tiles,
        NORM_K=k if norm is not None else 0, STATS_IN=triton.next_power_of_2(stats_tiles) if stats_tiles else 0,
        STATS_OUT=emit_stats, HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
        ACTIVATION=ACTIVATIONS.index(activation) + 1 if activation else 0, SWAP_AB=opts["swap_ab"], M_PAD=m_pad,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BALANCED=waves > 0, PRELOAD=preload,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=opts["num_warps"], num_stages=opts["num_stages"], **pdl_options(x),
    )
    return (out, stats) if emit_stats else out


def row_stats_ref(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance) per row of the (3, tiles, M) partials ``emit_stats`` returns, merged
    as the kernel merges them (float32)."""
    count, total, m2 = stats.double().unbind(0)
    k = count.sum(0)
    mean = total.sum(0) / k
    return mean.float(), ((m2 + count * (total / count - mean) ** 2).sum(0) / k).float()


def norm_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, activation: str | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused torch: layer_norm (float32 math, one rounding to x's dtype), F.linear, the
    activation, then residual + the result."""
    if norm is not None:
        w, b, eps = norm
        x = F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps).to(x.dtype)
    y = F.linear(x, weight, bias)
    if activation is not None:
        y = activation_ref(y, activation)
    return y if residual is None else residual + y


def norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, activation: str | None = None,
                residual: torch.Tensor | None = None, variant: tuple | None = None,
                row_stats: torch.Tensor | None = None, emit_stats: bool = False):
    """The fused kernel on CUDA for at most MAX_ROWS contiguous rows, else norm_linear_ref.
    Tiling: ``variant`` (the weight's load-time choice) for up to MAX_SKINNY_ROWS rows; PRELOAD
    without one, for more rows, or with $TRITONLLM_NORM_LINEAR_PRELOAD=1. ``emit_stats``: return
    (out, row statistics or None); ``row_stats``: such statistics of x (None: the norm reads x)."""
    if use_triton(x) and x.shape[0] <= MAX_ROWS and x.stride(1) == 1:
        if variant is None or x.shape[0] > MAX_SKINNY_ROWS or os.environ.get(PRELOAD_ENV, "0") == "1":
            variant = PRELOAD
        return norm_linear_triton(x, weight, bias, norm=norm, activation=activation, residual=residual,
                                  variant=variant, row_stats=row_stats if norm is not None else None,
                                  emit_stats=emit_stats)
    out = norm_linear_ref(x, weight, bias, norm=norm, activation=activation, residual=residual)
    return (out, None) if emit_stats else out
