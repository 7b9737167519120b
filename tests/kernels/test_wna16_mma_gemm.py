"""kernels/wna16_mma_gemm.py: the fused W4A16 GEMM (tensor-core dots, large tiles) over the operand-order words.

CPU (CI): the kind-8 tilings' options, which tilings fit a layer, the dispatch and its switch.
TRITON_INTERPRET=1 (``device`` fixture, skipped in CI): the kernel against the dequantized reference (both
operand orders, both nibble forms, split-K, bias, groups, per channel, masked rows); float16 only (the
interpreter's bfloat16 dots are wrong). CUDA: every tiling the engine times and the sweep's, both dtypes, the
default dispatch through prepare_wna16, the load-time timing and a CUDA graph. TRITONLLM_AOT_SM90=1: every engine
tiling compiled for sm_90 here (wgmma, no spills).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import TOLERANCE, half_inputs, relative_error, replayed
from sm90_compile import AOT_SM90, resource_usage

from kernels import wna16, wna16_mma, wna16_mma_dense, wna16_mma_gemm
from kernels.wna16 import (MMA_GEMM_KIND, MMA_GEMM_VARIANTS, WNA16Weight, dequantize, gemm_variants_for,
                           prepare_wna16, quantize, tile_options, tiling_for, unpack_codes, wna16_linear, wna16_matmul)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


def layout_and_reference(n, k, group_size, device):
    torch.manual_seed(0)
    stored, scale, zero = quantize(torch.randn(n, k), 4, group_size or k, symmetric=False)
    layout = wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero)
    kernel = {"mma_words": layout["words"].to(device), "mma_meta": layout["meta"].to(device)}
    return kernel, dequantize(stored, scale.half().float(), zero, 4).to(device)  # the layout holds float16 scales


def test_tile_options_of_the_gemm_tilings():
    assert tile_options((128, 64, 4, 3, 2, MMA_GEMM_KIND, 64, 0, 1)) == dict(
        block_n=128, block_m=64, num_warps=4, num_stages=3, split_k=2, kind=MMA_GEMM_KIND, block_k=64, w_first=0,
        joined=1)
    assert "block_k" not in tile_options(wna16.ROWS_DEFAULT)
    assert all(len(v) == 9 and v[5] == MMA_GEMM_KIND for v in MMA_GEMM_VARIANTS)


def test_takes_whole_k_steps_and_padded_row_tiles():
    assert wna16_mma_gemm.takes(4096, 128, 128) and wna16_mma_gemm.takes(14336, 256, 64)
    assert not wna16_mma_gemm.takes(384, 128, 256)  # K not whole 256-column steps
    assert not wna16_mma_gemm.takes(4096, 512, 64)  # past the words' 256-row padding
    with pytest.raises(ValueError, match="block_k 96"):
        wna16_mma_gemm.k_steps(4096, 96)


def test_a_layout_or_grouping_the_kernel_would_misread_is_refused():
    """Refused before any launch (CPU, no Triton run): K not the layout's (pack_mma_layout pads K = 192 to 256 and
    the kernel would read x past its rows), and groups of 32 columns (one scale a 64-column block)."""
    kernel, _ = layout_and_reference(32, 192, 64, "cpu")
    with pytest.raises(ValueError, match="K = 192"):
        wna16_mma_gemm.mma_gemm_matmul(torch.zeros(4, 192, dtype=torch.float16), wna16._mma_layout(kernel), 32, 64,
                                       block_n=16, block_m=16, block_k=64)
    kernel, _ = layout_and_reference(32, 256, 64, "cpu")
    with pytest.raises(ValueError, match="group size 32"):
        wna16_mma_gemm.mma_gemm_matmul(torch.zeros(4, 256, dtype=torch.float16), wna16._mma_layout(kernel), 32, 32,
                                       block_n=16, block_m=16, block_k=64)


def test_timed_gemm_tiling_is_dispatched_and_can_be_switched_off(monkeypatch):
    monkeypatch.delenv(wna16.MMA_ROWS_ENV, raising=False)
    monkeypatch.delenv(wna16.MMA_GEMM_ENV, raising=False)
    words = {"mma_words": torch.zeros(1), "mma_meta": torch.zeros(1)}
    weight = WNA16Weight(300, 256, 4, 64, torch.bfloat16, kernel=words)
    weight.variant = {64: MMA_GEMM_VARIANTS[0], 256: MMA_GEMM_VARIANTS[-1]}
    assert tiling_for(weight, 40) == MMA_GEMM_VARIANTS[0] and tiling_for(weight, 200) == MMA_GEMM_VARIANTS[-1]
    assert gemm_variants_for(4096) == MMA_GEMM_VARIANTS
    assert gemm_variants_for(384) == tuple(v for v in MMA_GEMM_VARIANTS if 384 % v[6] == 0)
    assert wna16.rows_and_gemm_variants(4096) == wna16.ROWS_BESIDE_GEMM + (wna16.DENSE,) + MMA_GEMM_VARIANTS
    monkeypatch.setenv(wna16.MMA_GEMM_ENV, "0")
    assert gemm_variants_for(4096) == ()
    assert wna16.rows_and_gemm_variants(4096) == wna16.ROWS_VARIANTS + (wna16.DENSE,)


@pytest.mark.parametrize("n, k, group_size, m, tiling", [
    (150, 256, 128, 37, dict(block_n=64, block_m=32, block_k=128, w_first=1, joined=2)),  # masked rows and columns
    (150, 256, 128, 37, dict(block_n=64, block_m=32, block_k=128, w_first=0, joined=1)),  # the weight as B
    (150, 512, 64, 20, dict(block_n=32, block_m=16, block_k=64, w_first=1, joined=0, split_k=3)),  # split-K, broadcast
    (40, 256, None, 5, dict(block_n=16, block_m=16, block_k=256, w_first=1, joined=2)),  # per channel, 1 step
    (150, 768, 128, 40, dict(block_n=64, block_m=32, block_k=128, w_first=1, joined=2, split_k=2)),  # 3 steps a split
    (300, 384, 128, 70, dict(block_n=128, block_m=64, block_k=128, w_first=0, joined=0, split_k=2)),  # 2 splits
])
def test_kernel_matches_the_reference(device, n, k, group_size, m, tiling):
    kernel, weight = layout_and_reference(n, k, group_size, device)
    for dtype, x, bias in half_inputs(device, m, k, n):
        out = wna16_matmul(x, kernel, n, 4, group_size or k, bias, kind=MMA_GEMM_KIND, num_warps=4, num_stages=2,
                           **{"split_k": 1, **tiling})
        assert out.shape == (m, n) and out.dtype == dtype
        ref = x.float() @ weight.to(dtype).float().t() + bias.float()  # the weight rounded to x's dtype, as dequantized
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


@pytest.mark.parametrize("joined", [2, 1, 0])
def test_the_dequantized_tile_is_bit_identical_to_the_reference(device, joined):
    """x = the identity: each output is one weight times 1, exact in the float32 sums, so out.T is the kernel's
    dequantized weight itself, which must equal wna16_mma_dense's reference bit for bit (every nibble form; the
    inline PTX one, 2, only on CUDA: the interpreter runs 1 for it)."""
    n, k, group_size = 48, 256, 64
    kernel, _ = layout_and_reference(n, k, group_size, device)
    layout = {"words": kernel["mma_words"], "meta": kernel["mma_meta"]}
    for dtype in (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,):
        eye = torch.eye(k, device=device, dtype=dtype)
        out = wna16_matmul(eye, kernel, n, 4, group_size, kind=MMA_GEMM_KIND, block_n=16, block_m=64, block_k=128,
                           num_warps=4, num_stages=2, joined=joined)
        assert torch.equal(out.t(), wna16_mma_dense.dequantize_mma_ref(layout, n, k, group_size, dtype)), dtype


@cuda
@pytest.mark.parametrize("variant", MMA_GEMM_VARIANTS)
def test_every_timed_tiling_matches_the_reference(variant):
    n, k = 336, 2048  # N not whole 128-row tiles: padded rows masked (a multiple of 16: the sweep's compiles serve)
    kernel, weight = layout_and_reference(n, k, 128, "cuda")
    for m in (17, 64, 100, 256, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = wna16_matmul(x, kernel, n, 4, 128, **tile_options(variant))
        assert relative_error(out, x.float() @ weight.bfloat16().float().t()) < TOLERANCE[torch.bfloat16], m


@cuda
def test_the_sweeps_tilings_match_the_reference():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quantization" / "wna16_gemm_sweep.py"
    spec = importlib.util.spec_from_file_location("wna16_gemm_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    n, k = 528, 1024
    kernel, weight = layout_and_reference(n, k, 128, "cuda")
    x = torch.randn(150, k, device="cuda", dtype=torch.bfloat16)
    for variant in sweep.TILINGS:
        out = wna16_matmul(x, kernel, n, 4, 128, **tile_options(variant))
        assert relative_error(out, x.float() @ weight.bfloat16().float().t()) < TOLERANCE[torch.bfloat16], variant


@cuda
@pytest.mark.parametrize("group_size", [64, 128, None])
def test_groupings_float16_and_spaced_rows(group_size):
    n, k = 520, 1024
    kernel, weight = layout_and_reference(n, k, group_size, "cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    x = torch.randn(70, 2 * k, device="cuda", dtype=torch.float16)[:, :k]  # rows 2K apart
    out = wna16_matmul(x, kernel, n, 4, group_size or k, bias, **tile_options(MMA_GEMM_VARIANTS[1]))
    assert relative_error(out, x.float() @ weight.half().float().t() + bias.float()) < TOLERANCE[torch.float16]


@cuda
def test_dispatch_through_prepare_the_timing_and_a_cuda_graph(monkeypatch):
    """With only the GEMM and DENSE to choose from at 64 rows, the timing picks one; the chosen path runs
    eagerly and replayed from a graph."""
    monkeypatch.delenv(wna16.MMA_ROWS_ENV, raising=False)
    monkeypatch.delenv(wna16.MMA_GEMM_ENV, raising=False)
    monkeypatch.setattr(wna16, "ROWS_BESIDE_GEMM", ())
    n, k = 384, 512
    torch.manual_seed(0)
    stored, scale, zero = quantize(torch.randn(n, k), 4, 128, symmetric=False)
    prepared = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, torch.bfloat16)
    report = wna16.choose_wna16_variants([prepared], rows=(), mid_rows=(64,))  # no decode tilings: 20 compiles
    timed = next(iter(report.values()))["all_us"][64]
    assert set(timed) == {wna16.DENSE, *gemm_variants_for(k)}
    weight = dequantize(stored, scale.half().float(), zero, 4).cuda().bfloat16().float()
    x = torch.randn(48, k, device="cuda", dtype=torch.bfloat16)
    assert relative_error(wna16_linear(x, prepared), x.float() @ weight.t()) < TOLERANCE[torch.bfloat16]
    captured = replayed(lambda: wna16_linear(x, prepared), x)
    assert relative_error(captured, F.linear(x.float(), weight)) < TOLERANCE[torch.bfloat16]


AOT = AOT_SM90


@AOT
@pytest.mark.parametrize("variant", MMA_GEMM_VARIANTS)
def test_compiles_for_sm90_with_wgmma_and_no_spills(variant, tmp_path):
    """Triton's own compiler and ptxas (no GPU needed) on every tiling the engine times: the dots become wgmma, and
    nothing spills (split-K 4's finish may keep 32 bytes on the stack: its 4 partial tiles, after the K loop)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = tile_options(variant)
    names = ["x_ptr", "w_ptr", "meta_ptr", "bias_ptr", "out_ptr", "part_ptr", "arrivals_ptr", "M", "N", "N_PAD",
             "GROUP", "BLOCKS", "BLOCKS_PER_SPLIT", "stride_xm", "stride_om"]
    types = ["*bf16", "*i32", "*i32", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 8
    const = {"HAS_BIAS": False, "TT": options["block_n"] // 16, "KB": options["block_k"] // 64,
             "BLOCK_M": options["block_m"], "SPLIT_K": options["split_k"], "W_FIRST": bool(options["w_first"]),
             "JOINED": options["joined"] > 0, "ASM": options["joined"] == 2,
             "ROUND_BY_HAND": False, "PDL": True}
    signature = {**dict(zip(names, types)), **{name: "constexpr" for name in const}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:7] + ["stride_xm", "stride_om"]}
    compiled = triton.compile(ASTSource(fn=wna16_mma_gemm._mma_gemm_kernel, signature=signature, constexprs=const,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": options["num_warps"], "num_stages": options["num_stages"]})
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        assert stack <= (32 if options["split_k"] >= 4 else 0), usage
