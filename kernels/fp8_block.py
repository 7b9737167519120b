"""Block-scaled FP8 (E4M3) linear layers: the DeepSeek-V3 / Qwen3-*-FP8 checkpoint scheme.

Scheme (an engine built with quantization ``fp8_block``; transformers'
integrations/finegrained_fp8.py runs the same one):

- weight (N, K) float8_e4m3fn with ``weight_scale`` float32 (ceil(N / 128), ceil(K / 128)): the real
  weight is ``weight[n, k].float() * weight_scale[n // 128, k // 128]`` (the checkpoints call that
  scale ``weight_scale_inv``: the inverse of the one the weight was divided by; the last row or
  column block may be partial);
- activations x (M, K) quantized at run time per token and per group of 128 columns (a 1 x 128
  tile): scale (M, ceil(K / 128)) = max|group| / 448 (at least 1e-12, as kernels/e4m3_rows.py), so
  an outlier only costs its own group's resolution;
- y[m, n] = sum over K blocks b of s_x[m, b] * s_w[n // 128, b] * (x_q[m, b] . w_q[n, b]): each
  block's dot of E4M3 values accumulated in float32, scaled, and added in float32; returned in x's
  dtype.

Paths: on CUDA ``quantize_groups_triton`` (the rounding of ``quantize_groups``) and one Triton GEMM
(``fp8_block_linear_triton``) whose K step is one 128-column block, so both scales apply once per
step. Elsewhere ``fp8_block_linear_ref`` (plain torch: quantize, dequantize both, float32 matmul),
also the oracle of the kernel tests. Nothing waits on the host: the decode CUDA graphs capture it.

Measured on an H200 (benchmarks/fp8_block_bench.py, Llama-3.1-8B's four projections of a layer,
2026-11-26): 95.9 / 101.0 / 125.0 us at 1 / 16 / 64 rows against bf16's 113.5 / 115.3 / 123.7, but
461 / 3,450 us at 512 / 4,096 rows against 293 / 2,313: prefill-size products are slower than bf16
(the per-step scaling keeps the tensor cores' accumulator from running on), so from
DEQUANTIZED_MIN_ROWS rows the weight is dequantized in one pass and multiplied by cuBLAS. Quantizing the
activation tiles inside the GEMM instead of the quantize launch measured slower at every size
(150 us at 1 row, 7,298 at 4,096), so it is not kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import jit, num_sms, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

BLOCK = 128  # the checkpoints' weight_block_size [128, 128]; activation groups are 1 x BLOCK


def blocks(size: int) -> int:
    """Scale entries along a dimension of ``size`` (the last block may be partial)."""
    return -(-size // BLOCK)


# ---- quantization (reference) ----------------------------------------------------------------

def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (x_q (R, C) float8_e4m3fn, scale (R, ceil(C / 128)) float32): each 1 x 128 group
    quantized with max|group| / 448, the arithmetic of kernels.fp8.quantize_rows."""
    rows, cols = x.shape
    groups = blocks(cols)
    padded = F.pad(x.detach().float(), (0, groups * BLOCK - cols)).view(rows, groups, BLOCK)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
    x_q = (padded / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(rows, groups * BLOCK)[:, :cols].contiguous(), scale


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales (..., ceil(rows / 128), ceil(cols / 128)) -> one per element (..., rows, cols)."""
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (..., N, K) E4M3 with block scales (..., ceil(N / 128), ceil(K / 128)) -> real values."""
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_block_scales(scale.float(), rows, cols)).to(dtype)


def quantize_blocks(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (..., N, K) -> (E4M3 codes, block scales (..., ceil(N / 128), ceil(K / 128)) float32).

    ``scale``: use these block scales instead of max|block| / 448, for a weight that was E4M3 with
    them already (a block-FP8 checkpoint, dequantized for conversion): its codes come back exactly,
    since the float32 rounding of code x scale is far inside half an E4M3 step (2^-4)."""
    rows, cols = weight.shape[-2:]
    if scale is None:
        lead = weight.shape[:-2]
        padded = F.pad(weight.float(), (0, blocks(cols) * BLOCK - cols, 0, blocks(rows) * BLOCK - rows))
        tiles = padded.view(*lead, blocks(rows), BLOCK, blocks(cols), BLOCK)
        scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_(min=MIN_SCALE)
    scale = scale.float()
    codes = (weight.float() / expand_block_scales(scale, rows, cols)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The scheme in plain torch: x (..., K) quantized per 1 x 128 group, both dequantized, float32 matmul."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_groups(rows)
    out = dequantize_groups(x_q, x_scale) @ dequantize_blocks(weight, weight_scale).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def dequantize_groups(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_groups' output back to float32 values (R, C)."""
    return x_q.float() * scale.repeat_interleave(BLOCK, dim=-1)[:, :x_q.shape[1]]


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, stride_s, BLOCK_K: tl.constexpr):
    """Program (row, group): one 1 x BLOCK_K group of x quantized (quantize_groups)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = e4m3_row_scale(tl.max(tl.abs(x), axis=0))
    tl.store(scale_ptr + row * stride_s + group, scale)
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(x, scale), mask=cols < K)


def quantize_groups_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_groups`` in one launch (x (R, C) with unit column stride)."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    x_q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, blocks(cols), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_groups_kernel[(rows, blocks(cols))](x, x_q, scale, cols, x.stride(0), x_q.stride(0), scale.stride(0),
                                                      BLOCK_K=BLOCK, num_warps=1)
    return x_q, scale


@jit
def _fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum over K blocks b of dot(a_q[m, b], w[n, b]) * s_a[m, b] * s_w[n // BLOCK_K, b]
    (+ bias[n]) for the (BLOCK_M, BLOCK_N) tile of program (program_id(0), program_id(1)). BLOCK_K
    is the scales' block (128), so each K step meets one scale per row of a (E4M3, scales a_scale
    (M, ceil(K / BLOCK_K))) and per weight row block."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    a_base = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    ws_base = w_scale_ptr + (cols // BLOCK_K) * stride_wsn  # weight blocks are BLOCK_K x BLOCK_K too
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + rows * stride_asm + k0 // BLOCK_K, mask=row_ok, other=0.0)
        w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_scale = tl.load(ws_base + k0 // BLOCK_K, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_gemm_config(rows: int, n: int, device) -> dict:
    """Tiles per batch size: decode rows stream the weight (narrow column tiles, enough programs
    for every SM); long prefill chunks are compute-bound (128 x 128 tiles)."""
    if rows <= 16:
        block_n = 32 if triton.cdiv(n, 64) < num_sms(device) else 64
        return {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        return {"BLOCK_M": 32 if rows <= 32 else 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, *, config: dict | None = None) -> torch.Tensor:
    """fp8_block_linear_ref on the Triton GEMM (x (..., K) with unit column stride). On CPU tensors
    (Triton's interpreter) the activations are quantized by the reference."""
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    n = weight.shape[0]
    assert rows.stride(1) == 1 and weight.is_contiguous() and weight.dtype == FP8_DTYPE
    assert weight_scale.shape == (blocks(n), blocks(k)) and weight_scale.dtype == torch.float32
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    a, a_scale = quantize_groups_triton(rows) if use_triton(rows) else quantize_groups(rows)
    cfg = dict(config or block_gemm_config(m, n, x.device))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    _fp8_block_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, a_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, **cfg)
    return out.reshape(*x.shape[:-1], n)


@jit
def _dequantize_blocks_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_w, stride_s, stride_o, BLOCK_N: tl.constexpr,
                              SCALE_BLOCK: tl.constexpr):
    """Program (row tile, SCALE_BLOCK-column block): weight * its block's scale, in out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    scale = tl.load(scale_ptr + (rows // SCALE_BLOCK)[:, None] * stride_s + tl.program_id(1), mask=(rows < N)[:, None])
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], (w * scale).to(out_ptr.dtype.element_ty),
             mask=ok)


def dequantize_blocks_triton(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_blocks of a 2-D weight in one pass (read E4M3, write ``dtype``)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantize_blocks_kernel[(triton.cdiv(n, 32), blocks(k))](weight, scale, out, n, k, weight.stride(0),
                                                               scale.stride(0), out.stride(0), BLOCK_N=32,
                                                               SCALE_BLOCK=BLOCK, num_warps=4)
    return out


# Rows from which fp8_block_linear dequantizes the weight for cuBLAS instead of running the block
# GEMM: from the H200 figures in the module docstring, writing Llama-8B's four projections of a
# layer in bf16 costs ~140 us (654 MB), against the block GEMM's 168 us deficit at 512 rows and
# ~1,100 at 4,096. Those rows then keep their activations unquantized (more exact, not less).
DEQUANTIZED_MIN_ROWS = 512


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ the block-dequantized weight (N, K).T (+ bias): Triton on CUDA (the block GEMM;
    from DEQUANTIZED_MIN_ROWS rows the weight dequantized for cuBLAS), else the reference."""
    if use_triton(x) and x.stride(-1) == 1:
        if x.numel() // x.shape[-1] >= DEQUANTIZED_MIN_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            return F.linear(x, dequantize_blocks_triton(weight, weight_scale, x.dtype), bias)
        return fp8_block_linear_triton(x, weight, weight_scale, bias)
    return fp8_block_linear_ref(x, weight, weight_scale, bias)
