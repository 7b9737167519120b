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

Paths: on CUDA at decode rows (at most 16), for a weight the engine's load timed it faster on
(kernels/fp8_block_choice.py), kernels/fp8_block_skinny.py: the E4M3 weight widened in registers and
the activations unquantized (those rows are weight-read bound: quantizing them and the FP8 dot bought
nothing, see there). Otherwise on CUDA ``quantize_groups_triton`` (the rounding of ``quantize_groups``)
and one Triton GEMM (``fp8_block_linear_triton``) whose K step is one 128-column block, so both scales apply once per
step; from CUBLAS_BLOCK_SCALED_MIN_ROWS rows cuBLAS's own block-scaled GEMM (``fp8_block_linear_cublas``,
torch._scaled_mm with 1 x 128 and 128 x 128 scales, CUDA 12.9+ on Hopper), which keeps the tensor
cores' accumulator running where the Triton GEMM's per-step scaling stops it (prefill-size rows
ran at ~2/3 of bf16's speed on it); prefill-size rows of narrow outputs, or every row from
DEQUANTIZED_MIN_ROWS where cuBLAS lacks that scaling, take the weight dequantized in one pass for
bf16 cuBLAS. Elsewhere ``fp8_block_linear_ref`` (plain torch: quantize, dequantize both, float32
matmul), also the oracle of the kernel tests. Nothing waits on the host: the decode CUDA graphs
capture every path.

Measured: benchmarks/quantization/fp8_block_bench.py (figures beside CUBLAS_BLOCK_SCALED_MIN_ROWS). Quantizing the
activation tiles inside the Triton GEMM instead of the quantize launch measured slower at every size
(H200: 150 us at 1 row, 7,298 at 4,096, for Llama-3.1-8B's four projections), so it is not kept.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels._triton import dense, device_capability, jit, num_sms, tl, triton, use_triton
from kernels.e4m3_rows import e4m3_row_scale, to_e4m3
from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kernels.fp8_block_skinny import SCALE_BLOCK, fp8_block_skinny_triton, skinny_options, skinny_variant

BLOCK = SCALE_BLOCK  # the checkpoints' weight_block_size [128, 128] (128); activation groups are 1 x BLOCK


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
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_x, stride_q, stride_s_row, stride_s_group,
                            BLOCK_K: tl.constexpr):
    """Program (row, group): one 1 x BLOCK_K group of x quantized (quantize_groups); rows from M on
    (padding) quantize zeros."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=(cols < K) & (row < M), other=0.0).to(tl.float32)
    scale = e4m3_row_scale(tl.max(tl.abs(x), axis=0))
    tl.store(scale_ptr + row * stride_s_row + group * stride_s_group, scale)
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(x, scale), mask=cols < K)


def quantize_groups_triton(x: torch.Tensor, *, scale_column_major: bool = False,
                           padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_groups`` in one launch (x (R, C) with unit column stride). ``scale_column_major``:
    the (R, ceil(C / 128)) scales laid out with unit row stride, as cuBLAS's block-scaled GEMM reads
    them. ``padded_rows`` (>= R): both outputs have that many rows, the ones past R quantized zeros."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    out_rows = padded_rows or rows
    assert out_rows >= rows
    x_q = torch.empty(out_rows, cols, dtype=FP8_DTYPE, device=x.device)
    if scale_column_major:
        scale = torch.empty(blocks(cols), out_rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(out_rows, blocks(cols), dtype=torch.float32, device=x.device)
    if out_rows:
        _quantize_groups_kernel[(out_rows, blocks(cols))](x, x_q, scale, rows, cols, x.stride(0), x_q.stride(0),
                                                          scale.stride(0), scale.stride(1), BLOCK_K=BLOCK, num_warps=1)
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
    bias, = dense(bias)  # read at bias_ptr + column
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


# ---- cuBLAS's block-scaled GEMM (CUDA 12.9+, sm90) -----------------------------------------------

@functools.lru_cache(maxsize=None)
def _cublas_block_scaled_device(index: int) -> bool:
    """cuBLAS 12.9 added DeepSeek-style block scaling (torch 2.9 passes it through) for Hopper."""
    if not (hasattr(torch, "_scaled_mm") and torch.version.cuda):
        return False
    cuda = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    return cuda >= (12, 9) and device_capability(index) == (9, 0)


def cublas_block_scaled_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this layer's scales as 1 x 128 activation groups and 128 x 128
    weight blocks: bf16 or fp16 activations on such a device, whole blocks only (N and K multiples
    of 128). Called per layer per eager step, so the device part is cached."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = weight.shape
    if n % BLOCK or k % BLOCK:
        return False
    return _cublas_block_scaled_device(x.device.index if x.device.index is not None else torch.cuda.current_device())


# cuBLAS finds no block-scaled algorithm for some row counts (1 and 129 on an H100, CUDA 13.0; 16,
# 64, 128, 256, ... all ran): the activations are padded to a multiple of this many rows.
CUBLAS_BLOCK_SCALED_ROW_MULTIPLE = 16


def fp8_block_linear_cublas(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The scheme on cuBLAS (cublas_block_scaled_supported): x quantized per 1 x 128 group with its
    scales column-major (rows padded with zeros to CUBLAS_BLOCK_SCALED_ROW_MULTIPLE), then one
    torch._scaled_mm with the weight's block scales transposed with the weight (a (K / 128, N / 128)
    view of the stored (N / 128, K / 128))."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    padded = -(-m // CUBLAS_BLOCK_SCALED_ROW_MULTIPLE) * CUBLAS_BLOCK_SCALED_ROW_MULTIPLE
    a, a_scale = quantize_groups_triton(rows, scale_column_major=True, padded_rows=padded)
    out = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=weight_scale.t(), out_dtype=x.dtype)[:m]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


# From these rows fp8_block_linear leaves the Triton block GEMM for cuBLAS's block-scaled one (H100,
# `benchmarks/quantization/fp8_block_bench.py`, 2026-11-26, us; Llama-3.1-8B's four projections of a layer):
# 64 rows Triton 143 / cuBLAS block-scaled 130, 128 rows 235 / 137, 512 rows 484 / 259 (bf16 303;
# the weight dequantized for bf16 cuBLAS 535), 8,192 rows 7,306 / 4,204 (dequantized 5,360; bf16 5,085).
CUBLAS_BLOCK_SCALED_MIN_ROWS = 128
# But narrow outputs run faster on the dequantized weight from some rows on: (widest N, from rows).
# Same runs: 2048 x 4096 (Qwen3-30B-A3B's o_proj) at 512 rows 24.8 us block-scaled / 24.0 dequantized,
# 2,048 rows 69.4 / 52.4, 8,192 rows 274.9 / 184.0; Llama's 4096 x 4096 and 4096 x 14336 at 8,192 rows
# 380 / 357 and 1,313 / 1,228; wider outputs gain (5120 x 2048 at 8,192 rows 230.6 / 239.2, 28672 x
# 4096 1,723 / 2,499). Dequantized rows keep their activations unquantized: more exact, not less.
DEQUANTIZED_NARROW_OUTPUTS = ((2048, 2048), (4096, 4096))
# Without cuBLAS's block-scaled GEMM, the weight is dequantized from these rows (H200 figures of the
# module docstring's first version: the Triton GEMM 461 / 3,450 us against bf16 293 / 2,313 at 512 /
# 4,096 rows, Llama-3.1-8B's layer).
DEQUANTIZED_MIN_ROWS = 512


def _dequantize_for_cublas(rows: int, n: int, block_scaled: bool) -> bool:
    """Whether rows x (N = n) runs on bf16 cuBLAS over the dequantized weight (the figures above)."""
    if not block_scaled:
        return rows >= DEQUANTIZED_MIN_ROWS
    return any(n <= widest and rows >= from_rows for widest, from_rows in DEQUANTIZED_NARROW_OUTPUTS)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ the block-dequantized weight (N, K).T (+ bias): on CUDA, decode rows (at most
    MAX_SKINNY_ROWS) of a weight marked at engine load on the skinny kernel with the activations
    unquantized (kernels/fp8_block_skinny.py), else the Triton block GEMM, from
    CUBLAS_BLOCK_SCALED_MIN_ROWS rows cuBLAS's block-scaled GEMM, and the dequantized weight on bf16
    cuBLAS where _dequantize_for_cublas says; else the reference."""
    if use_triton(x) and x.stride(-1) == 1:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        variant = skinny_variant(flat, weight)  # marked at load where it timed faster (kernels/fp8_block_choice.py)
        if variant:
            return fp8_block_skinny_triton(flat, weight, weight_scale, bias, **skinny_options(variant)).reshape(
                *x.shape[:-1], weight.shape[0])
        block_scaled = cublas_block_scaled_supported(x, weight)
        if _dequantize_for_cublas(rows, weight.shape[0], block_scaled) and x.dtype in (torch.bfloat16, torch.float16):
            return F.linear(x, dequantize_blocks_triton(weight, weight_scale, x.dtype), bias)
        if rows >= CUBLAS_BLOCK_SCALED_MIN_ROWS and block_scaled:
            return fp8_block_linear_cublas(x, weight, weight_scale, bias)
        return fp8_block_linear_triton(x, weight, weight_scale, bias)
    return fp8_block_linear_ref(x, weight, weight_scale, bias)
