"""A SwiGLU MLP's widening product with its SiLU-and-product in the epilogue, for many rows in 16-bit floats:
``silu(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up)`` in one Triton GEMM, the (M, 2N) product never written.

Why: in Qwen2.5-VL-7B's tower (engine/vision/qwen2_5_vl.py; 32 images of 448 x 448 = 32,768 patches a forward,
width 1280, MLP 3,456 padded) the gate_up product (cuBLAS, ~740 TFLOPS) writes a 453-MB (M, 6,912) bf16 tensor that
kernels/activation.py's silu_and_mul reads back to write 226 MB: 165 us a block at the copy rate, 5.3 of the
forward's 79 ms of device time (H200 profile, 2026-11-30 call 32). Here each program holds a gate and an up
accumulator for the same output columns and stores only silu(gate) * up.

Roundings as the unfused path: each product plus its bias rounded to the output dtype (cuBLAS's bias epilogue),
SiLU of the rounded gate in float32 rounded again (kernels/activation.py), times the rounded up, rounded.

Shapes: x (M, K) rows with unit column stride; weight (2N, K) = [gate | up] rows, row-major; bias (2N,) or None
-> (M, N) in x's dtype. Tilings (block_m, block_n, block_k, num_warps, num_stages, tma): block_n output columns a
program (gate and up: twice that many weight rows a stage); tma 1 reads the tiles through TMA descriptors where
the operands allow (16-byte aligned rows), else per-thread loads. Programs in groups of GROUP_M row tiles (the
matmul tutorial's order: a wave shares weight tiles in L2). ``gated_gemm`` runs on CUDA (and under
TRITON_INTERPRET=1 on CPU tensors, for the tests); ``gated_gemm_ref`` is the plain-torch reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import TensorDescriptor, jit, tl, triton

# The tiling of a call without one: the fastest of GATED_GEMM_TILINGS at the 7B tower's shape on an H200 (to be
# measured; until then the int8 gated kernel's best shape, 128 x 128 output tiles through TMA).
DEFAULT_TILING = (128, 128, 64, 8, 3, 1)
# Candidates (benchmarks/kernels/tower_parts_bench.py sweeps them). Shared memory a stage: (block_m + 2 block_n)
# block_k 2-byte values: 48 KB at 128 / 128 / 64, so at most 4 stages on an H200 (227 KB).
# 128 x 64 and 64 x 128 at 3 stages: two programs an SM (~228 registers a thread at 4 warps, 96 KB of stages), one
# program's epilogue beside the other's products.
GATED_GEMM_TILINGS = ((128, 128, 64, 8, 3, 1), (128, 64, 64, 4, 3, 1), (128, 128, 64, 8, 4, 1), (64, 128, 64, 4, 3, 1),
                      (128, 128, 64, 8, 3, 0), (128, 64, 64, 4, 4, 1), (128, 64, 64, 8, 3, 1), (256, 64, 64, 8, 3, 1),
                      (128, 128, 32, 8, 5, 1))
GROUP_M = 8


@jit(do_not_specialize=["M"])
def _gated_gemm_kernel(x_ptr, w_ptr, x_desc, w_desc, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """One program: the (BLOCK_M, BLOCK_N) output tile (pid_m, pid_n) in grouped order. Rows and columns past M
    and N are loaded as row / column 0 (TMA: rows past the tensor read as zeros; a gate tile's rows past N are
    up rows) and never stored."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            x = x_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([pid_n * BLOCK_N, k0])
            w_up = w_desc.load([N + pid_n * BLOCK_N, k0])
        elif EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
            w_up = tl.load(w_up_ptrs)
        else:
            in_k = (ks < K - k0)[None, :]
            x = tl.load(x_ptrs, mask=in_k, other=0.0)
            w = tl.load(w_ptrs, mask=in_k, other=0.0)
            w_up = tl.load(w_up_ptrs, mask=in_k, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w_up_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = acc.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    rows = rows.to(tl.int64)  # M x N may pass 2^31
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def tma_readable(t: torch.Tensor) -> bool:
    """The TMA unit can read the 2-D tensor by descriptor: 16-byte aligned base and row stride, unit column stride."""
    return (TensorDescriptor is not None and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tiling: tuple | None = None) -> torch.Tensor:
    """The module docstring's product, Triton's (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    m, k = x.shape
    n = weight.shape[0] // 2
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or weight.shape != (2 * n, k) \
            or x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.shape != (2 * n,)):
        raise ValueError(f"gated_gemm takes 16-bit rows (M, K) and a [gate | up] weight (2N, K) of their dtype "
                         f"with unit column strides; got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages, tma = tiling or DEFAULT_TILING
    tma = bool(tma) and tma_readable(x) and tma_readable(weight)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k]) if tma else None
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if tma else None
    bias = bias.contiguous() if bias is not None else None
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gated_gemm_kernel[grid](
        x, weight, x_desc, w_desc, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
        EVEN_K=k % block_k == 0, TMA=tma, num_warps=num_warps, num_stages=num_stages)
    return out


def gated_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused path: the [gate | up] product rounded to x's dtype, then SiLU-and-product as
    kernels/activation.py rounds it (SiLU of the gate rounded, times up, rounded)."""
    gate, up = F.linear(x, weight, bias).float().chunk(2, dim=-1)
    return (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
