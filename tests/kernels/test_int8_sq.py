"""kernels/int8_sq.py (SmoothQuant W8A8 INT8): the per-token quantizer kernel against the torch
reference (same codes, same scales), the scheme's reference against the dequantized float product,
the decode-size skinny kernel (int8 dots, int32 sums; plain, with a bias, gated) against the reference
(Triton's CPU interpreter with TRITON_INTERPRET=1, or the GPU), and the CUDA paths (the skinny kernel
up to 16 rows, kernels/int8_gemm.py's GEMM past them: tests/kernels/test_int8_gemm.py) against the reference,
eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error, replayed

from kernels import int8_sq
from kernels.activation import silu_and_mul

# Tilings the int8 skinny kernel is tried with: the default, split-K (int32 partial sums added by the last
# program), swapped operands (the weight tile as the dot's first operand), both, and balanced tiles.
INT8_TILINGS = (int8_sq.INT8_SKINNY_DEFAULT, (16, 256, 4, 6, 4), (64, 256, 4, 5, 1, 1), (64, 256, 4, 5, 2, 1),
                (64, 128, 4, 6, 1, 1, 1))


def test_weight_quantization_is_per_channel_symmetric():
    w = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]
    codes, scale = int8_sq.quantize_weight_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and codes.min() >= -127
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()  # half a step
    half = torch.tensor([[0.5, -0.5, 1.5, -2.5, 127.0]])  # ties round away from zero
    assert int8_sq.quantize_rows_int8(half)[0].tolist() == [[1, -1, 2, -3, 127]]


def test_reference_is_the_dequantized_product():
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    codes, scale = int8_sq.quantize_weight_int8(w)
    bias = torch.randn(24)
    xq, xs = int8_sq.quantize_rows_int8(x)
    expected = (xq.float() * xs[:, None]) @ (codes.float() * scale[:, None]).T + bias
    assert torch.allclose(int8_sq.int8_linear_ref(x, codes, scale, bias), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [40, 5000, 20000])  # read once (up to 16384), and in 4096-wide blocks twice
def test_quantize_kernel_matches_the_reference(device, cols):
    x = (torch.randn(3, cols) * torch.tensor([[1.0], [1e-3], [0.0]])).to(device)  # an all-zero row too
    codes, scale = int8_sq.quantize_rows_int8_triton(x)
    ref_codes, ref_scale = int8_sq.quantize_rows_int8(x)
    assert torch.equal(scale, ref_scale) and torch.equal(codes, ref_codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._int_mm path: CUDA only")
@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_cuda_path_matches_the_reference(m):
    w = torch.randn(264, 512, device="cuda")
    codes, scale = int8_sq.quantize_weight_int8(w)
    x = torch.randn(m, 512, device="cuda").to(torch.bfloat16)
    bias = torch.randn(264, device="cuda").to(torch.bfloat16)
    out = int8_sq.int8_linear(x, codes, scale, bias)
    assert relative_error(out, int8_sq.int8_linear_ref(x, codes, scale, bias)) < TOLERANCE[torch.bfloat16]


def _int8_problem(m: int, n: int, k: int, device: str, dtype: torch.dtype, seed: int):
    """x (m, k) with one outlier channel (SmoothQuant's case), int8 weight (n, k) + scales, bias (n,)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 7] *= 30.0
    codes, scale = int8_sq.quantize_weight_int8(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen)
    return x.to(dtype).to(device), codes.to(device), scale.to(device), bias.to(dtype).to(device)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_kernel_computes_the_reference_integers(device, m):
    """The skinny kernel's int8 dots (int32 sums over K = 1001, past one 512 tile; N = 37 and 2 x 37, not
    multiples of a tile), every INT8_TILINGS tiling, against int8_linear_ref: without a bias the same
    integers scaled in the same order, so equal bit for bit; with a bias one output rounding apart at
    most (the GPU may fuse the add into a multiply-add; the interpreter does not, and is equal there too);
    gated: silu_and_mul of the reference product within one rounding (the SiLU's exp differs).
    GPU: bf16 (the models' dtype; fewer compiles); Triton's CPU interpreter: float32 and float16."""
    n, k = 37, 1001
    for dtype in (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.float16):
        x, codes, scale, bias = _int8_problem(m, 2 * n, k, device, dtype, seed=m)
        plain_w, plain_s = codes[:n], scale[:n]
        for tiling in INT8_TILINGS:
            got = int8_sq.int8_skinny_linear(x, plain_w, plain_s, variant=tiling)
            assert torch.equal(got, int8_sq.int8_linear_ref(x, plain_w, plain_s)), (dtype, tiling)
            got = int8_sq.int8_skinny_linear(x, plain_w, plain_s, bias[:n], variant=tiling)
            want = int8_sq.int8_linear_ref(x, plain_w, plain_s, bias[:n])
            if device == "cpu":
                assert torch.equal(got, want), (dtype, tiling)
            assert relative_error(got, want) < TOLERANCE[dtype], (dtype, tiling)
            got = int8_sq.int8_skinny_linear(x, codes, scale, gated=True, variant=tiling)
            want = silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))
            assert got.shape == (m, n) and relative_error(got, want) < TOLERANCE[dtype], (dtype, tiling)


def test_skinny_kernel_sums_stay_exact_past_float32_integers(device):
    """Sums far past 2**24 (every x code 127, weight codes 126 or 127 over K = 4096: ~6.6e7), where a
    float32 running sum of the K tiles would round at each add: the kernel keeps them in int32, so its
    float32 output (no output rounding to hide a difference) equals the reference's, which rounds the
    exact integer once. The test checks that a float32 sum of 512-wide tiles would have differed."""
    k, n = 4096, 16
    gen = torch.Generator().manual_seed(7)
    x = torch.ones(2, k)
    w = (126 + torch.randint(0, 2, (n, k), generator=gen)).to(torch.int8)
    scale = torch.ones(n)
    exact = (x.double() * 127) @ w.double().T
    tile_sums = torch.zeros(2, n, dtype=torch.float32)
    for k0 in range(0, k, 512):
        tile_sums += ((x[:, k0:k0 + 512].double() * 127) @ w[:, k0:k0 + 512].double().T).float()
    assert (tile_sums != exact.float()).any()  # float32 accumulation would not be exact here
    want = int8_sq.int8_linear_ref(x, w, scale)
    x, w, scale = x.to(device), w.to(device), scale.to(device)
    for tiling in INT8_TILINGS:
        assert torch.equal(int8_sq.int8_skinny_linear(x, w, scale, variant=tiling).cpu(), want), tiling


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int8_linear's CUDA paths")
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17])
def test_cuda_int8_linear_takes_the_skinny_kernel_for_decode_rows(m):
    """int8_linear / int8_gated_linear on CUDA: up to 16 rows the skinny kernel (the same values as
    int8_skinny_linear, and the reference's integers), at 17 kernels/int8_gemm.py's GEMM; both within one
    rounding of the reference; and the same when captured in a CUDA graph and replayed on new rows. N = 270,
    2 x 270: not multiples of 8 (which only torch._int_mm, the path before the GEMM, needed)."""
    x, codes, scale, bias = _int8_problem(m, 2 * 270, 1000, "cuda", torch.bfloat16, seed=40 + m)
    plain_w, plain_s = codes[:270], scale[:270]
    got = int8_sq.int8_linear(x, plain_w, plain_s, bias[:270])
    assert relative_error(got, int8_sq.int8_linear_ref(x, plain_w, plain_s, bias[:270])) < TOLERANCE[torch.bfloat16]
    gated = int8_sq.int8_gated_linear(x, codes, scale)
    gated_want = silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))
    assert relative_error(gated, gated_want) < TOLERANCE[torch.bfloat16]
    if m <= 16:
        assert torch.equal(got, int8_sq.int8_skinny_linear(x, plain_w, plain_s, bias[:270]))
        assert torch.equal(int8_sq.int8_linear(x, plain_w, plain_s), int8_sq.int8_linear_ref(x, plain_w, plain_s))
        assert torch.equal(gated, int8_sq.int8_skinny_linear(x, codes, scale, gated=True))
    x3 = x[None]  # (1, m, K): leading dimensions kept
    assert int8_sq.int8_linear(x3, plain_w, plain_s).shape == (1, m, 270)
    assert int8_sq.int8_gated_linear(x3, codes, scale).shape == (1, m, 270)
    out = replayed(lambda: int8_sq.int8_linear(x, plain_w, plain_s, bias[:270]), x)
    assert relative_error(out, int8_sq.int8_linear_ref(x, plain_w, plain_s, bias[:270])) < TOLERANCE[torch.bfloat16]
    out = replayed(lambda: int8_sq.int8_gated_linear(x, codes, scale), x)
    assert relative_error(out, silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the load-time choice times on a CUDA device")
def test_load_time_choice_marks_each_int8_weight_with_a_candidate_tiling():
    """choose_int8_skinny_variants (the engine's load, engine/executor/runner.py choose_kernels): one of
    INT8_SKINNY_VARIANTS per shape, plain and gated apart, set on every weight of that shape; int8_linear and
    int8_gated_linear then run that tiling (the same values as int8_skinny_linear with it). Shapes in multiples
    of 16, as the models' (so these compiles are the ones benchmarks/quantization/int8_skinny_bench.py reuses)."""
    plain = [int8_sq.quantize_weight_int8(torch.randn(256, 512, device="cuda"))[0] for _ in range(2)]
    gate_up, gate_up_scale = int8_sq.quantize_weight_int8(torch.randn(2 * 128, 512, device="cuda"))
    chosen = int8_sq.choose_int8_skinny_variants(plain, gated=[gate_up], rows=(1,))
    assert set(chosen) == {(256, 512), ("gated", 256, 512)}
    assert all(variant in int8_sq.INT8_SKINNY_VARIANTS for variant in chosen.values())
    assert all(getattr(w, int8_sq.INT8_VARIANT_ATTR) == chosen[(256, 512)] for w in plain)
    assert getattr(gate_up, int8_sq.INT8_VARIANT_ATTR) == chosen[("gated", 256, 512)]
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(256, device="cuda") * 1e-2
    assert torch.equal(int8_sq.int8_linear(x, plain[0], scale),
                       int8_sq.int8_skinny_linear(x, plain[0], scale, variant=chosen[(256, 512)]))
    assert torch.equal(int8_sq.int8_gated_linear(x, gate_up, gate_up_scale),
                       int8_sq.int8_skinny_linear(x, gate_up, gate_up_scale, gated=True,
                                                  variant=chosen[("gated", 256, 512)]))


@pytest.mark.parametrize("hidden", [40, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quantizing_its_output_equals_the_norm_then_the_quantizer(device, hidden, with_residual):
    """rms_norm_quantized_int8 (the int8_sq layers' input norms, engine/models/layers.py rms_norm_into): the
    RMSNorm's output quantized per row in the norm's own kernel equals rms_norm then the row quantizer bit for
    bit (codes, scales, new residual); int8_linear and int8_gated_linear of those QuantizedRows equal the
    same products of the norm's output (an all-zero row too: scale 1e-12, codes 0).
    GPU: bf16; Triton's CPU interpreter: float16."""
    from kernels.rmsnorm import rms_norm_quantized_int8_triton, rms_norm_triton

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, hidden, generator=gen) * 2).to(dtype).to(device)
    x[1] = 0.0
    residual = torch.randn(3, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    if residual is not None:
        residual[1] = 0.0
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    codes, scale, new_residual = rms_norm_quantized_int8_triton(x, weight, 1e-6, residual)
    out, want_residual = rms_norm_triton(x, weight, 1e-6, residual)
    want_codes, want_scale = int8_sq.quantize_rows_int8_triton(out)
    assert codes.dtype == torch.int8 and torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert torch.equal(scale, int8_sq.quantize_rows_int8(out)[1])  # the torch reference's scales too
    assert torch.equal(new_residual, want_residual)
    rows = int8_sq.QuantizedRows(codes, scale, dtype)
    w, w_scale = int8_sq.quantize_weight_int8(torch.randn(2 * 24, hidden, generator=gen).to(device))
    assert torch.equal(int8_sq.int8_skinny_linear(rows, w, w_scale), int8_sq.int8_skinny_linear(out, w, w_scale))
    if device == "cuda":  # the public entries take QuantizedRows (the CPU path quantizes with torch: same values)
        assert torch.equal(int8_sq.int8_linear(rows, w, w_scale), int8_sq.int8_linear(out, w, w_scale))
        assert torch.equal(int8_sq.int8_gated_linear(rows, w, w_scale), int8_sq.int8_gated_linear(out, w, w_scale))
    assert torch.equal(int8_sq.int8_linear(int8_sq.as_int8_rows(out.cpu()), w.cpu(), w_scale.cpu()),
                       int8_sq.int8_linear_ref(out.cpu(), w.cpu(), w_scale.cpu()))
