"""kernels/keys_major_decode.py, the decode attention with the keys as the products' rows (the default for FP8 pools
in the 64-key 2-warp tiling; $TRITONLLM_DECODE_KEYS_MAJOR=0 / 1 force it off / on), against the torch reference and
against the default decode kernel; where it runs by default and the splits it takes (its own residency).

Cases: Llama-8B's heads (group 4, 128 dims), a group of 8 and of 1 (MHA, a head_dim that is not a power of two);
16-bit (bf16; fp16 under the interpreter) and FP8 pools; contexts of 1 key, a page exactly, a page and one, a partial last page deep in the last split;
splits 1 and 4 and the policy's; a decode graph's dynamic splits; the served rotary-append form (the same cache
bytes as the default kernel's). CPU under TRITON_INTERPRET=1, or CUDA. The sm_90 compile (TRITONLLM_AOT_SM90=1)
prints the registers and checks nothing spills."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.attention import KV_FP8_DTYPE, paged_attention_ref
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, registers, resource_usage_or_skip, stack_bytes, \
    strides_but_block_table
from test_kernel_attention import make_batch

triton_attention = pytest.importorskip("kernels.triton_attention")
keys_major = pytest.importorskip("kernels.keys_major_decode")
ENV = keys_major.DECODE_KEYS_MAJOR_ENV
# Contexts of 1 key, a page exactly, a page and one, and a partial last page (page 16).
BATCH = [(0, 1), (15, 1), (16, 1), (298, 1)]
HEADS = {"llama-8b": (32, 8, 128), "group 8": (16, 2, 64), "group 1": (3, 3, 48)}


def activation_dtype(device: str) -> torch.dtype:
    """bfloat16 on CUDA; float16 under the interpreter, whose bfloat16 dots are wrong (kernel_testing)."""
    return torch.bfloat16 if device == "cuda" else torch.float16


def decode_case(device: str, heads: tuple, pool: str, seed: int = 0, batch: list | None = None):
    """(q, k_cache, v_cache, meta) of ``batch`` (BATCH unless given; (cached, new) tokens a sequence): a 16-bit pool
    of q's dtype, or an FP8 one (random values as E4M3 codes, scale 1) read with fp16 math."""
    batch = BATCH if batch is None else batch
    num_heads, num_kv_heads, head_dim = heads
    dtype = activation_dtype(device)
    _, _, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, dtype, device, seed=seed)
    if pool == "fp8":
        k_cache, v_cache = (c.float().clamp(-448, 448).to(KV_FP8_DTYPE) for c in (k_cache, v_cache))
    q = torch.randn(len(batch), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype).to(device), k_cache, v_cache, meta


def both_kernels(monkeypatch, run) -> tuple[torch.Tensor, torch.Tensor]:
    """run() with the switch off (the default kernel), then on (keys-major)."""
    monkeypatch.setenv(ENV, "0")
    default = run()
    monkeypatch.setenv(ENV, "1")
    return default, run()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("pool", ["16-bit", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_keys_major_decode_matches_the_reference_and_the_default_kernel(device, monkeypatch, heads, pool, num_splits):
    q, k_cache, v_cache, meta = decode_case(device, HEADS[heads], pool)
    scale = HEADS[heads][2] ** -0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    default, out = both_kernels(monkeypatch, lambda: triton_attention.paged_attention_triton(
        q, k_cache, v_cache, meta, scale, num_splits=num_splits))
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)
    assert relative_error(out, default) < TOLERANCE[torch.bfloat16], relative_error(out, default)


def keys_major_runs(monkeypatch) -> list[tuple]:
    """The configs of the keys-major launches paged_attention_triton makes from now on (the kernel still runs)."""
    runs = []
    launch = triton_attention._decode_keys_major

    def recorded(*args, **kwargs):
        runs.append(args[10])  # the decode config
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "_decode_keys_major", recorded)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["1", None])
@pytest.mark.parametrize("active", [1, 3])
def test_keys_major_decode_runs_the_splits_a_graph_replay_asks_for(device, monkeypatch, active, switch):
    """A decode graph's launch of 4 splits whose replay uses ``active`` of them (split-major programs, the merge
    reading only those), forced on and by default (an FP8 pool in the 64-key 2-warp tiling)."""
    q, k_cache, v_cache, meta = decode_case(device, HEADS["group 8"], "fp8", seed=3)
    meta.decode_splits = torch.tensor([active], dtype=torch.int32, device=device)
    meta.decode_split_plan = (2, 528, 132)
    if switch is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, switch)
    runs = keys_major_runs(monkeypatch)
    out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, 64**-0.5, num_splits=4)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 64**-0.5)
    assert [config[1:5] for config in runs] == [(64, 2, 5, 4)]
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["16-bit", "fp8"])
@pytest.mark.parametrize("launch", ["split", "one split", "large-batch tiles"])
@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_decode_takes_the_keys_major_kernel_where_the_switch_and_tiling_say(device, monkeypatch, pool, launch, switch):
    """Unset ("auto"): FP8 pools in the 64-key 2-warp tiling run the keys-major kernel, split or not; the FP8
    large-batch tiling (32 x 1 x 3, FP8_SHORT_CONTEXT_BATCH lowered so 4 sequences take it) the default kernel;
    16-bit pools (64 x 4 x 3) the keys-major kernel when the launch splits the keys (4 sequences of 2 KV heads over
    299 keys: 2 splits), else the default kernel. "0": never; "1": always. Each within bf16's rounding of the
    reference."""
    if switch is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, switch)
    monkeypatch.delenv(triton_attention.FP8_WIDEN_ENV, raising=False)
    if launch == "large-batch tiles":
        monkeypatch.setattr(triton_attention, "FP8_SHORT_CONTEXT_BATCH", 2)
    q, k_cache, v_cache, meta = decode_case(device, HEADS["group 8"], pool, seed=7)
    runs = keys_major_runs(monkeypatch)
    out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, 64**-0.5,
                                                  num_splits=1 if launch == "one split" else None)
    if pool == "fp8":
        by_default = launch != "large-batch tiles"
    else:
        by_default = launch != "one split"
    expected = switch == "1" or (switch is None and by_default)
    assert len(runs) == expected, runs
    if expected and switch is None:
        assert runs[0][1:3] == ((64, 2) if pool == "fp8" else (64, 4))
        assert pool == "fp8" or runs[0][4] > 1
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 64**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compiled kernel's resources exist on CUDA only")
def test_keys_major_launch_records_its_own_residency(monkeypatch):
    """The keys-major kernel's first launch of a tiling records its programs an SM under its own _DECODE_RESIDENT key
    (the default kernel, which did not run, records nothing), and the next launch of that tiling still matches."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(triton_attention, "_DECODE_RESIDENT", {})
    q, k_cache, v_cache, meta = decode_case("cuda", HEADS["llama-8b"], "fp8", seed=11)
    for _ in range(2):
        out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, 128**-0.5)
    recorded = triton_attention._DECODE_RESIDENT
    assert recorded and all(key[-1] is True and key[2:4] == (64, 2) for key in recorded), recorded
    assert all(1 <= n <= 32 for n in recorded.values()), recorded
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 128**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)


def test_the_default_choice_goes_by_pool_math_tiling_splits_and_layer(monkeypatch):
    """keys_major_decode_chosen: unset or "auto" -> FP8 pools under 16-bit queries in the 64-key 2-warp tiling (any
    stages, split or not, no TMA), 16-bit pools in 64 x 4 x 3 when split; not the 32 x 1 x 3 / 32 x 1 x 6 TMA /
    32 x 4 x 2 FP8 tilings, 4-warp FP8 ones, an unsplit 16-bit launch or a wide-head (64 x 4 x 2) one, fp32
    queries, fp32 pools, layers outside the kernel's scope or groups over 64. "1": wherever it can run; "0": nowhere."""
    def chosen(tiling, kv_itemsize=1, splits=1, fp32_queries=False, plain_layer=True, group=4):
        return keys_major.keys_major_decode_chosen(group, plain_layer=plain_layer, kv_itemsize=kv_itemsize,
                                                   fp32_queries=fp32_queries, tiling=tiling, splits=splits)

    served = [dict(tiling=(64, 2, 5, False)), dict(tiling=(64, 2, 5)), dict(tiling=(64, 2, 3, False)),
              dict(tiling=(64, 2, 5, False), splits=8), dict(tiling=(64, 4, 3, False), kv_itemsize=2, splits=2),
              dict(tiling=(64, 4, 3, False), kv_itemsize=2, splits=16)]
    others = [dict(tiling=t) for t in [(32, 1, 3, False), (32, 1, 6, True), (32, 4, 2, False), (64, 4, 3, False),
                                       (128, 4, 3, False), (64, 2, 5, True)]]
    others += [dict(tiling=(64, 4, 3, False), kv_itemsize=2), dict(tiling=(64, 4, 2, False), kv_itemsize=2, splits=8),
               dict(tiling=(64, 4, 3, True), kv_itemsize=2, splits=8), dict(tiling=(64, 2, 5, False), kv_itemsize=2,
                                                                            splits=8),
               dict(tiling=(64, 4, 3, False), kv_itemsize=4, splits=8),
               dict(tiling=(64, 2, 5, False), fp32_queries=True),
               dict(tiling=(64, 4, 3, False), kv_itemsize=2, splits=8, fp32_queries=True)]
    outside = [dict(tiling=(64, 2, 5, False), plain_layer=False), dict(tiling=(64, 2, 5, False), group=65),
               dict(tiling=(64, 4, 3, False), kv_itemsize=2, splits=8, plain_layer=False)]
    for switch in (None, "", "auto"):
        if switch is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, switch)
        assert all(chosen(**c) for c in served)
        assert not any(chosen(**c) for c in others + outside)
    monkeypatch.setenv(ENV, "1")
    assert all(chosen(**c) for c in served + others)
    assert not any(chosen(**c) for c in outside)
    monkeypatch.setenv(ENV, "0")
    assert not any(chosen(**c) for c in served + others)
    assert keys_major.keys_major_own_residency(1) and not keys_major.keys_major_own_residency(2)


def test_a_keys_major_graph_capture_plans_its_replays_by_its_own_residency(monkeypatch):
    """A decode graph's capture of a mid-size bucket (meta.decode_splits set) whose launches the keys-major kernel
    runs records a split plan from that kernel's residency (its own _DECODE_RESIDENT key), so each replay's
    decode_active_splits counts its waves; switched off, or for a layer outside its scope, the default kernel's.
    (As test_kernel_attention's test_decode_graphs_of_mid_size_buckets_take_their_splits_per_replay for the default.)"""
    from kernels.attention_metadata import AttentionMetadata

    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)
    monkeypatch.delenv(triton_attention.FP8_WIDEN_ENV, raising=False)
    monkeypatch.setenv(triton_attention.DECODE_SPLIT_POLICY_ENV, "h200")  # DYNAMIC_SPLITS_CAPTURED's policy
    monkeypatch.setattr(triton_attention, "_DECODE_RESIDENT", {})
    device = torch.device("cpu")
    tiling = triton_attention._decode_tiling(48, 16, False, 1, False)
    assert tiling[:2] == (64, 2)
    widening = triton_attention.fp8_widening(tiling[0])
    key = lambda km: triton_attention._decode_tiling_key(device, 16, tiling, 128, 1, widening, km)  # noqa: E731
    triton_attention._DECODE_RESIDENT.update({key(False): 5, key(True): 3})

    def captured(num_seqs, plain_decode=True, kv_itemsize=1):
        meta = AttentionMetadata(slot_mapping=None, block_tables=None, cu_seqlens_q=None,
                                 context_lens=torch.zeros(num_seqs), max_seqlen_q=1, max_context_len=22016,
                                 is_decode_only=True, decode_splits=torch.ones(1, dtype=torch.int32))
        splits = triton_attention._decode_config(meta, 4, 8, device, None, None, 128, kv_itemsize,
                                                 plain_decode=plain_decode)[4]
        return meta.decode_split_plan, splits

    monkeypatch.delenv(ENV, raising=False)
    plan, splits = captured(48)
    assert plan == (8, 3 * 132, 132) and splits == triton_attention.DYNAMIC_SPLITS_CAPTURED
    assert captured(48, plain_decode=False)[0] == (8, 5 * 132, 132)
    monkeypatch.setenv(ENV, "0")
    default_plan = captured(48)[0]
    assert default_plan == (8, 5 * 132, 132)
    # A replay's count: the waves of the kernel the graph holds. 48 sequences over 21,000 keys: 384 programs, more
    # than one wave of 3 an SM (396 programs at once) at 2 splits, within one of 5 (660).
    replay = [triton_attention.decode_active_splits(p, 48, 21000) for p in (plan, default_plan)]
    assert replay[0] == triton_attention._decode_num_splits(48, 8, 21000, 132, 64, 3)
    assert replay[1] == triton_attention._decode_num_splits(48, 8, 21000, 132, 64, 5)
    assert replay[0] != replay[1], replay
    # 16-bit pools split by the default kernel's residency whichever kernel runs (the keys-major one's left 64 x
    # 8,192 on a bf16 pool at 1 split, 681 us against the default's 553 with 16).
    monkeypatch.delenv(ENV, raising=False)
    tiling_16 = triton_attention._decode_tiling(48, 16, False, 2, False)
    key_16 = lambda km: triton_attention._decode_tiling_key(device, 16, tiling_16, 128, 2,  # noqa: E731
                                                            (False, triton_attention.V_BY_TRITON), km)
    triton_attention._DECODE_RESIDENT.update({key_16(False): 5, key_16(True): 3})
    assert captured(48, kv_itemsize=2)[0] == (8, 5 * 132, 132)


@pytest.mark.gpu
@pytest.mark.parametrize("pool", ["16-bit", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_keys_major_rotary_append_writes_what_the_default_kernel_writes(device, monkeypatch, pool, num_splits):
    """The served form (new_kv: q and the new k unrotated): the same cache bytes as the default kernel's append,
    and the same attention within bf16's rounding; the new keys were written."""
    from kernels.rotary import build_cos_sin_cache

    q, k_cache, v_cache, meta = decode_case(device, HEADS["llama-8b"], pool, seed=5)
    gen = torch.Generator().manual_seed(9)
    k_new, v_new = (torch.randn(len(BATCH), 8, 128, generator=gen).to(q.dtype).to(device) for _ in range(2))
    positions = meta.context_lens.to(torch.int64) - 1
    cos_sin = build_cos_sin_cache(1024, 128, 500000.0, device=device)
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(ENV, switch)
        k_c, v_c = k_cache.clone(), v_cache.clone()
        out = triton_attention.paged_attention_triton(q, k_c, v_c, meta, 128**-0.5, num_splits=num_splits,
                                                      new_kv=(k_new, v_new, positions, cos_sin))
        results.append((out, k_c, v_c))
    (default, k_d, v_d), (out, k_k, v_k) = results
    as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)  # noqa: E731
    assert torch.equal(as_bytes(k_k), as_bytes(k_d)) and torch.equal(as_bytes(v_k), as_bytes(v_d))
    assert not torch.equal(as_bytes(k_k), as_bytes(k_cache))
    ref = paged_attention_ref(q_rotated(q, positions, cos_sin), k_k, v_k, meta, 128**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)
    assert relative_error(out, default) < TOLERANCE[torch.bfloat16], relative_error(out, default)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Llama-8B's heads at a long context: CUDA only")
@pytest.mark.parametrize("num_seqs,tiling", [(3, None), (800, None), (40, (64, 4, 3)), (40, (128, 4, 3))])
def test_llama_heads_keys_major_on_a_head_major_fp8_pool_in_each_tiling(monkeypatch, num_seqs, tiling):
    """Llama-8B's heads on the runner's head-major FP8 pool at 600-970 keys, in the tilings the grid times: the
    default's (64 x 2 x 5; 32 x 1 x 3 from 768 sequences) and 64 / 128 keys over 4 warps (warpgroup MMAs), forced
    as attention_kernel_bench.py forces them: within bf16's rounding of the reference and of the default kernel."""
    gen = torch.Generator().manual_seed(21)
    batch = [(600 + 37 * (i % 11), 1) for i in range(num_seqs)]
    _, _, k_cache, v_cache, meta = make_batch(batch, 8, 128, 32, torch.bfloat16, "cuda", seed=21)
    head_major = lambda cache: cache.float().clamp(-448, 448).to(KV_FP8_DTYPE).transpose(1, 2).contiguous() \
        .transpose(1, 2)  # noqa: E731
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    q = (torch.randn(num_seqs, 32, 128, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    if tiling is not None:
        chosen = triton_attention._decode_config
        monkeypatch.setattr(triton_attention, "_decode_config",
                            lambda *a, **k: (lambda c: (c[0], *tiling, c[4], False))(chosen(*a, **k)))
    default, out = both_kernels(monkeypatch, lambda: triton_attention.paged_attention_triton(
        q, k_cache, v_cache, meta, 128**-0.5))
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 128**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)
    assert relative_error(out, default) < TOLERANCE[torch.bfloat16], relative_error(out, default)


def q_rotated(q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """q rotated at its sequences' positions (neox halves), as the kernels do it (fp32, rounded once)."""
    half = q.shape[-1] // 2
    cos, sin = (t[:, None, :].repeat(1, 1, 2) for t in cos_sin[positions].split(half, dim=-1))
    partner = torch.cat([-q[..., half:], q[..., :half]], dim=-1).float()
    return (q.float() * cos + partner * sin).to(q.dtype)


def test_the_switch_is_auto_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert keys_major.keys_major_decode_mode() == "auto"
    for switch in ("auto", "0", "1"):
        monkeypatch.setenv(ENV, f" {switch} ")
        assert keys_major.keys_major_decode_mode() == switch
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="TRITONLLM_DECODE_KEYS_MAJOR='yes': auto .*, 0 .* or 1"):
        keys_major.keys_major_decode_mode()
    assert keys_major.keys_major_columns(4) == 8 and keys_major.keys_major_columns(1) == 8
    assert keys_major.keys_major_columns(12) == 16


def fp8_pool_kernel_pointers() -> dict[str, str]:
    """The keys-major decode kernel's pointer arguments over an FP8 pool with bf16 queries, as compile_for_sm90 takes
    them (sm90_compile)."""
    pointers = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_new_ptr", "v_new_ptr")}
    pointers.update({name: "*fp8e4nv" for name in ("k_cache_ptr", "v_cache_ptr")})
    pointers.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")})
    pointers.update({name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "active_splits_ptr")})
    pointers.update(positions_ptr="*i64", slot_ptr="*i64")
    return pointers


@AOT_SM90
@pytest.mark.parametrize("tiling", [(64, 4, 3), (64, 2, 5), (32, 1, 3)])
@pytest.mark.parametrize("rotary", [False, True])
def test_keys_major_decode_compiles_for_sm90(tiling, rotary, tmp_path, capsys):
    """Llama-8B's heads over an FP8 pool (group 4 as 8 columns, 128 dims, page 32), in the default decode tilings
    and 64 keys over 4 warps (a warpgroup MMA's 64 rows): compiles, spills nothing; the registers printed."""
    block_n, warps, stages = tiling
    k_bits, v_widen = triton_attention.fp8_widening(block_n)
    pointers = fp8_pool_kernel_pointers()
    const = dict(GROUP=4, G_PAD=keys_major.keys_major_columns(4), HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=32,
                 BLOCK_N=block_n, NUM_SPLITS=4, PRECISION="tf32", FP16_MATH=True, ROTARY_APPEND=rotary,
                 ROTATE=rotary, DYNAMIC_SPLITS=False, PDL=False, K_BITS=k_bits, V_WIDEN=v_widen, ASM=True)
    compiled = compile_for_sm90(keys_major._keys_major_decode_kernel, pointers, const, warps=warps, stages=stages,
                                floats=("qk_scale",), aligned_int=strides_but_block_table)
    usage = resource_usage_or_skip(compiled, Path(tmp_path))
    with capsys.disabled():
        wgmma = compiled.asm["ptx"].count("wgmma.mma_async")
        print(f"\nkeys-major {block_n}x{warps}x{stages} rotary={rotary}: {usage.strip()} wgmma={wgmma} "
              f"mma.sync={compiled.asm['ptx'].count('mma.sync')}")
    assert stack_bytes(usage) == 0 and "LOCAL:0" in usage, usage
    assert registers(usage) <= 255
