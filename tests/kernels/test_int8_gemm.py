"""kernels/int8_gemm.py (SmoothQuant W8A8 INT8 past 16 rows): the Triton GEMM with the scaling fused against
int8_linear_ref (the same integers scaled in the same order: equal bit for bit without a bias), plain, with a
bias and gated, at row counts that leave partial tiles and partial program groups, K and N not multiples of a
tile (Triton's CPU interpreter with TRITON_INTERPRET=1, or the GPU); int8_linear / int8_gated_linear taking it
on CUDA past MAX_SKINNY_ROWS, eagerly and replayed from a CUDA graph; the load-time choice per row bucket."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error, replayed

from kernels import int8_gemm, int8_sq
from kernels.activation import silu_and_mul

# Interpreter tests run small tilings (their time is per program and op, not per value), per-thread loads and
# TMA descriptors; the GPU tests every candidate.
SMALL_TILING = (64, 128, 64, 4, 4)
SMALL_TMA_TILING = (64, 128, 64, 4, 4, 1)


def _problem(m: int, n: int, k: int, device: str, dtype: torch.dtype, seed: int):
    """Quantized rows of x (m, k) with one outlier channel (SmoothQuant's case), an int8 weight (n, k) with
    scales, a bias (n,)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 30.0
    codes, scale = int8_sq.quantize_weight_int8(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen).to(dtype)
    rows = int8_sq.QuantizedRows(*int8_sq.quantize_rows_int8(x.to(dtype)), dtype)
    rows = int8_sq.QuantizedRows(rows.values.to(device), rows.scale.to(device), dtype)
    return rows, x.to(dtype), codes.to(device), scale.to(device), bias.to(device)


def _dtypes(device: str) -> tuple[torch.dtype, ...]:
    return (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.float16)


@pytest.mark.parametrize("m", [17, 64, 130])
@pytest.mark.parametrize("k, tiling", [(201, SMALL_TILING), (208, SMALL_TMA_TILING), (201, SMALL_TMA_TILING)])
def test_gemm_computes_the_reference_integers(device, m, k, tiling):
    """K = 201 (not a multiple of BLOCK_K: the masked K loop) or 208 (through TMA descriptors: rows 16-byte
    aligned; its last K tile partly past K, read as zeros; at 201 the TMA tiling falls back to per-thread loads),
    N = 37 and 2 x 37 (a partial column tile), rows 17, 64 (one full row tile), 130 (a partial third): without a
    bias the reference's integers scaled in its order, equal bit for bit; with a bias one output rounding apart at
    most (the GPU may fuse the add into a multiply-add; the interpreter does not, and is equal there too); gated:
    silu_and_mul of the reference's product within one rounding (the SiLU's exp may differ by an ulp)."""
    n = 37
    for dtype in _dtypes(device):
        rows, x, codes, scale, bias = _problem(m, 2 * n, k, device, dtype, seed=m)
        plain_w, plain_s = codes[:n], scale[:n]
        ref_x = x.to(device)
        assert int8_gemm.tma_readable(rows.values) == int8_gemm.tma_readable(codes) == (k % 16 == 0)
        got = int8_gemm.int8_gemm(rows.values, rows.scale, plain_w, plain_s, out_dtype=dtype, tiling=tiling)
        assert torch.equal(got, int8_sq.int8_linear_ref(ref_x, plain_w, plain_s)), dtype
        got = int8_gemm.int8_gemm(rows.values, rows.scale, plain_w, plain_s, bias[:n], out_dtype=dtype,
                                  tiling=tiling)
        want = int8_sq.int8_linear_ref(ref_x, plain_w, plain_s, bias[:n])
        if device == "cpu":
            assert torch.equal(got, want), dtype
        assert relative_error(got, want) < TOLERANCE[dtype], dtype
        got = int8_gemm.int8_gemm(rows.values, rows.scale, codes, scale, out_dtype=dtype, gated=True,
                                  tiling=tiling)
        want = silu_and_mul(int8_sq.int8_linear_ref(ref_x, codes, scale))
        assert got.shape == (m, n) and relative_error(got, want) < TOLERANCE[dtype], dtype


@pytest.mark.parametrize("tiling", [SMALL_TILING, SMALL_TMA_TILING])
def test_grouped_program_order_covers_every_tile(device, tiling):
    """600 rows are ten 64-row tiles, one group of GROUP_M = 8 and a partial group of 2; 300 columns three
    column tiles of 128: every output tile is written once, with its own rows and columns (equal to the
    reference bit for bit, plain and gated; per-thread loads and TMA)."""
    m, n, k = 600, 300, 64
    dtype = _dtypes(device)[0]
    rows, x, codes, scale, _ = _problem(m, 2 * n, k, device, dtype, seed=5)
    got = int8_gemm.int8_gemm(rows.values, rows.scale, codes[:n], scale[:n], out_dtype=dtype, tiling=tiling)
    assert torch.equal(got, int8_sq.int8_linear_ref(x.to(device), codes[:n], scale[:n]))
    got = int8_gemm.int8_gemm(rows.values, rows.scale, codes, scale, out_dtype=dtype, gated=True, tiling=tiling)
    want = silu_and_mul(int8_sq.int8_linear_ref(x.to(device), codes, scale))
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_gemm_sums_stay_exact_past_float32_integers(device):
    """Sums far past 2**24 (every code 127 against weight codes 126 or 127 over K = 2048: ~3.3e7), where a
    float32 running sum of the K tiles would round: the kernel's int32 sums give the reference's float32 output
    (one rounding of the exact integer) bit for bit. The test checks that float32 tile sums would differ."""
    m, k, n, block_k = 17, 2048, 16, SMALL_TILING[2]
    gen = torch.Generator().manual_seed(7)
    x = torch.ones(m, k)
    codes, x_scale = int8_sq.quantize_rows_int8(x)
    assert (codes == 127).all()
    w = (126 + torch.randint(0, 2, (n, k), generator=gen)).to(torch.int8)
    exact = codes.double() @ w.double().T
    tile_sums = torch.zeros(m, n, dtype=torch.float32)
    for k0 in range(0, k, block_k):
        tile_sums += (codes[:, k0:k0 + block_k].double() @ w[:, k0:k0 + block_k].double().T).float()
    assert (tile_sums != exact.float()).any()  # float32 accumulation would not be exact here
    want = int8_sq.int8_linear_ref(x, w, torch.ones(n))
    got = int8_gemm.int8_gemm(codes.to(device), x_scale.to(device), w.to(device), torch.ones(n, device=device),
                              out_dtype=torch.float32, tiling=SMALL_TILING)
    assert torch.equal(got.cpu(), want)


def test_row_buckets_and_the_rows_timed_at_load(monkeypatch):
    """A product of M rows takes the tiling of the first bucket >= M (the last beyond them); the load times the
    buckets that its steps reach, none for decode-only row counts or with the kernel off."""
    assert [int8_gemm.row_bucket(m) for m in (17, 33, 64, 65, 1024, 1025, 8192, 9000)] == [
        32, 64, 64, 128, 1024, 2048, 8192, 8192]
    assert int8_gemm.int8_gemm_row_counts(16) == ()
    assert int8_gemm.int8_gemm_row_counts(100) == (32, 64, 128)
    assert int8_gemm.int8_gemm_row_counts(8192) == int8_gemm.INT8_GEMM_ROW_BUCKETS
    assert int8_gemm.int8_gemm_row_counts(20000) == int8_gemm.INT8_GEMM_ROW_BUCKETS
    monkeypatch.setenv(int8_gemm.INT8_GEMM_ENV, "0")
    assert int8_gemm.int8_gemm_row_counts(8192) == ()
    weight = torch.zeros(8, 8, dtype=torch.int8)
    assert int8_gemm.tiling_for(weight, 300, gated=False) == int8_gemm.default_tiling(300, False)
    setattr(weight, int8_gemm.INT8_GEMM_ATTR, {512: (128, 128, 64, 4, 4)})
    assert int8_gemm.tiling_for(weight, 300, gated=False) == (128, 128, 64, 4, 4)
    assert int8_gemm.tiling_for(weight, 600, gated=False) == int8_gemm.default_tiling(600, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="every tiling compiled on the GPU")
def test_cuda_every_candidate_tiling_computes_the_reference_integers():
    """Each of INT8_GEMM_TILINGS and INT8_GATED_TILINGS on the GPU (N and K multiples of 16, as the models',
    so the compiles are those of the load-time choice and of benchmarks/quantization/int8_gemm_bench.py), at
    130 rows: plain equal to the reference bit for bit, gated within one rounding of silu_and_mul of it."""
    n, k = 384, 512
    rows, x, codes, scale, _ = _problem(130, 2 * n, k, "cuda", torch.bfloat16, seed=11)
    want = int8_sq.int8_linear_ref(x.cuda(), codes[:n], scale[:n])
    for tiling in int8_gemm.INT8_GEMM_TILINGS:
        got = int8_gemm.int8_gemm(rows.values, rows.scale, codes[:n], scale[:n], out_dtype=torch.bfloat16,
                                  tiling=tiling)
        assert torch.equal(got, want), tiling
    gated_want = silu_and_mul(int8_sq.int8_linear_ref(x.cuda(), codes, scale))
    for tiling in int8_gemm.INT8_GATED_TILINGS:
        got = int8_gemm.int8_gemm(rows.values, rows.scale, codes, scale, out_dtype=torch.bfloat16, gated=True,
                                  tiling=tiling)
        assert relative_error(got, gated_want) < TOLERANCE[torch.bfloat16], tiling


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int8_linear's CUDA paths")
@pytest.mark.parametrize("m", [17, 130, 700])
def test_cuda_int8_linear_takes_the_gemm_past_decode_rows(m, monkeypatch):
    """int8_linear / int8_gated_linear on CUDA past 16 rows: the GEMM (the same values as int8_gemm at
    tiling_for's tiling; the reference's bit for bit without a bias, within a rounding with one), for x in the
    model dtype and for QuantizedRows (the norm's), leading dimensions kept, the same when captured in a CUDA
    graph and replayed on new rows; with TRITONLLM_INT8_GEMM=0 torch._int_mm within a rounding."""
    n, k = 272, 1024
    _, x, codes, scale, bias = _problem(m, 2 * n, k, "cuda", torch.bfloat16, seed=30 + m)
    x, bias = x.cuda(), bias[:n]
    plain_w, plain_s = codes[:n], scale[:n]
    rows = int8_sq.as_int8_rows(x)
    got = int8_sq.int8_linear(x, plain_w, plain_s, bias)
    assert torch.equal(got, int8_gemm.int8_gemm(rows.values, rows.scale, plain_w, plain_s, bias,
                                                out_dtype=torch.bfloat16))
    assert relative_error(got, int8_sq.int8_linear_ref(x, plain_w, plain_s, bias)) < TOLERANCE[torch.bfloat16]
    assert torch.equal(int8_sq.int8_linear(rows, plain_w, plain_s), int8_sq.int8_linear_ref(x, plain_w, plain_s))
    gated = int8_sq.int8_gated_linear(x, codes, scale)
    assert torch.equal(gated, int8_gemm.int8_gemm(rows.values, rows.scale, codes, scale, out_dtype=torch.bfloat16,
                                                  gated=True))
    assert torch.equal(int8_sq.int8_gated_linear(rows, codes, scale), gated)
    gated_want = silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))
    assert relative_error(gated, gated_want) < TOLERANCE[torch.bfloat16]
    assert int8_sq.int8_linear(x[None], plain_w, plain_s).shape == (1, m, n)
    assert int8_sq.int8_gated_linear(x[None], codes, scale).shape == (1, m, n)
    out = replayed(lambda: int8_sq.int8_linear(x, plain_w, plain_s, bias), x)
    assert relative_error(out, int8_sq.int8_linear_ref(x, plain_w, plain_s, bias)) < TOLERANCE[torch.bfloat16]
    out = replayed(lambda: int8_sq.int8_gated_linear(x, codes, scale), x)
    assert relative_error(out, silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))) < TOLERANCE[torch.bfloat16]
    monkeypatch.setenv(int8_gemm.INT8_GEMM_ENV, "0")
    old = int8_sq.int8_linear(x, plain_w, plain_s, bias)
    assert relative_error(old, int8_sq.int8_linear_ref(x, plain_w, plain_s, bias)) < TOLERANCE[torch.bfloat16]
    old = int8_sq.int8_gated_linear(x, codes, scale)
    assert relative_error(old, silu_and_mul(int8_sq.int8_linear_ref(x, codes, scale))) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the load-time choice times on a CUDA device")
def test_load_time_choice_marks_each_weight_per_row_bucket():
    """choose_int8_gemm_tilings (the engine's load, engine/executor/runner.py choose_kernels): per shape (gated
    [gate | up] weights under ("gated", 2N, K)) and row bucket one candidate, kept on every weight of that shape as {bucket: tiling};
    int8_linear and int8_gated_linear then run it (the same values as int8_gemm with that tiling)."""
    plain = [int8_sq.quantize_weight_int8(torch.randn(384, 512, device="cuda"))[0] for _ in range(2)]
    gate_up, gate_up_scale = int8_sq.quantize_weight_int8(torch.randn(2 * 384, 512, device="cuda"))
    chosen = int8_gemm.choose_int8_gemm_tilings(plain, gated=[gate_up], rows=(64, 256))
    assert set(chosen) == {(64, 384, 512), (256, 384, 512), (64, "gated", 768, 512), (256, "gated", 768, 512)}
    for bucket in (64, 256):
        assert chosen[(bucket, 384, 512)] in int8_gemm.INT8_GEMM_TILINGS
        assert chosen[(bucket, "gated", 768, 512)] in int8_gemm.INT8_GATED_TILINGS
    assert all(getattr(w, int8_gemm.INT8_GEMM_ATTR) == {b: chosen[(b, 384, 512)] for b in (64, 256)} for w in plain)
    x = torch.randn(200, 512, device="cuda", dtype=torch.bfloat16)
    rows = int8_sq.as_int8_rows(x)
    scale = torch.rand(384, device="cuda") * 1e-2
    assert torch.equal(int8_sq.int8_linear(x, plain[0], scale), int8_gemm.int8_gemm(
        rows.values, rows.scale, plain[0], scale, out_dtype=torch.bfloat16, tiling=chosen[(256, 384, 512)]))
    assert torch.equal(int8_sq.int8_gated_linear(x, gate_up, gate_up_scale), int8_gemm.int8_gemm(
        rows.values, rows.scale, gate_up, gate_up_scale, out_dtype=torch.bfloat16, gated=True,
        tiling=chosen[(256, "gated", 768, 512)]))
