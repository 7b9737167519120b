"""Llama 4's attention at decode in one kernel (kernels/llama4_attention.py: kernels/triton_attention.py's paged
kernel with ``chunk_size``, ``qk_l2_eps`` and ``temperature``) against the unfused path's references: rotary,
the q/k L2 norm, the KV write and kernels/chunked_attention.py's reference for rope layers; the temperature,
the KV write and paged attention for NoPE layers. Decode rows whose chunks start at 0, mid-context and at the
row itself, over shuffled pages, with the keys in one split or four (the new key in one of them).
GPU, or TRITON_INTERPRET=1 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from kernel_testing import TOLERANCE, relative_error
from kernels.attention import paged_attention_ref, write_kv_cache_ref
from kernels.chunked_attention import chunked_attention_ref
from kernels.llama4_attention import attention_temperature, l2_normed_heads
from kernels.rotary import apply_rotary_ref, build_cos_sin_cache
from kernels.triton_attention import paged_attention_triton
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip, strides_but_block_table
from test_kernel_attention import make_batch

HEADS, KV_HEADS, HEAD_DIM, PAGE, CHUNK = 8, 2, 32, 8, 16
# positions 36 (chunk 32..36), 4 (0..4), 64 (its chunk's first key), 79 (64..79), 15 (0..15)
BATCH = [(36, 1), (4, 1), (64, 1), (79, 1), (15, 1)]


def _decode_batch(device, seed):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k, v, k_cache, v_cache, meta = make_batch(BATCH, KV_HEADS, HEAD_DIM, PAGE, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (3 * torch.randn(len(BATCH), HEADS, HEAD_DIM, generator=gen)).to(dtype).to(device)
    return q, 3 * k, v, k_cache, v_cache, meta, (meta.context_lens - 1).long(), dtype


def _unfused_cache(k, v, k_cache, v_cache, meta):
    k_ref, v_ref = k_cache.cpu().clone(), v_cache.cpu().clone()
    write_kv_cache_ref(k.cpu(), v.cpu(), k_ref, v_ref, meta.slot_mapping.cpu())
    return k_ref, v_ref


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_rope_layer_decode_kernel_equals_rotary_l2_norm_write_and_chunked_attention(device, num_splits):
    q, k, v, k_cache, v_cache, meta, positions, dtype = _decode_batch(device, 11)
    cos_sin = build_cos_sin_cache(256, HEAD_DIM, 500000.0, device=device)
    scale, eps = HEAD_DIM**-0.5, 1e-5

    q_rot, k_rot = apply_rotary_ref(q.cpu(), k.cpu(), positions.cpu(), cos_sin.cpu())
    q_ref, k_ref_rows = l2_normed_heads(q_rot, eps), l2_normed_heads(k_rot, eps)
    k_ref, v_ref = _unfused_cache(k_ref_rows, v, k_cache, v_cache, meta)
    cpu_meta = _cpu(meta)
    want = chunked_attention_ref(q_ref, k_ref, v_ref, cpu_meta, scale, CHUNK)

    k_one, v_one = k_cache.clone(), v_cache.clone()
    out = paged_attention_triton(q, k_one, v_one, meta, scale, num_splits=num_splits,
                                 new_kv=(k, v, positions, cos_sin), chunk_size=CHUNK, qk_l2_eps=eps)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(k_one.cpu(), k_ref, rtol=tolerance, atol=tolerance)
    assert torch.equal(v_one.cpu(), v_ref)
    assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[dtype]
    # Not the whole context: the chunk bites (rows 0, 3 have earlier chunks' keys in their pages).
    whole = paged_attention_ref(q_ref, k_ref, v_ref, cpu_meta, scale)
    assert relative_error(whole[[0, 3]].float(), want[[0, 3]].float()) > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_chunked_decode_through_the_paged_kernel_equals_the_reference(device, num_splits):
    """kernels/chunked_attention.py's decode dispatch: the paged kernel with the chunk as its walk's start."""
    q, k, v, k_cache, v_cache, meta, _, dtype = _decode_batch(device, 21)
    k_ref, v_ref = _unfused_cache(k, v, k_cache, v_cache, meta)
    want = chunked_attention_ref(q.cpu(), k_ref, v_ref, _cpu(meta), 0.25, CHUNK)
    out = paged_attention_triton(q, k_ref.to(device), v_ref.to(device), meta, 0.25, num_splits=num_splits,
                                 chunk_size=CHUNK)
    assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_nope_layer_decode_kernel_equals_temperature_write_and_attention(device):
    q, k, v, k_cache, v_cache, meta, positions, dtype = _decode_batch(device, 31)
    temperature = (8.0, 0.1)  # floors 4, 0, 8, 10, 2 at positions 36, 4, 64, 79, 15
    scale = HEAD_DIM**-0.5
    q_ref = attention_temperature(q.cpu(), positions.cpu(), *temperature)
    k_ref, v_ref = _unfused_cache(k, v, k_cache, v_cache, meta)
    want = paged_attention_ref(q_ref, k_ref, v_ref, _cpu(meta), scale)

    k_one, v_one = k_cache.clone(), v_cache.clone()
    out = paged_attention_triton(q, k_one, v_one, meta, scale, num_splits=4, new_kv=(k, v, positions, None),
                                 temperature=temperature)
    assert torch.equal(k_one.cpu(), k_ref) and torch.equal(v_one.cpu(), v_ref)
    assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[dtype]
    plain = paged_attention_ref(q.cpu(), k_ref, v_ref, _cpu(meta), scale)
    assert relative_error(plain.float(), want.float()) > 1e-2  # (the temperature bites)


def test_references_follow_the_formulas():
    """l2_normed_heads: unit RMS per head; attention_temperature: 1 + 0.1 * log1p(floor((p + 1) / 8))."""
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(l2_normed_heads(x, 0.0).pow(2).mean(-1), torch.ones(3, 2, dtype=torch.float64))
    q = torch.ones(3, 1, 1)
    factor = attention_temperature(q, torch.tensor([6, 7, 23]), 8.0, 0.1).flatten()
    assert torch.allclose(factor, torch.tensor([1.0, 1.0 + 0.1 * torch.log1p(torch.tensor(1.0)).item(),
                                                1.0 + 0.1 * torch.log1p(torch.tensor(3.0)).item()]))


def _cpu(meta):
    from dataclasses import replace

    return replace(meta, slot_mapping=meta.slot_mapping.cpu(), block_tables=meta.block_tables.cpu(),
                   cu_seqlens_q=meta.cu_seqlens_q.cpu(), context_lens=meta.context_lens.cpu())


@AOT_SM90
@pytest.mark.parametrize("variant", [dict(CHUNK=8192, QK_L2=True), dict(ROTATE=False, TEMPERATURE=True),
                                     dict(ROTARY_APPEND=False, CHUNK=8192)])
def test_decode_kernel_compiles_for_sm90_without_spills(variant, tmp_path):
    """Triton's compiler and ptxas (no GPU) on the paged kernel's Llama 4 decode variants at Scout's shape (40 query
    heads over 8 KV heads of 128, bf16 pool, 16 splits): the rope layer's (chunk and L2 norm), the NoPE layer's
    (temperature), the plain chunked decode; no local memory (spills)."""
    from kernels.triton_attention import _paged_attention_kernel

    pointers = {name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_desc", "v_desc",
                                           "k_new_ptr", "v_new_ptr", "q_norm_ptr", "k_norm_ptr", "sinks_ptr",
                                           "alibi_ptr")}
    pointers.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")})
    pointers.update({name: "*i32" for name in ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr",
                                               "tile_seq_ptr", "tile_m_ptr", "active_splits_ptr", "span_ptr",
                                               "tree_ptr")})
    pointers.update(positions_ptr="*i64", slot_ptr="*i64")
    const = dict(GROUP=5, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=16,
                 PRECISION="tf32", FP16_MATH=False, ROTARY_APPEND=True, ROTATE=True, HAS_WINDOW=False,
                 HAS_SOFTCAP=False, HAS_TILE_MAP=False, HAS_SINKS=False, HAS_ALIBI=False, SEQ_KIND=0, TMA=False,
                 DYNAMIC_SPLITS=False, PDL=False, HAS_TREE=False, TREE_AS_BITS=False, HAS_SPANS=False,
                 APPEND_ROWS=False, QK_NORM=False, K_BITS=False, V_WIDEN=0) | variant
    compiled = compile_for_sm90(_paged_attention_kernel, pointers, const, warps=4, stages=3,
                                floats=("qk_scale", "softcap_log2", "qk_eps", "temp_scale"),
                                aligned_int=strides_but_block_table)
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage, usage
