"""kernels/wna16_mma_rows.py: 17-256 rows from the operand-order words of kernels/wna16_mma.py.

CPU (CI): x's fragment order against its definition, the PTX text's operands, the dispatch (default, overrides).
TRITON_INTERPRET=1 (``device`` fixture, skipped in CI): the whole kernel with its PTX replaced by the
plain-Triton emulation (fragments gathered by the PTX ISA's table) against the dequantized reference:
addresses, x order, zeros, scales, folds, masks, bias and split-K. CUDA (the real PTX): every timed
tiling, dtypes, groupings, bias, the default dispatch through prepare_wna16 and a CUDA graph.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import TOLERANCE, half_inputs, relative_error, replayed
from sm90_compile import AOT_SM90, resource_usage

from kernels import wna16, wna16_mma, wna16_mma_rows
from kernels.wna16 import (DENSE, MMA_ROWS_KIND, ROWS_DEFAULT, ROWS_VARIANTS, WNA16Weight, dequantize, prepare_wna16,
                           quantize, tile_options, tiling_for, unpack_codes, wna16_linear, wna16_matmul)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel's PTX is CUDA-only")


def quantized(n: int, k: int, group_size: int | None, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k), 4, group_size or k, symmetric=False)


def layout_and_reference(n, k, group_size, device):
    stored, scale, zero = quantized(n, k, group_size)
    layout = {name: t.to(device) for name, t in wna16_mma.pack_mma_layout(unpack_codes(stored, 4), scale, zero).items()}
    return layout, dequantize(stored, scale.half().float(), zero, 4).to(device)  # the layout holds float16 scales


def run(x, layout, n, group_size, bias, variant):
    return wna16_matmul(x, {"mma_words": layout["words"], "mma_meta": layout["meta"]}, n, 4, group_size, bias,
                        **tile_options(variant))


def test_fragment_order_puts_each_lanes_pairs_together():
    m, k = 3, 128
    x = torch.arange(m * k, dtype=torch.int32).to(torch.float32).view(m, k).to(torch.float16)  # exact below 2048
    pairs = wna16_mma_rows.fragment_order(x).view(torch.float16).view(m, k // 64, 32, 2).float()
    for block in range(k // 64):
        for c in range(4):
            for j in range(4):
                for f in range(2):
                    column = 64 * block + 16 * j + 8 * f + 2 * c
                    assert torch.equal(pairs[:, block, 8 * c + 2 * j + f], x[:, column:column + 2].float())


def test_ptx_operands():
    """16 sums out, then the word, two zero pairs, 8 x registers, 16 sums in: every operand used once as
    declared (a wrong index would compile and multiply the wrong registers)."""
    for fp16 in (False, True):
        text = wna16_mma_rows._rows_asm(fp16)
        used = sorted({int(i) for i in re.findall(r"\$(\d+)", text)})
        assert used == list(range(43))
        assert text.count("mma.sync") == wna16_mma_rows.NB and text.count("sub.rn") == 4
        for b in range(wna16_mma_rows.NB):  # block b: sums 4b.. in and out, x registers 19 + 2b, 20 + 2b
            assert f"{{${4 * b}, ${4 * b + 1}, ${4 * b + 2}, ${4 * b + 3}}}, {{a0, a1, a2, a3}}, " \
                   f"{{${19 + 2 * b}, ${20 + 2 * b}}}, {{${27 + 4 * b}," in text


@pytest.mark.parametrize("env", [None, "1"])
def test_rows_dispatch_is_the_default_past_16_rows(monkeypatch, env):
    """Unset (and "1"): 17-256 rows the timed choice, else ROWS_DEFAULT; past 256 DENSE; "0": DENSE past 16."""
    weight = WNA16Weight(300, 256, 4, 64, torch.bfloat16, kernel={"mma_words": torch.zeros(1), "mma_meta": torch.zeros(1)})
    if env is None:
        monkeypatch.delenv(wna16.MMA_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(wna16.MMA_ROWS_ENV, env)
    assert tiling_for(weight, 17) == ROWS_DEFAULT and tiling_for(weight, 256) == ROWS_DEFAULT
    assert tiling_for(weight, 257) == DENSE
    weight.variant = {64: ROWS_VARIANTS[0], 256: DENSE}
    assert tiling_for(weight, 33) == ROWS_VARIANTS[0] and tiling_for(weight, 100) == DENSE
    monkeypatch.setenv(wna16.MMA_ROWS_ENV, "0")
    assert tiling_for(weight, 17) == DENSE and tiling_for(weight, 64) == DENSE
    assert all(v[5] == MMA_ROWS_KIND and v[0] % (16 * v[2]) == 0 for v in ROWS_VARIANTS)


@pytest.mark.parametrize("n, k, group_size, m, variant", [
    (40, 256, 128, 37, (256, 32, 8, 2, 1, MMA_ROWS_KIND)),  # two x blocks, the second masked after row 36
    (40, 256, None, 5, (128, 32, 4, 1, 1, MMA_ROWS_KIND)),  # per channel, no prefetch
    (150, 256, 64, 40, (256, 32, 8, 2, 2, MMA_ROWS_KIND)),  # split-K finish, groups of one k block
    (150, 512, 128, 40, (256, 32, 8, 3, 2, MMA_ROWS_KIND)),  # each next k block's words and x read ahead, split-K
    (40, 256, None, 33, (128, 32, 4, 3, 1, MMA_ROWS_KIND)),  # the same per channel (two blocks a chunk)
])
def test_emulated_kernel_matches_the_reference(device, n, k, group_size, m, variant):
    """TRITON_INTERPRET=1: the kernel with its PTX emulated (or the real one on CUDA)."""
    layout, weight = layout_and_reference(n, k, group_size, device)
    for dtype, x, bias in half_inputs(device, m, k, n):
        out = run(x, layout, n, group_size or k, bias, variant)
        ref = x.float() @ weight.t() + bias.float()
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


# Read-ahead of every next k block (num_stages 3): timed by benchmarks/quantization/wna16_rows_bench.py, not at load yet.
READ_AHEAD = ((128, 32, 4, 3, 1, MMA_ROWS_KIND), (128, 32, 4, 3, 4, MMA_ROWS_KIND), (256, 32, 8, 3, 1, MMA_ROWS_KIND))


@cuda
@pytest.mark.parametrize("variant", ROWS_VARIANTS + READ_AHEAD)
def test_every_tiling_matches_the_reference(variant):
    n, k = 301, 2048  # odd N: padded rows masked; 16 chunks, so every split has work
    layout, weight = layout_and_reference(n, k, 128, "cuda")
    for m in (17, 64, 100, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = run(x, layout, n, 128, None, variant)
        assert relative_error(out, x.float() @ weight.t()) < TOLERANCE[torch.bfloat16], m


@cuda
@pytest.mark.parametrize("group_size", [64, 128, 256, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_groupings_dtypes_and_bias(group_size, dtype):
    n, k = 520, 1024
    layout, weight = layout_and_reference(n, k, group_size, "cuda")
    bias = torch.randn(n, device="cuda", dtype=dtype)
    x = torch.randn(70, 2 * k, device="cuda", dtype=dtype)[:, ::2]  # strided rows: fragment_order copies
    out = run(x, layout, n, group_size or k, bias, ROWS_DEFAULT)
    assert relative_error(out, x.float() @ weight.t() + bias.float()) < TOLERANCE[dtype]


@cuda
def test_default_dispatch_through_prepare_and_a_cuda_graph(monkeypatch):
    monkeypatch.delenv(wna16.MMA_ROWS_ENV, raising=False)
    n, k = 384, 512
    stored, scale, zero = quantized(n, k, 128)
    prepared = prepare_wna16(stored.cuda(), scale.cuda(), zero.cuda(), 4, torch.bfloat16)
    assert prepared.mma_only
    wna16.choose_wna16_variants([prepared], rows=(1,), mid_rows=(64,))
    assert 64 in prepared.variant
    weight = dequantize(stored, scale.half().float(), zero, 4).cuda()
    x = torch.randn(48, k, device="cuda", dtype=torch.bfloat16)
    eager = wna16_linear(x, prepared)
    assert relative_error(eager, x.float() @ weight.t()) < TOLERANCE[torch.bfloat16]
    captured = replayed(lambda: wna16_linear(x, prepared), x)
    assert relative_error(captured, F.linear(x.float(), weight)) < TOLERANCE[torch.bfloat16]


AOT = AOT_SM90


@AOT
@pytest.mark.parametrize("variant, fp16, group", [(v, False, 128) for v in ROWS_VARIANTS + READ_AHEAD] + [
    (ROWS_DEFAULT, True, 128), (ROWS_DEFAULT, False, 64), (ROWS_DEFAULT, False, 256), (ROWS_DEFAULT, False, None)])
def test_compiles_for_sm90_without_spills(variant, fp16, group, tmp_path):
    """Triton's own compiler and ptxas (no GPU needed) on every timed tiling: catches what the
    interpreter lets through (module globals that are no constexprs, PTX operand errors) before a GPU run."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt = "*fp16" if fp16 else "*bf16"
    names = ["xp_ptr", "w_ptr", "meta_ptr", "bias_ptr", "out_ptr", "part_ptr", "arrivals_ptr", "M", "N", "N_PAD",
             "BLOCKS", "CHUNKS_PER_SPLIT", "M_BLOCKS", "stride_om"]
    types = ["*i32", "*i32", "*i32", dt, dt, "*fp32", "*i32"] + ["i32"] * 7
    options = tile_options(variant)
    const = {"HAS_BIAS": True, "TN": options["block_n"] // (16 * options["num_warps"]), "WARPS": options["num_warps"],
             "CHUNK_KB": wna16_mma.chunk_blocks(4096, group or 4096), "SPLIT_K": options["split_k"], "FP16": fp16,
             "PER_CHANNEL": group is None, "PREFETCH": min(2, options["num_stages"] - 1), "EMULATE": False,
             "PDL": True}
    signature = {**dict(zip(names, types)), **{name: "constexpr" for name in const}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:7] + ["N", "N_PAD", "BLOCKS", "stride_om"]}
    import triton

    compiled = triton.compile(ASTSource(fn=wna16_mma_rows._mma_rows_kernel, signature=signature, constexprs=const,
                                        attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": options["num_warps"], "num_stages": 1})
    assert compiled.asm["ptx"].count("mma.sync") >= 4
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:  # ptxas's register use: no stack (spills) and no local memory
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
