"""Skinny (decode-size) matrix products: the Triton kernel against F.linear.

Odd row counts (1, 3, 16), output widths that are not multiples of the 16-feature tile, and
reduction lengths that are not multiples of the 512-element K tile. Both sides accumulate in
fp32 from the same bf16/fp16 inputs and round once at the end, in a different order, so they
agree to about one output rounding (ROUNDING) rather than bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import low_precision_dtypes, relative_error

import torch.nn.functional as F

ROUNDING = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (200, 576), (37, 1000)])
def test_skinny_linear_matches_f_linear(device, m, n, k):
    from kernels.linear import skinny_linear_triton

    gen = torch.Generator().manual_seed(m * n + k)
    for dtype in low_precision_dtypes(device):
        x = torch.randn(m, k, generator=gen).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).to(device)
        bias = torch.randn(n, generator=gen).to(dtype).to(device)
        precise = F.linear(x.double(), w.double(), bias.double())
        assert relative_error(skinny_linear_triton(x, w, bias), precise) < ROUNDING[dtype]
        assert relative_error(skinny_linear_triton(x, w), F.linear(x.double(), w.double())) < ROUNDING[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="every tiling compiled on the GPU")
@pytest.mark.parametrize("m", [1, 5])
def test_every_load_time_variant_is_correct(m):
    """choose_skinny_weights may pick any tiling of half_variants() (choose_fp8_skinny_variants any
    of SKINNY_VARIANTS): each must compute the same product, plain, with a bias and an activation,
    and gated."""
    from kernels.activation import silu_and_mul
    from kernels.linear import SKINNY_VARIANTS, activation_ref, half_variants, skinny_linear_triton, variant_options

    x = torch.randn(m, 1000, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(334, 1000, dtype=torch.bfloat16, device="cuda") * 0.05
    bias = torch.randn(334, dtype=torch.bfloat16, device="cuda")
    precise = F.linear(x.double(), w.double())
    assert any(len(v) == 5 and v[4] > 1 for v in SKINNY_VARIANTS)  # split-K tilings are among them
    assert half_variants()[:len(SKINNY_VARIANTS)] == SKINNY_VARIANTS
    for variant in half_variants():
        out = skinny_linear_triton(x, w, **variant_options(variant))
        assert relative_error(out, precise) < ROUNDING[torch.bfloat16], variant
        out = skinny_linear_triton(x, w, bias, activation="gelu", **variant_options(variant))
        assert relative_error(out, activation_ref(F.linear(x, w, bias), "gelu")) < 2 * ROUNDING[torch.bfloat16], variant
        out = skinny_linear_triton(x, w, gated=True, **variant_options(variant))
        assert relative_error(out, silu_and_mul(F.linear(x, w))) < 2 * ROUNDING[torch.bfloat16], variant


def test_half_extra_variants_are_correct_in_the_interpreter():
    """The tilings HALF_EXTRA_VARIANTS adds (64-wide swap_ab tiles, more split-K, 2 or 8 warps) under
    Triton's CPU interpreter in float32, plain with a bias and gated, on a width and K that are not
    multiples of any tile (TRITON_INTERPRET=1; on CUDA the test above covers them)."""
    from kernel_testing import triton_device

    from kernels.activation import silu_and_mul
    from kernels.linear import HALF_EXTRA_VARIANTS, skinny_linear_triton, variant_options

    if triton_device() != "cpu":
        pytest.skip("Triton's CPU interpreter (TRITON_INTERPRET=1)")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 600, generator=gen)
    w = torch.randn(2 * 70, 600, generator=gen) * 0.05
    bias = torch.randn(140, generator=gen)
    for variant in HALF_EXTRA_VARIANTS:
        out = skinny_linear_triton(x, w, bias, **variant_options(variant))
        assert relative_error(out, F.linear(x.double(), w.double(), bias.double())) < 1e-5, variant
        out = skinny_linear_triton(x, w, gated=True, **variant_options(variant))
        assert relative_error(out, silu_and_mul(F.linear(x, w))) < 1e-5, variant


@pytest.mark.parametrize("m", [17, 65])
def test_wide_row_tilings_take_the_marked_products(device, m):
    """17-128 rows (tree verify steps) on the skinny kernel where engine load marked the weight with a
    wide-row tiling (kernels/wide_rows.py; every half-precision WIDE_TILINGS tiling here): linear,
    linear_float32_out and gated_linear equal F.linear (then SiLU-and-mul) up to one rounding of the
    output dtype; an unmarked weight or a row count without a tiling stays F.linear.
    GPU: bf16; Triton's CPU interpreter: float32."""
    from kernels.activation import silu_and_mul
    from kernels.linear import WIDE_ATTR, gated_linear, linear, linear_float32_out, padded_rows
    from kernels.wide_rows import WIDE_TILINGS, wide_tiling

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bound = 2 * ROUNDING[torch.bfloat16] if device == "cuda" else 1e-5
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 600, generator=gen).to(dtype).to(device)
    w = (torch.randn(2 * 70, 600, generator=gen) * 0.05).to(dtype).to(device)
    want = F.linear(x.double(), w.double())
    assert torch.equal(linear(x, w), F.linear(x, w))  # unmarked
    for tiling in WIDE_TILINGS[2]:
        setattr(w, WIDE_ATTR, {padded_rows(m) * 2: tiling})  # another row count's tiling: not this one's
        assert torch.equal(linear(x, w), F.linear(x, w))
        setattr(w, WIDE_ATTR, {padded_rows(m): wide_tiling(tiling, 140, 600, torch.device(device))})
        assert relative_error(linear(x, w), want) < bound, tiling
        assert relative_error(linear_float32_out(x, w), want) < 1e-5, tiling  # fp32 sums, unrounded
        setattr(w, WIDE_ATTR, {padded_rows(m): wide_tiling(tiling, 70, 600, torch.device(device))})
        assert relative_error(gated_linear(x, w), silu_and_mul(F.linear(x, w))) < bound, tiling


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt on a CUDA device")
def test_cublaslt_gelu_epilogue_is_tanh_gelu_of_the_unrounded_product():
    """A weight marked CUBLASLT_GELU (choose_activated_weights, gelu_tanh with a bias): linear_activated
    is cuBLASLt's GELU_BIAS epilogue, tanh GELU of the fp32 product plus bias rounded once, so within
    one output rounding of the exact value (closer than the unfused path's two roundings may be);
    without a bias, or for another activation, it is the unfused path."""
    from kernels.linear import _ACTIVATED_ATTR, CUBLASLT_GELU, _cublaslt_gelu_is_tanh, activation_ref, linear_activated

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(1000, 512, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    bias = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
    if not _cublaslt_gelu_is_tanh(w):
        pytest.skip("torch._addmm_activation's GELU is not the tanh GELU on this device")
    setattr(w, _ACTIVATED_ATTR, CUBLASLT_GELU)
    exact = F.gelu(F.linear(x.double(), w.double(), bias.double()), approximate="tanh")
    assert relative_error(linear_activated(x, w, bias, "gelu_tanh"), exact) < ROUNDING[torch.bfloat16]
    unfused = activation_ref(F.linear(x, w, None), "gelu_tanh")
    torch.testing.assert_close(linear_activated(x, w, None, "gelu_tanh"), unfused, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels on the GPU")
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("split_k", [2, 3, 4, 64])
def test_split_k_equals_one_program_per_tile(m, split_k):
    """Split-K (partial sums added in split order) against the unsplit kernel: plain with bias,
    gated, and FP8-scaled, on a K that splits unevenly (1000 = 3 full 256-tiles + a partial one;
    64 splits are more than there are K tiles)."""
    from kernels.fp8 import quantize_weight
    from kernels.linear import gated_linear_ref, skinny_linear_triton

    gen = torch.Generator().manual_seed(split_k + m)
    x = torch.randn(m, 1000, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(2 * 150, 1000, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    bias = torch.randn(300, generator=gen).to(torch.bfloat16).cuda()
    tile = dict(block_n=16, block_k=256, num_warps=4, num_stages=4)
    precise = F.linear(x.double(), w.double(), bias.double())
    split = skinny_linear_triton(x, w, bias, split_k=split_k, **tile)
    assert relative_error(split, precise) < ROUNDING[torch.bfloat16]
    gated = skinny_linear_triton(x, w, gated=True, split_k=split_k, **tile)
    assert relative_error(gated, gated_linear_ref(x, w)) < 2 * ROUNDING[torch.bfloat16]
    w_q, scale = quantize_weight(w)
    fp8_split = skinny_linear_triton(x, w_q, weight_scale=scale, split_k=split_k, **tile)
    fp8_whole = skinny_linear_triton(x, w_q, weight_scale=scale, **tile)
    assert relative_error(fp8_split, fp8_whole.double()) < ROUNDING[torch.bfloat16]


def test_split_k_layout_covers_k_in_whole_tiles_with_no_idle_program():
    """The skinny kernels' split-K grid: parts of whole BLOCK_K tiles that cover K exactly once, each with work,
    never more parts than asked or than tiles (K 1000 in 256-tiles is the test above's: 3 full + 1 partial)."""
    from kernels.linear import split_k_layout

    assert split_k_layout(1000, 256, 1) == (1, 1024)
    assert split_k_layout(1000, 256, 3) == (2, 512)  # 2 tiles a part covers the 4 tiles in 2 parts
    assert split_k_layout(1000, 256, 64) == (4, 256)
    for k in (1, 128, 255, 256, 257, 1000, 4096, 5000):
        for block_k in (128, 256, 512):
            for asked in (1, 2, 3, 4, 7, 64):
                parts, k_per_split = split_k_layout(k, block_k, asked)
                assert 1 <= parts <= min(asked, -(-k // block_k)) and k_per_split % block_k == 0
                assert (parts - 1) * k_per_split < k <= parts * k_per_split, (k, block_k, asked)


def test_linear_without_a_marked_weight_is_f_linear():
    from kernels.linear import linear

    x, w = torch.randn(2, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("one_row_env", ["1", "0"])
def test_batch_one_takes_the_tiling_that_wins_at_one_row(monkeypatch, one_row_env):
    """The real load-time choice (_time_shape, choose_skinny_weights) with the device timings replaced by a
    table: a tiling faster than cuBLAS at 1 row but not at 8 marks the weight for batch 1 only, 2-16 rows keep
    cuBLAS, and TRITONLLM_ONE_ROW_CHOICE=0 restores the one choice for every row count."""
    import types

    import kernels.linear as linear

    fast_at_one, fast_at_both = linear.SKINNY_VARIANTS[0], linear.SKINNY_VARIANTS[1]
    cublas_us = {1: 6.0, 8: 10.0}
    table = {(48, 32): {fast_at_one: {1: 5.0, 8: 12.0}, fast_at_both: {1: 5.5, 8: 9.0}},
             (32, 48): {fast_at_one: {1: 7.0, 8: 12.0}, fast_at_both: {1: 8.0, 8: 11.0}}}  # cuBLAS beats both
    timed = {}

    def product(kind):
        def run(x, weight, *args, **options):
            timed["last"] = (kind, tuple(weight.shape), x.shape[0], options)
        return run

    def device_time_ms(fn, repeat=20):
        fn()
        kind, shape, rows, options = timed.pop("last")
        if kind == "cublas":
            return cublas_us[rows] / 1e3
        tiling = next((v for v in table[shape] if linear.variant_options(v).items() <= options.items()), None)
        return (table[shape][tiling][rows] if tiling else 50.0) / 1e3  # the other tilings: slow

    monkeypatch.setattr(linear, "use_triton", lambda t: True)
    monkeypatch.setattr(linear, "skinny_linear_triton", product("skinny"))
    monkeypatch.setattr(linear, "F", types.SimpleNamespace(linear=product("cublas")))
    monkeypatch.setattr(linear, "graph_time_ms", device_time_ms)
    monkeypatch.setenv("TRITONLLM_KERNEL_CHOICE_CACHE", "off")
    monkeypatch.setenv(linear.ONE_ROW_ENV, one_row_env)
    both, neither = torch.zeros(48, 32, dtype=torch.bfloat16), torch.zeros(32, 48, dtype=torch.bfloat16)
    linear.choose_skinny_weights([both, neither])
    assert linear._skinny_variant(torch.zeros(1, 32), both) == (fast_at_one if one_row_env == "1" else fast_at_both)
    assert linear._skinny_variant(torch.zeros(8, 32), both) == fast_at_both
    assert linear._skinny_variant(torch.zeros(1, 48), neither) is None  # cuBLAS at every row count
    assert linear._skinny_variant(torch.zeros(8, 48), neither) is None
    table[(32, 48)][fast_at_one][1] = 4.0  # now faster at 1 row only: batch 1 takes it, 8 rows keep cuBLAS
    linear.choose_skinny_weights([neither])
    assert linear._skinny_variant(torch.zeros(1, 48), neither) == (fast_at_one if one_row_env == "1" else None)
    assert linear._skinny_variant(torch.zeros(8, 48), neither) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on a CUDA device")
def test_choose_skinny_weights_marks_by_measurement():
    from kernels.linear import choose_skinny_weights, linear

    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    report = choose_skinny_weights([w])
    assert getattr(w, "_use_skinny_gemm") == report[(4096, 4096)]["variant"]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    assert relative_error(linear(x, w), F.linear(x.double(), w.double())) < ROUNDING[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gated_skinny_matches_linear_then_silu_and_mul(device, m):
    """The fused gate_up + SiLU-and-mul kernel rounds like the unfused path: one output rounding apart."""
    from kernels.linear import gated_linear_ref, skinny_linear_triton

    gen = torch.Generator().manual_seed(m)
    for dtype in low_precision_dtypes(device):
        x = torch.randn(m, 576, generator=gen).to(dtype).to(device)
        w = (torch.randn(2 * 300, 576, generator=gen) * 0.08).to(dtype).to(device)  # inter 300: a partial tile
        for bn, bk in [(16, 512), (32, 128)]:
            out = skinny_linear_triton(x, w, block_n=bn, block_k=bk, gated=True)
            assert relative_error(out, gated_linear_ref(x, w)) < 2 * ROUNDING[dtype], (bn, bk)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_activated_skinny_matches_linear_then_activation(device, activation, split_k):
    """The up projection's bias and activation in the skinny kernel's epilogue round like F.linear
    followed by the activation (the LayerNorm families' MLP): one output rounding apart."""
    from kernels.linear import activation_ref, skinny_linear_triton

    gen = torch.Generator().manual_seed(split_k)
    for dtype in low_precision_dtypes(device):
        x = torch.randn(3, 576, generator=gen).to(dtype).to(device)
        w = (torch.randn(300, 576, generator=gen) * 0.08).to(dtype).to(device)
        bias = torch.randn(300, generator=gen).to(dtype).to(device)
        out = skinny_linear_triton(x, w, bias, block_n=16, block_k=256, split_k=split_k, activation=activation)
        assert relative_error(out, activation_ref(F.linear(x, w, bias), activation)) < 2 * ROUNDING[dtype]


@pytest.mark.parametrize("m,skinny", [(3, False), (3, True), (64, False)])
def test_float32_logits_are_the_product_unrounded(device, m, skinny):
    """linear_float32_out (the lm_head): float32 for every batch. A weight marked for the skinny
    kernel (as engine load marks the lm_head) has it store fp32 accumulators, and so does cuBLAS
    for a larger half-precision batch on CUDA: within fp32 accumulation error of the exact product,
    closer than the product rounded to bf16 is. Otherwise a skinny batch widens the rounded product."""
    from kernels.linear import _SKINNY_ATTR, linear_float32_out

    if skinny and device != "cuda":
        pytest.skip("Triton's CPU interpreter does not run bf16 dots faithfully")
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(1000, 512, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    if skinny:
        setattr(w, _SKINNY_ATTR, (16, 256, 4, 4, 2))  # split-K: the fp32 sums of two programs, added
    got = linear_float32_out(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, 1000)
    exact = F.linear(x.double(), w.double()).float()
    rounded = F.linear(x, w).float()
    if skinny or (device == "cuda" and m > 16):
        assert relative_error(got, exact) < 1e-5 < relative_error(rounded, exact)
    else:
        torch.testing.assert_close(got, rounded, rtol=0, atol=0)


def test_graph_capture_holds_the_cyclic_gc_off_inside_only(monkeypatch):
    """A GC pass inside a capture could destroy dead CUDA graphs there, which invalidates the capture
    (kernels/linear.py graph_capture): the collector is off inside, back on after, even on error."""
    import contextlib
    import gc

    from kernels import linear

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, **options):
        seen.append(options)
        yield

    monkeypatch.setattr(linear.torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(linear, "capture_stream", lambda: "this device's capture stream")
    assert gc.isenabled()
    with linear.graph_capture(None, capture_error_mode="thread_local"):
        assert not gc.isenabled()
    # the device's own capture stream, not torch's process-wide default (made on the first capturing device)
    assert gc.isenabled() and seen == [{"capture_error_mode": "thread_local", "stream": "this device's capture stream"}]
    with pytest.raises(RuntimeError), linear.graph_capture(None):
        raise RuntimeError("capture failed")
    assert gc.isenabled()
