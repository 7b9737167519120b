"""Per-head products of a decode batch: y[t, h] = x[t, h] @ w[h] for 1..MAX_TOKENS tokens, one launch.

MLA's absorbed attention (engine/models/deepseek.py) multiplies each head's query by its W_UK
before attention and each head's latent output by its W_UV after: two batched GEMMs of one to a few
rows a head over 2 MB of weights (V2-Lite: 16 heads x 128 x 512 bf16). cuBLAS took ~3.2-3.4 us each
on an H200 (2026-11-29 profile, 54 calls a step); here one program covers BLOCK_N columns of one
head for every token (a 16-row tensor-core tile), ~128 programs streaming 16 KB of weight each.

Shapes: x (T, H, K) with unit stride along K; w (H, K, N) any strides (W_UV's transposed view
(H, R, V) included) -> y (T, H, N) contiguous in x's dtype, float32 accumulation rounded once,
as torch.einsum("thk,hkn->thn") (``head_matmul_ref``, the reference and the path past MAX_TOKENS).
"""
from __future__ import annotations

import torch

from kernels._triton import jit, tl, triton, use_triton

MAX_TOKENS = 16


def head_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thk,hkn->thn", x, w)


@jit
def _head_matmul_kernel(x_ptr, w_ptr, y_ptr, num_tokens, K, N, stride_xt, stride_xh, stride_wh, stride_wk, stride_wn,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Program (head h, column tile j): y[:, h, j * BLOCK_N ...] for every token."""
    head_matmul_tile(x_ptr, w_ptr, y_ptr, tl.program_id(0), tl.program_id(1), tl.num_programs(0), num_tokens, K, N,
                     stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, BLOCK_T, BLOCK_N, BLOCK_K, DOT_PRECISION)


@jit
def head_matmul_tile(x_ptr, w_ptr, y_ptr, head, tile, num_heads, num_tokens, K, N, stride_xt, stride_xh, stride_wh,
                     stride_wk, stride_wn, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """y[:, head, tile * BLOCK_N ...] for every token (y (T, num_heads, N) contiguous); also run by
    kernels/mla_latent_write.py's launch for W_UK."""
    head = head.to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    tokens = tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + head * stride_xh + k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + head * stride_wh + k[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + (tokens[:, None] * num_heads + head) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & col_ok[None, :])


def head_matmul_launch(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int, dict]:
    """(y, column tiles a head, the tile's constexprs) of a launch: y (T, H, N) empty."""
    num_tokens, num_heads, k = x.shape
    n = w.shape[2]
    assert 1 <= num_tokens <= MAX_TOKENS and x.stride(2) == 1 and w.shape[:2] == (num_heads, k)
    y = torch.empty(num_tokens, num_heads, n, dtype=x.dtype, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(n) // 8))  # W_UK (N 512): 64; W_UV (N 128): 16
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    return y, triton.cdiv(n, block_n), dict(BLOCK_T=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


def head_matmul_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y, tiles, constexprs = head_matmul_launch(x, w)
    _head_matmul_kernel[(x.shape[1], tiles)](x, w, y, x.shape[0], x.shape[2], w.shape[2], x.stride(0), x.stride(1),
                                             *w.stride(), **constexprs, num_warps=4, num_stages=2)
    return y


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, H, K) @ w (H, K, N) per head -> (T, H, N): the kernel on CUDA for 1..MAX_TOKENS tokens,
    else the reference."""
    if use_triton(x) and 1 <= x.shape[0] <= MAX_TOKENS and x.stride(2) == 1:
        return head_matmul_triton(x, w)
    return head_matmul_ref(x, w)
