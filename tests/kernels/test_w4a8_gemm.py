"""kernels/w4a8_gemm.py: the W4A8 GEMM (INT4 operand-order words, activations per token in E4M3, FP8 dots).

CPU (CI): which tilings fit a layer, the refusals, the reference's own arithmetic. TRITON_INTERPRET=1 (``device``
fixture, skipped in CI): the kernel against ``w4a8_reference`` within one output rounding (float16 output only: the
interpreter truncates float32 -> bfloat16 where the GPU rounds; on CUDA W8A8's relative RMS bound, the FP8 dots'
accumulation being reduced-precision: ``assert_matches_reference``), groups of 128 and 64 (one and two sub-dots a
step, and 64-column steps), per channel, zero points and symmetric codes, odd N, masked rows, both operand
orders, both ways of applying the group scales (``rescale``), the fragment order and its quantizer, split-K, bias,
zero scales, QuantizedRows input. CUDA: both dtypes, the sweep's tilings, and a CUDA graph.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from kernel_testing import replayed

from kernels import wna16_mma
from kernels.fp8 import QuantizedRows, quantize_rows, quantize_rows_triton
from kernels.w4a8_gemm import (fragment_order, quantize_rows_in_fragment_order_triton, supports, w4a8_matmul,
                               w4a8_reference)
from kernels.wna16 import dequantize, quantize, unpack_codes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def layout_of(n, k, group_size, device, symmetric=False, seed=0):
    """The operand-order layout of a random INT4 weight, and its dequantized weight (float16 scales, as held).
    Rows 0-2's first group are zeros: a float16 scale of 0 (quantize's 1e-10 floor underflows) with q = z."""
    torch.manual_seed(seed)
    weight = torch.randn(n, k)
    weight[:3, :group_size or k] = 0
    stored, scale, zero = quantize(weight, 4, group_size or k, symmetric=symmetric)
    assert (scale[:3, 0].half() == 0).all()
    layout = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
    weight = dequantize(stored, scale.half().float(), zero, 4)
    return {name: t.to(device) for name, t in layout.items()}, weight.to(device)


def one_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values at |values| (float64; subnormals: the smallest normal's)."""
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(values.abs().double().clamp(min=info.tiny)))) * info.eps


def assert_matches_reference(out, x, layout, n, group_size, bias=None):
    """Under the interpreter: out is the float64 product of the reference's exact values rounded to out's dtype, or
    its neighbour (the kernel sums in float32: an ulp off where the exact value lies near a rounding boundary). On
    CUDA the FP8 wgmma accumulates each dot in its own reduced precision (Triton's default on sm_90, as cuBLASLt's
    fast accumulation in kernels/fp8.py's W8A8): tens to thousands of ulps on outputs near cancellation (H200,
    2026-11-30), so there the bound is W8A8's, a relative RMS error under 5e-3 (test_fp8's fast accumulation)."""
    rows = x if isinstance(x, QuantizedRows) else QuantizedRows(*quantize_rows(x), x.dtype)
    k = rows.values.shape[1]
    exact = (rows.values.double() @ wna16_mma.mma_layout_weight(layout, n, k, group_size).double().t()) \
        * rows.scale.double()[:, None]
    if bias is not None:
        exact = exact + bias.double()
    assert out.dtype == rows.dtype and out.shape == exact.shape
    if out.is_cuda:
        rms = ((out.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
        assert rms < 5e-3, rms
        return
    off = (out.double() - exact).abs() / one_ulp(exact, out.dtype)
    assert off.max().item() <= 1.0, f"{off.max().item():.2f} ulps; {(off > 0.5).float().mean().item():.3f} past half"


def test_supports_whole_steps_with_each_sub_dot_in_one_group():
    assert supports(4096, 128, 128) and supports(4096, 128, 64) and supports(4096, 128, 256)
    assert supports(4096, 64, 128) and supports(4096, 4096, 256)  # two sub-dots a step; per channel
    assert not supports(4096, 32, 64)  # a 64-column block holds one scale in the layout
    assert not supports(4096, 192, 128)  # a 128-column step across two groups of 192
    assert not supports(384, 128, 256)  # K not whole steps
    assert not supports(4096, 128, 96)


def test_a_layout_or_grouping_the_kernel_would_misread_is_refused():
    """Refused before any launch (no Triton run): K not the layout's, a step across groups, block_n past the
    words' padding."""
    layout, _ = layout_of(32, 256, 64, "cpu")
    with pytest.raises(ValueError, match="K = 128"):
        w4a8_matmul(torch.zeros(4, 128, dtype=torch.float16), layout, 32, 64, block_k=64)
    layout, _ = layout_of(32, 384, 192, "cpu")
    with pytest.raises(ValueError, match="group size 192"):
        w4a8_matmul(torch.zeros(4, 384, dtype=torch.float16), layout, 32, 192, block_k=128)
    layout, _ = layout_of(32, 256, 128, "cpu")
    with pytest.raises(ValueError, match="block_n 512"):
        w4a8_matmul(torch.zeros(4, 256, dtype=torch.float16), layout, 32, 128, block_n=512)


def test_the_reference_is_the_exact_weight_times_x_in_e4m3():
    """The reference's weight is (q - z) * s exactly (the layout decoded against kernels.wna16.dequantize) and
    its x is kernels/fp8.py's per-token E4M3 rounding: against the bf16-x product it differs by E4M3's rounding
    (a few percent), not by the weight."""
    n, k, group_size = 40, 256, 64
    layout, weight = layout_of(n, k, group_size, "cpu")
    assert torch.equal(wna16_mma.mma_layout_weight(layout, n, k, group_size), weight)
    x = torch.randn(9, k, dtype=torch.float16)
    x_q, x_scale = quantize_rows(x)
    ref = w4a8_reference(x, layout, n, group_size)
    want = ((x_q.double() * x_scale.double()[:, None]) @ weight.double().t()).half()
    assert ref.dtype == torch.float16 and torch.equal(ref, want)
    error = ((ref.double() - x.double() @ weight.double().t()).norm() / ref.double().norm()).item()
    assert 1e-3 < error < 6e-2, error


@pytest.mark.parametrize("n, k, group_size, m, symmetric, tiling", [
    (151, 256, 128, 37, False, dict(block_n=64, block_m=32, block_k=128, w_first=True)),  # odd N, masked rows
    (151, 256, 128, 37, False, dict(block_n=64, block_m=32, block_k=128, w_first=True, rescale=True)),
    (151, 256, 128, 37, False, dict(block_n=64, block_m=32, block_k=128, w_first=False)),  # the weight as B
    (96, 256, 64, 20, False, dict(block_n=32, block_m=16, block_k=128, split_k=2, rescale=True)),  # 2 sub-dots
    (96, 256, 64, 20, True, dict(block_n=32, block_m=16, block_k=64, w_first=False)),  # symmetric, 64-column steps
    (40, 256, None, 5, False, dict(block_n=16, block_m=16, block_k=128, rescale=True)),  # per channel
    (70, 512, 128, 33, False, dict(block_n=64, block_m=16, block_k=256, split_k=2)),  # 2 groups a step, 1 a split
    (151, 256, 128, 37, False, dict(block_n=64, block_m=32, block_k=128, in_fragment_order=True, half2=True)),
    (96, 256, 64, 20, False, dict(block_n=32, block_m=16, block_k=128, split_k=2, rescale=True,
                                  in_fragment_order=True, half2=True)),  # half2: CUDA only (inline PTX)
])
def test_kernel_matches_the_reference(device, n, k, group_size, m, symmetric, tiling):
    layout, _ = layout_of(n, k, group_size, device, symmetric=symmetric)
    dtypes = (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,)
    for dtype in dtypes:
        torch.manual_seed(1)
        x = torch.randn(m, k, device=device, dtype=dtype)
        bias = torch.randn(n, device=device, dtype=dtype)
        out = w4a8_matmul(x, layout, n, group_size or k, bias, num_warps=4, num_stages=2, **tiling)
        assert_matches_reference(out, x, layout, n, group_size or k, bias)


def test_fragment_order_permutes_each_64_column_block():
    """Logical column 32 s + 16 f + 4 c + 2 jj + e of a block holds x's column 16 (2 s + jj) + 8 f + 2 c + e: lane
    c's four columns of each 32 (4c..4c+3) are its words' 2c, 2c+1 of slices 2s and 2s+1."""
    x = torch.arange(256).repeat(3, 1)
    permuted = fragment_order(x)
    assert torch.equal(permuted.sort(dim=-1).values, x)  # a permutation, within each 64-column block
    assert torch.equal(permuted[:, :64] // 64, torch.zeros(3, 64, dtype=torch.long))
    assert permuted[0, 4 * 3:4 * 3 + 4].tolist() == [6, 7, 22, 23]  # c = 3: slice 0's 2c, 2c+1, slice 1's
    assert permuted[0, 64 + 32 + 16 + 4:64 + 32 + 16 + 8].tolist() == [64 + 32 + 8 + 2, 64 + 32 + 8 + 3,
                                                                       64 + 48 + 8 + 2, 64 + 48 + 8 + 3]


def test_the_fragment_order_quantizer_is_fragment_order_of_the_row_quantizer(device):
    """Bit for bit kernels/fp8.py's Triton quantizer, permuted (on CUDA that equals quantize_rows, test_fp8's
    check; the interpreter's float32 -> E4M3 conversion rounds some values differently from torch's)."""
    x = torch.randn(5, 384, device=device, dtype=torch.float16) * 3
    x[2] = 0
    got = quantize_rows_in_fragment_order_triton(x)
    values, scale = quantize_rows_triton(x)
    assert torch.equal(got.scale, scale) and got.dtype == torch.float16
    assert torch.equal(got.values.view(torch.uint8), fragment_order(values).view(torch.uint8))


def test_quantized_rows_in_give_the_same_product(device):
    """x already quantized (a norm or activation that quantizes its output, kernels/fp8.py) gives the product of
    quantizing it here, bit for bit; an all-zero row (scale 1e-12) gives zeros."""
    n, k, group_size = 64, 256, 128
    layout, _ = layout_of(n, k, group_size, device)
    x = torch.randn(12, k, device=device, dtype=torch.float16)
    x[3] = 0
    tiling = dict(block_n=32, block_m=16, block_k=128, num_warps=4, num_stages=2)
    out = w4a8_matmul(x, layout, n, group_size, **tiling)
    rows = QuantizedRows(*quantize_rows(x), x.dtype)
    assert torch.equal(w4a8_matmul(rows, layout, n, group_size, **tiling), out)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert_matches_reference(out, rows, layout, n, group_size)


def _sweep_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quantization" / "w4a8_gemm_sweep.py"
    spec = importlib.util.spec_from_file_location("w4a8_gemm_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


@cuda
@pytest.mark.parametrize("group_size", [128, 64])
def test_the_sweeps_tilings_match_the_reference(group_size):
    """Every tiling the sweep times (compiled for the GPU: wgmma with FP8 operands; after a sweep, from Triton's
    cache) on N not whole 128-row tiles and rows not whole tiles; group 64 (two sub-dots a step: new compiles) on
    its first two and a tiling without the fragment order."""
    sweep = _sweep_module()
    n, k = 528, 1024
    layout, _ = layout_of(n, k, group_size, "cuda")
    tilings = sweep.TILINGS if group_size == 128 else sweep.TILINGS[:2] + sweep.TILINGS[-1:]
    for m in (64, 150):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for tiling in tilings:
            options = sweep.tiling_options(tiling)
            if not supports(k, group_size, options["block_k"]):
                continue
            out = w4a8_matmul(x, layout, n, group_size, **options)
            assert_matches_reference(out, x, layout, n, group_size)


@cuda
def test_a_cuda_graph_replays_the_quantize_and_the_product():
    n, k = 384, 512
    layout, _ = layout_of(n, k, 128, "cuda")
    x = torch.randn(80, k, device="cuda", dtype=torch.bfloat16)
    captured = replayed(lambda: w4a8_matmul(x, layout, n, 128, block_n=64, block_m=64), x)
    assert_matches_reference(captured, x, layout, n, 128)


def test_the_engine_takes_wide_layers_from_129_rows(monkeypatch):
    """What the opt-in sends here (where the H200 sweep found W4A8 faster): 129+ rows, 6144+ outputs, 16-bit x on
    CUDA (patched here: no kernel runs), groups a 128-column step takes."""
    from kernels import w4a8_gemm

    monkeypatch.setattr(w4a8_gemm, "use_triton", lambda t: True)
    rows = torch.zeros(129, 4096, dtype=torch.bfloat16)
    assert w4a8_gemm.takes(rows, 6144, 4096, 128) and w4a8_gemm.takes(rows, 28672, 4096, 64)
    assert not w4a8_gemm.takes(rows[:128], 6144, 4096, 128)
    assert not w4a8_gemm.takes(rows, 4096, 4096, 128)  # o, down: not faster at 256 rows
    assert not w4a8_gemm.takes(rows, 6144, 4096, 32)
    assert not w4a8_gemm.takes(rows.float(), 6144, 4096, 128)


def test_the_engine_opt_in_routes_an_int4_layer_s_products(device, monkeypatch):
    """$TRITONLLM_W4A8=1: wna16_linear of an operand-order INT4 layer that ``takes`` accepts runs the W4A8 GEMM (the
    same product as w4a8_linear, matching the reference), and the W4A16 paths otherwise or when unset (its default).
    The thresholds are lowered so that a small layer runs; on CPU the dispatch's CUDA test is patched so the
    interpreter runs the GEMM."""
    from kernels import w4a8_gemm, wna16

    n, k = 80, 256
    layout, _ = layout_of(n, k, 128, device)
    weight = wna16.WNA16Weight(n, k, 4, 128, torch.float16, kernel={"mma_words": layout["words"],
                                                                    "mma_meta": layout["meta"]})
    assert weight.mma_only
    monkeypatch.setattr(w4a8_gemm, "MIN_ROWS", 64)
    monkeypatch.setattr(w4a8_gemm, "MIN_OUT_FEATURES", 80)
    if device == "cpu":  # the interpreter's float32 -> E4M3 rounds unlike torch: the torch quantizer here
        monkeypatch.setattr(w4a8_gemm, "use_triton", lambda t: True)
        monkeypatch.setattr(w4a8_gemm, "quantized_rows", lambda x: QuantizedRows(*quantize_rows(x), x.dtype))
        monkeypatch.setattr(w4a8_gemm, "ENGINE_TILING", dict(block_n=16, block_m=64, num_warps=4, rescale=True))
    w4a16 = torch.zeros(1, n, device=device, dtype=torch.float16)  # a marker only the W4A16 paths return
    monkeypatch.setattr(wna16, "_product", lambda rows, *args, **kwargs: w4a16.expand(rows.shape[0], n))
    x = torch.randn(2, 40, k, device=device, dtype=torch.float16)  # 80 rows
    monkeypatch.delenv(w4a8_gemm.ENV, raising=False)
    assert wna16.wna16_linear(x, weight).data_ptr() == w4a16.data_ptr()
    monkeypatch.setenv(w4a8_gemm.ENV, "1")
    out = wna16.wna16_linear(x, weight)
    assert out.shape == (2, 40, n)
    rows = x.reshape(80, k)
    assert torch.equal(out.reshape(80, n), w4a8_gemm.w4a8_linear(rows, layout, n, 128))
    assert_matches_reference(out.reshape(80, n), rows, layout, n, 128)
    assert wna16.wna16_linear(x[:, :20], weight).data_ptr() == w4a16.data_ptr()  # 40 rows
