"""kernels/moe_decode_tiles.py: every candidate tiling of the one-token grouped expert GEMMs, marked on
gate_up as the load-time choice marks it, gives fused_moe_triton the reference's output (GPU, or Triton's
CPU interpreter with TRITON_INTERPRET=1); the choice itself times on CUDA only. Tiny shapes whose widths
are not multiples of the column or K tiles."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import relative_error

from kernels import moe_decode_tiles
from kernels.fused_moe import DECODE_TILES_ATTR, fused_moe_ref, fused_moe_triton
from kernels.moe_decode_tiles import DECODE_TILE_CANDIDATES, choose_decode_tiles, mark_decode_tiles

HIDDEN, INTER, EXPERTS, TOP_K = 80, 40, 10, 4


def problem(dtype, device, seed=0):
    """([x, gate_up, down, weights, ids] on the CPU, [x, gate_up, down] on ``device``), x and the experts in
    ``dtype`` on both (the device copies were float32 whatever the dtype: the choice, for half types only,
    then skipped the GPU test's layers and returned {})."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * INTER ** -0.5
    ids = torch.randperm(EXPERTS, generator=gen)[:TOP_K].view(1, TOP_K).to(torch.int32)
    weights = torch.rand(1, TOP_K, generator=gen)
    typed = [t.to(dtype) for t in (x, gate_up, down)]
    return typed + [weights, ids], [t.to(device) for t in typed]


@pytest.mark.gpu
def test_every_candidate_pair_equals_the_reference(device):
    """Each candidate for gate_up, beside another for down (so the two GEMMs' tiles differ), at one token."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (the interpreter has no bf16 dots)
    (x, gate_up, down, weights, ids), (x_d, gate_up_d, down_d) = problem(dtype, device)
    ref = fused_moe_ref(x, gate_up, down, weights, ids).float()
    for i, variant in enumerate(DECODE_TILE_CANDIDATES):
        down_variant = DECODE_TILE_CANDIDATES[(i + 1) % len(DECODE_TILE_CANDIDATES)]
        mark_decode_tiles(gate_up_d, variant, down_variant)
        out = fused_moe_triton(x_d, gate_up_d, down_d, weights.to(device), ids.to(device))
        assert relative_error(out.float().cpu(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5), (variant,
                                                                                                      down_variant)


def test_choice_is_cuda_only_and_can_be_turned_off(monkeypatch):
    """CPU tensors (and the interpreter: nothing to time from graphs) get no choice and no mark; on CUDA,
    $TRITONLLM_MOE_DECODE_TILES=0 times nothing either."""
    _, (_, gate_up, down) = problem(torch.float32, "cpu")
    assert choose_decode_tiles([(gate_up, down, TOP_K)]) == {}
    assert getattr(gate_up, DECODE_TILES_ATTR, None) is None
    monkeypatch.setenv(moe_decode_tiles.TILES_ENV, "0")
    monkeypatch.setattr(moe_decode_tiles, "time_decode_tiles", lambda *a: pytest.fail("timed"))
    assert choose_decode_tiles([(gate_up.to(torch.bfloat16), down.to(torch.bfloat16), TOP_K)]) == {}


@pytest.mark.gpu
def test_choice_marks_each_layer_of_the_shape_with_the_fastest():
    if not torch.cuda.is_available():
        pytest.skip("times CUDA graphs")
    layers = [problem(torch.bfloat16, "cuda", seed)[1][1:] for seed in (0, 1)]
    assert all(t.dtype == torch.bfloat16 for layer in layers for t in layer)
    reports = choose_decode_tiles([(gate_up, down, TOP_K) for gate_up, down in layers])
    (report,) = reports.values()
    assert report["gate_up"] == min(report["gate_up_us"], key=report["gate_up_us"].get) or report.get("cached")
    for gate_up, _ in layers:
        configs = getattr(gate_up, DECODE_TILES_ATTR)
        assert configs[0]["BLOCK_N"] == report["gate_up"][0] and configs[1]["BLOCK_N"] == report["down"][0]


@pytest.mark.gpu
def test_timing_runs_every_candidate_on_both_gemms(device, monkeypatch):
    """time_decode_tiles' calls (two expert sets, both GEMMs, each candidate) run; the timer is faked off
    CUDA (the interpreter has no graphs): the report's pick is the least time of each GEMM."""
    if device != "cuda":
        from kernels import linear

        timed = iter(DECODE_TILE_CANDIDATES * 2)  # (the order they are timed in: gate_up's, then down's)
        calls = []

        def graph_time_ms(fn):  # the last candidate fastest
            calls.append(fn())
            return float(len(DECODE_TILE_CANDIDATES) - DECODE_TILE_CANDIDATES.index(next(timed)))
        monkeypatch.setattr(linear, "graph_time_ms", graph_time_ms)
    _, (_, gate_up, down) = problem(torch.bfloat16 if device == "cuda" else torch.float32, device)
    report = moe_decode_tiles.time_decode_tiles(gate_up, down, TOP_K)
    for name in ("gate_up", "down"):
        assert set(report[name + "_us"]) == set(DECODE_TILE_CANDIDATES)
        assert report[name] == min(report[name + "_us"], key=report[name + "_us"].get)
    if device != "cuda":
        assert len(calls) == 2 * len(DECODE_TILE_CANDIDATES) and report["gate_up"] == DECODE_TILE_CANDIDATES[-1]
