"""$TRITONLLM_PREFILL_FP8_QK=1 (kernels/triton_attention.py PREFILL_FP8_QK_ENV): prompt tiles over an FP8 pool take
Q K^T as an FP8 product (q rounded to E4M3, the pool's K codes unwidened). With queries whose scaled values E4M3 holds
exactly the product is the fp16 path's, so the outputs match the torch reference (this checks the plumbing: the
unmasked and masked walks, a mixed batch's decode rows, which keep fp16); on a GPU, random queries match the reference
of their E4M3-rounded selves. (Triton's interpreter rounds fp32/fp16 -> E4M3 wrongly where the rounding carries into
the exponent, 1.96 -> 1.0: hence exact queries on the CPU.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip, strides_but_block_table

from benchmarks.kernels import attention_kernel_bench as bench
from kernels import triton_attention as ta
from kernels.attention import paged_attention_ref

LOG2E = 1.4426950408889634
BATCH = [(40, 520), (0, 100), (30, 1)]  # a chunk after a prefix, a whole prompt, a decode row: 21 query tiles x 8


def case(device: str, monkeypatch, exact: bool):
    monkeypatch.setattr(bench, "DEVICE", device)
    q, k_cache, v_cache, meta = bench.build_case(BATCH, torch.float8_e4m3fn)
    if exact:  # scale * log2(e) == 1 and q of E4M3 values (none subnormal): the kernel's E4M3 q is q itself
        q = q.float().to(torch.float8_e4m3fn).float()
        q = torch.where(q.abs() < 2.0**-6, torch.zeros_like(q), q)
        scale = 1.0 / LOG2E
        assert torch.tensor(scale * LOG2E, dtype=torch.float32).item() == 1.0
    else:
        scale = bench.HEAD_DIM**-0.5
    return q.to(bench.half_dtype()), k_cache[0], v_cache[0], meta, scale


def close(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def test_fp8_qk_with_e4m3_exact_queries_is_the_reference(device, monkeypatch):
    q, k_cache, v_cache, meta, scale = case(device, monkeypatch, exact=True)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    monkeypatch.setenv(ta.PREFILL_FP8_QK_ENV, "1")
    out = ta.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    assert close(out, ref) < 1e-2


def test_fp8_qk_matches_the_reference_of_its_rounded_queries_on_the_gpu(device, monkeypatch):
    if device != "cuda":
        pytest.skip("the interpreter's E4M3 rounding is wrong (module docstring)")
    q, k_cache, v_cache, meta, scale = case(device, monkeypatch, exact=False)
    qk = torch.tensor(scale * LOG2E, dtype=torch.float32).item()
    rounded = ((q.float() * qk).half().float().clamp(-448, 448).to(torch.float8_e4m3fn).float() / qk)
    ref8 = paged_attention_ref(rounded, k_cache, v_cache, meta, scale)  # fp32 queries: no second rounding
    monkeypatch.setenv(ta.PREFILL_FP8_QK_ENV, "1")
    out = ta.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    assert close(out, ref8) < 2e-2


def test_the_switch_reaches_the_prompt_tiles_only(device, monkeypatch):
    """Random queries: the prompt rows change with the switch (E4M3 q), the decode row (its own launch) does not."""
    q, k_cache, v_cache, meta, scale = case(device, monkeypatch, exact=False)
    base = ta.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    monkeypatch.setenv(ta.PREFILL_FP8_QK_ENV, "1")
    out = ta.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    prompt_rows = sum(n for _, n in BATCH[:2])
    assert not torch.equal(out[:prompt_rows], base[:prompt_rows])
    assert torch.equal(out[prompt_rows:], base[prompt_rows:])


@AOT_SM90
@pytest.mark.parametrize("tiling", [(128, 128, 8, 2), (128, 64, 8, 3)])
def test_fp8_qk_prompt_tiles_compile_for_sm90_as_fp8_mma_without_spills(tiling, tmp_path):
    """Triton's compiler and ptxas (no GPU, opt-in: TRITONLLM_AOT_SM90=1): the prompt launch over an FP8 pool with
    FP8_QK compiles to wgmma (HGMMA) with E4M3 operands for Q K^T, spills nothing, and needs less shared memory than
    the fp16 path (K is no longer widened into fp16 operand tiles)."""
    import triton

    block_m, block_n, warps, stages = tiling
    pointers = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_new_ptr", "v_new_ptr", "q_norm_ptr", "k_norm_ptr",
                                           "sinks_ptr", "alibi_ptr")}
    pointers.update({name: "*fp8e4nv" for name in ("k_cache_ptr", "v_cache_ptr", "k_desc", "v_desc")})
    pointers.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")})
    pointers.update({name: "*i32" for name in ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr",
                                               "tile_seq_ptr", "tile_m_ptr", "active_splits_ptr", "span_ptr",
                                               "tree_ptr")})
    pointers.update(positions_ptr="*i64", slot_ptr="*i64")
    const = dict(GROUP=4, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=32, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=1,
                 PRECISION="tf32", FP16_MATH=True, ROTARY_APPEND=False, ROTATE=False, HAS_WINDOW=False,
                 HAS_SOFTCAP=False, HAS_TILE_MAP=True, HAS_SINKS=False, HAS_ALIBI=False, SEQ_KIND=ta.MULTI_TOKEN,
                 TMA=False, DYNAMIC_SPLITS=False, PDL=True, HAS_TREE=False, TREE_AS_BITS=False, HAS_SPANS=False,
                 APPEND_ROWS=False, QK_NORM=False, K_BITS=False, V_WIDEN=0, ASM=True)
    shared = {}
    for fp8_qk in (False, True):
        compiled = compile_for_sm90(ta._paged_attention_kernel, pointers, {**const, "FP8_QK": fp8_qk}, warps=warps,
                                    stages=stages, floats=("qk_scale", "softcap_log2", "qk_eps", "temp_scale"),
                                    aligned_int=strides_but_block_table)
        usage = resource_usage_or_skip(compiled, tmp_path)
        assert "LOCAL:0 " in usage and "STACK:0 " in usage, usage
        shared[fp8_qk] = compiled.metadata.shared
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
    assert "E4M3.E4M3" in sass, "no FP8 wgmma in the FP8_QK kernel"
    assert shared[True] < shared[False]
