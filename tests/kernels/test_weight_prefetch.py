"""The weight prefetch before the PDL wait (kernels/_triton.py prefetch_weight_l2, switched by
$TRITONLLM_WEIGHT_PREFETCH): the switch's rule, the alignment rule of its bulk prefetches, and the MLA launches
(W_UK in the latent write's launch, W_UV in the combine) compiled for sm_90 with their prefetches ahead of
griddepcontrol.wait (opt-in, TRITONLLM_AOT_SM90=1).
(The results with the prefetch on: the kernels' own tests run on a GPU with TRITONLLM_WEIGHT_PREFETCH=1.)"""
from __future__ import annotations

import pytest
from sm90_compile import AOT_SM90, compile_for_sm90


def test_weight_prefetch_names_kinds_and_needs_pdl(monkeypatch):
    from kernels._triton import WEIGHT_PREFETCH_ENV, WEIGHT_PREFETCH_KINDS, weight_prefetch

    monkeypatch.setenv(WEIGHT_PREFETCH_ENV, "mla,router")
    assert weight_prefetch("mla", True) and weight_prefetch("router", True) and not weight_prefetch("skinny", True)
    assert not weight_prefetch("mla", False)
    monkeypatch.setenv(WEIGHT_PREFETCH_ENV, "1")
    assert all(weight_prefetch(kind, True) for kind in WEIGHT_PREFETCH_KINDS)
    monkeypatch.setenv(WEIGHT_PREFETCH_ENV, "0")
    assert not any(weight_prefetch(kind, True) for kind in WEIGHT_PREFETCH_KINDS)
    with pytest.raises(AssertionError):
        weight_prefetch("lm_head", True)


def test_bulk_prefetchable_needs_aligned_rows_of_whole_16_bytes():
    """cp.async.bulk.prefetch.L2 faults on a span that is not 16-byte aligned or not a multiple of 16 bytes."""
    import torch

    from kernels._triton import bulk_prefetchable

    weight = torch.empty(64, 2048, dtype=torch.bfloat16)
    assert bulk_prefetchable(weight) and bulk_prefetchable(torch.empty(3, 8, 512, dtype=torch.bfloat16))
    assert not bulk_prefetchable(torch.empty(64, 1000 + 4, dtype=torch.bfloat16))  # 2,008-byte rows
    assert not bulk_prefetchable(weight[:, 4:])  # rows 8 bytes off their alignment, and 4,088 bytes long
    assert not bulk_prefetchable(weight.t())  # no unit column stride


def prefetches_before_the_wait(ptx: str) -> bool:
    """Prefetches, and none after the last wait (the compiler may copy the wait into each branch of the
    program's role, as it does for the latent write's rows and products)."""
    before, _, after = ptx.rpartition("griddepcontrol.wait")
    return "cp.async.bulk.prefetch.L2" in before and "cp.async.bulk.prefetch.L2" not in after


@AOT_SM90
def test_combine_prefetches_w_uv_before_the_pdl_wait():
    from kernels.mla_attention import _mla_combine_values_kernel

    pointers = dict(part_ptr="*fp32", lse_ptr="*fp32", w_ptr="*bf16", out_ptr="*bf16")
    import triton.language as tl

    const = dict(RANK=512, SPLITS_PAD=32, BLOCK_R=256, BLOCK_V=32, LATENT_DTYPE=tl.bfloat16, PDL=True)  # V2-Lite, 1k
    plain = compile_for_sm90(_mla_combine_values_kernel, pointers, {**const, "PREFETCH": False}, warps=8).asm["ptx"]
    ptx = compile_for_sm90(_mla_combine_values_kernel, pointers, {**const, "PREFETCH": True}, warps=8).asm["ptx"]
    assert "cp.async.bulk.prefetch.L2" not in plain and prefetches_before_the_wait(ptx)


@AOT_SM90
def test_latent_write_prefetches_w_uk_before_the_pdl_wait():
    from kernels.mla_latent_write import _latent_rope_write_absorb_kernel

    pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", w_ptr="*bf16", positions_ptr="*i64", cos_sin_ptr="*fp32",
                    cache_ptr="*bf16", slots_ptr="*i64", q_nope_ptr="*bf16", w_uk_ptr="*bf16", q_lat_ptr="*bf16")
    const = dict(RANK=512, RANK_PAD=512, HALF=32, HALF_PAD=32, HEADS_PAD=16, PAGE=32, PDL=True, BLOCK_T=16,
                 BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32", PREFETCH=True)  # V2-Lite's shapes
    ptx = compile_for_sm90(_latent_rope_write_absorb_kernel, pointers, const, warps=4, stages=2, floats=("eps",),
                           aligned_int=lambda name: name.startswith("stride") or name in ("nope", "rank")).asm["ptx"]
    assert prefetches_before_the_wait(ptx)
