"""kernels/norm_linear.py: LayerNorm -> skinny product -> bias, activation, residual, one kernel,
against its plain-torch reference (layer_norm, F.linear, the activation, the add; the unfused
decoder layer's ops). GPU: bf16 at 1..16 rows, PRELOAD and a few tilings, every load-time tiling at
3 rows; CPU: Triton's
interpreter (TRITON_INTERPRET=1) in float32, else skipped (the reference runs in the
encoder-decoder model tests)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import relative_error

# Both sides round the normalized rows and the product to the dtype, summing in a different order.
ROUNDING = {torch.bfloat16: 8e-3, torch.float32: 1e-5}


def _inputs(m, n, k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    return dict(x=t(m, k, scale=3.0) + 0.5, weight=t(n, k, scale=0.05), bias=t(n), norm=(t(k) + 1, t(k), 1e-5),
                residual=t(m, n))


@pytest.mark.parametrize("m,n,k", [(1, 96, 80), (3, 200, 576), (16, 37, 130), (40, 70, 300)])
def test_norm_linear_matches_reference(device, m, n, k):
    from kernels.norm_linear import PRELOAD, norm_linear_ref, norm_linear_triton

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = _inputs(m, n, k, dtype, device, seed=m * n + k)
    cases = [dict(norm=a["norm"]), dict(norm=a["norm"], activation="gelu"), dict(residual=a["residual"]),
             dict(norm=a["norm"], residual=a["residual"])]
    variants = [PRELOAD, (16, 64, 4, 2), (16, 64, 4, 2, 2), (64, 32, 4, 2, 1, 1, 1)] if m <= 16 else [PRELOAD]
    every_case = variants
    if device == "cuda" and m == 3:  # every tiling the load-time choice may give a weight, on one shape
        from kernels.linear import half_variants
        variants = [PRELOAD, *half_variants()]
    for index, case in enumerate(cases):
        ref = norm_linear_ref(a["x"], a["weight"], a["bias"], **case)
        for variant in variants:
            if index in (0, 3) and variant not in every_case:
                # (a compile per tiling and case: 44 took ~57 s of the GPU suite) the load-time tilings take
                # norm + GELU and residual without norm, each switch of the kernel's prologue and epilogue
                # through their split-K / balanced / swapped paths; every case runs on the four above
                continue
            out = norm_linear_triton(a["x"], a["weight"], a["bias"], variant=variant, **case)
            assert relative_error(out, ref) < ROUNDING[dtype], (case.keys(), variant)
    out = norm_linear_triton(a["x"], a["weight"], None, norm=a["norm"], variant=variants[0])
    assert relative_error(out, norm_linear_ref(a["x"], a["weight"], None, norm=a["norm"])) < ROUNDING[dtype]


def test_reference_is_the_unfused_layer_ops():
    """norm_linear_ref = F.layer_norm (torch's, in the dtype) -> F.linear -> GELU -> + residual."""
    import torch.nn.functional as F

    from kernels.norm_linear import norm_linear, norm_linear_ref

    a = _inputs(2, 24, 40, torch.bfloat16, "cpu")
    w, b, eps = a["norm"]
    h = F.layer_norm(a["x"], (40,), w, b, eps)
    expected = a["residual"] + F.gelu(F.linear(h, a["weight"], a["bias"]))
    got = norm_linear_ref(a["x"], a["weight"], a["bias"], norm=a["norm"], activation="gelu", residual=a["residual"])
    assert torch.equal(got, expected)
    assert torch.equal(norm_linear(a["x"], a["weight"], a["bias"], norm=a["norm"], activation="gelu",
                                   residual=a["residual"]), expected)  # CPU tensors: the reference


@pytest.mark.parametrize("m", [1, 3])
def test_row_stats_from_the_producer(device, m):
    """A residual product's emitted row statistics (per output tile: count, sum, squared deviations)
    merge to its stored rows' mean and variance, and a LayerNorm consumer reading them instead of
    its rows gives what it gives recomputing them (and the reference). The tilings: one K tile a
    program (PRELOAD), split-K, and balanced swapped tiles of one feature each (96 tiles)."""
    from kernels.norm_linear import PRELOAD, norm_linear_ref, norm_linear_triton, row_stats_ref

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = _inputs(m, 96, 80, dtype, device, seed=7 + m)
    b = _inputs(m, 40, 96, dtype, device, seed=11 + m)
    for variant in (PRELOAD, (16, 64, 4, 2, 2), (64, 32, 4, 2, 1, 1, 1)):
        out, stats = norm_linear_triton(a["x"], a["weight"], a["bias"], residual=a["residual"], variant=variant,
                                        emit_stats=True)
        assert torch.equal(out, norm_linear_triton(a["x"], a["weight"], a["bias"], residual=a["residual"],
                                                   variant=variant))
        mean, var = row_stats_ref(stats)
        rows = out.float()
        assert torch.allclose(mean, rows.mean(1), rtol=1e-5, atol=1e-6), variant
        assert torch.allclose(var, rows.var(1, unbiased=False), rtol=1e-5), variant
        for case in (dict(), dict(activation="gelu")):
            got = norm_linear_triton(out, b["weight"], b["bias"], norm=b["norm"], row_stats=stats, variant=variant,
                                     **case)
            recomputed = norm_linear_triton(out, b["weight"], b["bias"], norm=b["norm"], variant=variant, **case)
            assert relative_error(got, recomputed) < ROUNDING[dtype] / 4, (variant, case)
            ref = norm_linear_ref(out, b["weight"], b["bias"], norm=b["norm"], **case)
            assert relative_error(got, ref) < ROUNDING[dtype], (variant, case)
        if variant == PRELOAD:  # the consumer reads the statistics, not its rows
            shifted = stats.clone()
            shifted[1] += stats[0]  # every row's mean + 1
            got = norm_linear_triton(out, b["weight"], None, norm=b["norm"], row_stats=shifted, variant=variant)
            g, beta, eps = b["norm"]
            h = (rows - mean[:, None] - 1) * torch.rsqrt(var[:, None] + eps) * g.float() + beta.float()
            ref = torch.nn.functional.linear(h.to(dtype), b["weight"])
            assert relative_error(got, ref) < ROUNDING[dtype]
