"""kernels/keys_major_decode.py, the opt-in decode attention with the keys as the products' rows
($TRITONLLM_DECODE_KEYS_MAJOR=1), against the torch reference and against the default decode kernel.

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


def decode_case(device: str, heads: tuple, pool: str, seed: int = 0):
    """(q, k_cache, v_cache, meta) of BATCH: a 16-bit pool of q's dtype, or an FP8 one (random values as E4M3 codes,
    scale 1) read with fp16 math."""
    num_heads, num_kv_heads, head_dim = heads
    dtype = activation_dtype(device)
    _, _, k_cache, v_cache, meta = make_batch(BATCH, num_kv_heads, head_dim, 16, dtype, device, seed=seed)
    if pool == "fp8":
        k_cache, v_cache = (c.float().clamp(-448, 448).to(KV_FP8_DTYPE) for c in (k_cache, v_cache))
    q = torch.randn(len(BATCH), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
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


@pytest.mark.gpu
@pytest.mark.parametrize("active", [1, 3])
def test_keys_major_decode_runs_the_splits_a_graph_replay_asks_for(device, monkeypatch, active):
    """A decode graph's launch of 4 splits whose replay uses ``active`` of them (split-major programs, the merge
    reading only those)."""
    q, k_cache, v_cache, meta = decode_case(device, HEADS["group 8"], "fp8", seed=3)
    meta.decode_splits = torch.tensor([active], dtype=torch.int32, device=device)
    meta.decode_split_plan = (2, 528, 132)
    monkeypatch.setenv(ENV, "1")
    out = triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, 64**-0.5, num_splits=4)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 64**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], relative_error(out, ref)


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


def test_the_switch_is_off_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not keys_major.keys_major_decode_on()
    monkeypatch.setenv(ENV, "1")
    assert keys_major.keys_major_decode_on()
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="TRITONLLM_DECODE_KEYS_MAJOR='yes': 0 .* or 1"):
        keys_major.keys_major_decode_on()
    assert keys_major.keys_major_columns(4) == 8 and keys_major.keys_major_columns(1) == 8
    assert keys_major.keys_major_columns(12) == 16


@AOT_SM90
@pytest.mark.parametrize("tiling", [(64, 4, 3), (64, 2, 5), (32, 1, 3)])
@pytest.mark.parametrize("rotary", [False, True])
def test_keys_major_decode_compiles_for_sm90(tiling, rotary, tmp_path, capsys):
    """Llama-8B's heads over an FP8 pool (group 4 as 8 columns, 128 dims, page 32), in the default decode tilings
    and 64 keys over 4 warps (a warpgroup MMA's 64 rows): compiles, spills nothing; the registers printed."""
    block_n, warps, stages = tiling
    k_bits, v_widen = triton_attention.fp8_widening(block_n)
    pointers = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_new_ptr", "v_new_ptr")}
    pointers.update({name: "*fp8e4nv" for name in ("k_cache_ptr", "v_cache_ptr")})
    pointers.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")})
    pointers.update({name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "active_splits_ptr")})
    pointers.update(positions_ptr="*i64", slot_ptr="*i64")
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
