"""kernels/wna16_mma.py: the W4A16 decode kernel whose weights are stored in mma.m16n8k16's operand
order. The layout is checked on CPU by replaying each lane's fragments (``mma_layout_reference``,
written from the PTX ISA's fragment table, not from the packing code) against the dequantized
weight; the kernel itself is inline PTX, which Triton's interpreter cannot run, so it is checked on
CUDA against the reference (kernel_testing.TOLERANCE on the relative error, as tests/kernels/test_wna16.py).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error

from kernels import wna16_mma
from kernels.wna16 import MMA_VARIANTS, dequantize, quantize, tile_options, unpack_codes, wna16_matmul

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel is CUDA-only (inline PTX)")


def quantized(n: int, k: int, group_size: int | None, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k), 4, group_size or k, symmetric=False)


@pytest.mark.parametrize("n, k, group_size", [(24, 128, 64), (301, 256, 128), (40, 384, None), (16, 512, 256)])
def test_layout_replayed_lane_by_lane_is_the_dequantized_weight(n, k, group_size):
    """Every code lands in the fragment slot of its row and column (padding: zero codes, scale 0)."""
    stored, scale, zero = quantized(n, k, group_size)
    layout = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
    assert layout["meta"].shape == (scale.shape[1], -(-n // wna16_mma.PAD_ROWS) * wna16_mma.PAD_ROWS)
    x = torch.randn(3, k)
    expected = x @ dequantize(stored, scale.half().float(), zero, 4).t()  # the layout holds float16 scales
    assert torch.allclose(wna16_mma.mma_layout_reference(x, layout, n, k, group_size or k), expected,
                          rtol=1e-5, atol=1e-4)


def test_supports():
    assert wna16_mma.supports(4096, 128, 4, torch.bfloat16) and wna16_mma.supports(4096, 4096, 4, torch.float16)
    assert not wna16_mma.supports(4096, 32, 4, torch.bfloat16)  # groups smaller than a 64-column block
    assert not wna16_mma.supports(4096, 128, 8, torch.bfloat16)
    assert not wna16_mma.supports(4096, 128, 4, torch.float32)
    assert not wna16_mma.supports(4160, 64, 4, torch.bfloat16)  # K not whole 128-column chunks


def _layout_and_dense(n, k, group_size, dtype):
    stored, scale, zero = quantized(n, k, group_size)
    layout = {name: t.cuda() for name, t in wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero).items()}
    return layout, dequantize(stored, scale.half().float(), zero, 4, dtype).cuda()


def _run(x, layout, n, group_size, bias, variant):
    options = tile_options(variant)
    return wna16_mma.mma_matmul(x, layout, n, group_size, bias, tiles=options["block_n"] // (16 * options["num_warps"]),
                                num_warps=options["num_warps"], split_k=options["split_k"],
                                prefetch=options["num_stages"] > 1)


@cuda
@pytest.mark.parametrize("variant", MMA_VARIANTS)
def test_every_tiling_matches_the_reference(variant):
    n, k = 301, 2048  # odd N: padded rows masked; 16 chunks, so every split has work
    layout, dense = _layout_and_dense(n, k, 128, torch.bfloat16)
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert relative_error(_run(x, layout, n, 128, None, variant), x @ dense.t()) < TOLERANCE[torch.bfloat16], m


@cuda
@pytest.mark.parametrize("group_size", [64, 256, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_groupings_dtypes_and_bias(group_size, dtype):
    n, k = 200, 1024
    layout, dense = _layout_and_dense(n, k, group_size, dtype)
    for variant in (MMA_VARIANTS[1], MMA_VARIANTS[-2]):
        for m in (1, 3, 9, 16):
            x = torch.randn(m, k, device="cuda").to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
            ref = torch.nn.functional.linear(x, dense, bias)
            assert relative_error(_run(x, layout, n, group_size or k, bias, variant), ref) < TOLERANCE[dtype], (variant, m)


@cuda
def test_dispatch_and_strided_rows():
    """wna16_matmul's kind 6 on prepare_wna16's layout, x a strided view of wider rows."""
    from kernels.wna16 import prepare_wna16

    n, k = 512, 2048
    stored, scale, zero = quantized(n, k, 128)
    weight = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, torch.bfloat16)
    assert "mma_words" in weight.kernel
    dense = dequantize(stored, scale.half().float(), zero, 4, torch.bfloat16).cuda()
    x = torch.randn(4, 2 * k, device="cuda").to(torch.bfloat16)[:, :k]
    out = wna16_matmul(x, weight.kernel, n, 4, 128, **tile_options(MMA_VARIANTS[5]))
    assert relative_error(out, torch.nn.functional.linear(x, dense)) < TOLERANCE[torch.bfloat16]
