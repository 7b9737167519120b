"""kernels/wna16_mma_dense.py: 17+ rows of an INT4 layer held only in the operand order
(kernels/wna16_mma.py) run as dequantize-into-scratch + cuBLAS. On CPU: the plain-torch reference
equals kernels.wna16.dequantize exactly, the Triton kernel (TRITON_INTERPRET=1) equals the reference
bit for bit, and the dispatch of an operand-order-only layer multiplies the reference's weight. On
CUDA (marked gpu): the engine's prepare_wna16 holds the codes once, every row count matches the
reference, the scratch is one static buffer, and CUDA graphs replay it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import TOLERANCE, relative_error

from kernels import wna16_mma, wna16_mma_dense
from kernels.wna16 import (DENSE, MMA_DEFAULT, MMA_VARIANTS, ROWS_DEFAULT, WNA16Weight, dequantize, prepare_wna16,
                           quantize, tiling_for, unpack_codes, wna16_linear)

CASES = [(40, 256, 64), (150, 384, 128), (24, 256, None)]  # odd N: padded rows; None: per channel


def quantized(n: int, k: int, group_size: int | None, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k), 4, group_size or k, symmetric=False)


def mma_layout(n, k, group_size):
    stored, scale, zero = quantized(n, k, group_size)
    return stored, scale, zero, wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)


@pytest.mark.parametrize("n, k, group_size", CASES)
def test_reference_is_the_dequantized_weight_exactly(n, k, group_size):
    stored, scale, zero, layout = mma_layout(n, k, group_size)
    for dtype in (torch.bfloat16, torch.float16):
        expected = dequantize(stored, scale.half().float(), zero, 4, dtype)  # the layout holds float16 scales
        assert torch.equal(wna16_mma_dense.dequantize_mma_ref(layout, n, k, group_size or k, dtype), expected)


@pytest.mark.parametrize("n, k, group_size, tiling", [
    case + (tiling,) for case, tiling in zip(CASES, [None, None, (1, 2)])] + [(300, 512, 128, (2, 4))])
def test_triton_kernel_equals_the_reference_exactly(device, n, k, group_size, tiling):
    """Triton's interpreter on CPU (TRITON_INTERPRET=1) or the GPU: bit-identical weights (the default
    tiling with 4 and 2 k blocks a program, others; a masked last row tile)."""
    _, _, _, layout = mma_layout(n, k, group_size)
    ref = {dtype: wna16_mma_dense.dequantize_mma_ref(layout, n, k, group_size or k, dtype)
           for dtype in (torch.bfloat16, torch.float16)}
    layout = {name: t.to(device) for name, t in layout.items()}
    for dtype, expected in ref.items():
        scratch = wna16_mma_dense.DenseScratch(torch.device(device), dtype)
        scratch.reserve(n * k + 100)
        out = wna16_mma_dense.dequantize_mma(layout, n, k, group_size or k, dtype, out=scratch.weight(n, k),
                                             tiling=tiling)
        assert out.data_ptr() == scratch.buffer.data_ptr()
        assert torch.equal(out.cpu(), expected), dtype


def test_operand_order_only_layer_dispatch_on_cpu():
    """A layer holding only the operand-order words: decode rows the MMA tilings (timed, else MMA_DEFAULT),
    17-256 the rows kernel (ROWS_DEFAULT untimed), more DENSE; off CUDA every 17+-row product is the
    reference's weight (no Triton there)."""
    n, k, group_size = 40, 256, 64
    stored, scale, zero, layout = mma_layout(n, k, group_size)
    weight = WNA16Weight(n, k, 4, group_size, torch.bfloat16,
                         kernel={"mma_words": layout["words"], "mma_meta": layout["meta"]})
    assert weight.mma_only
    assert tiling_for(weight, 1) == MMA_DEFAULT and tiling_for(weight, 17) == ROWS_DEFAULT
    assert tiling_for(weight, 999) == DENSE
    weight.variant.update({1: MMA_VARIANTS[0], 8: MMA_VARIANTS[3]})
    assert [tiling_for(weight, m) for m in (1, 2, 8, 9, 16, 17)] == \
        [MMA_VARIANTS[0], MMA_VARIANTS[3], MMA_VARIANTS[3], MMA_DEFAULT, MMA_DEFAULT, ROWS_DEFAULT]
    dense = dequantize(stored, scale.half().float(), zero, 4, torch.bfloat16)
    for m in (17, 40):
        x = torch.randn(m, k).to(torch.bfloat16)
        bias = torch.randn(n).to(torch.bfloat16) if m == 17 else None
        assert torch.equal(wna16_linear(x, weight, bias), F.linear(x, dense, bias)), m


def test_scratch_grows_at_load_and_keeps_used_buffers():
    scratch = wna16_mma_dense.DenseScratch(torch.device("cpu"), torch.float16)
    scratch.reserve(64)
    scratch.reserve(256)  # unused: replaced, nothing retired
    assert scratch.buffer.numel() == 256 and not scratch.retired
    first = scratch.weight(16, 16)
    scratch.reserve(100)  # smaller: no change
    assert scratch.weight(10, 10).data_ptr() == first.data_ptr()
    scratch.reserve(512)  # used: the old buffer stays alive for graphs captured over it
    assert scratch.buffer.numel() == 512 and len(scratch.retired) == 1
    with pytest.raises(RuntimeError, match="cannot hold"):
        scratch.weight(32, 32)


# ---- CUDA (tests/gpu_run.sh) -------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the operand-order kernels are CUDA-only")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, None])
def test_codes_held_once_and_every_row_count_matches(dtype, group_size):
    n, k = 301, 1024
    stored, scale, zero = quantized(n, k, group_size)
    weight = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, dtype)
    assert weight.mma_only and set(weight.kernel) == {"mma_words", "mma_meta"}
    assert weight.kernel["mma_words"].numel() * 4 == 512 * k // 2  # N padded to 512: one nibble a code
    assert weight.scratch.buffer.numel() >= n * k and weight.scratch.buffer.dtype == dtype
    dense = dequantize(stored, scale.half().float(), zero, 4, dtype).cuda()
    pointer = weight.scratch.buffer.data_ptr()
    for m in (1, 5, 16, 17, 64, 300):
        x = torch.randn(m, k, device="cuda").to(dtype)
        bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
        out = wna16_linear(x, weight, bias)
        assert relative_error(out, F.linear(x, dense, bias)) < TOLERANCE[dtype], m
    assert weight.scratch.buffer.data_ptr() == pointer  # no allocation per call
    assert torch.equal(weight.scratch.weight(n, k), dense)  # the 17+-row weight is the reference's exactly


@pytest.mark.gpu
@cuda
def test_mma_off_keeps_the_layout_before(monkeypatch):
    stored, scale, zero = quantized(256, 512, 128)
    monkeypatch.setenv("TRITONLLM_WNA16_MMA", "0")
    weight = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, torch.bfloat16)
    assert not weight.mma_only and "words" in weight.kernel and "mma_words" not in weight.kernel
    assert weight.scratch is None


@pytest.mark.gpu
@cuda
def test_operand_order_layer_inside_a_cuda_graph():
    n, k = 257, 768
    stored, scale, zero = quantized(n, k, 128)
    weight = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, torch.bfloat16)
    other = prepare_wna16(*(t.cuda() for t in quantized(64, k, 128, seed=1)), 4, torch.bfloat16)
    assert weight.scratch is other.scratch  # one buffer per device and dtype
    inputs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 33)}
    for x in inputs.values():  # compile outside the capture
        wna16_linear(x, weight), wna16_linear(x, other)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = {m: (wna16_linear(x, weight), wna16_linear(x, other)) for m, x in inputs.items()}
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in inputs.items():
        assert torch.equal(outputs[m][0], wna16_linear(x, weight)), m
        assert torch.equal(outputs[m][1], wna16_linear(x, other)), m
