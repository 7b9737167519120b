"""kernels/t5_bias_attention.py: the distance tables against transformers' buckets, and the Triton
kernels (GPU, or TRITON_INTERPRET=1 on CPU) against the torch references: the decoder's paged causal
attention (a prompt chunk after a cached prefix, decode rows, contexts past max_distance; decode
steps through both the decode kernel and the tensor-core path) and the encoder's padded
bidirectional attention (inputs of several lengths)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error, replayed
from kernels.attention_metadata import AttentionMetadata
from kernels.t5_bias_attention import (DENSE_KERNELS, bias_of_distances, dense_distance_bias, distance_bias,
                                       t5_dense_attention_ref, t5_dense_attention_triton, t5_paged_attention_ref,
                                       t5_paged_attention_triton)
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16)])
def test_distance_table_equals_transformers_buckets(bidirectional, num_buckets, max_distance):
    """Every key-minus-query distance up to +-300 (past max_distance: the clamped ends) gets
    table[transformers' bucket] from the (heads, 2 * max_distance + 1) table."""
    from transformers.models.t5.modeling_t5 import T5Attention

    table = torch.randn(num_buckets, 3)
    distance = torch.arange(-300, 301)
    buckets = T5Attention._relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=num_buckets,
                                                    max_distance=max_distance)
    bias = distance_bias(table, bidirectional=bidirectional, max_distance=max_distance)
    assert torch.equal(bias_of_distances(bias, distance), table[buckets].t())


def paged_batch(device, dtype, *, decode_only: bool):
    """Sequences on shuffled pages of 4, contexts past max_distance 10: a 9-token chunk after a
    14-token prefix, a 1-token prompt and decode rows (decode_only: decode rows only)."""
    torch.manual_seed(0)
    heads, dim, page = 3, 16, 4
    contexts, new = ([25, 10, 1, 17], [1, 1, 1, 1]) if decode_only else ([23, 1, 10, 30], [9, 1, 1, 1])
    width = 8
    k_cache = torch.randn(40, page, heads, dim, device=device).to(dtype)
    v_cache = torch.randn(40, page, heads, dim, device=device).to(dtype)
    tables = torch.randperm(40, device=device)[:len(contexts) * width].view(len(contexts), width)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables.to(torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device), max_seqlen_q=max(new),
        max_context_len=max(contexts), is_decode_only=decode_only, cu_seqlens_q_host=cu, context_lens_host=contexts)
    q = torch.randn(cu[-1], heads, dim, device=device).to(dtype)
    return q, k_cache, v_cache, meta, torch.randn(8, heads, device=device)


@pytest.mark.parametrize("decode_only, decode_kernel", [(False, True), (True, True), (True, False)])
def test_paged_kernel_equals_reference(device, decode_only, decode_kernel):
    """Prompt chunks; decode rows through the decode kernel (default tiling: 3 heads in one program
    of 4) and through the tensor-core path it replaced."""
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = paged_batch(device, dtype, decode_only=decode_only)
        bias = distance_bias(table, bidirectional=False, max_distance=10)
        out = t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias, decode_kernel=decode_kernel)
        ref = t5_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 1.0, table, 10)
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


def decode_batch(device, dtype, *, heads: int, contexts: list[int], pad_rows: int = 0):
    """One new token per sequence over shuffled pages of 4 (head dim 16, max_distance 10), the rows
    ``contexts`` long; ``pad_rows`` more rows as a CUDA-graph bucket pads a decode step (context 1
    over block 0, engine/encoder_decoder/decode_graphs.py) and one of context 0 (no keys) last."""
    torch.manual_seed(2)
    dim, page, blocks = 16, 4, 64
    width = max(-(-c // page) for c in contexts)
    k_cache = torch.randn(blocks, page, heads, dim, device=device).to(dtype)
    v_cache = torch.randn(blocks, page, heads, dim, device=device).to(dtype)
    tables = torch.zeros(len(contexts) + pad_rows + (1 if pad_rows else 0), width, dtype=torch.int32, device=device)
    tables[:len(contexts)] = torch.randperm(blocks - 1, device=device)[:len(contexts) * width].view(-1, width) + 1
    all_contexts = contexts + [1] * pad_rows + ([0] if pad_rows else [])
    rows = len(all_contexts)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables,
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(all_contexts, dtype=torch.int32, device=device), max_seqlen_q=1,
        max_context_len=max(all_contexts), is_decode_only=True, cu_seqlens_q_host=list(range(rows + 1)),
        context_lens_host=all_contexts)
    q = torch.randn(rows, heads, dim, device=device).to(dtype)
    return q, k_cache, v_cache, meta, torch.randn(8, heads, device=device)


@pytest.mark.parametrize("heads, decode_tiling", [(5, (2, 8, 4, 1)), (7, (4, 16, 2, 2)), (2, (4, 8, 1, 1))])
def test_decode_kernel_groups_of_heads_equal_reference(device, heads, decode_tiling):
    """Heads per program not dividing the head count (5 in groups of 2, 7 of 4) or above it (2 of 4,
    capped), contexts of 1 key, exactly BLOCK_N, past it over several tiles and past max_distance 10."""
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = decode_batch(device, dtype, heads=heads, contexts=[1, 8, 9, 16, 23, 40])
        bias = distance_bias(table, bidirectional=False, max_distance=10)
        out = t5_paged_attention_triton(q, k_cache, v_cache, meta, 0.7, bias, decode_tiling=decode_tiling)
        ref = t5_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.7, table, 10)
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype
        for row in range(q.shape[0]):  # every row and head written (no group left out)
            assert relative_error(out[row], ref[row]) < TOLERANCE[dtype], (dtype, row)


def test_decode_kernel_on_padding_rows(device):
    """A graph bucket's padding rows (context 1 over block 0) get their one key's value; a row of
    context 0 (no keys) gets zeros, never NaN; the real rows are unaffected."""
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = decode_batch(device, dtype, heads=3, contexts=[12, 5], pad_rows=2)
        bias = distance_bias(table, bidirectional=False, max_distance=10)
        out = t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias, decode_tiling=(2, 8, 4, 1))
        ref = t5_paged_attention_ref(q[:4].float(), k_cache.float(), v_cache.float(), meta, 1.0, table, 10)
        assert relative_error(out[:4], ref[:4]) < TOLERANCE[dtype], dtype
        assert torch.equal(out[2], v_cache[0, 0].to(out.dtype)) and torch.equal(out[3], v_cache[0, 0].to(out.dtype))
        assert torch.equal(out[4], torch.zeros_like(out[4])), dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture")
def test_decode_kernel_replays_in_a_cuda_graph(device):
    """Captured once, replayed after the queries change: the grid depends only on the batch size."""
    q, k_cache, v_cache, meta, table = decode_batch(device, torch.bfloat16, heads=5, contexts=[3, 30, 70], pad_rows=1)
    bias = distance_bias(table, bidirectional=False, max_distance=10)
    t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias)  # compiled before the capture
    out = replayed(lambda: t5_paged_attention_triton(q, k_cache, v_cache, meta, 1.0, bias), q)
    ref = t5_paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 1.0, table, 10)
    assert relative_error(out[:4], ref[:4]) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_kernel_reads_an_fp8_pool(device, decode_only):
    """An E4M3 KV pool (kv_cache_dtype fp8; scale 1): the kernel widens it as it loads and equals the
    reference over the same FP8 values widened in torch (bf16 under TRITON_INTERPRET is wrong with any
    pool: the interpreter's bf16 dots, kernel_testing.low_precision_dtypes; the CPU checks fp32 queries).
    Prompt chunks (tensor-core path) and decode rows (decode kernel)."""
    fp8 = torch.float8_e4m3fn
    for dtype in low_precision_dtypes(device):
        q, k_cache, v_cache, meta, table = paged_batch(device, dtype, decode_only=decode_only)
        k8, v8 = k_cache.float().to(fp8), v_cache.float().to(fp8)
        out = t5_paged_attention_triton(q, k8, v8, meta, 1.0, distance_bias(table, bidirectional=False, max_distance=10))
        ref = t5_paged_attention_ref(q.float(), k8.float(), v8.float(), meta, 1.0, table, 10)
        assert relative_error(out, ref) < TOLERANCE[dtype], dtype


@pytest.mark.parametrize("kernel", DENSE_KERNELS)
def test_dense_kernel_equals_reference(device, kernel):
    """Three inputs of 37, 20 and 5 tokens padded to 37 (one partial query and key tile), each kernel at
    its default tiling for short inputs (64 x 64: every tile near)."""
    torch.manual_seed(1)
    heads, dim = 3, 16
    lengths = torch.tensor([37, 20, 5], dtype=torch.int32, device=device)
    bias = distance_bias(torch.randn(8, heads, device=device), bidirectional=True, max_distance=10)
    for dtype in low_precision_dtypes(device):
        q, k, v = (torch.randn(3, 37, heads, dim, device=device).to(dtype) for _ in range(3))
        out = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, kernel=kernel)
        ref = t5_dense_attention_ref(q.float(), k.float(), v.float(), lengths, 1.0, bias)
        for row, length in enumerate(lengths.tolist()):
            assert relative_error(out[row, :length], ref[row, :length]) < TOLERANCE[dtype], (dtype, row)


@pytest.mark.parametrize("kernel", DENSE_KERNELS)
@pytest.mark.parametrize("dim", [16, 24])
def test_dense_kernel_far_tiles_equal_reference(device, kernel, dim):
    """16 x 16 tiles over inputs of 70 (5 query tiles, the last partial), 64 (full tiles only), 33 and 1
    tokens padded to 70, max_distance 5: query tiles with far key tiles on the left, the right, both
    and neither side of the near ones, a partial last key tile in and past the near band, scale 0.7; a
    head dim that is not a power of two (24: masked to 32); a register cap (maxnreg 128). Every row of
    every input, padding rows included (finite, over the input's keys, as the reference computes them)."""
    torch.manual_seed(3)
    heads = 3
    lengths = torch.tensor([70, 64, 33, 1], dtype=torch.int32, device=device)
    bias = distance_bias(torch.randn(6, heads, device=device), bidirectional=True, max_distance=5)
    for dtype in low_precision_dtypes(device):
        q, k, v = (torch.randn(4, 70, heads, dim, device=device).to(dtype) for _ in range(3))
        out = t5_dense_attention_triton(q, k, v, lengths, 0.7, bias, kernel=kernel, tiling=(16, 16, 4, 1, 128))
        ref = t5_dense_attention_ref(q.float(), k.float(), v.float(), lengths, 0.7, bias)
        for row in range(4):
            assert relative_error(out[row], ref[row]) < TOLERANCE[dtype], (dtype, row)


def test_dense_tma_kernel_reads_views_of_one_projection(device):
    """The TMA variant over q, k, v as the engine passes them (views of one (batch, L, 3, heads, dim) projection
    output, read as (batch x L, heads x dim) rows): inputs of 40, 23 and 9 tokens padded to 40 (their key tiles
    past the input read the next input's rows, hidden by the bias), 16 x 16 tiles, max_distance 6."""
    torch.manual_seed(6)
    heads, dim = 2, 16
    lengths = torch.tensor([40, 23, 9], dtype=torch.int32, device=device)
    bias = distance_bias(torch.randn(6, heads, device=device), bidirectional=True, max_distance=6)
    for dtype in low_precision_dtypes(device):
        q, k, v = torch.randn(3, 40, 3, heads, dim, device=device).to(dtype).unbind(2)
        out = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, kernel="tma", tiling=(16, 16, 4, 2))
        ref = t5_dense_attention_ref(q.float(), k.float(), v.float(), lengths, 1.0, bias)
        for row in range(3):
            assert relative_error(out[row], ref[row]) < TOLERANCE[dtype], (dtype, row)


@pytest.mark.parametrize("kernel, bias_vector", [("split", 4), ("ahead", 4), ("tma", 4)])
def test_dense_kernel_bias_vectors_equal_reference(device, kernel, bias_vector):
    """The bias read in runs of 4 floats (rows from copies i % 4 of the same table; the default, 2, runs in every
    other dense test) at the far-tiles test's shapes (16 x 16 tiles, inputs of 70, 64, 33 and 1
    tokens, max_distance 5)."""
    torch.manual_seed(5)
    heads, dim = 3, 16
    lengths = torch.tensor([70, 64, 33, 1], dtype=torch.int32, device=device)
    bias = distance_bias(torch.randn(6, heads, device=device), bidirectional=True, max_distance=5)
    for dtype in low_precision_dtypes(device):
        q, k, v = (torch.randn(4, 70, heads, dim, device=device).to(dtype) for _ in range(3))
        out = t5_dense_attention_triton(q, k, v, lengths, 0.7, bias, kernel=kernel, tiling=(16, 16, 4, 1),
                                        bias_vector=bias_vector)
        ref = t5_dense_attention_ref(q.float(), k.float(), v.float(), lengths, 0.7, bias)
        for row in range(4):
            assert relative_error(out[row], ref[row]) < TOLERANCE[dtype], (dtype, row)


@pytest.mark.parametrize("length, block_m", [(20, 16), (33, 64), (64, 64)])
def test_dense_distance_bias_covers_every_distance(length, block_m):
    """The split kernel's table: query row i's run of keys j (copy i % 4 from column zero - 4 * (i // 4)) holds
    log2(e) times the bias at distance j - i, for every query row of the padded tiles and every key, beyond
    max_distance too (clamped); runs start 16-byte aligned."""
    bias = distance_bias(torch.randn(8, 3), bidirectional=True, max_distance=6)
    table, zero = dense_distance_bias(bias, length, block_m)
    width = table.shape[2]
    assert zero % 16 == 0 and width % 16 == 0
    rows = torch.arange(-(-length // block_m) * block_m)
    starts = zero - 4 * (rows // 4)
    assert (starts % 4 == 0).all()
    keys = torch.arange(length)
    runs = table[:, rows.view(-1, 1) % 4, starts.view(-1, 1) + keys.view(1, -1)]  # (heads, rows, keys)
    expected = bias_of_distances(bias, keys.view(1, -1) - rows.view(-1, 1)) * 1.4426950408889634
    assert torch.allclose(runs, expected, rtol=1e-7, atol=0)
    assert torch.equal(table[:, 0, 0], bias[:, 0] * 1.4426950408889634)  # the far values the kernel reads
    assert torch.equal(table[:, 0, width - 1], bias[:, -1] * 1.4426950408889634)


def test_dense_table_made_once_per_bias_and_length(device):
    """The split kernel's table is kept per (bias table, length, query tile): a second call reuses it; another
    length, or the same bias changed in place, makes a new one whose output follows the change."""
    from kernels.t5_bias_attention import _DENSE_TABLES

    torch.manual_seed(4)
    bias = distance_bias(torch.randn(8, 2, device=device), bidirectional=True, max_distance=6)
    q, k, v = (torch.randn(2, 20, 2, 16, device=device) for _ in range(3))
    lengths = torch.tensor([20, 9], dtype=torch.int32, device=device)
    t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, kernel="split")
    first = _DENSE_TABLES[(id(bias), 20, 64)][2]
    t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, kernel="split")
    assert _DENSE_TABLES[(id(bias), 20, 64)][2] is first
    t5_dense_attention_triton(q[:, :17], k[:, :17], v[:, :17], lengths.clamp(max=17), 1.0, bias, kernel="split")
    assert _DENSE_TABLES[(id(bias), 17, 64)][2] is not first
    bias.mul_(-1.0)
    out = t5_dense_attention_triton(q, k, v, lengths, 1.0, bias, kernel="split")
    assert _DENSE_TABLES[(id(bias), 20, 64)][2] is not first
    ref = t5_dense_attention_ref(q, k, v, lengths, 1.0, bias)
    assert relative_error(out[0], ref[0]) < TOLERANCE[torch.float32] and relative_error(out[1, :9], ref[1, :9]) < 1e-5


@AOT_SM90
@pytest.mark.parametrize("kernel", DENSE_KERNELS)
def test_dense_kernels_compile_for_sm90_without_spills(kernel, tmp_path):
    """Each encoder kernel at its DENSE_TILINGS entry for Flan-T5-XL's heads (64 dims, max_distance 128, bf16):
    no spills (local memory or stack)."""
    from kernels.t5_bias_attention import DENSE_BIAS_VECTOR, DENSE_TILINGS, _t5_dense_kernel, _t5_dense_split_kernel

    block_m, block_n, warps, stages, *max_registers = DENSE_TILINGS[kernel]
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", bias_ptr="*fp32",
                    lengths_ptr="*i32")
    const = dict(REACH=128, HEAD_DIM=64, DIM_PAD=64, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="tf32")
    if kernel != "old":
        const.update(SPLIT_FAR=kernel != "gather", AHEAD=kernel == "ahead", BIAS_VECTOR=DENSE_BIAS_VECTOR,
                     TMA=kernel == "tma")
        descriptors = dict(q_desc=block_m, k_desc=block_n, v_desc=block_n)
        if kernel == "tma":  # TensorDescriptor arguments: (rows, head dim) bf16 tiles
            pointers.update({name: f"tensordesc<bf16[{rows}, 64]>" for name, rows in descriptors.items()})
        else:
            const.update(dict.fromkeys(descriptors))  # None
    unaligned = ("stride_bias", "seq_len") if kernel == "old" else ("seq_len",)
    compiled = compile_for_sm90(_t5_dense_kernel if kernel == "old" else _t5_dense_split_kernel, pointers, const,
                                warps=warps, stages=stages, floats=("scale_log2",),
                                aligned_int=lambda name: name not in unaligned, max_registers=(max_registers or [None])[0])
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage and "STACK:0 " in usage, usage
