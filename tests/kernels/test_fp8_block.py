"""Block-scaled FP8 (kernels/fp8_block.py): the 1 x 128 activation groups and 128 x 128 weight blocks
(CPU), the reference against a block-by-block float32 accumulation (CPU), and the Triton GEMM and
group quantizer against the reference (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1),
also replayed from a CUDA graph.

Triton's CPU interpreter (3.9) rounds some values to E4M3 wrongly (31.02 to 16: a mantissa carried
into the next binade is lost), so the group quantizer kernel is checked on the GPU only; under the
interpreter the GEMM runs on activations quantized by the reference (as it does for CPU tensors).

Tolerances (||kernel - reference|| / ||reference||): both multiply the same E4M3 values with the
same scales and differ only in the order of float32 accumulation (fp32 outputs: far under 1e-5) and
in the rounding of that sum to bf16 outputs (2^-9 relative, kernel_testing.TOLERANCE's 1e-2 is loose)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

from kernels.fp8 import FP8_DTYPE, FP8_MAX
from kernels.fp8_block import (BLOCK, dequantize_blocks, dequantize_groups, fp8_block_linear_ref,
                               fp8_block_linear_triton, quantize_blocks, quantize_groups)

HALF_ULP = 2.0 ** -4  # E4M3 keeps 3 mantissa bits


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_groups_of_128_columns_each_take_their_own_scale():
    x = randn(5, 300, seed=0)  # groups [0, 128), [128, 256), [256, 300): the last one partial
    x[1, 128:256] *= 1000.0  # an outlier group costs no other group its resolution
    x[2, :128] = 0.0  # an all-zero group quantizes to zeros
    x_q, scale = quantize_groups(x)
    assert x_q.dtype == FP8_DTYPE and scale.shape == (5, 3)
    for g, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
        peak = x[:, cols].abs().amax(dim=1)
        assert torch.equal(scale[:, g], (peak / FP8_MAX).clamp(min=1e-12))
    back = dequantize_groups(x_q, scale)
    assert ((back - x).abs() <= HALF_ULP * x.abs() + 2.0 ** -10 * scale.repeat_interleave(BLOCK, 1)[:, :300]).all()
    assert torch.equal(back[2, :128], torch.zeros(128))


def test_block_scales_recover_a_checkpoints_codes_exactly():
    """A weight whose blocks were E4M3 with some scale (here max / 400, not the engine's max / 448)
    comes back code for code when requantized with those scales, partial edge blocks included."""
    weight = randn(3, 300, 200, seed=1)
    codes, scale = quantize_blocks(weight)
    assert codes.dtype == FP8_DTYPE and scale.shape == (3, 3, 2)
    source = (scale * 448.0 / 400.0)
    codes = (weight / torch.repeat_interleave(torch.repeat_interleave(source, BLOCK, 1), BLOCK, 2)[:, :300, :200]
             ).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    again, kept = quantize_blocks(dequantize_blocks(codes, source), source)
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(kept, source)


@pytest.mark.parametrize("rows,n,k", [(1, 256, 384), (9, 300, 320), (64, 128, 130)])
def test_reference_is_the_blockwise_float32_accumulation(rows, n, k):
    """y = sum over K blocks of (x_q . w_q over the block) * s_x * s_w, as the kernel accumulates."""
    x, bias = randn(rows, k, seed=rows), randn(n, seed=2)
    w_q, w_scale = quantize_blocks(randn(n, k, seed=3, scale=k**-0.5))
    x_q, x_scale = quantize_groups(x)
    expected = torch.zeros(rows, n, dtype=torch.float64)
    for b in range(-(-k // BLOCK)):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        dots = x_q[:, cols].double() @ w_q[:, cols].double().T
        expected += dots * x_scale[:, b, None].double() * w_scale[:, b].repeat_interleave(BLOCK)[:n].double()
    out = fp8_block_linear_ref(x, w_q, w_scale, bias)
    assert relative_error(out, expected + bias.double()) < 1e-6


def test_w8a8_block_product_is_within_the_rounding_of_its_inputs():
    """Against the unquantized product: both factors rounded to E4M3 (~2.6% relative RMS each)."""
    x, w = randn(32, 1024, seed=4), randn(256, 1024, seed=5, scale=1024**-0.5)
    out = fp8_block_linear_ref(x, *quantize_blocks(w))
    assert relative_error(out, x @ w.T) < 0.05


# ---- Triton (GPU; or TRITON_INTERPRET=1 on CPU) ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 33, 130])
@pytest.mark.parametrize("n,k", [(256, 384), (300, 320)])  # the second: partial row and column blocks
def test_kernel_equals_reference(device, rows, n, k):
    w_q, w_scale = quantize_blocks(randn(n, k, seed=6, scale=k**-0.5))
    for dtype in low_precision_dtypes(device):
        x, bias = randn(rows, k, seed=rows).to(dtype), randn(n, seed=7).to(dtype)
        expected = fp8_block_linear_ref(x, w_q, w_scale, bias)
        out = fp8_block_linear_triton(x.to(device), w_q.to(device), w_scale.to(device), bias.to(device))
        assert out.dtype == dtype and out.shape == (rows, n)
        assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 384), (300, 320)])
def test_dequantize_kernel_equals_reference(device, n, k):
    """The prefill-size path's one-pass dequantization: exactly dequantize_blocks, rounded once."""
    from kernels.fp8_block import dequantize_blocks, dequantize_blocks_triton

    w_q, w_scale = quantize_blocks(randn(n, k, seed=9, scale=k**-0.5))
    # bf16 on CUDA only: the interpreter truncates float32 -> bf16 instead of rounding.
    for dtype in (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,):
        out = dequantize_blocks_triton(w_q.to(device), w_scale.to(device), dtype)
        assert torch.equal(out.cpu(), dequantize_blocks(w_q, w_scale, dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS on prefill-size rows: GPU only")
def test_prefill_rows_take_the_dequantized_weight():
    from kernels.fp8_block import DEQUANTIZED_MIN_ROWS, fp8_block_linear

    w_q, w_scale = quantize_blocks(randn(300, 320, seed=10, scale=320**-0.5))
    x = randn(DEQUANTIZED_MIN_ROWS + 3, 320, seed=11).bfloat16()
    expected = x.float() @ dequantize_blocks(w_q, w_scale).T
    out = fp8_block_linear(x.cuda(), w_q.cuda(), w_scale.cuda())
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's block-scaled GEMM: GPU only")
@pytest.mark.parametrize("rows", [128, 129, 300, 1000])
def test_cublas_block_scaled_gemm_equals_the_reference(rows):
    """torch._scaled_mm with the column-major 1 x 128 scales and the transposed 128 x 128 ones,
    at row counts a scheduler hands out (odd ones, which cuBLAS only takes padded, included), with a
    bias; and fp8_block_linear at those rows (cuBLAS's block-scaled GEMM or the dequantized weight)."""
    from kernels.fp8_block import (CUBLAS_BLOCK_SCALED_MIN_ROWS, _dequantize_for_cublas, cublas_block_scaled_supported,
                                   fp8_block_linear, fp8_block_linear_cublas)

    w_q, w_scale = quantize_blocks(randn(384, 512, seed=12, scale=512**-0.5))
    x, bias = randn(rows, 512, seed=13).bfloat16(), randn(384, seed=14).bfloat16()
    if not cublas_block_scaled_supported(x.cuda(), w_q.cuda()):
        pytest.skip("this cuBLAS has no block-scaled FP8 GEMM (CUDA < 12.9 or not sm90)")
    expected = fp8_block_linear_ref(x, w_q, w_scale, bias)
    out = fp8_block_linear_cublas(x.cuda(), w_q.cuda(), w_scale.cuda(), bias.cuda())
    assert out.shape == (rows, 384) and out.dtype == torch.bfloat16
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
    assert rows >= CUBLAS_BLOCK_SCALED_MIN_ROWS
    picked = fp8_block_linear(x.cuda(), w_q.cuda(), w_scale.cuda(), bias.cuda())
    if _dequantize_for_cublas(rows, 384, block_scaled=True):  # the dequantized weight, activations unquantized
        unquantized = x.float() @ dequantize_blocks(w_q, w_scale).T + bias.float()
        assert relative_error(picked, unquantized) < TOLERANCE[torch.bfloat16]
    else:
        assert torch.equal(picked, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's E4M3 conversion is wrong (docstring)")
@pytest.mark.parametrize("column_major", [False, True])
def test_group_quantizer_equals_the_reference(device, column_major):
    from kernels.fp8_block import quantize_groups_triton

    x = randn(7, 300, seed=8, scale=3.0)
    x[2, 128:256] = 0.0
    x_q, scale = quantize_groups_triton(x.to(device), scale_column_major=column_major, padded_rows=16)
    assert x_q.shape == (16, 300) and scale.stride() == ((1, 16) if column_major else (3, 1))
    assert not x_q[7:].cpu().float().any()  # padding rows quantize zeros
    x_q, scale = x_q[:7], scale[:7]
    ref_q, ref_scale = quantize_groups(x)
    torch.testing.assert_close(scale.cpu(), ref_scale)  # Triton's float32 division may differ in the last bit
    assert torch.equal(x_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_from_a_cuda_graph():
    """Decode rows and a prefill chunk (quantize launch + GEMM each) captured once."""
    w_q, w_scale = (t.cuda() for t in quantize_blocks(randn(512, 1024, seed=9, scale=1024**-0.5)))
    inputs = [torch.zeros(rows, 1024, device="cuda", dtype=torch.bfloat16) for rows in (4, 200)]
    fp8_block_linear_triton(inputs[0], w_q, w_scale)
    fp8_block_linear_triton(inputs[1], w_q, w_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fp8_block_linear_triton(x, w_q, w_scale) for x in inputs]
    for seed, x in enumerate(inputs):
        x.copy_(randn(*x.shape, seed=10 + seed).to(x))
    graph.replay()
    for x, out in zip(inputs, outs):
        assert relative_error(out, fp8_block_linear_ref(x.cpu(), w_q.cpu(), w_scale.cpu())) < 1e-2


def test_prefill_rows_of_narrow_outputs_take_the_dequantized_weight():
    """fp8_block_linear's routing (the H100 figures beside DEQUANTIZED_NARROW_OUTPUTS): with cuBLAS's
    block-scaled GEMM, outputs of up to 2,048 columns dequantize from 2,048 rows and of up to 4,096
    from 4,096; wider ones never. Without it, every output from DEQUANTIZED_MIN_ROWS rows."""
    from kernels.fp8_block import DEQUANTIZED_MIN_ROWS, _dequantize_for_cublas

    assert not _dequantize_for_cublas(512, 2048, block_scaled=True)
    assert _dequantize_for_cublas(2048, 2048, block_scaled=True)
    assert not _dequantize_for_cublas(2048, 4096, block_scaled=True)
    assert _dequantize_for_cublas(4096, 4096, block_scaled=True)
    assert not _dequantize_for_cublas(8192, 5120, block_scaled=True)
    assert _dequantize_for_cublas(DEQUANTIZED_MIN_ROWS, 28672, block_scaled=False)
    assert not _dequantize_for_cublas(DEQUANTIZED_MIN_ROWS - 1, 2048, block_scaled=False)
