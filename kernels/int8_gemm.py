"""SmoothQuant W8A8 INT8 products of many rows (prefill, batched decode): one Triton GEMM with the scaling fused.

Why: past MAX_SKINNY_ROWS, kernels/int8_sq.py ran ``torch._int_mm`` (cuBLASLt int8 tensor cores) into an int32
(M, N) tensor, then scaled it in torch: the float conversion, the row scale, the column scale, the bias and the
cast each a full pass over (M, N) int32 / float32 values, and for the gated MLP a separate silu_and_mul on top.
On an H200 (2026-11-30, commit 135a3bf, engine_bench 128/128 offline at max batch 512, Llama-3.1-8B shape)
int8_sq served 12,275 output tok/s against bf16's 16,686: a batch-512 decode step took 23.7 ms against 17.7.

What: tiles of int8 rows x (BLOCK_M, BLOCK_K) and weight rows w (BLOCK_N, BLOCK_K) meet in int8 tensor-core
dots (``tl.dot(..., out_dtype=tl.int32)``) into an int32 accumulator, exact over the whole K range
(|sum| <= 127^2 K < 2^31 for K < 133,000); the epilogue is kernels/linear.py ``product_epilogue``, the skinny
int8 kernel's: float32 (sum * s_x[m]) * s_w[n], the bias, one rounding to the output dtype: ``_scaled``'s order,
so without a bias the result equals ``int8_linear_ref`` bit for bit (with one, within one rounding: the GPU may
fuse the add into a multiply-add). Gated ([gate | up] weight (2N, K)): each program holds a gate and an up
accumulator for the same output columns and writes silu(gate) * up, each product rounded to the output dtype
first, as silu_and_mul(int8_linear(...)) rounds; the (M, 2N) product is never written.

On an H200 (2026-11-30, benchmarks/quantization/int8_gemm_bench.py, Llama-8B shapes, the row quantizer included):
gate_up with its SiLU-and-mul at 512 / 8,192 rows 135.5 / 1,799 us against the _int_mm path's 326.7 / 4,748 and
cuBLAS bf16 + silu_and_mul's 166.0 / 3,054; down_proj 76.5 / 920 against 111.9 / 1,608 and 79.0 / 1,269; the plain
products equal to int8_linear_ref bit for bit.

Programs are ordered in groups of GROUP_M row tiles (Triton's matmul tutorial's grouped order): consecutive
programs share a weight column tile and a few row tiles, so both stay in L2 while a wave runs.

Tilings, (block_m, block_n, block_k, num_warps, num_stages[, tma]): INT8_GEMM_TILINGS (plain) and
INT8_GATED_TILINGS (two accumulators and two weight tiles a stage, so at most 128 columns); tma: the tiles come
through the tensor-memory accelerator (host-side descriptors) where the operands' alignment allows. They are
timed at engine load per weight shape and per row bucket of INT8_GEMM_ROW_BUCKETS (``choose_int8_gemm_tilings``,
through kernels/fp8.py choose_skinny_tilings / fastest_tiling and the persistent choice cache) and kept on the
weight. Why timed and not a rule by M: the best tiling depends on how the (M / block_m) x (N / block_n) tiles
fill the SMs' waves, per shape; and the kernel does not specialize on M, so the compiles are per tiling (16),
shared by every bucket, and the timings themselves are ~10 s for a Llama-8B engine's four shapes at all nine
buckets (estimated, not measured yet), once: the choice cache keeps them. An untimed weight takes
``default_tiling(M)``.
"""
from __future__ import annotations

import os

import torch

from kernels._triton import TensorDescriptor, dense, jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import product_epilogue

# Candidate tilings (block_m, block_n, block_k, num_warps, num_stages[, tma]). Shared memory a stage: block_m *
# block_k + block_n * block_k bytes (gated: two weight tiles), at most ~160 KB over the stages (an H200 has 227 KB).
# tma 1: the tiles through TMA descriptors (Hopper's bulk copies) instead of per-thread loads.
INT8_GEMM_TILINGS = ((64, 128, 128, 4, 4), (64, 256, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4),
                     (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
                     (64, 128, 128, 4, 4, 1), (128, 128, 128, 8, 4, 1), (128, 256, 128, 8, 3, 1))
# Gated: each program's columns are twice its block_n (gate and up), so the accumulators of 128 x 128 tiles
# need 8 warps (128 int32 registers a thread each).
INT8_GATED_TILINGS = ((64, 128, 128, 4, 4), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
                      (128, 64, 128, 4, 4), (64, 128, 128, 4, 4, 1), (128, 128, 128, 8, 3, 1))
GROUP_M = 8  # row tiles per group of the program order
# Row counts timed at load; a product of M rows takes the tiling of the first bucket >= M (the last beyond it).
INT8_GEMM_ROW_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
INT8_GEMM_ATTR = "_int8_gemm_tilings"  # on a weight: {bucket: tiling} chosen at load
INT8_GEMM_ENV = "TRITONLLM_INT8_GEMM"  # "0": rows past MAX_SKINNY_ROWS take torch._int_mm as before (A/B runs)


def int8_gemm_enabled() -> bool:
    return os.environ.get(INT8_GEMM_ENV, "1") != "0"


def default_tiling(m: int, gated: bool) -> tuple:
    """The tiling of an M-row product whose weight was not timed at load: the fastest of the candidates on an
    H200 (2026-11-30, benchmarks/quantization/int8_gemm_bench.py, Llama-8B shapes): gated 128 x 128 x 128 tiles
    through TMA (gate_up at 512 / 8192 rows: 127.8 / 1757 us); plain 64 x 128 x 128 through TMA up to 1,024 rows
    (down_proj at 512: 51.7 us, 117.3 for 128 x 256), 128 x 128 x 128 by per-thread loads past them (down at
    8192: 697.5 us, 957.5 for 128 x 256)."""
    if gated:
        return (128, 128, 128, 8, 3, 1)
    return (64, 128, 128, 4, 4, 1) if m <= 1024 else (128, 128, 128, 8, 3)


def row_bucket(m: int) -> int:
    """The INT8_GEMM_ROW_BUCKETS entry whose load-time tiling an M-row product takes."""
    return next((b for b in INT8_GEMM_ROW_BUCKETS if m <= b), INT8_GEMM_ROW_BUCKETS[-1])


def tiling_for(weight: torch.Tensor, m: int, gated: bool) -> tuple:
    """The load-time tiling of ``weight`` for M rows, else default_tiling."""
    return getattr(weight, INT8_GEMM_ATTR, {}).get(row_bucket(m)) or default_tiling(m, gated)


@jit(do_not_specialize=["M"])  # one compile for every row count
def _int8_gemm_kernel(x_ptr, w_ptr, x_desc, w_desc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                      PDL: tl.constexpr):
    """One program: the (BLOCK_M, BLOCK_N) output tile (pid_m, pid_n), in grouped order. Rows and columns past
    M and N are loaded as row / column 0 (in bounds, no masks in the K loop) and never stored; EVEN_K: K is a
    multiple of BLOCK_K, so the K loop loads unmasked too. TMA: the tiles come through the tensor-memory
    accelerator (x_desc, w_desc: boxes (BLOCK_M, BLOCK_K) and (BLOCK_N, BLOCK_K); out-of-range rows and K
    columns read as zeros) instead of per-thread loads."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_rows = tl.where(col_ok, cols, 0).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]
    w_up_ptrs = w_ptr + (w_rows + N)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    pdl_prologue(PDL)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            x = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(ks < K - k0)[None, :], other=0)
            w = tl.load(w_ptrs, mask=(ks < K - k0)[None, :], other=0)
        # out_dtype named: tl.dot's default (float32) against an int32 acc fails to compile on the GPU
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        if GATED:
            if TMA:  # (the last tile's gate rows past N are up rows, its up rows past 2N zeros: never stored)
                w_up = w_desc.load([N + pid_n * BLOCK_N, k0])
            elif EVEN_K:
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=(ks < K - k0)[None, :], other=0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, out_dtype=tl.int32)
            w_up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rows = rows.to(tl.int64)  # the epilogue's output offsets: M x N may pass 2^31
    product_epilogue(acc.to(tl.float32), acc_up.to(tl.float32), rows, cols, row_ok, col_ok,
                     row_ok[:, None] & col_ok[None, :], bias_ptr, w_scale_ptr, x_scale_ptr, out_ptr, N, stride_om,
                     HAS_BIAS, GATED, True, True, 0)


def tma_readable(t: torch.Tensor) -> bool:
    """Whether the TMA unit can read the 2-D int8 tensor ``t`` (rows x K) by descriptor: Triton's host-side
    descriptors, a 16-byte aligned base and row stride (TMA's rules), unit column stride."""
    return (TensorDescriptor is not None and t.stride(1) == 1 and t.stride(0) % 16 == 0
            and t.data_ptr() % 16 == 0)


def int8_gemm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, *, out_dtype: torch.dtype, gated: bool = False,
              tiling: tuple | None = None) -> torch.Tensor:
    """codes (M, K) int8 rows with per-row scales x_scale (M,) float32, @ the int8 weight (N, K) with per-column
    scales weight_scale (N,) float32 (+ bias (N,)) -> (M, N) in ``out_dtype``. ``gated``: weight (2N, K) =
    [gate | up], result silu(gate product) * (up product) (no bias). ``tiling``: (block_m, block_n, block_k,
    num_warps, num_stages[, tma]), default ``tiling_for(weight, M)``; tma (1) reads the tiles through TMA
    descriptors where both operands allow it (tma_readable; else per-thread loads, the same values).
    Triton's: CUDA, or CPU under TRITON_INTERPRET=1."""
    m, k = codes.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert codes.dtype == weight.dtype == torch.int8 and weight.shape[1] == k and not (gated and bias is not None)
    assert codes.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages, *tma = tiling or tiling_for(weight, m, gated)
    tma = bool(tma and tma[0]) and tma_readable(codes) and tma_readable(weight)
    x_desc = TensorDescriptor.from_tensor(codes, [block_m, block_k]) if tma else None
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if tma else None
    x_scale, weight_scale, bias = dense(x_scale, weight_scale, bias)  # read at ptr + row / + column
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int8_gemm_kernel[grid](
        codes, weight, x_desc, w_desc, x_scale, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
        codes.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, EVEN_K=k % block_k == 0, TMA=tma,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(codes))
    return out


def int8_gemm_row_counts(max_rows: int) -> tuple[int, ...]:
    """The INT8_GEMM_ROW_BUCKETS that products of 17 .. ``max_rows`` rows reach (none when the kernel is off)."""
    from kernels.linear import MAX_SKINNY_ROWS

    if max_rows <= MAX_SKINNY_ROWS or not int8_gemm_enabled():
        return ()
    return tuple(b for b in INT8_GEMM_ROW_BUCKETS if b <= row_bucket(max_rows))


@torch.inference_mode()
def choose_int8_gemm_tilings(weights: list[torch.Tensor], gated: list[torch.Tensor] = (),
                             rows: tuple[int, ...] = INT8_GEMM_ROW_BUCKETS) -> dict[tuple, tuple]:
    """Per distinct int8 weight shape (gated [gate | up] weights under ("gated", N, K)) and row bucket of ``rows``,
    the candidate tiling of least device time at that many rows (kernels/fp8.py choose_skinny_tilings: CUDA graphs
    over copies of the weight that defeat the L2 cache, the persistent choice cache), kept on each weight as
    {bucket: tiling} (INT8_GEMM_ATTR), which int8_gemm reads. Returns {(bucket, *key): tiling}. CUDA only."""
    from kernels.fp8 import choose_skinny_tilings

    report: dict[tuple, tuple] = {}
    for bucket in rows:
        chosen = choose_skinny_tilings("int8_gemm", list(weights), list(gated), (bucket,), attr=_TIMED_ATTR,
                                       candidates=INT8_GEMM_TILINGS + INT8_GATED_TILINGS, sources=_sources(),
                                       fastest=_fastest_tiling)
        report.update({(bucket,) + key: tiling for key, tiling in chosen.items()})
        for weight in list(weights) + list(gated):
            tilings = {**getattr(weight, INT8_GEMM_ATTR, {}), bucket: getattr(weight, _TIMED_ATTR)}
            setattr(weight, INT8_GEMM_ATTR, tilings)
    return report


_TIMED_ATTR = "_int8_gemm_timed"  # choose_skinny_tilings' attribute for the bucket being timed


def _sources() -> tuple[str, ...]:
    """The files whose kernels the choice times (kernels/choice_cache.py's key)."""
    from kernels import _triton, linear

    return (__file__, linear.__file__, _triton.__file__)


def _fastest_tiling(weight: torch.Tensor, gated: bool, rows: tuple[int, ...]) -> tuple:
    """kernels/fp8.py fastest_tiling over the candidates that compile on this device (one that does not, say for
    want of shared memory, drops out with a line on stderr)."""
    import sys

    from kernels.fp8 import fastest_tiling

    k = weight.shape[1]
    w_scale = torch.full((weight.shape[0],), 1e-3, dtype=torch.float32, device=weight.device)

    def inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=weight.device)
        return codes, torch.full((m,), 1e-2, dtype=torch.float32, device=weight.device)

    def product(x, w, tiling):
        return int8_gemm(x[0], x[1], w, w_scale, out_dtype=torch.bfloat16, gated=gated, tiling=tiling)

    probe = inputs(max(rows))
    candidates = []
    for tiling in INT8_GATED_TILINGS if gated else INT8_GEMM_TILINGS:
        try:
            product(probe, weight, tiling)
            candidates.append(tiling)
        except Exception as error:  # noqa: BLE001 (any compile failure: OutOfResources, an MLIR pass)
            print(f"int8_gemm: tiling {tiling} dropped for {tuple(weight.shape)}{' gated' if gated else ''}: "
                  f"{type(error).__name__}: {str(error)[:200]}", file=sys.stderr, flush=True)
    if not candidates:
        raise RuntimeError(f"int8_gemm: no tiling compiles for weight {tuple(weight.shape)}")
    return fastest_tiling(weight, rows, tuple(candidates), inputs, product)
