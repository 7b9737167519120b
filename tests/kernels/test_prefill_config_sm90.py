"""kernels/triton_attention.py's sm_90 prompt-chunk tilings (PREFILL_SM90_TILINGS, issue 51): an entry replaces the
keys, warps and stages of _prefill_config for a prompt-chunk launch on an sm_90 GPU over long contexts only, never
BLOCK_M (the tile maps' unit), and a launch in such a tiling still computes the reference's attention."""
from __future__ import annotations

import torch

from benchmarks.kernels import attention_kernel_bench as bench
from kernels import triton_attention as ta

CUDA = torch.device("cuda", 0)


def test_without_an_entry_every_launch_keeps_the_default():
    assert ta.PREFILL_SM90_TILINGS == {}  # filled only from a measured H200 lane (the table's comment)
    for itemsize in (1, 2):
        assert ta._prefill_config(4, 128, itemsize, CUDA, 20000) == ta._prefill_config(4, 128, itemsize)


def test_an_entry_applies_on_sm90_over_long_contexts_only(monkeypatch):
    monkeypatch.setattr(ta, "PREFILL_SM90_TILINGS", {1: (64, 8, 3)})
    monkeypatch.setattr(ta, "_is_sm90", lambda device: device.type == "cuda")
    base = ta._prefill_config(4, 128, 1)
    assert base == (128, 128, 8, 2, 1)
    assert ta._prefill_config(4, 128, 1, CUDA, ta.PREFILL_SM90_MIN_KEYS) == (128, 64, 8, 3, 1)
    assert ta._prefill_config(4, 128, 1, CUDA, ta.PREFILL_SM90_MIN_KEYS - 1) == base  # short contexts
    assert ta._prefill_config(4, 128, 1, torch.device("cpu"), 20000) == base  # not sm_90
    assert ta._prefill_config(4, 128, 1) == base  # no device: prefill_tokens_per_tile, the short-step configs
    assert ta._prefill_config(4, 128, 2, CUDA, 20000) == ta._prefill_config(4, 128, 2)  # no bf16 entry
    assert ta._prefill_config(4, 256, 1, CUDA, 20000) == ta._prefill_config(4, 256, 1)  # heads of 256 keep theirs
    assert ta._prefill_config(16, 128, 1, CUDA, 20000)[0] == ta._prefill_config(16, 128, 1)[0]  # BLOCK_M never moves


def test_sm90_needs_a_cuda_device_of_capability_9_0():
    assert not ta._is_sm90(torch.device("cpu"))


def test_a_launch_in_the_entry_tiling_matches_the_reference(device, monkeypatch):
    if device != "cpu":
        return  # the GPU lane times and checks it on the device (benchmarks/engine/lanes/s32_c2/fa51.sh)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(ta, "PREFILL_SM90_TILINGS", {1: (64, 8, 3), 2: (128, 4, 3)})
    monkeypatch.setattr(ta, "PREFILL_SM90_MIN_KEYS", 0)
    monkeypatch.setattr(ta, "_is_sm90", lambda device: True)
    # 16 query tiles x 8 KV heads: a chunk's own launch (fewer programs make a short step, which splits its keys in
    # the default tiling: _short_step_config)
    for pool, tiling, tokens in (("fp8", "128x64x8x3", 16 * 32), ("bf16", "64x128x4x3", 16 * 16)):
        row = bench.run_case(f"chunk {tokens} over {tokens + 8}", pool, check=True)
        assert row["config"] == tiling and row["check"] == "ok", row
