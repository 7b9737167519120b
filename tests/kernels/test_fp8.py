"""FP8 E4M3 quantization (kernels/fp8.py): round trips within E4M3's rounding bound, the W8A8
product within its error bound, and the GPU paths (skinny Triton kernel, torch._scaled_mm)
against the plain-torch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_rows, fp8_gated_linear, fp8_linear, fp8_linear_ref,
                         fp8_linear_scaled_mm, quantize_rows, quantize_weight)
from kernels.activation import silu_and_mul

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
    if rows <= 16:  # weight-only on the skinny kernel: exact weights times bf16 activations
        want = (x.float() @ dequantize_rows(w_q, w_scale).T + bias.float())
    else:  # W8A8 on cuBLASLt
        want = fp8_linear_ref(x.float(), w_q, w_scale, bias.float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@cuda
def test_scaled_mm_and_skinny_gated_equal_the_reference():
    torch.manual_seed(4)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight(torch.randn(2 * 1024, 2048, device="cuda") * 0.02)
    want = silu_and_mul((x.float() @ dequantize_rows(w_q, w_scale).T)).float()
    torch.testing.assert_close(fp8_gated_linear(x, w_q, w_scale).float(), want, rtol=3e-2, atol=3e-2)
    x_big = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(fp8_linear_scaled_mm(x_big, w_q, w_scale).float(),
                               fp8_linear_ref(x_big.float(), w_q, w_scale), rtol=2e-2, atol=2e-2)


@cuda
@pytest.mark.parametrize("shape", [(1, 4096), (37, 14336), (512, 4096), (3, 100)])
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
def test_fp8_kv_pool_write_and_paged_attention_equal_the_reference():
    """The Triton KV write (rotary-fused and plain) saturates and rounds as the reference does, and
    the attention kernel reads an FP8 pool as the reference reads it (both widen before the math)."""
    from kernels.attention import KV_FP8_DTYPE, paged_attention, paged_attention_ref, write_kv_cache, write_kv_cache_ref
    from kernels.attention_metadata import AttentionMetadata

    torch.manual_seed(6)
    heads, kv_heads, dim, page, blocks = 8, 2, 64, 16, 30
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
    q = torch.randn(3, heads, dim, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.full((3,), -1, dtype=torch.int64, device="cuda"), block_tables=tables,
        cu_seqlens_q=torch.arange(4, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), max_seqlen_q=1,
        max_context_len=max(lens), is_decode_only=True, cu_seqlens_q_host=[0, 1, 2, 3], context_lens_host=lens)
    got = paged_attention(q, pools[0], pools[1], meta, dim ** -0.5)
    want = paged_attention_ref(q, pools[0], pools[1], meta, dim ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
