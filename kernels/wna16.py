"""Weight-only integer linear layers (W4A16, W8A16): the storage format, its plain-torch
reference, and the entry points the model calls.

Scheme (what an engine built with ``--quantization int4_wo/int4_awq/int8_wo``, or from an AWQ,
GPTQ or compressed-tensors checkpoint, holds):

    weight[n, k] ~= (code[n, k] - zero[n, g]) * scale[n, g],    g = k // group_size

- ``code`` unsigned ``bits``-bit integers in [0, 2**bits); ``zero`` the same range (symmetric
  schemes store 2**(bits - 1), so the codes are signed values offset by half the range);
- ``group_size`` divides K; per-channel quantization is ``group_size == K`` (one group per row);
- ``scale`` (N, K // group_size) float32 (checkpoints store float16 or bfloat16 scales; float32
  holds either exactly), ``zero`` (N, K // group_size) uint8.

Storage of the codes (the engine directory's ``<linear>.weight``):
- 8 bits: uint8 (N, K), one code a byte;
- 4 bits: uint8 (N, K // 2), codes of columns 2j and 2j + 1 in the low and high nibble of byte j.
  Row-major along K, so a tensor-parallel split of K (row-parallel layers) is a split of bytes,
  and one of N (column-parallel) a split of rows; either keeps whole groups when the group count
  divides by the ranks (engine.build checks).

Activations stay in the model dtype (float16/bfloat16); products accumulate in float32.

``prepare_wna16`` turns a layer's stored tensors into a ``WNA16Weight``, once at load: the layout
the kernels read. On CPU (and as the oracle of the kernel tests) the layout is the dequantized
weight in the activations' dtype, so the CPU path multiplies exactly the "dequantized model".

On CUDA (with Triton), 4-bit codes with 16-bit activations and a grouping kernels/wna16_mma.py takes
(K a multiple of 128, groups of whole 64-column blocks or per channel) are held ONCE, in the
tensor cores' operand order (``kernel`` = {"mma_words", "mma_meta"}; $TRITONLLM_WNA16_MMA=0 turns
this off), and ``wna16_linear`` runs:
- M <= MAX_SKINNY_ROWS: kernels/wna16_mma.py's decode kernel, the tiling timed at load among
  MMA_VARIANTS (untimed: MMA_DEFAULT);
- more rows: kernels/wna16_mma_dense.py dequantizes the same words into a scratch weight in x's
  dtype (one buffer per device and dtype, sized at load for the largest layer; static, so CUDA graphs
  capture it), then cuBLAS. By default 17-256 rows (wna16_mma_rows.MAX_ROWS) take
  kernels/wna16_mma_rows.py's MMA kernel on the same words instead, where the load-time timing
  picks it over dequantize + cuBLAS (ROWS_VARIANTS beside DENSE at MID_ROWS; untimed: ROWS_DEFAULT);
  $TRITONLLM_WNA16_MMA_ROWS overrides: "0" never (DENSE past 16 rows), "1" always (DENSE not timed).
  kernels/wna16_mma_gemm.py's fused GEMM (tensor-core dots over up to 256 x 256 tiles of out, the weight
  dequantized once per tile) is timed there too (MMA_GEMM_VARIANTS, then beside ROWS_BESIDE_GEMM alone of the
  rows kernel's; $TRITONLLM_WNA16_MMA_GEMM=0: not).

$TRITONLLM_W4A8=1 (off by default: an accuracy trade): operand-order layers of 6144+ outputs multiply 129+ rows by
kernels/w4a8_gemm.py instead (the same words; x rounded to E4M3 per token; FP8 tensor-core dots), whatever the
timing chose (w4a8_gemm.takes: where an H200 sweep found it faster).

Otherwise (8 bits, other groupings, the operand order turned off) the weight stays packed in
kernels/wna16_layout.py's layout (no dequantized copy: the point is memory and bandwidth), and
``wna16_linear`` runs, by row count M:
- M <= MAX_SKINNY_ROWS (decode): the tilings timed for the weight's shape at load per row count
  (``choose_wna16_variants``): the FMA kernel for a few rows or the tensor-core kernel with
  16-row tiles, split-K where N gives too few programs;
- up to MID_ROWS[-1] (256) rows: the tiling timed at load for the next timed row count (32, 64, 128,
  256) among the factored tensor-core kernel's row tiles, the GEMM tiles (dequantized in registers
  into tensor-core dots) and dequantize + cuBLAS; without timings (CPU-made weights, tests) the GEMM
  tiles below DENSE_MIN_ROWS and dequantize + cuBLAS from there;
- more rows: the weight dequantized into a temporary (N, K) in x's dtype, then cuBLAS: there the
  dequantizing pass is a few percent of the product's time.
The GEMM tiles and the dense path dequantize each weight to (code - zero) * scale rounded once to
x's dtype (with the scale as held: float16 by default); the factored kernels sum code * x exactly
and apply scale * (sum - zero * sum x) once per 128-column unit. All accumulate in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import os

from kernels import (_triton, choice_cache, w4a8_gemm, wna16_decode, wna16_gemm, wna16_layout, wna16_mma,
                     wna16_mma_dense, wna16_mma_gemm, wna16_mma_rows)
from kernels._triton import use_triton

SUPPORTED_BITS = (4, 8)


# ---- storage --------------------------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes (..., K) integers in [0, 16) -> uint8 (..., K // 2): column 2j low nibble, 2j + 1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit codes need an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., K // 2) -> codes uint8 (..., K), the inverse of ``pack_int4``."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., K) -> the stored weight of ``bits`` (see the module docstring)."""
    return pack_int4(codes) if bits == 4 else codes.to(torch.uint8)


def unpack_codes(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored weight -> codes uint8 (..., K)."""
    return unpack_int4(weight) if bits == 4 else weight


def stored_columns(in_features: int, bits: int) -> int:
    """Columns of the stored weight for ``in_features`` codes a row."""
    return in_features // 2 if bits == 4 else in_features


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored weight (..., N, stored K), scale and zero (..., N, K // G) -> the weight (..., N, K) in
    ``dtype``, computed in float32 ((code - zero) * scale) and rounded once."""
    codes = unpack_codes(weight, bits).float()
    group_size = codes.shape[-1] // scale.shape[-1]
    values = (codes - zero.float().repeat_interleave(group_size, dim=-1)) * \
        scale.float().repeat_interleave(group_size, dim=-1)
    return values.to(dtype)


def round_to_nearest(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize``'s arithmetic before the codes are stored: (codes (..., N, K // G, G), scale and
    zero (..., N, K // G)), all float32. AWQ's searches dequantize from here without packing."""
    *lead, n, k = weight.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit weights are not supported; supported: {SUPPORTED_BITS}")
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input columns")
    groups = weight.float().reshape(*lead, n, k // group_size, group_size)
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = groups.abs().amax(dim=-1) / (half - 1)
        scale = scale.clamp_(min=1e-10)
        zero = torch.full_like(scale, half)
    else:
        low = groups.amin(dim=-1).clamp(max=0.0)
        high = groups.amax(dim=-1).clamp(min=0.0)
        scale = ((high - low) / top).clamp_(min=1e-10)
        zero = (-low / scale).round_().clamp_(0, top)
    codes = (groups / scale[..., None] + zero[..., None]).round_().clamp_(0, top)
    return codes, scale, zero


def quantize(weight: torch.Tensor, bits: int, group_size: int, *, symmetric: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of a float weight (..., N, K) -> (stored weight, scale, zero).

    Asymmetric: each group's [min, max] (widened to include 0) maps onto [0, 2**bits - 1]:
    scale = (max - min) / (2**bits - 1), zero = round(-min / scale). Symmetric: zero = 2**(bits-1)
    and scale = max|w| / (2**(bits-1) - 1), so +-max|w| are codes 1 and 2**bits - 1 (the most
    negative code stays unused, as in TensorRT-LLM's and GPTQ's symmetric modes).
    """
    *lead, n, k = weight.shape
    codes, scale, zero = round_to_nearest(weight, bits, group_size, symmetric=symmetric)
    codes = codes.reshape(*lead, n, k).to(torch.uint8)
    return pack_codes(codes, bits), scale, zero.to(torch.uint8)


# ---- the layer's product -------------------------------------------------------------------

@dataclass
class WNA16Weight:
    """One linear layer's quantized weight in the layout its kernels read (``prepare_wna16``).

    ``out_features``/``in_features``: N and K; ``bits``/``group_size``: the scheme. ``dense``: the
    dequantized weight (N, K) in the activations' dtype, for the reference path (CPU). ``kernel``:
    the tensors of the CUDA kernels' layout, by name; empty where the reference path runs.
    ``variant``: the decode tilings chosen at load, {rows: (block_n, block_m, num_warps, num_stages,
    split_k, kind)} (``choose_wna16_variants``): M rows take that of the least timed row count >= M;
    none: SKINNY_DEFAULT.
    """

    out_features: int
    in_features: int
    bits: int
    group_size: int
    dtype: torch.dtype
    dense: torch.Tensor | None = None
    kernel: dict[str, torch.Tensor] = field(default_factory=dict)
    variant: dict = field(default_factory=dict)  # chosen at load per row count (kernel timings)
    scratch: wna16_mma_dense.DenseScratch | None = None  # operand-order weights: where 17+ rows dequantize

    @property
    def mma_only(self) -> bool:
        """The codes are held once, in the operand order (no kernels/wna16_layout.py words)."""
        return "mma_words" in self.kernel and "words" not in self.kernel


# Kernel tilings: (block_n, block_m, num_warps, num_stages, split_k, kind); kind (``wna16_matmul``):
# 0 the tensor-core kernel, 1 the FMA kernel of kernels/wna16_gemm.py, 2 / 3 the factored FMA / tensor-core
# kernels of kernels/wna16_decode.py (scale and zero applied per unit of words, not per weight),
# which fall back to 1 / 0 for groups smaller than a unit (32, 64 columns at 4 bits); 4 / 5 those
# two with the next unit's words prefetched into registers while this one is multiplied.
MAX_SKINNY_ROWS = 16
SKINNY_DEFAULT = (128, 16, 4, 3, 4, 3)
SKINNY_VARIANTS = ((64, 16, 4, 4, 4, 0), (64, 16, 4, 3, 8, 0), (64, 1, 4, 4, 4, 1), (128, 1, 8, 4, 4, 1),
                   (64, 8, 4, 4, 4, 1),
                   (64, 1, 4, 2, 4, 2), (64, 1, 4, 2, 8, 2), (64, 1, 4, 2, 16, 2), (128, 1, 4, 2, 8, 2),
                   (128, 1, 8, 2, 4, 2), (128, 1, 8, 2, 8, 2),
                   (128, 16, 4, 3, 4, 3), (128, 16, 4, 3, 8, 3), (64, 16, 4, 3, 4, 3), (64, 16, 4, 3, 2, 3),
                   (128, 1, 4, 2, 4, 4), (128, 1, 4, 2, 8, 4), (256, 1, 4, 2, 8, 4), (256, 1, 4, 2, 16, 4),
                   (128, 16, 4, 3, 8, 5), (128, 16, 4, 3, 16, 5))


def is_fma_tiling(tiling: tuple) -> bool:
    """An FMA tiling (kind 1, 2 or 4): its block_m rows are all it multiplies per weight read."""
    return isinstance(tiling, tuple) and len(tiling) > 5 and tiling[5] in (1, 2, 4)


# Kind 6: kernels/wna16_mma.py (4 bits, bf16/fp16 x, groups of whole 64-column blocks), which reads the
# weight in the tensor cores' operand order (``kernel["mma_words"]``, then the layer's only copy of the
# codes); block_n = warps x row tiles x 16, block_m 16 (M <= 16), num_stages 2: the next chunk's words
# read before this chunk's MMAs (1: not). The only decode tilings timed for such a layer. Splits 1-2 never won on the
# Llama-8B shapes (H200, benchmarks/results/quantization.md), so they are not timed.
MMA_KIND = 6
MMA_VARIANTS = tuple((block_n, 16, warps, stages, split, MMA_KIND)
                     for block_n, warps, splits in ((64, 4, (8, 16)), (128, 4, (4, 8, 16)), (128, 8, (8, 16)),
                                                    (256, 4, (4, 8, 16)))
                     for split in splits for stages in (1, 2))
MMA_ENV = "TRITONLLM_WNA16_MMA"  # "0": no operand-order layout, the kernels before it (comparisons, a fallback)


MMA_DEFAULT = (128, 16, 4, 2, 8, MMA_KIND)  # operand-order weights, decode rows no timing covers


def mma_enabled() -> bool:
    return os.environ.get(MMA_ENV, "1") != "0"


# Kind 7: kernels/wna16_mma_rows.py, the same operand-order words for 17-256 rows (32 rows of x a
# program; block_n = warps x row tiles x 16, 1-2 tiles (4 spill on sm_90: 255 registers); num_stages 2: the
# next chunk's first words read early; 3: every next k block's words and x fragments (wna16_rows_bench's
# candidates until measured)).
# The default past 16 rows since its H200 figures (benchmarks/results/quantization.md, 2026-11-29: at 64
# rows 1.5-2.5x faster than dequantize + cuBLAS on every Llama-3.1-8B shape; at 256 rows faster or equal
# on two shapes, 3-10% slower on two; at 1024 1.6-1.8x slower): the load-time timing covers MID_ROWS
# among ROWS_VARIANTS and DENSE for operand-order layers, so each shape and batch gets the faster one;
# untimed weights take ROWS_DEFAULT up to wna16_mma_rows.MAX_ROWS rows, DENSE past it.
# $TRITONLLM_WNA16_MMA_ROWS: "0" never the rows kernel (DENSE past 16 rows, the path before it); "1" the
# rows kernel up to MAX_ROWS whatever DENSE would time (DENSE is not timed): comparisons.
MMA_ROWS_KIND = 7
MMA_ROWS_ENV = "TRITONLLM_WNA16_MMA_ROWS"
ROWS_VARIANTS = tuple((block_n, 32, warps, 2, split, MMA_ROWS_KIND)
                      for block_n, warps, splits in ((64, 4, (1, 2, 4)), (128, 4, (1, 2, 4)), (128, 8, (1,)),
                                                     (256, 8, (1,)))
                      for split in splits) + ((128, 32, 4, 1, 1, MMA_ROWS_KIND),)
ROWS_DEFAULT = (128, 32, 4, 2, 1, MMA_ROWS_KIND)

# Kind 8: kernels/wna16_mma_gemm.py, the same operand-order words for 17+ rows with Triton's tensor-core dots
# (wgmma on Hopper) over (block_m, block_n) tiles of out up to 256 rows, dequantizing each weight tile once
# per block_m rows. Its tilings are 9-tuples: (block_n, block_m, num_warps, num_stages, split_k, kind,
# block_k, weight first (the weight the dot's A operand, in registers), joined (nibbles made by tl.join: 1; by
# inline PTX too: 2)). Timed at
# load beside DENSE (and ROWS_BESIDE_GEMM) for MID_ROWS; $TRITONLLM_WNA16_MMA_GEMM=0: not timed (ROWS_VARIANTS
# and DENSE, the choice before it, for comparisons).
# MMA_GEMM_VARIANTS: each Llama-3.1-8B shape's fastest tilings at 64, 128 and 256 rows in the H200 sweeps of
# 2026-11-30 00:53 and 01:24 (benchmarks/results/quantization.md): 4-warp programs of 64-128 weight rows (at 256
# rows 64 x 256 tiles, two programs an SM) but for gate_up at 128 rows and down at 256, split-K 2-4 for the narrow
# layers. Left out after the 01:24 sweep: 128 x 256 tiles of 8 warps (6-40% more time than 64 x 256), two stages,
# the "ahead" order (each dot issued before the next tile's dequantization: 15-28% more), split-K 8.
MMA_GEMM_KIND = 8
MMA_GEMM_ENV = "TRITONLLM_WNA16_MMA_GEMM"
MMA_GEMM_VARIANTS = tuple((block_n, block_m, warps, 3, split, MMA_GEMM_KIND, block_k, 1, 2)
                          for block_n, block_m, warps, split, block_k in (
                              (128, 64, 4, 1, 128), (128, 64, 4, 4, 128), (64, 64, 4, 1, 128), (64, 64, 4, 4, 128),
                              (64, 128, 4, 1, 128), (64, 128, 4, 2, 128), (128, 128, 8, 2, 128),
                              (256, 128, 8, 1, 64), (64, 256, 4, 1, 64)))
# The rows kernel lost to the GEMM on every shape at 64-256 rows in the 00:53 sweep but for qkv / o at 64 rows
# (within 0-7%; at 01:24 the engine's timing took it for two of a layer's four products at 64 requests); beside
# the GEMM only that tiling is timed (each tiling is a compile at engine load).
ROWS_BESIDE_GEMM = ((128, 32, 4, 2, 4, MMA_ROWS_KIND),)


def gemm_variants_for(in_features: int) -> tuple:
    """The MMA_GEMM_VARIANTS that fit a layer of ``in_features`` (whole K steps); none if
    $TRITONLLM_WNA16_MMA_GEMM=0."""
    if os.environ.get(MMA_GEMM_ENV, "") == "0":
        return ()
    return tuple(v for v in MMA_GEMM_VARIANTS if wna16_mma_gemm.takes(in_features, v[0], v[6]))


def rows_and_gemm_variants(in_features: int) -> tuple:
    """What the load-time timing weighs past 16 rows for an operand-order layer: DENSE and the GEMM's tilings with
    ROWS_BESIDE_GEMM, or (GEMM off) ROWS_VARIANTS and DENSE."""
    gemm = gemm_variants_for(in_features)
    return (ROWS_BESIDE_GEMM if gemm else ROWS_VARIANTS) + (DENSE,) + gemm


def mma_rows_enabled() -> bool:
    """Operand-order layers may run the rows kernel past 16 rows (default; $TRITONLLM_WNA16_MMA_ROWS=0: never)."""
    return os.environ.get(MMA_ROWS_ENV, "") != "0"


def mma_rows_forced() -> bool:
    """$TRITONLLM_WNA16_MMA_ROWS=1: the rows kernel up to MAX_ROWS rows, dequantize + cuBLAS not timed."""
    return os.environ.get(MMA_ROWS_ENV, "") == "1"


# The tiling for M rows past MAX_SKINNY_ROWS when none was timed: the first (bound, tiling) with M <= bound.
GEMM_TILES = ((32, (64, 32, 4, 4, 1, 0)), (1 << 62, (64, 64, 4, 4, 2, 0)))
DENSE_MIN_ROWS = 64  # from 64 rows dequantize + cuBLAS beat the Triton tiles (H200, benchmarks/results/quantization.md)
# Batches past MAX_SKINNY_ROWS up to MID_ROWS[-1] (decode at serving concurrency): timed at load at
# each of MID_ROWS among MID_VARIANTS and DENSE (dequantize + cuBLAS). Dequantizing writes and
# re-reads the whole weight in the model dtype whatever the batch, so at 32-128 rows it costs more
# than the product; the factored tensor-core kernel (kind 3) reads the packed codes once per row tile.
DENSE = "dense"
MID_ROWS = (32, 64, 128, 256)
MID_VARIANTS = ((64, 32, 4, 3, 1, 3), (128, 32, 4, 3, 1, 3), (128, 32, 4, 3, 2, 3), (64, 64, 4, 3, 1, 3),
                (128, 64, 8, 3, 1, 3), (128, 64, 4, 3, 1, 3), (64, 32, 4, 4, 1, 0), (64, 64, 4, 4, 2, 0),
                (128, 64, 8, 3, 1, 0), DENSE)


def mid_rows_for(batches) -> tuple[int, ...]:
    """The MID_ROWS that decode steps of ``batches`` rows (an engine's graph buckets) read their tiling from
    (``tiling_for``: the least timed row count >= the step's rows): all the load-time timing needs past
    MAX_SKINNY_ROWS. An engine of at most 16 rows a decode step times none of them: its load skips ~10 tilings
    x 4 row counts per weight shape (Llama-8B INT4 on an H200: most of 40 s on a cold Triton cache), and its
    eager prompt steps of 17-256 tokens take the untimed default (ROWS_DEFAULT / GEMM_TILES / DENSE)."""
    return tuple(sorted({next(m for m in MID_ROWS if m >= b) for b in batches if MAX_SKINNY_ROWS < b <= MID_ROWS[-1]}))


def prepare_wna16(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  dtype: torch.dtype, *, scale_dtype: torch.dtype = torch.float16, mma: bool | None = None
                  ) -> WNA16Weight:
    """A layer's stored weight, scale and zero (module docstring) -> its WNA16Weight for
    activations of ``dtype``: on CUDA with Triton the kernels' packed layout, elsewhere (or for a
    grouping the kernels do not take) the dequantized weight. The operand-order layout alone where
    ``mma`` (default: $TRITONLLM_WNA16_MMA not "0") and wna16_mma takes the shape (its scales are
    float16, so only with ``scale_dtype`` float16); else kernels/wna16_layout.py's, scales in ``scale_dtype``."""
    n, groups = scale.shape
    k = unpack_codes(weight[:1], bits).shape[-1]
    prepared = WNA16Weight(out_features=n, in_features=k, bits=bits, group_size=k // groups, dtype=dtype)
    if use_triton(weight) and wna16_layout.supports(k, k // groups):
        codes = unpack_codes(weight, bits)
        if (mma_enabled() if mma is None else mma) and scale_dtype == torch.float16 and \
                wna16_mma.supports(k, k // groups, bits, dtype):
            packed = wna16_mma.pack_mma_layout(codes, scale, zero)
            prepared.kernel = {"mma_words": packed["words"], "mma_meta": packed["meta"]}
            prepared.scratch = wna16_mma_dense.dense_scratch(weight.device, dtype)
            prepared.scratch.reserve(n * k)
        else:
            prepared.kernel = wna16_layout.pack_kernel_layout(codes, scale, zero, bits, scale_dtype)
    else:
        prepared.dense = dequantize(weight, scale, zero, bits, dtype)
    return prepared


def wna16_linear_ref(x: torch.Tensor, weight: WNA16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ the dequantized weight.T (+ bias), in x's dtype: the dequantized model's product."""
    return F.linear(x, weight.dense, bias)


def wna16_linear(x: torch.Tensor, weight: WNA16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) in the model dtype @ the quantized weight (N, K).T (+ bias) -> (..., N) in x's dtype,
    by the paths of the module docstring."""
    if not weight.kernel:
        return wna16_linear_ref(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if weight.mma_only and w4a8_gemm.enabled() and \
            w4a8_gemm.takes(rows, weight.out_features, weight.in_features, weight.group_size):
        out = w4a8_gemm.w4a8_linear(rows, _mma_layout(weight.kernel), weight.out_features, weight.group_size, bias)
        return out.reshape(*x.shape[:-1], weight.out_features)
    out = _product(rows, weight, weight.kernel, tiling_for(weight, rows.shape[0]), bias)
    return out.reshape(*x.shape[:-1], weight.out_features)


def _product(rows: torch.Tensor, weight: WNA16Weight, layout: dict[str, torch.Tensor], tiling: tuple | str,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows (M, K) @ the weight held in ``layout`` (``weight.kernel`` or a copy of it) by ``tiling``:
    a kernel tiling, or DENSE (dequantized into a temporary, or for operand-order weights into
    their scratch, then cuBLAS)."""
    if "words" not in layout:  # operand order only: the decode, rows or GEMM kernel, or the scratch weight + cuBLAS
        kind = tiling[5] if isinstance(tiling, tuple) and len(tiling) > 5 else None
        rows_kernel = kind in (MMA_ROWS_KIND, MMA_GEMM_KIND) and use_triton(rows)
        if tiling == DENSE or (rows.shape[0] > MAX_SKINNY_ROWS and not rows_kernel):
            return wna16_mma_dense.mma_dense_linear(rows, _mma_layout(layout), weight.out_features,
                                                    weight.group_size, weight.scratch, bias)
        if kind not in (MMA_KIND, MMA_ROWS_KIND, MMA_GEMM_KIND):
            tiling = MMA_DEFAULT
    if tiling == DENSE:
        dense = wna16_gemm.dequantize_layout(layout, weight.out_features, weight.in_features, weight.bits,
                                             weight.group_size, rows.dtype)
        return F.linear(rows, dense, bias)
    return wna16_matmul(rows, layout, weight.out_features, weight.bits, weight.group_size, bias, **tile_options(tiling))


def wna16_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, bits: int, group_size: int,
                 bias: torch.Tensor | None = None, *, block_n: int = 64, block_m: int = 16, num_warps: int = 4,
                 num_stages: int = 4, split_k: int = 1, kind: int = 0, block_k: int = 128, w_first: int = 1,
                 joined: int = 1) -> torch.Tensor:
    """x (M, K) with unit column stride @ the weight (N, K) in ``layout``.T (+ bias) -> (M, N) in x's dtype,
    by the kernel of ``kind``: 0 the tensor-core kernel, 1 the FMA kernel (a few rows), both of
    kernels/wna16_gemm.py; 2 / 3 the factored FMA / tensor-core kernels of kernels/wna16_decode.py
    where the grouping allows (else 1 / 0), 4 / 5 the same with the next unit's words loaded before
    this one is multiplied (``prefetch``); 6 kernels/wna16_mma.py's operand-order kernel where the layout
    holds its words and M <= 16 (else SKINNY_DEFAULT); 7 kernels/wna16_mma_rows.py's (any M, meant for 17-256)
    on the same words; 8 kernels/wna16_mma_gemm.py's (any M, ``block_k``, ``w_first``, ``joined``) on
    them (7 and 8 take SKINNY_DEFAULT on other layouts)."""
    tiling = dict(block_n=block_n, block_m=block_m, num_warps=num_warps, num_stages=num_stages, split_k=split_k)
    if kind == MMA_GEMM_KIND:
        if "mma_words" in layout:
            return wna16_mma_gemm.mma_gemm_matmul(x, _mma_layout(layout), n, group_size, bias, block_k=block_k,
                                                  w_first=bool(w_first), joined=joined, **tiling)
        kind = MMA_KIND
    if kind == MMA_ROWS_KIND:
        if "mma_words" in layout:
            return wna16_mma_rows.mma_rows_matmul(x, _mma_layout(layout), n, group_size, bias,
                                                  tiles=block_n // (16 * num_warps), num_warps=num_warps,
                                                  split_k=split_k, prefetch=min(2, max(0, num_stages - 1)))
        kind = MMA_KIND
    if kind == MMA_KIND:
        if "mma_words" in layout and x.shape[0] <= 16:
            return wna16_mma.mma_matmul(x, _mma_layout(layout), n, group_size,
                                        bias, tiles=block_n // (16 * num_warps), num_warps=num_warps, split_k=split_k,
                                        prefetch=num_stages > 1)
        return wna16_matmul(x, layout, n, bits, group_size, bias, **tile_options(SKINNY_DEFAULT))
    if kind >= 2:
        dot = kind in (3, 5)
        if wna16_decode.supports(x.shape[1], group_size, bits):
            return wna16_decode.factored_matmul(x, layout, n, bits, group_size, bias, **tiling, dot=dot,
                                                prefetch=int(kind >= 4))
        kind = 0 if dot else 1
    return wna16_gemm.dequantizing_matmul(x, layout, n, bits, group_size, bias, **tiling, fma=kind == 1)


def _mma_layout(layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kernels/wna16_mma.py's names for the operand-order tensors of a layer's ``kernel``."""
    return {"words": layout["mma_words"], "meta": layout["mma_meta"]}


def dequantized_weight(weight: WNA16Weight, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight in ``dtype`` (a new tensor): the reference's copy, or one made from the kernel layout."""
    if weight.dense is not None:
        return weight.dense.to(dtype)
    if weight.mma_only:
        layout = _mma_layout(weight.kernel)
        if use_triton(layout["words"]):
            return wna16_mma_dense.dequantize_mma(layout, weight.out_features, weight.in_features,
                                                  weight.group_size, dtype)
        return wna16_mma_dense.dequantize_mma_ref(layout, weight.out_features, weight.in_features,
                                                  weight.group_size, dtype)
    return wna16_gemm.dequantize_layout(weight.kernel, weight.out_features, weight.in_features, weight.bits,
                                        weight.group_size, dtype)


def tiling_for(weight: WNA16Weight, rows: int) -> tuple | str:
    """The kernel tiling for ``rows`` rows, or DENSE: the one chosen at load for the fewest timed
    rows >= ``rows`` (decode sizes among the skinny tilings, MID_ROWS among MID_VARIANTS); past the
    timed sizes, DENSE from DENSE_MIN_ROWS rows, else GEMM_TILES'. Operand-order weights (``mma_only``):
    the timed MMA tiling (else MMA_DEFAULT) up to MAX_SKINNY_ROWS; then up to wna16_mma_rows.MAX_ROWS the
    timed rows or fused-GEMM tiling or DENSE (else ROWS_DEFAULT; DENSE throughout when $TRITONLLM_WNA16_MMA_ROWS=0);
    DENSE past it."""
    skinny = rows <= MAX_SKINNY_ROWS
    if weight.mma_only:
        if not skinny:
            if not mma_rows_enabled() or rows > wna16_mma_rows.MAX_ROWS:
                return DENSE
            timed = [m for m in sorted(weight.variant) if m >= rows]
            return weight.variant[timed[0]] if timed else ROWS_DEFAULT
        timed = [m for m in sorted(weight.variant) if rows <= m <= MAX_SKINNY_ROWS]
        return weight.variant[timed[0]] if timed else MMA_DEFAULT
    timed = [m for m in sorted(weight.variant) if m >= rows and (m <= MAX_SKINNY_ROWS) == skinny]
    if timed:
        return weight.variant[timed[0]]
    if skinny:
        return SKINNY_DEFAULT
    if rows >= DENSE_MIN_ROWS:
        return DENSE
    return next(tiling for bound, tiling in GEMM_TILES if rows <= bound)


def tile_options(tiling: tuple) -> dict:
    """wna16_matmul's keyword arguments for a (block_n, block_m, num_warps, num_stages, split_k, kind) tiling,
    or a kind-8 9-tuple (then block_k, w_first, joined)."""
    options = dict(zip(("block_n", "block_m", "num_warps", "num_stages", "split_k"), tiling))
    options.update(zip(("block_k", "w_first", "joined"), tiling[6:]))
    return {**options, "kind": tiling[5] if len(tiling) > 5 else 0}


@torch.inference_mode()
def choose_wna16_variants(weights: list[WNA16Weight], rows: tuple[int, ...] = (1, 8),
                          mid_rows: tuple[int, ...] = MID_ROWS) -> dict[tuple, dict]:
    """Per distinct (bits, group size, N, K) and row count in ``rows``, the SKINNY_VARIANTS tiling
    (MID_VARIANTS, DENSE included, for the counts in ``mid_rows``) with the least device time (from CUDA graph replays, on copies of the weight that together
    exceed twice the L2 cache), set on each weight as ``variant[rows]``; FMA tilings of fewer rows
    than timed are skipped (they would read the weight once per row tile). Returns per key the
    timings (microseconds) and the choices, for the load log. A no-op for weights without the
    kernel layout (CPU)."""
    report: dict[tuple, dict] = {}
    for weight in weights:
        if not weight.kernel:
            continue
        key = (weight.bits, weight.group_size, weight.out_features, weight.in_features)
        if key not in report:
            report[key] = _cached_time_variants(weight, key, tuple(rows) + tuple(mid_rows))
        weight.variant.update(report[key]["variant"])
    return report


def _cached_time_variants(weight: WNA16Weight, key: tuple, rows: tuple[int, ...]) -> dict:
    """_time_skinny_variants through the persistent choice cache (kernels/choice_cache.py); a hit says
    "cached": True. The layout's tensors, $TRITONLLM_WNA16_MMA_ROWS and $TRITONLLM_WNA16_MMA_GEMM are in the key
    (they pick the candidates)."""
    from kernels import fp8, linear

    candidates = SKINNY_VARIANTS + MID_VARIANTS + MMA_VARIANTS + ROWS_VARIANTS + ROWS_BESIDE_GEMM + MMA_GEMM_VARIANTS
    modules = (wna16_decode, wna16_gemm, wna16_layout, wna16_mma, wna16_mma_dense, wna16_mma_gemm, wna16_mma_rows,
               _triton, fp8, linear)
    return choice_cache.timed_report(
        "wna16", (key, str(weight.dtype), weight.mma_only, tuple(sorted(weight.kernel)), rows,
                  os.environ.get(MMA_ROWS_ENV, ""), os.environ.get(MMA_GEMM_ENV, "") == "0", wna16_mma_rows.MAX_ROWS),
        next(iter(weight.kernel.values())).device,
        lambda: _time_skinny_variants(weight, rows), sources=(__file__,) + tuple(m.__file__ for m in modules),
        candidates=candidates, valid=lambda r: all(v in candidates for v in r["variant"].values()))


def _time_skinny_variants(weight: WNA16Weight, rows: tuple[int, ...]) -> dict:
    from kernels.fp8 import l2_defeating_copies
    from kernels.linear import _TOO_LARGE, graph_time_ms

    if weight.mma_only:  # the decode kernel's tilings; past 16 rows the rows kernel's and DENSE (unless turned off)
        layouts = [{**weight.kernel, "mma_words": words} for words in l2_defeating_copies(weight.kernel["mma_words"])]
        rows = tuple(m for m in rows if m <= (wna16_mma_rows.MAX_ROWS if mma_rows_enabled() else MAX_SKINNY_ROWS))
    else:
        layouts = [{**weight.kernel, "words": words} for words in l2_defeating_copies(weight.kernel["words"])]
    turn = iter(range(1 << 40))
    chosen, times = {}, {}
    for m in rows:
        x = torch.randn(m, weight.in_features, dtype=weight.dtype, device=next(iter(weight.kernel.values())).device)
        candidates = SKINNY_VARIANTS if m <= MAX_SKINNY_ROWS else MID_VARIANTS
        if weight.mma_only:
            candidates = MMA_VARIANTS if m <= MAX_SKINNY_ROWS else \
                ROWS_VARIANTS if mma_rows_forced() else rows_and_gemm_variants(weight.in_features)
        times[m] = {}
        for variant in candidates:
            if is_fma_tiling(variant) and variant[1] < m:
                continue

            def product():
                return _product(x, weight, layouts[next(turn) % len(layouts)], variant)
            try:  # compiles; a tiling past this device's shared memory (the GEMM's 256-row x tiles) drops out
                product()
            except _TOO_LARGE:
                continue
            times[m][variant] = 1e3 * graph_time_ms(product)
        chosen[m] = min(times[m], key=times[m].get)
    return {"variant": chosen, "us": {m: times[m][chosen[m]] for m in rows}, "all_us": times}

