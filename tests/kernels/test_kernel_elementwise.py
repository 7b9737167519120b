"""Fused residual RMSNorm, rotary embedding and SiLU-and-mul: Triton kernels vs the references.

These kernels do the reference's arithmetic in the same order (fp32 math, roundings to the
activation dtype at the same points), so the outputs agree to about one rounding of the output
dtype: bounds are a few ulps, far under the attention tolerances. Sizes are awkward on purpose:
odd token counts, hidden sizes that are not powers of two (SmolLM2's 576), 9 or 3 heads.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import low_precision_dtypes, relative_error

from kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, build_cos_sin_cache

# One output rounding: bf16 2^-8 relative at worst per element (RMS ~ 2^-9), fp16 8x tighter.
ROUNDING = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}


def randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("heads,head_dim", [((32, 4), 128), ((9, 3), 64), ((6, 6), 96)])
def test_qk_rms_norm_reads_the_qkv_columns_in_place(device, num_tokens, heads, head_dim):
    """Qwen3's shape (32 q and 4 k heads of 128), a group of 3, and a head_dim that is not a power of
    two: q and k of the fused qkv output, each head normalized with its own weight, equal the reference
    (which copies the column views first); v's columns are left alone."""
    from kernels.rmsnorm import qk_rms_norm_ref, qk_rms_norm_triton

    num_heads, num_kv_heads = heads
    width = (num_heads + 2 * num_kv_heads) * head_dim
    for dtype in low_precision_dtypes(device):
        qkv = randn(num_tokens, width, dtype=dtype, device=device, seed=1)
        q_weight = randn(head_dim, dtype=dtype, device=device, seed=2)
        k_weight = randn(head_dim, dtype=dtype, device=device, seed=3)
        before = qkv.clone()
        q, k = qk_rms_norm_triton(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, 1e-6)
        q_ref, k_ref = qk_rms_norm_ref(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, 1e-6)
        assert q.shape == q_ref.shape and k.shape == k_ref.shape and q.stride(-1) == k.stride(-1) == 1
        assert relative_error(q, q_ref) < ROUNDING[dtype] and relative_error(k, k_ref) < ROUNDING[dtype]
        assert torch.equal(qkv, before)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,hidden", [(1, 4096), (7, 576), (33, 2048)])
def test_rms_norm_with_and_without_residual(device, num_tokens, hidden):
    from kernels.rmsnorm import rms_norm_triton

    for dtype in low_precision_dtypes(device):
        x = randn(num_tokens, hidden, dtype=dtype, device=device, seed=1)
        residual = randn(num_tokens, hidden, dtype=dtype, device=device, seed=2)
        weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=3)).to(dtype)
        out, new_residual = rms_norm_triton(x, weight, 1e-5, residual)
        ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
        assert torch.equal(new_residual, ref_residual)  # one rounded add, same on both sides
        assert relative_error(out, ref_out) < ROUNDING[dtype]
        out, passthrough = rms_norm_triton(x, weight, 1e-5)
        assert passthrough is x
        assert relative_error(out, rms_norm_ref(x, weight, 1e-5)[0]) < ROUNDING[dtype]
        # a shift (float32, a vision tower's pending biases): x + shift normalized, x itself returned
        shift = randn(hidden, dtype=torch.float32, device=device, seed=4)
        out, passthrough = rms_norm_triton(x, weight, 1e-5, shift=shift)
        assert passthrough is x
        assert relative_error(out, rms_norm_ref((x.float() + shift).to(dtype), weight, 1e-5)[0]) < ROUNDING[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,parts,hidden", [(1, 8, 2048), (5, 2, 576), (3, 4, 200)])
def test_rms_norm_sums_each_tokens_rows_first(device, num_tokens, parts, hidden):
    """x (tokens, parts, hidden), e.g. a mixture-of-experts layer's K weighted expert rows: the norm
    sums each token's rows (fp32, one rounding) before the residual add, plain and quantized to E4M3;
    the new residual is the summed rows plus the residual (or the summed rows alone)."""
    from kernels.fp8 import dequantize_rows
    from kernels.rmsnorm import rms_norm_quantized_triton, rms_norm_triton

    for dtype in low_precision_dtypes(device):
        # A strided view, as fused_moe's (T * K, H) output viewed (T, K, H) is not: rows parts apart.
        buffer = randn(num_tokens, parts + 1, hidden, dtype=dtype, device=device, seed=1)
        x = buffer[:, 1:]
        residual = randn(num_tokens, hidden, dtype=dtype, device=device, seed=2)
        weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=3)).to(dtype)
        summed = x.float().sum(dim=1).to(dtype)
        for res in (residual, None):
            out, new_residual = rms_norm_triton(x, weight, 1e-5, res)
            ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, res)
            assert out.shape == new_residual.shape == (num_tokens, hidden)
            expected_residual = summed if res is None else (summed.float() + res.float()).to(dtype)
            assert relative_error(new_residual, expected_residual) < ROUNDING[dtype]
            assert relative_error(new_residual, ref_residual) < ROUNDING[dtype]
            assert relative_error(out, ref_out) < 2 * ROUNDING[dtype]
        values, scale, new_residual = rms_norm_quantized_triton(x, weight, 1e-5, residual)
        ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
        assert relative_error(dequantize_rows(values, scale), ref_out.float()) < 0.07  # E4M3's 3-bit mantissa
        assert relative_error(new_residual, ref_residual) < ROUNDING[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,hidden", [(1, 4544), (7, 576), (3, 200)])
def test_layer_norm_with_its_adds_and_second_norm(device, num_tokens, hidden):
    """The LayerNorm families' fused norm (Falcon-7B's 4544, SmolLM2's 576, a partial block): the
    stream x + a0 + a1 equals the reference's adds bit for bit; each norm, with and without a
    bias, one output rounding from F.layer_norm; a second (weight, bias) normalizes the same row."""
    from kernels.layernorm import layer_norm_ref, layer_norm_triton

    for dtype in low_precision_dtypes(device):
        x, a0, a1 = (randn(num_tokens, hidden, dtype=dtype, device=device, seed=s) for s in (1, 2, 3))
        weight, weight2 = ((1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=s)).to(dtype)
                           for s in (4, 5))
        bias, bias2 = (randn(hidden, dtype=dtype, device=device, seed=s) for s in (6, 7))
        for adds in ((), (a0,), (a0, a1)):
            for b, second in ((bias, None), (None, None), (bias, (weight2, bias2)), (None, (weight2, None))):
                out, stream, out2 = layer_norm_triton(x + 3, weight, b, 1e-5, adds, second)
                ref, ref_stream, ref2 = layer_norm_ref(x + 3, weight, b, 1e-5, adds, second)
                assert torch.equal(stream, ref_stream)
                assert relative_error(out, ref) < ROUNDING[dtype]
                assert (out2 is None) == (second is None)
                if second is not None:
                    assert relative_error(out2, ref2) < ROUNDING[dtype]
        assert layer_norm_triton(x, weight, bias, 1e-5)[1] is x  # nothing added: the stream is x itself


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,hidden", [(1, 1280), (64, 1280), (3, 200)])  # 1280: Whisper large-v3's
def test_quantized_layer_norm_is_the_norm_then_its_row_quantization(device, num_tokens, hidden):
    """layer_norm_quantized_triton (an FP8 Whisper decoder step's norms): the stream as layer_norm_triton adds it,
    and E4M3 rows equal to quantizing layer_norm_triton's output, with and without the residual add and bias."""
    from kernels.fp8 import quantize_rows_triton
    from kernels.layernorm import layer_norm_quantized_triton, layer_norm_triton

    dtype = low_precision_dtypes(device)[0]
    x, residual = (randn(num_tokens, hidden, dtype=dtype, device=device, seed=s) * 2 for s in (41, 42))
    weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=43)).to(dtype)
    bias = randn(hidden, dtype=dtype, device=device, seed=44)
    for adds in ((), (residual,)):
        for b in (bias, None):
            values, scale, stream = layer_norm_quantized_triton(x, weight, b, 1e-5, adds)
            out, want_stream, _ = layer_norm_triton(x, weight, b, 1e-5, adds)
            assert torch.equal(stream, want_stream)
            assert_same_quantized_rows((values, scale), quantize_rows_triton(out), device)
    assert layer_norm_quantized_triton(x, weight, bias, 1e-5)[2] is x  # nothing added: the stream is x itself


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((9, 3), 64)])
def test_rotary_in_place_on_qkv_views(device, is_neox, heads, head_dim):
    from kernels.rotary import apply_rotary_triton

    num_q, num_k = heads
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cache = build_cos_sin_cache(20000, head_dim, 500000.0, scaling, device=device)
    for dtype in low_precision_dtypes(device):
        num_tokens = 13
        qkv = randn(num_tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype, device=device, seed=4)
        q, k, _ = qkv.split([num_q * head_dim, num_k * head_dim, num_k * head_dim], dim=-1)
        q, k = q.view(num_tokens, num_q, head_dim), k.view(num_tokens, num_k, head_dim)
        positions = torch.tensor([0, 1, 2, 15, 16, 17, 100, 1023, 1024, 4097, 8191, 8192, 19999], device=device)
        ref_q, ref_k = apply_rotary_ref(q, k, positions, cache, is_neox)
        out_q, out_k = apply_rotary_triton(q, k, positions, cache, is_neox)
        assert out_q.data_ptr() == q.data_ptr()  # rotated in place inside qkv
        assert relative_error(out_q, ref_q) < ROUNDING[dtype]
        assert relative_error(out_k, ref_k) < ROUNDING[dtype]


@pytest.mark.gpu
def test_rotary_of_one_position_broadcast_over_rows(device):
    """Positions as a broadcast view (one position expanded over a tree depth's rows: stride 0, as
    speculative/eagle3_graphs.py's one-sequence windows pass them): every row rotates at that
    position, as in the reference. The view's element sits before other positions in its storage,
    so a kernel reading positions_ptr + row past the view rotates at those instead."""
    from kernels.rotary import apply_rotary_triton, rotary_and_write_kv_ref, rotary_and_write_kv_triton

    rows, num_q, num_k, head_dim = 5, 4, 2, 16
    cache = build_cos_sin_cache(64, head_dim, 10000.0, device=device)
    stored = torch.tensor([20, 1, 2, 3, 4], device=device)  # the view's storage: 20, then other positions
    positions = stored[:1].expand(rows)
    want = torch.full((rows,), 20, device=device)
    qkv = randn(rows, (num_q + 2 * num_k) * head_dim, dtype=torch.float32, device=device, seed=11)
    q, k, v = (t.view(rows, -1, head_dim)
               for t in qkv.split([num_q * head_dim, num_k * head_dim, num_k * head_dim], dim=-1))
    ref_q, ref_k = apply_rotary_ref(q, k, want, cache)
    out_q, out_k = apply_rotary_triton(q.clone(), k.clone(), positions, cache)
    assert relative_error(out_q, ref_q) < 1e-6 and relative_error(out_k, ref_k) < 1e-6
    k_ref, v_ref = (torch.zeros(2, 4, num_k, head_dim, device=device) for _ in range(2))
    k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_ref, v_ref))  # head-major
    slots = torch.arange(rows, device=device)
    q_ref = rotary_and_write_kv_ref(q.clone(), k, v, want, cache, k_ref, v_ref, slots)
    q_out = rotary_and_write_kv_triton(q.clone(), k, v, positions, cache, k_cache, v_cache, slots)
    assert relative_error(q_out, q_ref) < 1e-6 and relative_error(k_cache, k_ref) < 1e-6
    assert torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,inter", [(1, 14336), (5, 1536), (17, 1000)])
def test_silu_and_mul(device, num_tokens, inter):
    from kernels.activation import silu_and_mul_triton

    for dtype in low_precision_dtypes(device):
        x = randn(num_tokens, 2 * inter, dtype=dtype, device=device, seed=5) * 3
        assert relative_error(silu_and_mul_triton(x), silu_and_mul_ref(x)) < ROUNDING[dtype]


def test_public_entries_use_the_reference_on_cpu():
    """On CPU tensors the public entries are exactly the references (what CI exercises)."""
    from kernels.activation import silu_and_mul
    from kernels.rmsnorm import rms_norm

    x = torch.randn(3, 64)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    assert torch.equal(rms_norm(x, torch.ones(64), 1e-6, x)[0], rms_norm_ref(x, torch.ones(64), 1e-6, x)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((9, 3), 64)])
def test_fused_rotary_and_kv_write(device, is_neox, heads, head_dim):
    """rotary_and_write_kv == apply_rotary + write_kv_cache: same q, same cache; slot -1 writes nothing.
    The kernel's pool is stored head-major (each KV head's page contiguous), as the runner stores it."""
    from kernels.rotary import rotary_and_write_kv_ref, rotary_and_write_kv_triton

    num_q, num_k = heads
    cache = build_cos_sin_cache(4096, head_dim, 10000.0, device=device)
    for dtype in low_precision_dtypes(device):
        num_tokens, num_blocks, page = 11, 6, 16
        qkv = randn(num_tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype, device=device, seed=7)
        q, k, v = (t.view(num_tokens, -1, head_dim)
                   for t in qkv.split([num_q * head_dim, num_k * head_dim, num_k * head_dim], dim=-1))
        positions = torch.tensor([0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 4095], device=device)
        slots = torch.tensor([3, 4, 17, 18, 19, 33, -1, 50, 60, 70, 95], device=device)
        k_cache = randn(num_blocks, page, num_k, head_dim, dtype=dtype, device=device, seed=8)
        v_cache = randn(num_blocks, page, num_k, head_dim, dtype=dtype, device=device, seed=9)
        k_ref, v_ref, q_ref_in = k_cache.clone(), v_cache.clone(), q.clone()
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
        keep = slots >= 0
        q_ref = rotary_and_write_kv_ref(q_ref_in[keep], k[keep], v[keep], positions[keep], cache, k_ref, v_ref,
                                        slots[keep], is_neox)
        k_before = k.clone()
        q_out = rotary_and_write_kv_triton(q, k, v, positions, cache, k_cache, v_cache, slots, is_neox)
        assert torch.equal(k, k_before)  # k itself is left alone
        assert relative_error(q_out[keep], q_ref) < ROUNDING[dtype]
        assert relative_error(k_cache, k_ref) < ROUNDING[dtype] and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,inter", [(1, 15360), (5, 88), (17, 1536)])
def test_gelu_tanh_and_mul(device, num_tokens, inter):
    from kernels.activation import gelu_tanh_and_mul_triton

    for dtype in low_precision_dtypes(device):
        x = 2 * randn(num_tokens, 2 * inter, dtype=dtype, device=device, seed=7)  # gates well into both tails
        assert relative_error(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x)) < ROUNDING[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (37, 576), (5, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_quantized_norm_applies_deferred_fp8_scales_as_the_product_would(device, rows, hidden, with_residual):
    """An FP8 product handed over unscaled (kernels/fp8.py ScaledProduct): the quantizing norm scales
    each value by its row's and column's scale in-kernel, bit for bit what it gives on the scaled
    product (apply_scales), and the new residual is the scaled product (plus the residual)."""
    from kernels.fp8 import ScaledProduct, apply_scales
    from kernels.rmsnorm import rms_norm_quantized_triton

    values = randn(rows, hidden, dtype=torch.bfloat16, device=device, seed=11) * 3000
    row_scale = torch.rand(rows, generator=torch.Generator().manual_seed(12)).to(device) * 1e-3 + 1e-4
    col_scale = torch.rand(hidden, generator=torch.Generator().manual_seed(13)).to(device) * 1e-3 + 1e-4
    residual = randn(rows, hidden, dtype=torch.bfloat16, device=device, seed=14) if with_residual else None
    weight = (1 + 0.1 * randn(hidden, dtype=torch.float32, device=device, seed=15)).to(torch.bfloat16)
    product = apply_scales(ScaledProduct(values, row_scale, col_scale))
    q, scale, new_residual = rms_norm_quantized_triton(values, weight, 1e-5, residual, x_scales=(row_scale, col_scale))
    want_q, want_scale, want_residual = rms_norm_quantized_triton(product, weight, 1e-5, residual)
    assert_same_quantized_rows((q, scale), (want_q, want_scale), device)
    want_residual = want_residual if with_residual else product
    if device == "cuda":
        assert torch.equal(new_residual, want_residual)
    else:
        assert relative_error(new_residual, want_residual) < 2.0**-7  # one bf16 step


def assert_same_quantized_rows(got, want, device):
    """Bit for bit on the GPU. Triton's CPU interpreter rounds float32 to bf16 toward zero (the GPU to
    nearest), so there the scaled values may sit one bf16 step apart before quantization."""
    from kernels.fp8 import dequantize_rows

    if device == "cuda":
        assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    else:
        assert relative_error(dequantize_rows(*got), dequantize_rows(*want)) < 0.07  # an E4M3 step at most


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,inter", [(1, 14336), (3, 1000), (2, 20000)])  # 20000: the two-pass form
def test_quantized_gated_activation_applies_deferred_fp8_scales_as_the_product_would(device, rows, inter, activation):
    """The gated MLP's [gate | up] product handed over unscaled: the activation-and-quantize kernel (SiLU, or
    T5 v1.1's gated-GELU) scales gate and up in-kernel, bit for bit what it gives on the scaled product."""
    from kernels import activation as kernels
    from kernels.fp8 import ScaledProduct, apply_scales

    quantized = getattr(kernels, f"{activation}_and_mul_quantized_triton")
    values = randn(rows, 2 * inter, dtype=torch.bfloat16, device=device, seed=21) * 3000
    row_scale = torch.rand(rows, generator=torch.Generator().manual_seed(22)).to(device) * 1e-3 + 1e-4
    col_scale = torch.rand(2 * inter, generator=torch.Generator().manual_seed(23)).to(device) * 1e-3 + 1e-4
    got = quantized(values, x_scales=(row_scale, col_scale))
    want = quantized(apply_scales(ScaledProduct(values, row_scale, col_scale)))
    assert_same_quantized_rows(got, want, device)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(1, 5120), (3, 1000), (2, 20000)])  # 5120: Flan-T5-XL's; 20000: two passes
def test_quantized_gelu_tanh_and_mul_is_the_activation_then_its_row_quantization(device, rows, inter):
    """gelu_tanh_and_mul_quantized_triton (an FP8 T5 v1.1 decoder's gated-GELU before its down product) gives the
    E4M3 rows that quantizing gelu_tanh_and_mul's output gives, without writing that output."""
    from kernels.activation import gelu_tanh_and_mul_quantized_triton, gelu_tanh_and_mul_triton
    from kernels.fp8 import quantize_rows_triton

    x = randn(rows, 2 * inter, dtype=torch.bfloat16, device=device, seed=31) * 3
    x[0, :inter // 2] = 0.0  # part of a row with gate 0: gelu(0) * up = 0
    assert_same_quantized_rows(gelu_tanh_and_mul_quantized_triton(x), quantize_rows_triton(gelu_tanh_and_mul_triton(x)),
                               device)
