"""kernels/triton_attention.py's sm_90 prompt tiles (PREFILL_SM90_TILINGS, issue 51): on a GPU of capability 9.0 a
16-bit pool's prompt chunks take 128 x 128 tiles over 8 warps, 3 stages at every context length, so a tile covers
128 // group tokens there; the tile maps count in the same rows (prefill_tokens_per_tile with the device), and
everything else (no device, other GPUs, FP8 pools, heads of 256, groups over 64) keeps its tiles. Launches in those
rows, through a tile map as the runner builds it, compute the reference's attention (Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error, triton_device
from test_kernel_attention import make_batch

from benchmarks.kernels import attention_kernel_bench as bench
import kernels._triton
from kernels import triton_attention as ta

CUDA = torch.device("cuda", 0)
DEVICE = triton_device()


def fake_capability(monkeypatch, capability: tuple[int, int]) -> None:
    """CUDA device 0 reads as ``capability`` through the lookup _is_sm90 makes (kernels/_triton.py
    device_capability, its cache emptied)."""
    monkeypatch.setattr(kernels._triton, "_CAPABILITIES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)


def test_sm90_16_bit_pools_take_128_row_tiles(monkeypatch):
    fake_capability(monkeypatch, (9, 0))
    assert ta.PREFILL_SM90_TILINGS == {2: (128, 128, 8, 3)}
    assert ta._prefill_config(4, 128, 2, CUDA) == (128, 128, 8, 3, 1)
    assert ta._prefill_config(4, 64, 2, CUDA) == (128, 128, 8, 3, 1)  # heads narrower than 128 too
    for group in (1, 4, 8, 64):  # Llama-8B's 4: 32 tokens a tile (16 without the device)
        assert ta.prefill_tokens_per_tile(group, 128, 2, CUDA) == 128 // group
        assert ta.prefill_tokens_per_tile(group, 128, 2) == 64 // group
    # unchanged: FP8 and fp32 pools, heads of 256, groups over 64 (their own rows already), and no device
    for args in ((4, 128, 1), (4, 128, 4), (4, 256, 2), (128, 128, 2)):
        assert ta._prefill_config(*args, CUDA) == ta._prefill_config(*args), args
    assert ta._prefill_config(4, 128, 2) == (64, 64, 4, 2, 1)
    assert ta._prefill_config(4, 128, 1) == (128, 128, 8, 2, 1)
    assert ta._prefill_config(4, 128, 2, torch.device("cpu")) == (64, 64, 4, 2, 1)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0), (9, 1)])
def test_other_gpus_keep_the_default_tiles(monkeypatch, capability):
    fake_capability(monkeypatch, capability)
    for args in ((4, 128, 2), (4, 128, 1), (1, 64, 2)):
        assert ta._prefill_config(*args, CUDA) == ta._prefill_config(*args), args
    assert ta.prefill_tokens_per_tile(4, 128, 2, CUDA) == 16


def test_sm90_short_steps_keep_the_tile_maps_rows_with_the_64_row_threads_share(monkeypatch):
    """A short step's split launch shares the prompt tiles' map: 128 rows on sm_90, 64 keys over 8 warps, 2 stages
    (a thread's share of the 64 x 64 x 4 x 2 tiling); "short" (64 rows) cannot apply there; FP8 pools as before."""
    fake_capability(monkeypatch, (9, 0))
    assert ta._short_step_config(4, 128, 2, CUDA) == (128, 64, 8, 2)
    monkeypatch.setenv(ta.SHORT_STEP_TILING_ENV, "short")
    assert ta._short_step_config(4, 128, 2, CUDA) == (128, 64, 8, 2)
    assert ta._short_step_config(4, 128, 2) == (64, 32, 8, 3)  # elsewhere "short" still applies
    assert ta._short_step_config(4, 128, 1, CUDA) == ta._short_step_config(4, 128, 1) == (128, 128, 8, 2)


def test_sm90_needs_a_cuda_device_of_capability_9_0(monkeypatch):
    assert not ta._is_sm90(torch.device("cpu"))
    fake_capability(monkeypatch, (9, 0))
    assert ta._is_sm90(CUDA)
    fake_capability(monkeypatch, (8, 0))
    assert not ta._is_sm90(CUDA)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's run of the sm_90 rows; a GPU lane runs them on the GPU")
@pytest.mark.parametrize("short_step", ["unsplit", "split"])
def test_sm90_rows_through_a_tile_map_match_the_reference(monkeypatch, short_step):
    """Group 4 (8 query heads, 2 KV heads of 32), a 16-bit pool, sm_90 faked for the CPU device: 32 tokens a tile. A
    70-token chunk over 230 keys (three tiles, the last partial), a 37-token prompt, decode rows, and padding sequence
    rows, through a tile map of the prefill graphs' length (PrefillGraphs.num_tiles) counted as the runner counts it;
    "unsplit" the prompt tiles' own launch (128 x 128 x 8 x 3), "split" a short step's (128 x 64 x 8 x 2)."""
    from engine.executor.prefill_graphs import tile_map
    from kernels.attention import paged_attention_ref, write_kv_cache_ref
    from kernels.attention_metadata import AttentionMetadata

    monkeypatch.setattr(ta, "_is_sm90", lambda device: True)
    if short_step == "unsplit":
        monkeypatch.setattr(ta, "SHORT_STEP_PROGRAMS", 0)
    short_configs = []  # the short-step configs the launches asked for
    monkeypatch.setattr(ta, "_short_step_config",
                        lambda *a, _f=ta._short_step_config: short_configs.append(_f(*a)) or short_configs[-1])
    num_heads, num_kv_heads, head_dim, dtype = 8, 2, 32, torch.float16
    cases = [(160, 70), (299, 1), (0, 37), (40, 1)]
    k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 16, dtype, "cpu", seed=11)
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=torch.Generator().manual_seed(12)).to(dtype)
    want = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)

    per_tile = ta.prefill_tokens_per_tile(num_heads // num_kv_heads, head_dim, k_cache.element_size(), k_cache.device)
    assert per_tile == 32
    padding, tokens = 2, k.shape[0]
    q_lens = [n for _, n in cases] + [0] * padding
    tile_seq, tile_m = tile_map(q_lens, per_tile, -(-tokens // per_tile) + len(q_lens))
    assert tile_seq.tolist()[:6] == [0, 0, 0, 1, 2, 2] and tile_m.tolist()[:6] == [0, 1, 2, 0, 0, 1]
    table = meta.block_tables
    graph_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping, cu_seqlens_q=torch.tensor(meta.cu_seqlens_q_host + [tokens] * padding,
                                                                  dtype=torch.int32),
        block_tables=torch.cat([table, torch.zeros(padding, table.shape[1], dtype=table.dtype)]),
        context_lens=torch.tensor(meta.context_lens_host + [0] * padding, dtype=torch.int32),
        max_seqlen_q=tokens, max_context_len=256, is_decode_only=False,
        tile_seq=torch.from_numpy(tile_seq), tile_m=torch.from_numpy(tile_m), tile_tokens=per_tile)
    got = ta.paged_attention_triton(q, k_cache, v_cache, graph_meta, head_dim ** -0.5)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert short_configs == ([(128, 64, 8, 2)] if short_step == "split" else [])
    # and eagerly (no map: the grid counts 32-token tiles too)
    assert relative_error(ta.paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5), want) < TOLERANCE[dtype]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's check of the wrapper; no kernel runs")
def test_a_tile_map_counted_in_other_rows_is_refused(monkeypatch):
    """A map counted without the device (16 tokens a tile) for sm_90's 32-token tiles: the wrapper refuses it."""
    from engine.executor.prefill_graphs import tile_map

    monkeypatch.setattr(ta, "_is_sm90", lambda device: True)
    k, v, k_cache, v_cache, meta = make_batch([(0, 40)], 2, 32, 16, torch.float16, "cpu", seed=1)
    tile_seq, tile_m = tile_map([40], 16, 4)
    meta.tile_seq, meta.tile_m, meta.tile_tokens = torch.from_numpy(tile_seq), torch.from_numpy(tile_m), 16
    with pytest.raises(AssertionError, match="16-token tiles for 32-token prompt tiles"):
        ta.paged_attention_triton(torch.zeros(40, 8, 32, dtype=torch.float16), k_cache, v_cache, meta, 1.0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the bench's own CUDA runs are the GPU lane's")
def test_the_bench_names_and_checks_the_sm90_default(monkeypatch):
    """attention_kernel_bench's prompt case on a bf16 pool, sm_90 faked: the launch (and its tile map) in
    128 x 128 x 8 x 3, against the reference; --sweep_prefill's forcing still takes the old tiles."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(ta, "_is_sm90", lambda device: True)
    row = bench.run_case("chunk 40 over 56", "bf16", check=True)
    assert row["config"] == "128x128x8x3" and row["check"] == "ok", row
    with bench.forced("_prefill_config", lambda default: (64, 64, 4, 2, 1)):
        row = bench.run_case("chunk 40 over 56", "bf16", "prefill 64:64:4:2", check=True)
    assert row["config"] == "64x64x4x2" and row["check"] == "ok", row
