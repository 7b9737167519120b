"""FP8 E4M3 quantization (kernels/fp8.py): round trips within E4M3's rounding bound, the W8A8
product within its error bound, and the GPU paths (skinny Triton kernel, torch._scaled_mm)
against the plain-torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (FP8_DTYPE, FP8_MAX, QuantizedRows, dequantize_rows, fp8_gated_linear, fp8_linear,
                         fp8_linear_ref, fp8_linear_scaled_mm, quantize_rows, quantize_weight, rms_norm_quantized,
                         gelu_tanh_and_mul_quantized, layer_norm_quantized, silu_and_mul_quantized)
from kernels.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.layernorm import layer_norm_ref
from kernels.rmsnorm import rms_norm

HALF_ULP = 2.0 ** -4  # E4M3 has 3 mantissa bits: rounding moves a normal value by at most 2^-4 of it
SUBNORMAL_HALF_STEP = 2.0 ** -10  # below 2^-6, values sit on a grid of 2^-9: at most half of that off
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_round_trip_within_the_e4m3_bound(scale):
    torch.manual_seed(0)
    x = torch.randn(64, 257) * scale
    x[3] = 0.0  # an all-zero row quantizes to zeros
    x_q, row_scale = quantize_rows(x)
    assert x_q.dtype == FP8_DTYPE and row_scale.shape == (64,)
    assert torch.equal(x_q.float().abs().amax(dim=1)[torch.arange(64) != 3], torch.full((63,), FP8_MAX))
    error = (dequantize_rows(x_q, row_scale) - x).abs()
    bound = torch.maximum(HALF_ULP * x.abs(), SUBNORMAL_HALF_STEP * row_scale[:, None])
    assert (error <= bound * (1 + 1e-6)).all()
    assert torch.equal(dequantize_rows(x_q, row_scale)[3], torch.zeros(257))



def e4m3_value(code: int) -> float:
    """The value of an E4M3 (fn) byte from its bit layout: sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6). Written from the format, independent of torch."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    return sign * (mantissa / 8 * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))


def test_e4m3_cast_rounds_to_nearest_even_on_the_formats_grid():
    """What the CPU reference emulates: torch's float32 -> float8_e4m3fn cast puts values on the
    format's grid (subnormals down to 2^-9, largest 448), rounding to the nearest value and ties to
    the even mantissa, as cuBLASLt's and Triton's conversions (cvt.rn) do."""
    finite = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7F and 0xFF are NaN, E4M3fn has no inf
    decoded = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    assert all(decoded[c].item() == e4m3_value(c) for c in finite)
    grid = torch.tensor(sorted({e4m3_value(c) for c in finite if e4m3_value(c) >= 0}), dtype=torch.float64)
    assert grid[1].item() == 2.0 ** -9 and grid[-1].item() == FP8_MAX
    low, high = grid[:-1], grid[1:]
    ties = ((low + high) / 2).float()
    went_up = ties.to(FP8_DTYPE).float().double() == high
    low_is_even = low.float().to(FP8_DTYPE).view(torch.uint8) % 2 == 0
    assert torch.equal(went_up, ~low_is_even)
    assert torch.equal((ties.double() * (1 + 1e-6)).float().to(FP8_DTYPE).float().double(), high)
    assert torch.equal((ties.double() * (1 - 1e-6)).float().to(FP8_DTYPE).float().double(), low)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_scales_are_float32_amax_over_448_and_zero_rows_stay_zero(dtype):
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -3.0, 0.5], [-1e-4, 2e-3, 7.0]]).to(dtype)
    x_q, scale = quantize_rows(x)
    assert scale.dtype == torch.float32
    torch.testing.assert_close(scale[1:], x[1:].float().abs().amax(dim=1) / FP8_MAX, rtol=0, atol=0)
    assert torch.equal(x_q.float()[0], torch.zeros(3))
    assert x_q.float()[1:].abs().amax(dim=1).tolist() == [FP8_MAX, FP8_MAX]  # no saturation past 448
    # 1e-4 / (7 / 448) = 0.0064 is below E4M3's smallest normal (2^-6): it lands on the subnormal
    # grid (steps of 2^-9), at 3 steps (0.0059), not flushed to zero.
    assert x_q.float()[2, 0].item() == -3 * 2.0 ** -9


def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch runs ``torch._scaled_mm`` on the CPU with per-row scales (2.13 does; the
    GPU machine's 2.11 does not)."""
    ones = torch.zeros(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not cpu_scaled_mm_takes_row_scales(), reason="this torch has no CPU _scaled_mm with row scales")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_torch_scaled_mm(dtype):
    """The CPU reference is what cuBLASLt's row-wise scaled FP8 GEMM computes: CPU torch runs
    ``torch._scaled_mm`` on float8_e4m3fn too, and both give the same numbers."""
    torch.manual_seed(6)
    x = (torch.randn(33, 576) * 3).to(dtype)
    x[5] = 0.0
    w_q, w_scale = quantize_weight(torch.randn(192, 576) * 0.02)
    x_q, x_scale = quantize_rows(x)
    scaled_mm = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                                 out_dtype=torch.float32)
    torch.testing.assert_close(scaled_mm, fp8_linear_ref(x.float(), w_q, w_scale), rtol=1e-6, atol=1e-6)

def test_w8a8_product_within_its_error_bound():
    """|y_q - y| <= (2 * 2^-4 + 2^-8) * (|x| @ |w|.T): each factor of each product is off by at most
    2^-4 of itself (plus the subnormal floor, negligible here), so each term by (1+e)^2 - 1."""
    torch.manual_seed(1)
    x, w = torch.randn(16, 512), torch.randn(384, 512) * 0.05
    w_q, w_scale = quantize_weight(w)
    y, y_q = x @ w.T, fp8_linear(x, w_q, w_scale)
    assert ((y_q - y).abs() <= (2 * HALF_ULP + HALF_ULP ** 2) * (x.abs() @ w.abs().T) + 1e-5).all()
    # On average far inside the bound: relative RMS error ~ 2^-4 * sqrt(2 / 3) / sqrt(3) (uniform rounding).
    assert ((y_q - y).norm() / y.norm()).item() < 0.06


def test_gated_product_equals_silu_and_mul_of_the_product():
    torch.manual_seed(2)
    x, w = torch.randn(4, 64), torch.randn(2 * 96, 64) * 0.1
    w_q, w_scale = quantize_weight(w)
    torch.testing.assert_close(fp8_gated_linear(x, w_q, w_scale), silu_and_mul(fp8_linear_ref(x, w_q, w_scale)))


@cuda
@pytest.mark.parametrize("rows", [1, 8, 16, 64, 512])
def test_gpu_paths_equal_the_reference(rows):
    torch.manual_seed(3)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(torch.randn(1536, 4096, device="cuda") * 0.02)
    bias = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    got = fp8_linear(x, w_q, w_scale, bias).float()
    want = fp8_linear_ref(x.float(), w_q, w_scale, bias.float())  # every GPU path is W8A8
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    if rows <= 16:  # the skinny kernel multiplies the same E4M3 values exactly: one bf16 rounding apart
        assert ((got - want).norm() / want.norm()).item() < 4e-3


@cuda
def test_fast_accumulation_error_is_far_below_the_e4m3_rounding():
    """The W8A8 product uses Hopper's fast FP8 accumulation. Against the exact product of the same
    E4M3 values its relative RMS error is ~2x the promoted accumulation's (on an H100, 2026-11-25:
    3.3e-3 against 1.7e-3, most of which is the bf16 rounding of the output), and an order of
    magnitude below the ~4% that rounding the inputs to E4M3 costs
    (test_w8a8_product_within_its_error_bound). K = 14336: Llama-8B's down_proj."""
    import kernels.fp8 as fp8

    torch.manual_seed(9)
    x = torch.randn(512, 14336, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(torch.randn(1024, 14336, device="cuda") * 0.02)
    x_q, x_scale = quantize_rows(x)
    exact = dequantize_rows(x_q, x_scale).double() @ dequantize_rows(w_q, w_scale).double().T

    def relative_rms(product: torch.Tensor) -> float:
        return ((product.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()

    assert fp8.FAST_ACCUM
    fast = relative_rms(fp8_linear_scaled_mm(x, w_q, w_scale))
    promoted = relative_rms(torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                                             out_dtype=torch.bfloat16, use_fast_accum=False))
    assert promoted < 3e-3 and fast < 5e-3, (fast, promoted)


@cuda
def test_scaled_mm_and_skinny_gated_equal_the_reference():
    torch.manual_seed(4)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(torch.randn(2 * 1024, 2048, device="cuda") * 0.02)
    want = silu_and_mul(fp8_linear_ref(x, w_q, w_scale)).float()  # W8A8, products rounded to bf16 first
    torch.testing.assert_close(fp8_gated_linear(x, w_q, w_scale).float(), want, rtol=3e-2, atol=3e-2)
    # Feeding an FP8 down projection, the gated output comes quantized per row, as quantize_rows makes it.
    rows = fp8_gated_linear(x, w_q, w_scale, quantize_output=True)
    values, scale = quantize_rows(fp8_gated_linear(x, w_q, w_scale))
    assert isinstance(rows, QuantizedRows) and rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.scale, scale)
    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
    x_big = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fp8_linear_scaled_mm(x_big, w_q, w_scale).float(),
                               fp8_linear_ref(x_big.float(), w_q, w_scale), rtol=2e-2, atol=2e-2)


def test_prequantized_rows_take_the_same_product():
    """A norm or activation that quantizes its output hands fp8_linear QuantizedRows: the product
    is the one fp8_linear would make from the unquantized activations."""
    torch.manual_seed(6)
    x, w = torch.randn(5, 64), torch.randn(48, 64) * 0.1
    w_q, w_scale = quantize_weight(w)
    rows = QuantizedRows(*quantize_rows(x), x.dtype)
    assert torch.equal(fp8_linear(rows, w_q, w_scale), fp8_linear_ref(x, w_q, w_scale))
    norm_weight, residual = torch.rand(64) + 0.5, torch.randn(5, 64)
    normed_rows, new_residual = rms_norm_quantized(x, norm_weight, 1e-5, residual)
    normed, want_residual = rms_norm(x, norm_weight, 1e-5, residual)
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(fp8_linear(normed_rows, w_q, w_scale), fp8_linear_ref(normed, w_q, w_scale))
    norm_bias = torch.randn(64)
    layer_normed_rows, stream = layer_norm_quantized(x, norm_weight, norm_bias, 1e-5, residual)
    layer_normed, want_stream, _ = layer_norm_ref(x, norm_weight, norm_bias, 1e-5, (residual,))
    assert torch.equal(stream, want_stream)
    assert torch.equal(fp8_linear(layer_normed_rows, w_q, w_scale), fp8_linear_ref(layer_normed, w_q, w_scale))
    gate_up = torch.randn(5, 128)
    assert torch.equal(fp8_linear(silu_and_mul_quantized(gate_up), w_q, w_scale),
                       fp8_linear_ref(silu_and_mul(gate_up), w_q, w_scale))
    assert torch.equal(fp8_linear(gelu_tanh_and_mul_quantized(gate_up), w_q, w_scale),
                       fp8_linear_ref(gelu_tanh_and_mul(gate_up), w_q, w_scale))


@cuda
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (37, 576), (300, 4096), (5, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_norm_quantization_equals_norm_then_quantization(rows, hidden, with_residual):
    """The norm kernel's quantized output is bit for bit the quantization of its plain output."""
    from kernels.fp8 import quantize_rows_triton
    from kernels.rmsnorm import rms_norm_quantized_triton, rms_norm_triton

    torch.manual_seed(7)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) * 2
    residual = torch.randn_like(x) if with_residual else None
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    values, scale, new_residual = rms_norm_quantized_triton(x, weight, 1e-5, residual)
    out, want_residual = rms_norm_triton(x, weight, 1e-5, residual)
    want_values, want_scale = quantize_rows_triton(out)
    assert torch.equal(scale, want_scale)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(new_residual, want_residual)


@cuda
@pytest.mark.parametrize("rows,inter", [(1, 14336), (64, 1536), (300, 14336), (3, 1000), (2, 20000)])
def test_fused_activation_quantization_equals_activation_then_quantization(rows, inter):
    from kernels.activation import silu_and_mul_quantized_triton, silu_and_mul_triton
    from kernels.fp8 import quantize_rows_triton

    torch.manual_seed(8)
    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    x[0] = 0.0  # an all-zero row: scale 1e-12, values 0
    values, scale = silu_and_mul_quantized_triton(x)
    want_values, want_scale = quantize_rows_triton(silu_and_mul_triton(x))
    assert torch.equal(scale, want_scale)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))


@cuda
@pytest.mark.parametrize("shape", [(1, 4096), (37, 14336), (512, 4096), (3, 100), (2, 20000)])  # 20000: two passes
def test_one_kernel_row_quantization_equals_the_reference(shape):
    from kernels.fp8 import quantize_rows_triton

    torch.manual_seed(5)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :7] = 0.0
    q, scale = quantize_rows_triton(x)
    q_ref, scale_ref = quantize_rows(x)
    torch.testing.assert_close(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


@cuda
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (32, 8, 128), (16, 8, 256)])
def test_fp8_kv_pool_write_and_paged_attention_equal_the_reference(heads, kv_heads, dim):
    """The Triton KV write (rotary-fused and plain) saturates and rounds as the reference does, and
    the attention kernel reads an FP8 pool as the reference reads it (both widen before the math).
    Head shapes: a small model's, Llama-8B's (the one-warp decode tiling) and Gemma's 256-wide heads."""
    from kernels.attention import KV_FP8_DTYPE, paged_attention, paged_attention_ref, write_kv_cache, write_kv_cache_ref
    from kernels.attention_metadata import AttentionMetadata

    torch.manual_seed(6)
    page, blocks = 16, 30
    lens = [1, 37, 150]  # context lengths; one new token each (decode); 150 tokens need 10 blocks
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(3, 10)
    pools = [torch.zeros(blocks, page, kv_heads, dim, dtype=KV_FP8_DTYPE, device="cuda") for _ in range(4)]
    for i, n in enumerate(lens):  # fill each sequence's context, values beyond 448 included
        k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16) * 100
        k[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, 500.0])  # beyond E4M3's 448: must saturate
        v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        slots = (tables[i].long()[torch.arange(n, device="cuda") // page] * page + torch.arange(n, device="cuda") % page)
        write_kv_cache(k, v, pools[0], pools[1], slots)
        write_kv_cache_ref(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0].view(torch.uint8), pools[2].view(torch.uint8))
    assert torch.equal(pools[1].view(torch.uint8), pools[3].view(torch.uint8))
    assert pools[0].float().abs().max().item() == 448.0
    # Keys of ~100 would give scores of ~100 with unit queries: a near one-hot softmax whose output
    # moves by percents when q moves by fp16's rounding (the kernel scales q into fp16). Queries of
    # ~0.05 give scores of ~5, as trained models have.
    q = torch.randn(3, heads, dim, device="cuda", dtype=torch.bfloat16) * 0.05
    meta = AttentionMetadata(
        slot_mapping=torch.full((3,), -1, dtype=torch.int64, device="cuda"), block_tables=tables,
        cu_seqlens_q=torch.arange(4, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), max_seqlen_q=1,
        max_context_len=max(lens), is_decode_only=True, cu_seqlens_q_host=[0, 1, 2, 3], context_lens_host=lens)
    got = paged_attention(q, pools[0], pools[1], meta, dim ** -0.5)
    want = paged_attention_ref(q, pools[0], pools[1], meta, dim ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@cuda
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("gated", [False, True])
def test_skinny_kernel_on_quantized_rows_equals_the_reference(split_k, gated):
    """The decode-size W8A8 kernel (FP8 x FP8 dots, both scales in the epilogue, split-K sums added
    by the last program) against the plain-torch W8A8 reference: the same E4M3 values multiplied
    exactly, so about one bf16 rounding apart (gated: the SiLU of the two rounded products)."""
    from kernels.linear import skinny_linear_triton

    torch.manual_seed(12 + split_k)
    x = torch.randn(5, 2048, device="cuda", dtype=torch.bfloat16)
    rows = QuantizedRows(*quantize_rows(x), x.dtype)
    w_q, w_scale = quantize_weight(torch.randn(2 * 384, 2048, device="cuda") * 0.02)
    got = skinny_linear_triton(rows.values, w_q, weight_scale=w_scale, x_scale=rows.scale, out_dtype=torch.bfloat16,
                               gated=gated, split_k=split_k, block_k=256).float()
    product = fp8_linear_ref(rows, w_q, w_scale)
    want = (silu_and_mul(product) if gated else product).float()
    assert ((got - want).norm() / want.norm()).item() < (1e-2 if gated else 4e-3)


@cuda
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_every_fp8_load_time_variant_is_correct(rows):
    """choose_fp8_skinny_variants may pick any of these tilings (swapped operands included), plain or
    gated: each is the W8A8 reference up to one bf16 rounding (gated: of the SiLU's inputs)."""
    from kernels.fp8 import FP8_EXTRA_VARIANTS
    from kernels.linear import SKINNY_VARIANTS, skinny_linear_triton, variant_options

    torch.manual_seed(30 + rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    x_rows = QuantizedRows(*quantize_rows(x), x.dtype)
    w_q, w_scale = quantize_weight(torch.randn(2 * 1024, 4096, device="cuda") * 0.02)
    product = fp8_linear_ref(x_rows, w_q, w_scale).float()
    gated_want = silu_and_mul(fp8_linear_ref(x_rows, w_q, w_scale)).float()
    for variant in SKINNY_VARIANTS + FP8_EXTRA_VARIANTS:
        options = variant_options(variant)
        got = skinny_linear_triton(x_rows.values, w_q, weight_scale=w_scale, x_scale=x_rows.scale,
                                   out_dtype=torch.bfloat16, **options).float()
        assert ((got - product).norm() / product.norm()).item() < 4e-3, variant
        got = skinny_linear_triton(x_rows.values, w_q, weight_scale=w_scale, x_scale=x_rows.scale,
                                   out_dtype=torch.bfloat16, gated=True, **options).float()
        assert ((got - gated_want).norm() / gated_want.norm()).item() < 1e-2, variant



@pytest.mark.parametrize("rows", [17, 40, 65, 128])
def test_wide_row_tilings_equal_the_reference(device, rows):
    """Tree verify steps' 17-128 rows on the skinny W8A8 kernel (kernels/wide_rows.py: rows padded
    to 32/64/128 in the dot, swapped operands, split-K): every FP8 WIDE_TILINGS tiling, plain and gated,
    is the W8A8 reference up to one rounding of the output dtype. GPU: bf16; the interpreter: float32."""
    from triton.runtime.errors import OutOfResources

    from kernels.wide_rows import WIDE_TILINGS, wide_tiling
    from kernels.linear import skinny_linear_triton, variant_options

    torch.manual_seed(40 + rows)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k, features = (4096, 1024) if device == "cuda" else (512, 96)
    x_rows = QuantizedRows(*quantize_rows(torch.randn(rows, k, device=device, dtype=dtype)), dtype)
    w_q, w_scale = quantize_weight(torch.randn(2 * features, k, device=device) * 0.02)
    product = fp8_linear_ref(x_rows, w_q, w_scale).float()
    gated_want = silu_and_mul(fp8_linear_ref(x_rows, w_q, w_scale)).float()
    bounds = {False: 4e-3, True: 1e-2} if device == "cuda" else {False: 1e-5, True: 1e-5}
    ran = {False: 0, True: 0}
    for tiling, gated in [(t, g) for t in WIDE_TILINGS[1] for g in (False, True)]:
        options = variant_options(wide_tiling(tiling, features, k, torch.device(device)))
        assert options["swap_ab"] and options["split_k"] > 1  # 96 or 1,024 features: split over K
        try:
            got = skinny_linear_triton(x_rows.values, w_q, weight_scale=w_scale, x_scale=x_rows.scale,
                                       out_dtype=dtype, gated=gated, **options).float()
        except OutOfResources:  # past the device's shared memory: the load-time choice drops such a tiling too
            continue
        want = gated_want if gated else product
        assert ((got - want).norm() / want.norm()).item() < bounds[gated], (tiling, gated)
        ran[gated] += 1
    assert ran[False] and ran[True]


def test_wide_row_counts_cover_the_steps_past_the_decode_rows():
    from kernels.wide_rows import wide_row_counts
    from kernels.linear import padded_rows

    assert [padded_rows(m) for m in (1, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert wide_row_counts(16) == ()  # decode rows only: the skinny tilings already take them
    assert wide_row_counts(33) == (32, 64)
    assert wide_row_counts(65) == (32, 64, 128)  # a 64-node tree and its root
    assert wide_row_counts(8192) == (32, 64, 128)


@cuda
@pytest.mark.parametrize("rows", [17, 65])
def test_fp8_linear_takes_the_wide_tiling_chosen_at_load(rows, monkeypatch):
    """choose_wide_variants marks a weight with {padded rows: tiling} where the kernel beat cuBLASLt
    (the default), at every timed row count with TRITONLLM_WIDE_ROWS=1 and nowhere with =0; fp8_linear
    and fp8_gated_linear then run it, equal to the W8A8 reference either way."""
    monkeypatch.setenv("TRITONLLM_WIDE_ROWS", "0")
    from kernels.linear import WIDE_ATTR, padded_rows
    from kernels.wide_rows import choose_wide_variants, wide_tiling

    off = torch.zeros(64, 256, device="cuda", dtype=torch.bfloat16)
    assert choose_wide_variants([off], row_counts=(32,)) == {} and not hasattr(off, WIDE_ATTR)
    monkeypatch.setenv("TRITONLLM_WIDE_ROWS", "1")
    report = choose_wide_variants([off], row_counts=(32,))
    assert getattr(off, WIDE_ATTR) == {32: report[(64, 256)][32]["tiling"]}  # forced, whatever the timing
    monkeypatch.delenv("TRITONLLM_WIDE_ROWS")
    torch.manual_seed(50 + rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(torch.randn(2 * 1024, 4096, device="cuda") * 0.02)
    gate_up = w_q.clone()
    m = padded_rows(rows)
    report = choose_wide_variants([w_q], gated=[gate_up], row_counts=(m,))
    assert set(report) == {("fp8", 2048, 4096), ("fp8", "gated", 2048, 4096)}
    tiling, gated_tiling = report[("fp8", 2048, 4096)][m]["tiling"], report[("fp8", "gated", 2048, 4096)][m]["tiling"]
    assert tiling == wide_tiling(tiling[:4], 2048, 4096, w_q.device) and gated_tiling is not None
    setattr(w_q, WIDE_ATTR, {m: tiling})  # the kernel, whichever the timing preferred
    setattr(gate_up, WIDE_ATTR, {m: gated_tiling})
    want = fp8_linear_ref(x.float(), w_q, w_scale).float()
    got = fp8_linear(x, w_q, w_scale).float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    gated_want = silu_and_mul(fp8_linear_ref(x.float(), w_q, w_scale)).float()
    got = fp8_gated_linear(x, gate_up, w_scale).float()
    assert ((got - gated_want).norm() / gated_want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [8, 40])  # 8: the skinny decode tiling; 40: a wide-row tiling marked on the weight
def test_activated_fp8_product_fuses_bias_and_activation_into_the_skinny_kernel(device, rows, activation):
    """The skinny W8A8 kernel with the bias and an activation in its epilogue (kernels/fp8.py _skinny_w8a8's
    ``activation``) gives the activation of its plain product (the product's rounding kept); fp8_linear_activated
    (a non-gated MLP's up product: Whisper's fc1) takes that kernel where it runs the rows (CUDA: the decode
    tiling, or a wide-row tiling marked on the weight) and the product then the activation elsewhere. A GELU
    computed after the product instead of in the epilogue fails on CUDA (the exact equality below)."""
    from kernels.fp8 import _skinny_w8a8, as_quantized_rows, fp8_linear_activated
    from kernels.linear import WIDE_ATTR, activation_ref
    from kernels.wide_rows import WIDE_TILINGS

    generator = torch.Generator().manual_seed(9)
    w_q, w_scale = (t.to(device) for t in quantize_weight(torch.randn(96, 64, generator=generator) * 0.1))
    bias = torch.randn(96, generator=generator).to(device)
    x = as_quantized_rows((torch.randn(rows, 64, generator=generator) * 2).to(device))
    variant = tuple(WIDE_TILINGS[1][0]) + (1, 1) if rows > 16 else None
    if variant is not None:
        setattr(w_q, WIDE_ATTR, {64: variant})
    fused = _skinny_w8a8(x, w_q, w_scale, bias, variant=variant, activation=activation)
    # (float32 outputs: the kernel's erf / tanh against torch's, an ulp or two apart)
    torch.testing.assert_close(fused, activation_ref(_skinny_w8a8(x, w_q, w_scale, bias, variant=variant), activation),
                               rtol=1e-5, atol=1e-5)
    takes_kernel = device == "cuda" or variant is not None  # (a weight marked wide takes it whatever the device)
    want = fused if takes_kernel else activation_ref(fp8_linear(x, w_q, w_scale, bias), activation)
    torch.testing.assert_close(fp8_linear_activated(x, w_q, w_scale, bias, activation), want, rtol=0, atol=0)
