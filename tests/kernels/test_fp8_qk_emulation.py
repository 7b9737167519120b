"""benchmarks/quantization/fp8_accuracy.py's emulation of an FP8 KV pool and of the prompt kernel's FP8 Q K^T
($TRITONLLM_PREFILL_FP8_QK=1): q rounded exactly as the kernel rounds it (the torch casts; Triton's interpreter
rounds to E4M3 wrongly, tests/kernels/test_prefill_fp8_qk.py), and the scores it yields off the float32 ones by a
nonzero amount within E4M3's rounding bound. Tiny random tensors, no model load."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from benchmarks.quantization import fp8_accuracy as acc

E4M3 = torch.float8_e4m3fn


def test_query_rounding_is_the_kernels_fp16_then_e4m3_round_trip():
    torch.manual_seed(0)
    scaling = 64**-0.5
    q = torch.randn(2, 3, 5, 64) * torch.logspace(-4, 6, 64)  # subnormal to past fp16 once scaled
    qk_scale = torch.tensor(scaling * acc.LOG2E, dtype=torch.float32)
    scaled = q * qk_scale
    expected = scaled.half().float().clamp(-448, 448).to(E4M3).float()
    got = acc.fp8_query(q, scaling)
    assert torch.equal(got, expected)
    assert torch.equal(got.to(E4M3).float(), got)  # on the E4M3 grid
    assert got.abs().max().item() == 448.0  # saturated, not NaN (E4M3 has no infinity)
    # E4M3's normal range: within half a step (2^-4) of the value
    normal = (scaled.abs() >= 2.0**-6) & (scaled.abs() <= 448.0)
    assert normal.any() and ((got - scaled).abs() <= scaled.abs() * 2.0**-4)[normal].all()
    # away from fp16's double rounding (rare ties), the same as rounding straight from float32
    assert (got == scaled.clamp(-448, 448).to(E4M3).float()).float().mean().item() > 0.99


def test_pool_rounding_saturates_at_448_and_is_e4m3():
    x = torch.tensor([1000.0, -1000.0, 1.96, 0.3, 1.5 * 2.0**-10, 2.0**-10])  # (a tie: to even, 0)
    assert torch.equal(acc.pool_rounded(x), torch.tensor([448.0, -448.0, 2.0, 0.3125, 2.0**-9, 0.0]))


def scores_of(round_kv: bool, round_q: bool, q, k, v, scaling):
    """The natural-log scores q . k * scaling that the wrapped attention hands its base."""
    def base(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return query @ key.transpose(-1, -2) * scaling
    attention = acc.rounded_attention(base, round_kv, round_q)
    return attention(SimpleNamespace(num_key_value_groups=1, training=False), q, k, v, None, scaling)


def test_fp8_qk_moves_the_scores_by_a_bounded_nonzero_amount():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 64) * 3 for _ in range(3))
    scaling = 64**-0.5
    exact = scores_of(False, False, q, k, v, scaling)
    assert torch.allclose(exact, q @ k.transpose(-1, -2) * scaling)
    kv = scores_of(True, False, q, k, v, scaling)
    kv_q = scores_of(True, True, q, k, v, scaling)
    q_only = scores_of(False, True, q, k, v, scaling)
    # q's rounding error (at most 2^-4 of each scaled value, or 2^-10 below E4M3's normals) times |k|, in base e
    qs = q * scaling * acc.LOG2E
    err_bound = ((qs.abs() * 2.0**-4 + 2.0**-10) @ k.abs().transpose(-1, -2)) * math.log(2.0) + 1e-5
    assert ((q_only - exact).abs() <= err_bound).all()
    kp = acc.pool_rounded(k)
    err_bound_kv = ((qs.abs() * 2.0**-4 + 2.0**-10) @ kp.abs().transpose(-1, -2)) * math.log(2.0) + 1e-5
    assert ((kv_q - kv).abs() <= err_bound_kv).all()
    # nonzero and of E4M3's size: a few percent of the scores' spread, not float32 noise
    relative = (kv_q - kv).abs().max().item() / exact.abs().max().item()
    assert 1e-3 < relative < 0.1
    assert 1e-3 < (q_only - exact).abs().max().item() / exact.abs().max().item() < 0.1
    # the product is the kernel's: base-2 scores q8 . k8 (scale 1 pool), times ln 2
    assert torch.allclose(kv_q, acc.fp8_query(q, scaling) @ kp.transpose(-1, -2) * math.log(2.0), rtol=1e-6,
                          atol=1e-6)


def test_the_attention_rows_route_through_the_wrapper_and_back():
    rows = acc.attention_rows()
    assert rows["FP8 KV"][1:] == (True, False) and rows["FP8 KV + FP8 Q K^T"][1:] == (True, True)
    assert rows["W8A8 + FP8 KV + FP8 Q K^T"][0](0, "qkv") == (True, True)
    config = SimpleNamespace(_attn_implementation="sdpa")
    model = SimpleNamespace(config=config)
    acc.set_attention(model, "sdpa", True, True)
    assert config._attn_implementation == acc.ROUNDED_ATTENTION
    acc.set_attention(model, "sdpa", False, False)
    assert config._attn_implementation == "sdpa"


def test_row_scaled_queries_differ_only_where_the_plain_rounding_is_subnormal():
    torch.manual_seed(2)
    scaling = 64**-0.5
    q = torch.randn(1, 2, 8, 64) * 0.3  # scaled: ~0.05, many below E4M3's normals (2^-6)
    plain, scaled = acc.fp8_query(q, scaling), acc.fp8_query(q, scaling, row_scaled=True)
    exact = (q * torch.tensor(scaling * acc.LOG2E, dtype=torch.float32)).half().float()
    normal = exact.abs() >= 2.0**-6
    assert torch.equal(plain[normal], scaled[normal])  # a power of two moves no normal value's rounding
    assert not torch.equal(plain, scaled)
    assert (scaled - exact).abs().sum() < (plain - exact).abs().sum()
