"""attention_kernel_bench.py's prompt-chunk cases of 20000/2000 (issue 51): the chunks' shapes, the causal work they
count, the pivot table the GPU lane prints, and a swept tiling's run checked against the torch reference (under
Triton's interpreter, tiny shapes)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.kernels import attention_kernel_bench as bench


def test_a_20k_prompt_is_chunks_of_8192_8192_and_3616_each_ending_at_its_context():
    batches = [bench.case_batch(name) for name in bench.PROMPT_CHUNKS_20K]
    assert batches == [[(0, 8192)], [(8192, 8192)], [(11808, 8192)], [(16384, 3616)]]
    assert bench.case_batch("chunk 8192 over 20000") == bench.CASES["chunk 8192 over 12k"]
    assert bench.case_batch("chunk 64 over 96") == [(32, 64)]  # any chunk by name
    with pytest.raises(AssertionError):
        bench.case_batch("chunk 96 over 64")


def test_the_work_counts_each_visible_query_key_pair_once():
    # 4 * q_len * (average visible keys) * head_dim * heads: a chunk of n over c earlier keys sees c + (j + 1) keys
    # at its j-th token, n * c + n (n + 1) / 2 pairs
    flops, _ = bench.work([(11808, 8192)], 1)
    pairs = sum(11808 + j + 1 for j in range(8192))
    assert flops == 4.0 * bench.HEAD_DIM * bench.NUM_HEADS * pairs
    # one 20k prompt (its three chunks; "over 20000" is the worst-placed 8,192, not one of them): ~1.0e14 FLOPs
    # over 32 layers, as issue 51 counts
    chunks = ("chunk 8192 over 8192", "chunk 8192 over 16384", "chunk 3616 over 20000")
    whole = sum(bench.work(bench.case_batch(name), 1)[0] for name in chunks)
    assert whole == 4.0 * 128 * 32 * 20000 * 20001 / 2
    assert 1.0e14 < whole * 32 < 1.1e14


def test_the_pivot_names_the_default_tiling_and_each_candidate_speed_up():
    rows = [{"case": "a", "pool": "fp8", "tiling": "default", "us": 100.0, "tflops": 400.0, "config": "128x128x8x2"},
            {"case": "a", "pool": "fp8", "tiling": "prefill 128:64:8:3", "us": 80.0, "tflops": 500.0,
             "config": "128x64x8x3", "check": "ok"},
            {"case": "a", "pool": "fp8", "tiling": "prefill 256:128:8:4", "us": float("nan"), "tflops": float("nan"),
             "config": "256x128x8x4", "error": "OutOfResources: shared memory"},
            {"case": "a", "pool": "bf16 dense", "tiling": "sdpa flash lower-right", "us": 50.0, "tflops": 800.0,
             "config": "-"}]
    lines = bench.pivot_table(rows)
    assert lines[0] == "| pool | tiling | a |"
    assert lines[2] == "| fp8 | default 128x128x8x2 | 100 us 400 TF |"
    assert lines[3] == "| fp8 | prefill 128:64:8:3 | 80 us 500 TF (1.25x) |"
    assert lines[4] == "| fp8 | prefill 256:128:8:4 | error |"
    assert lines[5] == "| bf16 dense | sdpa flash lower-right | 50 us 800 TF |"


@pytest.mark.parametrize("pool", ["fp8", "bf16"])
def test_a_swept_prompt_tiling_runs_the_case_and_matches_the_reference(device, pool, monkeypatch):
    if device != "cpu":
        pytest.skip("the bench's own CUDA runs are the GPU lane's")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    with bench.forced("_prefill_config", lambda default: (64, 32, 4, 2, 1)):
        row = bench.run_case("chunk 40 over 56", pool, "prefill 64:32:4:2", check=True)
    assert row["config"] == "64x32x4x2" and row["check"] == "ok", row
    row = bench.run_case("chunk 40 over 56", pool, check=True)  # the default tiling, named
    from kernels.triton_attention import _prefill_config

    assert row["config"] == "x".join(map(str, _prefill_config(4, 128, 1 if pool == "fp8" else 2)[:4]))
    assert row["check"] == "ok", row
