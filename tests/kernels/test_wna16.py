"""Weight-only integer linear layers (kernels/wna16.py; its kernels in wna16_layout.py, wna16_gemm.py
and wna16_decode.py): the storage format on CPU, the kernel layout's packing, and every kernel path
against the reference.

Tolerance of the kernel paths: kernel_testing.TOLERANCE on ||out - ref|| / ||ref|| (bf16 1e-2,
fp16 2e-3). The kernels and the reference multiply the same dequantized weights, (code - zero) *
scale rounded once to x's dtype, except that the kernels hold the scale in float16 (2^-12
relative rounding, shared by a group: ~1e-4 on the output); both accumulate in float32 and round
the output once, so what is left is the order of accumulation and a few flipped roundings of
weights or outputs, well under one rounding step of the output dtype on average.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

from kernels import wna16_decode, wna16_gemm, wna16_layout
from kernels.wna16 import (DENSE_MIN_ROWS, SKINNY_VARIANTS, WNA16Weight, choose_wna16_variants, dequantize,
                           is_fma_tiling, pack_codes, pack_int4, prepare_wna16, quantize, stored_columns, tile_options,
                           unpack_codes, unpack_int4, wna16_linear, wna16_linear_ref, wna16_matmul)

GROUPS = [32, 64, 128, None]  # None: per channel (group_size == K)
ROWS = [1, 3, 8, 16, 33, 200]


# ---- storage (CPU) ---------------------------------------------------------------------------

def test_int4_pack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 3, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[..., 0], codes[..., 0] | (codes[..., 1] << 4))
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError):
        pack_int4(codes[..., :3])


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_codes_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (7, 96), dtype=torch.uint8)
    stored = pack_codes(codes, bits)
    assert stored.shape == (7, stored_columns(96, bits))
    assert torch.equal(unpack_codes(stored, bits), codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_quantize_within_half_a_step(bits, symmetric, group_size):
    torch.manual_seed(0)
    weight = torch.randn(16, 256) * 0.05 + (0.0 if symmetric else 0.02)
    stored, scale, zero = quantize(weight, bits, group_size, symmetric=symmetric)
    assert scale.shape == zero.shape == (16, 256 // group_size) and zero.dtype == torch.uint8
    codes = unpack_codes(stored, bits)
    if symmetric:
        assert (zero == 1 << (bits - 1)).all() and codes.min() >= 1
    error = (dequantize(stored, scale, zero, bits) - weight).abs()
    step = scale.repeat_interleave(group_size, dim=-1)
    assert (error <= step * (0.5 + 1e-5)).all()


def test_dequantize_is_code_minus_zero_times_scale():
    codes = torch.tensor([[0, 15, 7, 8]], dtype=torch.uint8)
    scale, zero = torch.tensor([[0.5, 2.0]]), torch.tensor([[8, 1]], dtype=torch.uint8)
    out = dequantize(pack_int4(codes), scale, zero, 4, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), torch.tensor([[-4.0, 3.5, 12.0, 14.0]]))


def quantized(n: int, k: int, bits: int, group_size: int | None, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k) * 0.05, bits, group_size or k, symmetric=bits == 8)


def test_reference_multiplies_the_dequantized_weight():
    stored, scale, zero = quantized(48, 128, 4, 32)
    weight = prepare_wna16(stored, scale, zero, 4, torch.float32)
    assert weight.dense is not None and not weight.kernel and weight.group_size == 32 and weight.in_features == 128
    x, bias = torch.randn(3, 128), torch.randn(48)
    expected = x @ dequantize(stored, scale, zero, 4).T + bias
    torch.testing.assert_close(wna16_linear(x, weight, bias), expected)
    torch.testing.assert_close(wna16_linear_ref(x, weight), expected - bias)
    assert choose_wna16_variants([weight]) == {} and weight.variant == {}  # a no-op on CPU


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [256, 200])
def test_kernel_layout_holds_every_code_once(bits, k):
    """Word r of unit u of row n, bits [bits*j, bits*(j+1)): the code of column u*U + j*16 + r."""
    n, per_word, unit = 70, 32 // bits, wna16_layout.unit_columns(bits)
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    scale, zero = torch.rand(n, 2), torch.randint(0, 1 << bits, (n, 2), dtype=torch.uint8)
    layout = wna16_layout.pack_kernel_layout(codes, scale, zero, bits)
    units = -(-k // unit)
    words = layout["words"].view(-1, units, wna16_layout.BLOCK_ROWS, 16).transpose(1, 2).reshape(-1, units, 16).long()
    fields = torch.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(per_word)], dim=2)
    unpacked = fields.reshape(-1, units * unit)  # (rows, units, P, 16) in column order
    assert torch.equal(unpacked[:n, :k], codes.long())
    assert not unpacked[:n, k:].any() and not unpacked[n:].any()
    assert torch.equal(layout["scale"], scale.t().half()) and torch.equal(layout["zero"], zero.t())


# ---- the kernels (CUDA, or Triton's interpreter) ------------------------------------------------

def kernel_weight(stored, scale, zero, bits: int, dtype: torch.dtype, device: str) -> WNA16Weight:
    """prepare_wna16 on the device; under the CPU interpreter the kernel layout built by hand."""
    if device == "cuda":
        return prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), bits, dtype, mma=False)  # the kernels before wna16_mma
    k = unpack_codes(stored[:1], bits).shape[-1]
    return WNA16Weight(scale.shape[0], k, bits, k // scale.shape[1], dtype,
                       kernel=wna16_layout.pack_kernel_layout(unpack_codes(stored, bits), scale, zero, bits,
                                                              scale_dtype=torch.float32))


def reference_weight(stored, scale, zero, bits: int, dtype: torch.dtype, device: str) -> WNA16Weight:
    k = unpack_codes(stored[:1], bits).shape[-1]
    return WNA16Weight(scale.shape[0], k, bits, k // scale.shape[1], dtype,
                       dense=dequantize(stored, scale, zero, bits, dtype).to(device))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", GROUPS)
def test_kernels_match_the_reference(device, bits, group_size):
    n, k = 301, 512  # odd N: a partial tile
    stored, scale, zero = quantized(n, k, bits, group_size)
    for dtype in low_precision_dtypes(device):
        weight = kernel_weight(stored, scale, zero, bits, dtype, device)
        assert weight.dense is None and weight.kernel
        ref = reference_weight(stored, scale, zero, bits, dtype, device)
        for m in ROWS:
            x = torch.randn(m, k, device=device).to(dtype)
            bias = torch.randn(n, device=device).to(dtype) if m % 2 else None
            out = wna16_linear(x, weight, bias)
            assert out.shape == (m, n) and out.dtype == dtype
            assert relative_error(out, wna16_linear_ref(x, ref, bias)) < TOLERANCE[dtype], (dtype, m)


@pytest.mark.parametrize("variant", SKINNY_VARIANTS)
def test_every_decode_tiling_matches_the_reference(device, variant):
    n, k, bits = 200, 1024, 4
    stored, scale, zero = quantized(n, k, bits, 128)
    dtype = low_precision_dtypes(device)[0]
    weight = kernel_weight(stored, scale, zero, bits, dtype, device)
    ref = reference_weight(stored, scale, zero, bits, dtype, device)
    for m in (1, 5, 16):
        if is_fma_tiling(variant) and variant[1] < m and m > 5:
            continue  # an FMA tiling is never chosen for more rows than its tile (it works, slowly)
        x = torch.randn(m, k, device=device).to(dtype)
        out = wna16_matmul(x, weight.kernel, n, bits, 128, **tile_options(variant))
        assert relative_error(out, wna16_linear_ref(x, ref)) < TOLERANCE[dtype], m


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [128, 256, None])
def test_factored_kernels_match_the_reference(device, bits, group_size):
    """kernels/wna16_decode.py (scale and zero per unit of words) on the groupings it takes, both
    kernels, split-K and not, with and without the prefetch of the next unit.

    Which launch covers what (each a compile per dtype, bias and bits on a GPU: the FMA kernel's
    (block_m, block_n, 16) float32 tile makes a 16 x 256 prefetching one ~30 s of Triton compile, an 8 x 256
    one ~14 s, so those are not launched: they are no tiling the engine times, SKINNY_VARIANTS' FMA tiles
    having 1 or 8 rows, its prefetching ones 1):
    - FMA, split-K (kind 2): 1 row in a 1-row tile; 5 rows (bias) in a partial 8-row tile; 16 rows in
      two 8-row tiles (the row-tile grid).
    - FMA, prefetch (kind 4): block_m 1 x block_n 256 (the engine's shape) at 1 row, and 16 rows in 16
      row tiles (the same compile); 5 rows (bias) in a partial 8-row tile of 128 columns.
    - tensor cores (kind 3, kind 5 with prefetch): a 16-row tile at 1, 5 (bias) and 16 rows (one compile
      for 1 and 16), split-K 1, 2 (prefetch) and 4 (of K's 6 units of 4-bit codes: 3 splits; of 12 8-bit: 4);
      serving sizes (70 rows, bias): the 32- and 64-row tiles of MID_VARIANTS, a partial last row tile."""
    n, k = 150, 768
    stored, scale, zero = quantized(n, k, bits, group_size)
    assert wna16_decode.supports(k, group_size or k, bits)
    dots = [dict(block_m=16, dot=True, split_k=1), dict(block_m=16, dot=True, split_k=4, block_n=128),
            dict(block_m=16, dot=True, split_k=2, block_n=128, prefetch=1)]  # kind 5
    options = {1: [dict(block_m=1, split_k=2), dict(block_m=1, split_k=3, block_n=256, prefetch=1)] + dots,
               5: [dict(block_m=8, split_k=2), dict(block_m=8, split_k=3, block_n=128, prefetch=1)] + dots,
               16: [dict(block_m=8, split_k=2), dict(block_m=1, split_k=3, block_n=256, prefetch=1)] + dots,
               70: [dict(block_m=32, dot=True, split_k=1), dict(block_m=64, dot=True, split_k=2, block_n=128)]}
    for dtype in low_precision_dtypes(device):
        weight = kernel_weight(stored, scale, zero, bits, dtype, device)
        ref = reference_weight(stored, scale, zero, bits, dtype, device)
        for m, tilings in options.items():
            x = torch.randn(m, k, device=device).to(dtype)
            bias = torch.randn(n, device=device).to(dtype) if m in (5, 70) else None
            for option in tilings:
                out = wna16_decode.factored_matmul(x, weight.kernel, n, bits, group_size or k, bias, **option)
                assert relative_error(out, wna16_linear_ref(x, ref, bias)) < TOLERANCE[dtype], (dtype, m, option)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_weight_for_large_batches(device, bits):
    """From DENSE_MIN_ROWS rows the weight is dequantized from the kernel layout, then cuBLAS:
    the dequantized weight is the reference's, up to the float16 scale."""
    if device != "cuda":
        pytest.skip("cuBLAS path")
    n, k = 96, 384
    stored, scale, zero = quantized(n, k, bits, 64)
    weight = kernel_weight(stored, scale, zero, bits, torch.bfloat16, device)
    dense = wna16_gemm.dequantize_layout(weight.kernel, n, k, bits, 64, torch.float32).cpu()
    expected = dequantize(stored, scale.half().float(), zero, bits)
    torch.testing.assert_close(dense, expected, rtol=1e-6, atol=1e-7)
    x = torch.randn(DENSE_MIN_ROWS, k, device=device, dtype=torch.bfloat16)
    ref = reference_weight(stored, scale, zero, bits, torch.bfloat16, device)
    assert relative_error(wna16_linear(x, weight), wna16_linear_ref(x, ref)) < TOLERANCE[torch.bfloat16]


def test_kernels_inside_a_cuda_graph(device):
    """No host syncs and no data-dependent grids: captured products replay on new inputs."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    n, k = 257, 768
    stored, scale, zero = quantized(n, k, 4, 64)
    weight = kernel_weight(stored, scale, zero, 4, torch.bfloat16, device)
    weight.variant.update({1: (64, 1, 4, 4, 4, 1), 8: (64, 16, 4, 4, 4, 0)})  # split-K: arrival counters in the graph
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    inputs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in (1, 8, 33)}
    for m, x in inputs.items():
        wna16_linear(x, weight, bias)  # compile and allocate outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = {m: wna16_linear(x, weight, bias) for m, x in inputs.items()}
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in inputs.items():
        assert torch.equal(outputs[m], wna16_linear(x, weight, bias)), m


def test_choose_variants_sets_a_tiling(device):
    """Each timed row count gets a tiling of its candidates (which one wins is the GPU's business: the
    H100 and the H200 differ), shared by the weights of one shape, and the chosen tiling computes the
    product at that row count."""
    if device != "cuda":
        pytest.skip("timing on CUDA")
    from kernels.wna16 import MAX_SKINNY_ROWS, MID_ROWS, MID_VARIANTS

    # test_every_decode_tiling_matches_the_reference's weight (N 200, K 1024, group 128, bf16): the same
    # specialization, so each skinny tiling compiles once for both tests (Triton's cache on disk)
    stored, scale, zero = quantized(200, 1024, 4, 128)
    weights = [kernel_weight(stored, scale, zero, 4, torch.bfloat16, device) for _ in range(2)]
    report = choose_wna16_variants(weights, rows=(1, 4))
    assert list(report) == [(4, 128, 200, 1024)]
    chosen = weights[0].variant
    assert set(chosen) == {1, 4, *MID_ROWS} and weights[1].variant == chosen
    for m, tiling in chosen.items():
        assert tiling in (SKINNY_VARIANTS if m <= MAX_SKINNY_ROWS else MID_VARIANTS), (m, tiling)
        assert not is_fma_tiling(tiling) or tiling[1] >= m, (m, tiling)  # an FMA tile holds all m rows
    ref = reference_weight(stored, scale, zero, 4, torch.bfloat16, device)
    for m in chosen:
        x = torch.randn(m, 1024, device=device, dtype=torch.bfloat16)
        assert relative_error(wna16_linear(x, weights[0]), F.linear(x, ref.dense)) < TOLERANCE[torch.bfloat16], m


def test_mid_rows_timed_are_those_the_decode_buckets_read():
    """An engine's load times past 16 rows only the MID_ROWS its decode buckets take their tiling from (the
    next timed count >= the bucket): none at max batch 8 (a load ~40 s shorter for Llama-8B INT4 on a cold
    Triton cache), all four at 256."""
    from kernels.wna16 import MID_ROWS, mid_rows_for

    assert mid_rows_for([1, 2, 4, 8]) == mid_rows_for([1, 2, 4, 8, 16]) == ()  # engine/executor/cuda_graphs.py's
    assert mid_rows_for([1, 2, 4, 8, 16, 24]) == (32,) and mid_rows_for([40, 300]) == (64,)
    assert mid_rows_for([1, 8, 24, 48, 96, 208]) == mid_rows_for(range(1, 1025)) == MID_ROWS


def test_tiling_for_follows_the_timed_row_counts():
    """Decode sizes take the skinny tiling timed for the next timed count; serving sizes (17-256) the
    mid tiling or DENSE timed for the next of MID_ROWS; past them, or untimed, DENSE from
    DENSE_MIN_ROWS rows and the GEMM tiles below."""
    from kernels.wna16 import DENSE, DENSE_MIN_ROWS, GEMM_TILES, SKINNY_DEFAULT, WNA16Weight, tiling_for

    weight = WNA16Weight(out_features=64, in_features=128, bits=4, group_size=128, dtype=torch.float16)
    assert tiling_for(weight, 1) == SKINNY_DEFAULT and tiling_for(weight, 40) == GEMM_TILES[1][1]
    assert tiling_for(weight, DENSE_MIN_ROWS) == DENSE
    weight.variant.update({1: "one", 8: "eight", 32: "thirty-two", 64: DENSE, 128: "mid", 256: "mid"})
    assert [tiling_for(weight, m) for m in (1, 2, 8, 16, 17, 32, 33, 64, 100, 256, 257)] == \
        ["one", "eight", "eight", SKINNY_DEFAULT, "thirty-two", "thirty-two", DENSE, DENSE, "mid", "mid", DENSE]
