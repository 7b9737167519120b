"""Decode key splits of any count (issue 51): the opt-in policy $TRITONLLM_DECODE_SPLIT_POLICY=h200-any, whose cost
(kernels/triton_attention.py _decode_split_cost) picks among every count 1..8 where "h200" (the default) picks among
powers of two, and the merge of a split count that is not a power of two (_merge_splits_kernel pads its range).

The policy cases are CPU arithmetic: Llama-8B's 8 KV heads, 132 SMs, 4 programs an SM (the FP8 keys-major tiling 64 x
2 x 5: ~51.8 KB of shared memory a program), so 528 at once. The numerical cases force 3, 5, 6 and 7 splits through
the default decode kernel and the keys-major one (kernels/keys_major_decode.py), FP8 and 16-bit pools, tiny shapes:
CPU under TRITON_INTERPRET=1, or CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.attention import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, registers, resource_usage_or_skip, stack_bytes, \
    strides_but_block_table
from test_keys_major_decode import decode_case as keys_major_decode_case, fp8_pool_kernel_pointers

triton_attention = pytest.importorskip("kernels.triton_attention")
keys_major = pytest.importorskip("kernels.keys_major_decode")
POLICY = triton_attention.DECODE_SPLIT_POLICY_ENV
SMS, KV_HEADS, RESIDENT = 132, 8, 4
CAPACITY = SMS * RESIDENT  # 528 programs at once


def chosen(seqs: int, keys: int, resident: int = RESIDENT, kv_heads: int = KV_HEADS) -> int:
    return triton_attention._decode_num_splits(seqs, kv_heads, keys, SMS, 64, resident)


def slot_use(programs: int) -> float:
    """The share of the slots of the waves ``programs`` take (CAPACITY a wave) that hold a program."""
    waves = -(-programs // CAPACITY)
    return programs / (waves * CAPACITY)


def test_h200_any_picks_the_count_of_least_cost_among_every_count(monkeypatch):
    """At 20000/2000's plateau (91 sequences x ~21k keys: 728 programs a split) "h200-any" takes 5 splits: 3,640
    programs in 6.89 waves, 98.5% of their slots used, where "h200" takes 2 (1,456 programs, 2.76 waves, 92%). At 85
    and 100 sequences, where "h200" takes 16 (which a decode graph clamps to 4), it takes 3 (2,040 programs, 3.86 waves,
    97%) and 7 (5,600, 10.6 waves, 96%). Each is the least of _decode_split_cost over 1..8 at the policy's floor."""
    monkeypatch.setenv(POLICY, "h200-any")
    floor = 3.5 * SMS  # "h200"'s floor: 3.5 programs an SM
    expected = {91: 5, 85: 3, 100: 7}
    for seqs, splits in expected.items():
        programs = seqs * KV_HEADS
        costs = {n: triton_attention._decode_split_cost(programs, n, CAPACITY, 21000, floor) for n in range(1, 9)}
        assert min(costs, key=costs.get) == splits == chosen(seqs, 21000), (seqs, costs)
    assert 91 * KV_HEADS * 5 == 3640 and round(3640 / CAPACITY, 2) == 6.89 and round(slot_use(3640), 3) == 0.985
    assert 91 * KV_HEADS * 2 == 1456 and round(1456 / CAPACITY, 2) == 2.76 and round(slot_use(1456), 2) == 0.92
    assert round(slot_use(85 * KV_HEADS * 3), 2) == 0.97 and round(slot_use(100 * KV_HEADS * 7), 2) == 0.96
    monkeypatch.setenv(POLICY, "h200")
    assert [chosen(seqs, 21000) for seqs in expected] == [2, 16, 16]


# (sequences, KV heads, keys, programs an SM or None (the tiling not yet run)) -> "h200"'s count, as the policy chose
# before any count existed (kernels/triton_attention.py at fa4d22f9): 872,640 cases over 1-299, 384-1,024 sequences,
# 1-8 KV heads, 100-131,072 keys, 1-8 an SM and 78 / 132 SMs checked equal once; these stay here.
H200_CHOICES = [
    ((1, 8, 8192, None), 16), ((8, 8, 20480, None), 8), ((8, 8, 20480, 4), 8), ((32, 8, 21000, 4), 2),
    ((48, 8, 21000, 4), 4), ((48, 8, 21000, 5), 8), ((48, 8, 21000, 3), 1), ((64, 8, 20480, 4), 1),
    ((64, 8, 20480, 3), 16), ((85, 8, 21000, 4), 16), ((91, 8, 21000, 4), 2), ((91, 8, 21000, 3), 8),
    ((100, 8, 21000, 4), 16), ((100, 8, 21000, 5), 4), ((128, 8, 20480, 4), 1), ((128, 8, 20480, 5), 16),
    ((194, 8, 5250, 4), 1), ((208, 8, 5250, 4), 1), ((256, 8, 20480, 4), 1), ((256, 8, 2048, 5), 1),
    ((1, 8, 100, 4), 1), ((3, 2, 9000, 4), 16), ((40, 4, 3000, 4), 2), ((150, 4, 8192, 4), 4),
]


def test_the_powers_of_two_policy_chooses_as_before(monkeypatch):
    """"h200" (the default until "h200-any" was measured) and "h100" choose what they chose when only powers of two
    existed: the cost's per-count term log2(splits) is the per-doubling one at powers of two, and their candidates
    are still 1, 2, 4, ..."""
    monkeypatch.setenv(POLICY, "h200")
    for (seqs, heads, keys, resident), splits in H200_CHOICES:
        assert chosen(seqs, keys, resident, heads) == splits, (seqs, heads, keys, resident)
    for splits in (1, 2, 4, 8, 16):
        for programs, keys in ((728, 21000), (384, 5250), (2048, 300)):
            per_doubling = triton_attention._decode_split_cost(programs, splits, CAPACITY, keys, 462.0)
            slots = (programs * splits // CAPACITY) * CAPACITY + max(programs * splits % CAPACITY, 462.0) * (
                programs * splits % CAPACITY > 0)
            assert per_doubling == slots / splits * (1.0 + 210 / keys * (splits.bit_length() - 1))
    monkeypatch.setenv(POLICY, "h100")
    assert chosen(208, 5250) == 4 and chosen(48, 21000) == 1 and chosen(96, 6000) == 2


def test_split_counts_and_captured_splits_by_policy(monkeypatch):
    """"h200-any": every count up to min(most, 8), and mid-size decode graphs capture 8 (their replays take 3, 5, 6,
    7 too); "h200": powers of two up to most, graphs capture DYNAMIC_SPLITS_CAPTURED (4). Either way the covering
    rule (a batch of fewer programs than twice the SMs, or a tiling not yet run) keeps powers of two."""
    monkeypatch.setenv(POLICY, "h200-any")
    assert triton_attention.split_counts(16) == list(range(1, 9))
    assert triton_attention.split_counts(4) == [1, 2, 3, 4] and triton_attention.split_counts(1) == [1]
    assert triton_attention.captured_splits() == 8
    assert chosen(8, 20480) == 8 and chosen(91, 21000, resident=None) == 1 and chosen(1, 8192) == 16
    monkeypatch.delenv(POLICY, raising=False)  # the default since split51.sh's H200 figures (2026-12-02)
    assert triton_attention.captured_splits() == 8 and chosen(91, 21000) == 5
    monkeypatch.setenv(POLICY, "h200")
    assert triton_attention.split_counts(16) == [1, 2, 4, 8, 16]
    assert triton_attention.captured_splits() == triton_attention.DYNAMIC_SPLITS_CAPTURED == 4
    monkeypatch.setenv(POLICY, "h200-all")
    with pytest.raises(ValueError, match="h200-any"):
        triton_attention.split_counts(16)


def test_h200_any_graph_captures_8_splits_and_replays_take_the_cost_count(monkeypatch):
    """A decode graph's capture of a mid-size bucket (meta.decode_splits set) under "h200-any" captures 8 splits and
    records its plan; a replay of 91 sequences over 21,000 keys then asks for 5 (decode_active_splits), one of 85 for
    3 and of 100 for 7, all within the grid. Under "h200" the same capture holds 4 and the replays ask for 2, 16, 16
    (the kernel clamps 16 to the grid's 4)."""
    monkeypatch.setattr(triton_attention, "num_sms", lambda device: SMS)
    monkeypatch.delenv(triton_attention.FP8_WIDEN_ENV, raising=False)
    monkeypatch.delenv(keys_major.DECODE_KEYS_MAJOR_ENV, raising=False)
    monkeypatch.setattr(triton_attention, "_DECODE_RESIDENT", {})
    device = torch.device("cpu")
    tiling = triton_attention._decode_tiling(128, 16, False, 1, False)
    assert tiling[:3] == (64, 2, 5)
    widening = triton_attention.fp8_widening(tiling[0])
    key = triton_attention._decode_tiling_key(device, 16, tiling, 128, 1, widening, keys_major=True)
    triton_attention._DECODE_RESIDENT[key] = RESIDENT

    def captured(num_seqs):
        meta = AttentionMetadata(slot_mapping=None, block_tables=None, cu_seqlens_q=None,
                                 context_lens=torch.zeros(num_seqs), max_seqlen_q=1, max_context_len=32768,
                                 is_decode_only=True, decode_splits=torch.ones(1, dtype=torch.int32))
        splits = triton_attention._decode_config(meta, 4, KV_HEADS, device, None, None, 128, 1, plain_decode=True)[4]
        return meta.decode_split_plan, splits

    for policy, grid_splits, replays in (("h200-any", 8, [5, 3, 7]), ("h200", 4, [2, 16, 16])):
        monkeypatch.setenv(POLICY, policy)
        plan, splits = captured(128)
        assert plan == (KV_HEADS, CAPACITY, SMS) and splits == grid_splits, (policy, plan, splits)
        assert [triton_attention.decode_active_splits(plan, n, 21000) for n in (91, 85, 100)] == replays


# Contexts of 1 key, a page, 5 tiles of 64 keys (so 6 and 7 splits leave empty ones) and 11 tiles.
BATCH = [(0, 1), (15, 1), (298, 1), (700, 1)]
HEADS = (8, 2, 64)  # a group of 4, as Llama-8B's


def decode_case(device: str, pool: str, seed: int = 0):
    """test_keys_major_decode's case over this file's BATCH and HEADS."""
    return keys_major_decode_case(device, HEADS, pool, seed=seed, batch=BATCH)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["16-bit", "fp8"])
@pytest.mark.parametrize("kernel", ["default", "keys-major"])
def test_any_split_count_matches_the_reference_and_one_split(device, monkeypatch, pool, kernel):
    """3, 5, 6 and 7 forced splits (the merge's range padded to 4 / 8, the padded splits weighted 0) give the
    reference's attention and the 1-split launch's, through either decode kernel."""
    monkeypatch.setenv(keys_major.DECODE_KEYS_MAJOR_ENV, "1" if kernel == "keys-major" else "0")
    q, k_cache, v_cache, meta = decode_case(device, pool, seed=2)
    scale = HEADS[2] ** -0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    one = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=1)
    assert relative_error(one, ref) < TOLERANCE[torch.bfloat16]
    for splits in (3, 5, 6, 7):
        out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=splits)
        assert torch.isfinite(out).all(), splits
        assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], (splits, relative_error(out, ref))
        assert relative_error(out, one) < TOLERANCE[torch.bfloat16], (splits, relative_error(out, one))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["default", "keys-major"])
@pytest.mark.parametrize("grid_splits,active", [(8, 3), (8, 5), (8, 7), (6, 16), (5, 3)])
def test_a_graph_replay_takes_any_count_within_any_grid(device, monkeypatch, kernel, grid_splits, active):
    """A decode graph's launch of ``grid_splits`` splits whose replay asks for ``active`` (DYNAMIC_SPLITS): 3, 5 or 7
    of "h200-any"'s 8, and grids that are not a power of two themselves; a count past the grid (16 of 6, as the
    warm-ups ask) is clamped to it by the attention kernel and the merge alike (the merge's padded splits 6 and 7
    are never read). FP8 pool, matches the reference."""
    monkeypatch.setenv(keys_major.DECODE_KEYS_MAJOR_ENV, "1" if kernel == "keys-major" else "0")
    q, k_cache, v_cache, meta = decode_case(device, "fp8", seed=4)
    meta.decode_splits = torch.tensor([active], dtype=torch.int32, device=device)
    meta.decode_split_plan = (HEADS[1], CAPACITY, SMS)
    scale = HEADS[2] ** -0.5
    out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=grid_splits)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)


def test_the_bench_takes_any_split_count_the_any_policy_and_replays():
    """benchmarks/kernels/attention_kernel_bench.py --grid_more words of the split lane (s32_c2/split51.sh): splits=N
    for any N >= 1, policy=h200-any (a policy it does not know fails at parse time, not mid-run), replay; and the
    rows' wave columns: 91 x 8 x 5 = 3,640 programs at 4 an SM on 132 SMs are 6.89 waves, 98.5% of their slots."""
    from benchmarks.kernels import attention_kernel_bench as bench

    for n in range(1, 9):
        assert bench.parsed_variant(f"splits={n}")[2] == n
    label, env, splits, rotary, tiling, replay = bench.parsed_variant("policy=h200-any replay rotary")
    assert env[POLICY] == "h200-any" and splits is None and rotary and replay and tiling is None
    assert bench.parsed_variant("tile=64:2:4 splits=5")[2:5] == (5, False, (64, 2, 4, False))
    for bad in ("policy=h300", "splits=0", "splits=x", "replays"):
        with pytest.raises(ValueError):
            bench.parsed_variant(bad)
    assert bench.wave_columns(91, 5, 4, "cpu") == {"programs": 3640, "resident": 4, "waves": 6.89, "slot_use": 0.985}
    assert bench.wave_columns(91, 2, 4, "cpu") == {"programs": 1456, "resident": 4, "waves": 2.76, "slot_use": 0.919}
    assert bench.wave_columns(91, 2, None, "cpu")["waves"] is None


@AOT_SM90
@pytest.mark.parametrize("splits,dynamic", [(5, False), (7, True), (8, True), (4, False)])
def test_the_padded_merge_and_a_5_split_keys_major_launch_compile_for_sm90(splits, dynamic, tmp_path):
    """The merge of ``splits`` partials (its range padded to a power of two: SPLITS_PAD) and, beside it, the FP8
    keys-major decode kernel at 5 splits (a dynamic grid of them too) compile for sm_90 and spill nothing."""
    merge_pointers = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
                      "cu_seqlens_q_ptr": "*i32", "active_splits_ptr": "*i32"}
    const = dict(HEAD_DIM=128, DIM_PAD=128, NUM_SPLITS=splits, BY_SEQUENCE=False, DYNAMIC_SPLITS=dynamic, PDL=False,
                 SPLITS_PAD=triton_attention.merge_splits_pad(splits))
    merge = compile_for_sm90(triton_attention._merge_splits_kernel, merge_pointers, const, warps=1)
    usage = resource_usage_or_skip(merge, Path(tmp_path))
    assert stack_bytes(usage) == 0 and "LOCAL:0" in usage, usage
    k_bits, v_widen = triton_attention.fp8_widening(64)
    pointers = fp8_pool_kernel_pointers()
    const = dict(GROUP=4, G_PAD=keys_major.keys_major_columns(4), HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=32,
                 BLOCK_N=64, NUM_SPLITS=5, PRECISION="tf32", FP16_MATH=True, ROTARY_APPEND=False, ROTATE=False,
                 DYNAMIC_SPLITS=dynamic, PDL=False, K_BITS=k_bits, V_WIDEN=v_widen, ASM=True)
    compiled = compile_for_sm90(keys_major._keys_major_decode_kernel, pointers, const, warps=2, stages=5,
                                floats=("qk_scale",), aligned_int=strides_but_block_table)
    usage = resource_usage_or_skip(compiled, Path(tmp_path))
    assert stack_bytes(usage) == 0 and "LOCAL:0" in usage and registers(usage) <= 255, usage
