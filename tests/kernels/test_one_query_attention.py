"""kernels/one_query_attention.py beyond its two callers' tests (test_t5_bias_attention.py: T5's decode
self-attention with its bias, one split; test_cross_attention_decode.py: cross-attention, no bias): the bias
with key splits, a sequence of no new token and one of no keys, and its sm_90 compile (no spills) at both
callers' tilings."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, registers, resource_usage_or_skip, strides_but_block_table

from kernels.attention_metadata import AttentionMetadata
from kernels.one_query_attention import one_query_attention_triton
from kernels.t5_bias_attention import distance_bias, t5_paged_attention_ref


def test_bias_with_key_splits_and_rows_of_no_token_or_no_keys(device):
    """T5's causal bias over splits of a row's keys (contexts past max_distance); sequence 1 has no new token
    (its row is never written), sequence 3 no keys (zeros, not NaN, through the merge)."""
    torch.manual_seed(0)
    heads, dim, page, contexts = 3, 16, 4, [37, 5, 12, 0]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks = torch.randperm(40)[:4 * 10].view(4, 10).int().to(device)
    k_cache, v_cache = (torch.randn(40, page, heads, dim, device=device).to(dtype) for _ in range(2))
    q = torch.randn(3, heads, dim, device=device).to(dtype)
    cu = torch.tensor([0, 1, 1, 2, 3], dtype=torch.int32, device=device)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    table = torch.randn(8, heads, device=device)
    bias = distance_bias(table, bidirectional=False, max_distance=10)
    with_keys = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                                  block_tables=blocks[[0, 2]], cu_seqlens_q=cu[[0, 1, 2]], context_lens=lens[[0, 2]],
                                  max_seqlen_q=1, max_context_len=37, is_decode_only=True,
                                  cu_seqlens_q_host=[0, 1, 2], context_lens_host=[37, 12])
    ref = t5_paged_attention_ref(q[:2].float(), k_cache.float(), v_cache.float(), with_keys, 1.0, table, 10)
    for splits in (1, 4, 8):
        out = one_query_attention_triton(q, k_cache, v_cache, blocks, lens, 1.0, cu_seqlens_q=cu, bias=bias,
                                         tiling=(2, 4, 1, 1), max_context_len=40, splits=splits)
        assert relative_error(out[:2], ref) < TOLERANCE[dtype], splits
        assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())), splits


@AOT_SM90
@pytest.mark.parametrize("user", ["t5_self", "cross"])
@pytest.mark.parametrize("pool", ["*bf16", "*fp8e4nv"])
def test_kernel_compiles_for_sm90_without_spills(user, pool, tmp_path):
    """Triton's compiler and ptxas (no GPU) on T5's DECODE_TILING with its bias (Flan-T5-XL: 64 dims, pages of
    32, max_distance 128) and on the cross-attention's tiling of the pool (256 rows of 32 heads) without: no
    local memory (spills), at most 128 registers a thread (decode is bound by the K/V bytes in
    flight: many programs an SM)."""
    from kernels.cross_attention_decode import cross_tiling
    from kernels.one_query_attention import _one_query_kernel
    from kernels.t5_bias_attention import DECODE_TILING

    pool_dtype = torch.bfloat16 if pool == "*bf16" else torch.float8_e4m3fn
    heads, block_n, warps, stages = DECODE_TILING if user == "t5_self" else cross_tiling(pool_dtype, 256, 32)
    pointers = dict(q_ptr="*bf16", k_cache_ptr=pool, v_cache_ptr=pool, out_ptr="*bf16", part_out_ptr="*fp32",
                    part_lse_ptr="*fp32", bias_ptr="*fp32", block_tables_ptr="*i32",
                    cu_seqlens_q_ptr="*i32", context_lens_ptr="*i32")
    const = dict(HAS_BIAS=user == "t5_self", REACH=128, HEAD_DIM=64, DIM_PAD=64, PAGE_SIZE=32, HEADS=heads,
                 BLOCK_N=block_n, ONE_TOKEN_ROWS=user == "cross", PREFETCH=stages > 1, PDL=True)
    compiled = compile_for_sm90(_one_query_kernel, pointers, const, warps=warps, stages=1, floats=("scale_log2",),
                                aligned_int=strides_but_block_table)
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage and registers(usage) <= 128, usage
