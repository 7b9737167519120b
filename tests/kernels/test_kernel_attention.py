"""Paged KV write and attention: Triton kernels against the torch references.

Awkward sizes on purpose: odd token counts, prefixes ending exactly on and one past a page
boundary, GQA groups that are not powers of two (SmolLM2's 9/3 heads), a head_dim that is not
a power of two, shuffled block tables, and decode contexts long enough to be split.
The pool is filled with random values (never zeros) so a wrong gather cannot pass.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention import KV_FP8_DTYPE, decode_attention_ref, paged_attention, paged_attention_ref, write_kv_cache_ref
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error

# (num_heads, num_kv_heads, head_dim): Llama-3-8B, SmolLM2-135M, plain MHA with an odd head_dim.
HEAD_SHAPES = [(32, 8, 128), (9, 3, 64), (6, 6, 96)]


def make_batch(cached_and_new: list[tuple[int, int]], num_kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype, device: str, seed: int = 0, fill_pool: bool = True):
    """A pool holding each sequence's cached prefix, plus the new tokens' K/V and metadata.

    cached_and_new: per sequence (cached tokens, new tokens). Blocks are handed out shuffled.
    fill_pool=False: the pool left as torch.empty makes it, for a caller that fills it itself (random normals
    for hundreds of long contexts are seconds of CPU; the new tokens' K/V then come from other draws).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + n) // page_size) for c, n in cached_and_new]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(1, num_blocks))  # block 0 stays unused: it is the table's padding value
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in blocks_needed]
    max_blocks = max(blocks_needed)
    pool_shape = (num_blocks, page_size, num_kv_heads, head_dim)
    if fill_pool:
        k_cache = torch.randn(pool_shape, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(pool_shape, generator=gen).to(dtype).to(device)
    else:
        k_cache = torch.empty(pool_shape, dtype=dtype, device=device)
        v_cache = torch.empty(pool_shape, dtype=dtype, device=device)
    slots, cu, ctx = [], [0], []
    for (cached, new), table in zip(cached_and_new, tables):
        slots += [table[p // page_size] * page_size + p % page_size for p in range(cached, cached + new)]
        cu.append(cu[-1] + new)
        ctx.append(cached + new)
    num_tokens = cu[-1]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        max_seqlen_q=max(n for _, n in cached_and_new),
        max_context_len=max(ctx),
        is_decode_only=all(n == 1 for _, n in cached_and_new),
        cu_seqlens_q_host=cu,
        context_lens_host=ctx,
    )
    return k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("fp8_pool", [False, True])
def test_batched_decode_reference_equals_the_per_sequence_reference(heads, softcap, fp8_pool):
    """The CPU decode path (one pass over the batch) against the per-sequence reference: contexts
    of 1 token, one page exactly, one past it and long ones, side by side."""
    num_heads, num_kv_heads, head_dim = heads
    cases = [(0, 1), (15, 1), (16, 1), (40, 1), (3, 1), (127, 1)]
    k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 16, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    if fp8_pool:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
    q = torch.randn(len(cases), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    expected = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5, logit_softcap=softcap)
    got = decode_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5, logit_softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # ... and it is what the CPU dispatch takes for such a batch (a window keeps the loop)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, logit_softcap=softcap),
                               got, rtol=0, atol=0)


def test_reference_matches_dense_causal_attention():
    """The oracle itself, on CPU: one sequence in one contiguous page run equals dense SDPA."""
    k, v, k_cache, v_cache, meta = make_batch([(0, 37)], 2, 16, 8, torch.float32, "cpu")
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(37, 4, 16)
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True, scale=0.25,
    ).transpose(0, 1)
    assert relative_error(out, dense) < 1e-5


def dense_attention(q, k, v, scale, sliding_window=None, logit_softcap=None):
    """One sequence, every key in hand: q (n, heads, d), k/v (n, kv_heads, d), masked dense math."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window  # transformers: kv_idx > q_idx - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).float()


@pytest.mark.parametrize("window,softcap", [(8, None), (5, 3.0), (1, None), (64, 2.0), (None, 1.5)])
@pytest.mark.parametrize("chunks", [[37], [11, 1, 1, 17, 7]])
def test_reference_window_and_softcap_match_dense_masked_attention(window, softcap, chunks):
    """A 37-token sequence fed in chunks (prefill, decode steps, more chunks) through pages of 4:
    each chunk's output equals the dense masked computation's rows, with the entries of blocks
    wholly outside the window freed (-1) as the executor frees them: the reference never reads them."""
    num_heads, num_kv_heads, head_dim, page = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(3)
    total = sum(chunks)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    dense = dense_attention(q, k, v, 0.3, window, softcap)
    table = random.Random(0).sample(range(20), -(-total // page))
    k_cache, v_cache = torch.randn(20, page, num_kv_heads, head_dim), torch.randn(20, page, num_kv_heads, head_dim)
    start = 0
    for n in chunks:
        end = start + n
        dead = 0 if window is None else max(0, start - window + 1) // page
        meta = one_sequence_chunk(start, end, table, page, dead_blocks=dead)
        write_kv_cache_ref(k[start:end], v[start:end], k_cache, v_cache, meta.slot_mapping)
        out = paged_attention_ref(q[start:end], k_cache, v_cache, meta, 0.3, sliding_window=window,
                                  logit_softcap=softcap)
        assert relative_error(out, dense[start:end]) < 1e-5, (start, end)
        start = end


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same (blocks, page, kv_heads, head_dim) values stored as the runner stores its pool: each
    KV head's page one contiguous run (engine/executor/runner.py allocate_kv_cache)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_write_kv_cache_matches_reference(device, page_size, layout):
    from kernels.triton_attention import write_kv_cache_triton

    for dtype in low_precision_dtypes(device):
        k, v, k_cache, v_cache, meta = make_batch([(5, 27), (0, 1), (31, 33)], 8, 128, page_size, dtype, device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_cache_ref(k, v, k_ref, v_ref, meta.slot_mapping)
        if layout == "head_major":
            k_cache, v_cache = head_major(k_cache), head_major(v_cache)
            k_ref_hm, v_ref_hm = head_major(k_cache), head_major(v_cache)
            write_kv_cache_ref(k, v, k_ref_hm, v_ref_hm, meta.slot_mapping)  # the reference writes through strides too
            assert torch.equal(k_ref_hm, k_ref) and torch.equal(v_ref_hm, v_ref)
        write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_pool", [False, True])
def test_attention_reads_a_head_major_pool_as_a_token_major_one(device, fp8_pool):
    """The runner's pool layout (each KV head's page contiguous) through the kernels' strides: prompt
    chunks, decode rows and a mixed batch give exactly what the same values in a token-major pool give."""
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    if fp8_pool and device == "cpu":
        pytest.skip("the interpreter has no float8 loads")
    for batch in ([(0, 37), (20, 45)], [(40, 1), (90, 1), (3, 1)], [(0, 30), (70, 1), (33, 1)]):
        k, v, k_cache, v_cache, meta = make_batch(batch, 2, 64, 16, torch.bfloat16 if device != "cpu" else
                                                  torch.float32, device)
        if fp8_pool:
            k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        k_hm, v_hm = head_major(k_cache), head_major(v_cache)
        write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        write_kv_cache_triton(k, v, k_hm, v_hm, meta.slot_mapping)
        assert torch.equal(k_hm.view(torch.uint8), k_cache.view(torch.uint8))
        q = torch.randn(k.shape[0], 8, 64, generator=torch.Generator().manual_seed(3)).to(k.dtype).to(device)
        expected = paged_attention_triton(q, k_cache, v_cache, meta, 0.125)
        assert torch.equal(paged_attention_triton(q, k_hm, v_hm, meta, 0.125), expected)


@pytest.mark.gpu
def test_write_kv_cache_reads_strided_views_and_skips_negative_slots(device):
    """K/V arrive as column views of the fused qkv output; slot -1 (graph padding) writes nothing."""
    from kernels.triton_attention import write_kv_cache_triton

    k, v, k_cache, v_cache, meta = make_batch([(3, 9)], 2, 64, 16, torch.float32, device)
    qkv = torch.randn(9, (4 + 2 + 2) * 64, device=device)
    k, v = qkv[:, 256:384].view(9, 2, 64), qkv[:, 384:].view(9, 2, 64)
    slots = meta.slot_mapping.clone()
    slots[4] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache_ref(k[keep], v[keep], k_ref, v_ref, slots[keep])
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def run_attention_case(device, dtype, heads, page_size, cached_and_new, num_splits=None, seed=0,
                       sliding_window=None, logit_softcap=None, decode_splits=None):
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    num_heads, num_kv_heads, head_dim = heads
    k, v, k_cache, v_cache, meta = make_batch(cached_and_new, num_kv_heads, head_dim, page_size, dtype, device, seed)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    if sliding_window is not None:
        free_out_of_window_entries(meta, sliding_window, page_size)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    options = dict(sliding_window=sliding_window, logit_softcap=logit_softcap)
    if decode_splits is not None:  # as a decode graph's replay asks (engine/executor/cuda_graphs.py)
        meta.decode_splits = torch.tensor([decode_splits], dtype=torch.int32, device=device)
        meta.decode_split_plan = (num_kv_heads, 528, 132)  # as the capture of a mid-size bucket sets it
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, **options)
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=num_splits, **options)
    err = relative_error(out, ref)
    assert err < TOLERANCE[dtype], (f"{dtype} {heads} page={page_size} splits={num_splits} {options}: "
                                    f"rel err {err:.2e}")


def one_sequence_chunk(start: int, end: int, table: list[int], page: int, dead_blocks: int = 0) -> AttentionMetadata:
    """Metadata of one sequence's tokens start..end-1, after a cached prefix of ``start`` tokens, on the
    pages ``table`` (page i holds positions i*page .. i*page+page-1). The first ``dead_blocks`` entries
    of the block table are freed (-1), as the executor frees blocks wholly outside a sliding window."""
    n = end - start
    block_table = [-1] * dead_blocks + table[dead_blocks:-(-end // page)]
    return AttentionMetadata(
        slot_mapping=torch.tensor([table[p // page] * page + p % page for p in range(start, end)]),
        block_tables=torch.tensor([block_table], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, n]),
        context_lens=torch.tensor([end]), max_seqlen_q=n, max_context_len=end, is_decode_only=n == 1,
        cu_seqlens_q_host=[0, n], context_lens_host=[end])


def free_out_of_window_entries(meta: AttentionMetadata, sliding_window: int, page_size: int) -> None:
    """Mark the block-table entries no query of the batch can see as freed (-1), as the executor
    does once the blocks go back to the pool: a kernel that read one would fault or differ."""
    for i, (start, end) in enumerate(zip(meta.cu_seqlens_q_host, meta.cu_seqlens_q_host[1:])):
        first_query = meta.context_lens_host[i] - (end - start)
        dead = max(0, first_query - sliding_window + 1) // page_size
        meta.block_tables[i, :dead] = -1


# Prefill chunks over cached prefixes: empty prefix, prefix ending on a page boundary (32) and
# one past it (33), odd chunk lengths, and a decode row riding in the same batch.
PREFILL_BATCH = [(0, 37), (32, 17), (33, 1), (15, 64), (0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_prefill_with_cached_prefix_matches_reference(device, heads, page_size):
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, page_size, PREFILL_BATCH)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_matches_reference(device, heads, num_splits):
    """Contexts 1, 16, 17 and 300 tokens; forced splits exercise the merge with empty splits."""
    batch = [(0, 1), (15, 1), (16, 1), (299, 1)]
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, 16, batch, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("active", [1, 2, 3, 4, 16])
def test_decode_runs_the_splits_a_graph_replay_asks_for(device, active):
    """A decode graph's launch captures 4 splits; its replay uses min(active, 4) of them (the others
    return at once, the merge reads only those): every count matches the reference, with the
    in-kernel merge of empty splits too (contexts 1 and 16 have fewer tiles than splits)."""
    batch = [(0, 1), (15, 1), (299, 1), (700, 1)]
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, (8, 2, 64), 16, batch, num_splits=4, decode_splits=active)


# A mixed batch whose decode rows read contexts long enough to split, between and after prompt
# chunks, and one prompt chunk of a single token (a chunked prompt's last token: a decode row to the
# kernel, which is the same attention).
MIXED_BATCH = [(0, 37), (299, 1), (32, 17), (40, 1), (170, 1), (15, 64), (64, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEAD_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("short_step", ["one launch", "split prompt launch", "unsplit"])
def test_mixed_batch_decode_rows_in_their_own_launch_match_reference(device, heads, num_splits, short_step,
                                                                     monkeypatch):
    """A mixed batch runs its prompt chunks and its decode rows in two launches (decode rows with
    decode tiles, split and merged per sequence when num_splits > 1): every row matches the reference.
    This batch has few prefill tiles, a short step (kernels/triton_attention.py _short_step_splits): where
    its keys split at all, "one launch" runs every sequence in one split launch of prefill tiles, "split
    prompt launch" splits the prompt chunks' launch and keeps the decode rows' own launch; "unsplit"
    takes the prompt chunks' launch unsplit, as large steps do."""
    if short_step == "unsplit":
        monkeypatch.setattr("kernels.triton_attention.SHORT_STEP_PROGRAMS", 0)
    if short_step == "split prompt launch":
        monkeypatch.setattr("kernels.triton_attention.SHORT_STEP_ONE_LAUNCH", 0)
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, 16, MIXED_BATCH, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("fp8_pool", [False, True])
def test_mixed_batch_through_a_tile_map_with_padding_sequences(device, window, fp8_pool):
    """The CUDA-graph form of a mixed step (engine/executor/prefill_graphs.py): a fixed-length tile map
    with unused entries (-1), and sequence rows past the batch with no new tokens and no context. Both
    launches skip those; the batch's rows match the reference."""
    from engine.executor.prefill_graphs import tile_map
    from kernels.triton_attention import paged_attention_triton, prefill_tokens_per_tile, write_kv_cache_triton

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    dtype = low_precision_dtypes(device)[0]
    if fp8_pool and device != "cuda":
        pytest.skip("FP8 pools need the GPU")
    k, v, k_cache, v_cache, meta = make_batch(MIXED_BATCH, num_kv_heads, head_dim, 16, dtype, device, seed=7)
    if fp8_pool:  # its prompt chunks take other tiles (kernels/triton_attention.py _prefill_config)
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    if window is not None:
        free_out_of_window_entries(meta, window, 16)
    q = torch.randn(k.shape[0], num_heads, head_dim, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=window)

    padding_seqs = 3
    q_lens = [new for _, new in MIXED_BATCH] + [0] * padding_seqs
    per_tile = prefill_tokens_per_tile(num_heads // num_kv_heads, head_dim, k_cache.element_size(), k_cache.device)
    tile_seq, tile_m = tile_map(q_lens, per_tile, 64)
    cu = meta.cu_seqlens_q_host + [meta.cu_seqlens_q_host[-1]] * padding_seqs
    table = meta.block_tables
    graph_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=torch.cat([table, torch.zeros(padding_seqs, table.shape[1], dtype=table.dtype, device=device)]),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(meta.context_lens_host + [0] * padding_seqs, dtype=torch.int32, device=device),
        max_seqlen_q=k.shape[0], max_context_len=4096, is_decode_only=False,
        tile_seq=torch.from_numpy(tile_seq).to(device), tile_m=torch.from_numpy(tile_m).to(device),
        tile_tokens=per_tile,
    )
    out = paged_attention_triton(q, k_cache, v_cache, graph_meta, scale, sliding_window=window)
    assert relative_error(out, ref) < TOLERANCE[dtype]


# Windows shorter than, equal to and longer than a page, one that cuts a page in the middle, and a
# window of 1 (each token sees itself only); soft-caps small enough to bend the scores.
WINDOW_CASES = [(8, None), (16, None), (37, 5.0), (1, None), (None, 2.0), (100, 50.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 4, 256)])
def test_prefill_with_window_and_softcap_matches_reference(device, heads, window, softcap):
    """Mixed prefill batch; entries of blocks outside every window are freed (-1) first."""
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, heads, 16, PREFILL_BATCH, sliding_window=window, logit_softcap=softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_with_window_and_softcap_matches_reference(device, window, softcap, num_splits):
    """Split-K decode over a window: splits start at the window, empty splits merge away."""
    batch = [(0, 1), (15, 1), (16, 1), (299, 1), (40, 1)]
    for dtype in low_precision_dtypes(device):
        run_attention_case(device, dtype, (8, 4, 256), 16, batch, num_splits=num_splits,
                           sliding_window=window, logit_softcap=softcap)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="long contexts are too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_long_context_with_window_reads_only_the_window(dtype):
    """Gemma-3-sized window (1024) over 8k contexts, decode (automatic splits) and a 2k chunk."""
    run_attention_case("cuda", dtype, (16, 8, 256), 16, [(8190, 1), (4097, 1), (1, 1)], sliding_window=1024)
    run_attention_case("cuda", dtype, (16, 8, 256), 16, [(1000, 2047), (0, 129)], sliding_window=1024,
                       logit_softcap=50.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="long contexts are too slow for the CPU interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_decode_and_prefill(dtype):
    """8k-token decode contexts (split path chosen automatically) and a 2k-token prefill chunk."""
    run_attention_case("cuda", dtype, (32, 8, 128), 16, [(8190, 1), (4097, 1), (1, 1)])
    run_attention_case("cuda", dtype, (32, 8, 128), 16, [(1000, 2047), (0, 129)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compiled kernel's resources exist on CUDA only")
def test_decode_launch_records_its_tilings_residency_and_splits_by_waves_after():
    """The first decode launch of a tiling records how many of its programs an SM holds; the launch
    after it chooses its splits by waves (_decode_split_cost) and still matches the reference."""
    from kernels import triton_attention

    triton_attention._DECODE_RESIDENT.clear()
    run_attention_case("cuda", torch.bfloat16, (32, 8, 128), 16, [(3000, 1)] * 40)
    assert triton_attention._DECODE_RESIDENT, "no residency recorded"
    assert all(1 <= n <= 32 for n in triton_attention._DECODE_RESIDENT.values())
    run_attention_case("cuda", torch.bfloat16, (32, 8, 128), 16, [(3000, 1)] * 40)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 pools are read by the Triton kernel on CUDA only")
@pytest.mark.parametrize("q_magnitude,equal_keys", [(1.0, False), (1e5, True)])
@pytest.mark.parametrize("batch", [PREFILL_BATCH, [(0, 1), (16, 1), (299, 1)]], ids=["prefill", "decode"])
@pytest.mark.parametrize("large_batch_tiles", [False, True])
def test_fp8_pool_fp16_math_matches_reference(batch, q_magnitude, equal_keys, large_batch_tiles, monkeypatch):
    """An FP8 pool is read with fp16 math (E4M3 widens to fp16 exactly, q carries the softmax
    scale): prompt chunks over cached prefixes and decode rows match the reference, which works in
    fp32. Queries of 1e5 are beyond fp16's 65504 and would become inf if q were cast before it is
    scaled; with every key equal the scores tie whatever q is, so the output is the mean of the
    visible values, which the reference computes too. Decode rows take other tiles from
    FP8_SHORT_CONTEXT_BATCH sequences on: large_batch_tiles lowers that bound to 1."""
    from kernels import triton_attention
    from kernels.attention import KV_FP8_DTYPE
    from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

    if large_batch_tiles:
        monkeypatch.setattr(triton_attention, "FP8_SHORT_CONTEXT_BATCH", 1)

    num_heads, num_kv_heads, head_dim = 32, 8, 128
    k, v, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda", seed=3)
    k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
    if equal_keys:
        k_cache[:] = k_cache[0, 0]
        k[:] = k_cache[0, 0].to(k.dtype)
    write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    gen = torch.Generator().manual_seed(4)
    q = (torch.randn(k.shape[0], num_heads, head_dim, generator=gen) * q_magnitude).to(torch.bfloat16).cuda()
    scale = head_dim**-0.5
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_decode_split_count_is_a_bounded_power_of_two():
    pytest.importorskip("triton")
    from kernels.triton_attention import _decode_num_splits

    assert _decode_num_splits(1, 8, 8192, 132, 64) == 16  # batch 1, long context: fill the GPU, up to the cap
    assert _decode_num_splits(8, 8, 8192, 132, 64) == 8  # 64 programs a split: 5 cover the GPU twice, 8 a power of 2
    assert _decode_num_splits(1, 8, 100, 132, 64) == 1  # too short to split
    assert _decode_num_splits(256, 8, 8192, 132, 64) == 1  # the batch fills the GPU already
    for n in (1, 3, 17, 64):
        splits = _decode_num_splits(n, 8, 2000, 132, 64)
        assert splits & (splits - 1) == 0 and 1 <= splits <= 16


def test_decode_splits_fill_whole_waves(monkeypatch):
    """Once a decode tiling has run, its split count is the one whose programs fill their waves best
    (kernels/triton_attention.py _decode_split_cost). The cases are the H100's measured ones under its
    policy ($TRITONLLM_DECODE_SPLIT_POLICY=h100): 4 programs of the FP8 pool's 64-key tiling an SM, 132 SMs,
    Llama-8B's 8 KV heads."""
    pytest.importorskip("triton")
    from kernels.triton_attention import DECODE_SPLIT_POLICY_ENV, _decode_num_splits

    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h100")

    def splits(seqs, keys, resident=4):
        return _decode_num_splits(seqs, 8, keys, 132, 64, resident)

    assert [splits(n, 5250) for n in (128, 194, 256)] == [1, 1, 1]  # whole waves of 528 programs
    assert splits(208, 5250) == 4  # 1,664 programs: a fourth wave of 80; 4 splits measured 10% faster
    assert splits(160, 5250) == 2 and splits(224, 5250) == 2
    assert splits(96, 6000) == 2  # 768 programs: one whole wave and a part-filled one
    assert splits(48, 21000) == 1 and splits(32, 21000) == 2  # within one wave: enough programs to cover the GPU twice
    assert splits(264, 2500) == 1
    assert splits(1, 8192) == 16 and splits(1, 100) == 1  # fill the GPU, but not past 2 tiles a split
    assert splits(1024, 22000, resident=12) == 1  # 4 waves or more: never split
    for n in (1, 3, 17, 64, 100, 300):
        count = splits(n, 9000)
        assert count & (count - 1) == 0 and 1 <= count <= 16


def test_decode_splits_by_the_h200_policy_where_measured_fastest(monkeypatch):
    """The H200's powers-of-two policy ("h200", the default until "h200-any": kernels/triton_attention.py
    SPLIT_POLICIES) on its measured cases: 4 or 5 programs of the FP8 pool's 64-key tiling an SM (its recorded residency varied between compiles), 132 SMs,
    Llama-8B's 8 KV heads. Each count is the fastest measured or within 3.5% of it (48 x 21,000: 4 splits 614 us,
    8 635, 1 785), at either residency; the H100's policy took 48 x 21,000 to 1 split and, at 5 an SM,
    256 x 20,480 / 8,192 to 8 (3,283 / 1,380 us against ~3,170 / ~1,250 with 1)."""
    pytest.importorskip("triton")
    from kernels.triton_attention import DECODE_SPLIT_POLICY_ENV, _decode_num_splits

    def splits(seqs, keys, resident):
        return _decode_num_splits(seqs, 8, keys, 132, 64, resident)

    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h200")
    for resident in (4, 5):
        assert splits(8, 20480, resident) == 8 and splits(64, 20480, resident) == 1
        assert splits(256, 20480, resident) == splits(256, 8192, resident) == splits(256, 2048, resident) == 1
    assert splits(48, 21000, 4) == 4 and splits(48, 21000, 5) == 8
    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h100")
    assert splits(48, 21000, 4) == splits(48, 21000, 5) == 1
    assert splits(256, 20480, 5) == splits(256, 8192, 5) == 8
    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h300")
    with pytest.raises(ValueError, match="h300"):
        splits(48, 21000, 4)


def test_decode_graphs_of_mid_size_buckets_take_their_splits_per_replay(monkeypatch):
    """A decode graph's capture (meta.decode_splits set) of a bucket between twice the SMs' count of programs and
    the policy's unsplit waves records its split plan (decode_active_splits then picks each replay's count) and
    captures DYNAMIC_SPLITS_CAPTURED splits; smaller buckets keep one count. Under the H100's policy the plan began
    only past one wave (48 sequences of 8 KV heads, 384 programs, 660 on the GPU, kept 1 split)."""
    pytest.importorskip("triton")
    from kernels import triton_attention
    from kernels.triton_attention import (DECODE_SPLIT_POLICY_ENV, DYNAMIC_SPLITS_CAPTURED, _decode_config,
                                          _decode_tiling, _decode_tiling_key, fp8_widening)

    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)
    monkeypatch.delenv(triton_attention.FP8_WIDEN_ENV, raising=False)
    monkeypatch.setattr(triton_attention, "_DECODE_RESIDENT", {})
    device = torch.device("cpu")
    tiling = _decode_tiling(48, 16, False, 1, False)
    triton_attention._DECODE_RESIDENT[_decode_tiling_key(device, 16, tiling, 128, 1, fp8_widening(tiling[0]))] = 5

    def captured(num_seqs):
        meta = AttentionMetadata(slot_mapping=None, block_tables=None, cu_seqlens_q=None,
                                 context_lens=torch.zeros(num_seqs), max_seqlen_q=1, max_context_len=22016,
                                 is_decode_only=True, decode_splits=torch.ones(1, dtype=torch.int32))
        splits = _decode_config(meta, 4, 8, device, None, None, 128, 1)[4]
        return meta.decode_split_plan, splits

    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h200")
    assert captured(48) == ((8, 660, 132), DYNAMIC_SPLITS_CAPTURED)
    assert captured(8) == (None, 8)  # 64 programs: the covering rule's one count
    monkeypatch.delenv(DECODE_SPLIT_POLICY_ENV, raising=False)  # the default, "h200-any": any count up to 8
    assert captured(48) == ((8, 660, 132), 8) and captured(8) == (None, 8)
    monkeypatch.setenv(DECODE_SPLIT_POLICY_ENV, "h100")
    assert captured(48) == (None, 1)
    assert captured(96)[0] == (8, 660, 132)  # 768 programs: past one wave


def test_decode_reads_through_tma_only_where_measured_faster(monkeypatch):
    """The decode tiling's TMA flag (kernels/triton_attention.py FP8_TMA_BATCH): FP8 pools the TMA unit
    can read, 16-row tiles of 128-wide heads, 384-767 sequences; never bf16 pools, wide heads, larger
    GQA groups, smaller or larger batches, or a pool it cannot read."""
    pytest.importorskip("triton")
    from kernels import triton_attention
    from kernels.triton_attention import FP8_SHORT_CONTEXT_BATCH, FP8_TMA_BATCH, _decode_config

    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)

    def config(num_seqs, group=4, dim_pad=128, kv_itemsize=1, tma_pages=True):
        meta = AttentionMetadata(slot_mapping=None, block_tables=None, cu_seqlens_q=None,
                                 context_lens=torch.zeros(num_seqs), max_seqlen_q=1, max_context_len=1500,
                                 is_decode_only=True)
        return _decode_config(meta, group, 8, torch.device("cpu"), None, None, dim_pad, kv_itemsize, tma_pages)

    for num_seqs in (FP8_TMA_BATCH, 544, FP8_SHORT_CONTEXT_BATCH - 1):
        assert config(num_seqs)[1:] == (32, 1, 6, 1, True)
    for num_seqs in (1, 48, FP8_TMA_BATCH - 1, FP8_SHORT_CONTEXT_BATCH, 1024):
        assert config(num_seqs)[5] is False
    assert config(544, tma_pages=False)[5] is False
    assert config(544, kv_itemsize=2)[5] is False
    assert config(544, dim_pad=256)[5] is False
    assert config(544, group=32)[5] is False


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64), (8, 4, 256)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("fp8_pool", [False, True])
def test_decode_with_rotary_and_kv_append_matches_separate_kernels(device, heads, num_splits, fp8_pool):
    """At decode the attention kernel rotates q and k and appends k and v itself
    (kernels/rope_attention.py). Against rotary_and_write_kv + paged_attention as two kernels: the same
    cache bytes and the same output; against the torch references: within the dots' rounding. The new
    key ends a page (context 16), starts one (17), is the only key (1), lies deep in a split (300), and
    one row has slot -1 (a CUDA graph's padding row), which must write nothing (its output is unused)."""
    from kernels.attention import KV_FP8_DTYPE
    from kernels.rotary import build_cos_sin_cache, rotary_and_write_kv_ref, rotary_and_write_kv_triton
    from kernels.triton_attention import paged_attention_triton

    if fp8_pool and device != "cuda":
        pytest.skip("FP8 pools need the GPU")
    num_heads, num_kv_heads, head_dim = heads
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = [(0, 1), (15, 1), (16, 1), (299, 1), (40, 1)]
    k, v, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, dtype, device, seed=5)
    if fp8_pool:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
    meta.slot_mapping[4] = -1
    positions = (meta.context_lens - 1).long()
    cos_sin = build_cos_sin_cache(4096, head_dim, 500000.0, device=device)
    q = torch.randn(len(batch), num_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    scale = head_dim**-0.5

    k_split, v_split, q_split = k_cache.clone(), v_cache.clone(), q.clone()
    rotated = rotary_and_write_kv_triton(q_split, k, v, positions, cos_sin, k_split, v_split, meta.slot_mapping)
    out_split = paged_attention_triton(rotated, k_split, v_split, meta, scale, num_splits=num_splits)

    k_fused, v_fused, q_before, k_before = k_cache.clone(), v_cache.clone(), q.clone(), k.clone()
    out = paged_attention_triton(q, k_fused, v_fused, meta, scale, num_splits=num_splits,
                                 new_kv=(k, v, positions, cos_sin))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # the inputs are left unrotated
    assert torch.equal(k_fused.view(torch.uint8), k_split.view(torch.uint8))
    assert torch.equal(v_fused.view(torch.uint8), v_split.view(torch.uint8))
    padding_row_block = meta.block_tables[4, 40 // 16].item()  # position 40 of the slot -1 row: untouched
    assert torch.equal(k_fused[padding_row_block, 40 % 16].view(torch.uint8),
                       k_cache[padding_row_block, 40 % 16].view(torch.uint8))
    # A padding row's output is never used (and its new key, never written, is not in the pool).
    assert relative_error(out[:4], out_split[:4]) < TOLERANCE[dtype] / 10

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = meta.slot_mapping >= 0
    q_ref = rotary_and_write_kv_ref(q.clone()[keep], k[keep], v[keep], positions[keep], cos_sin, k_ref, v_ref,
                                    meta.slot_mapping[keep])
    ref = paged_attention_ref(torch.cat([q_ref, rotated[~keep]]), k_ref, v_ref, meta, scale)
    assert relative_error(out[:4], ref[:4]) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [4])  # (the new key in one of the splits)
def test_decode_with_qk_norm_matches_the_norm_then_the_kernel(device, num_splits):
    """qk_norm (Qwen3's per-head q/k RMSNorms, kernels/rope_attention.py): the decode kernel normalizes the raw q
    and new k itself, before rotating them. Against kernels/rmsnorm.py's per-head norm then the kernel with
    new_kv: the same cache rows and output, up to the norm's sums in another order (float32 here, bf16 on CUDA:
    a rounding step of a few values)."""
    from kernels.rmsnorm import rms_norm
    from kernels.rotary import build_cos_sin_cache
    from kernels.triton_attention import paged_attention_triton

    num_heads, num_kv_heads, head_dim = 4, 2, 32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = [(15, 1), (40, 1)]
    k, v, k_cache, v_cache, meta = make_batch(batch, num_kv_heads, head_dim, 16, dtype, device, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = (3 * torch.randn(len(batch), num_heads, head_dim, generator=gen)).to(dtype).to(device)
    k = 3 * k
    q_weight, k_weight = [(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)]
    positions = (meta.context_lens - 1).long()
    cos_sin = build_cos_sin_cache(512, head_dim, 10000.0, device=device)
    scale, eps = head_dim**-0.5, 1e-6

    q_normed, k_normed = (rms_norm(t.reshape(-1, head_dim), w, eps)[0].view(t.shape)
                          for t, w in ((q, q_weight), (k, k_weight)))
    k_two, v_two = k_cache.clone(), v_cache.clone()
    out_two = paged_attention_triton(q_normed, k_two, v_two, meta, scale, num_splits=num_splits,
                                     new_kv=(k_normed, v, positions, cos_sin))
    k_one, v_one = k_cache.clone(), v_cache.clone()
    out_one = paged_attention_triton(q, k_one, v_one, meta, scale, num_splits=num_splits,
                                     new_kv=(k, v, positions, cos_sin), qk_norm=(q_weight, k_weight, eps))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(k_one, k_two, rtol=tolerance, atol=tolerance)
    assert torch.equal(v_one, v_two)
    assert relative_error(out_one, out_two) < tolerance
    assert relative_error(q_normed, q) > 0.5 and relative_error(k_normed, k) > 0.5  # (the norms change them)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("fp8_pool", [False, True])
@pytest.mark.parametrize("rotary_append", [False, True])
def test_decode_reads_a_head_major_pool_through_tma_as_through_pointers(
        device, page_size, num_splits, fp8_pool, rotary_append, monkeypatch):
    """Decode tiles of one page's rows read a head-major pool through TMA descriptors
    (kernels/triton_attention.py _tma_descriptors): the same output as the pointer loads
    ($TRITONLLM_DECODE_TMA=0) and as the reference, the same cache bytes with the in-kernel
    append. Contexts end on a tile (16, 32, 64: with the append, the new key closes a whole tile,
    which must take the pointer walk), start one (17, 33) and run long (300, split 4 ways)."""
    from kernels import triton_attention
    from kernels.rotary import build_cos_sin_cache

    if fp8_pool and device != "cuda":
        pytest.skip("FP8 pools need the GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = [(0, 1), (15, 1), (16, 1), (31, 1), (32, 1), (63, 1), (299, 1)]
    k, v, k_cache, v_cache, meta = make_batch(batch, 8, 128, page_size, dtype, device, seed=9)
    if fp8_pool:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    chosen = triton_attention._decode_config
    monkeypatch.setattr(triton_attention, "_decode_config",
                        lambda *a, **kw: (16, page_size, 2, 3, chosen(*a, **kw)[4], True))
    assert triton_attention._tma_descriptors(k_cache, v_cache, page_size) is not None
    q = torch.randn(len(batch), 32, 128, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    new_kv = None
    if rotary_append:
        new_kv = (k, v, (meta.context_lens - 1).long(), build_cos_sin_cache(512, 128, 500000.0, device=device))
    else:
        triton_attention.write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    outs, caches = [], []
    for tma in ("1", "0"):
        monkeypatch.setenv(triton_attention.DECODE_TMA_ENV, tma)
        k_run, v_run = k_cache.clone(), v_cache.clone()
        outs.append(triton_attention.paged_attention_triton(q, k_run, v_run, meta, 128**-0.5, num_splits=num_splits,
                                                            new_kv=new_kv))
        caches.append((k_run.view(torch.uint8), v_run.view(torch.uint8)))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert relative_error(outs[0], outs[1]) < 1e-6
    if not rotary_append:
        ref = paged_attention_ref(q, k_cache, v_cache, meta, 128**-0.5)
        assert relative_error(outs[0], ref) < TOLERANCE[dtype]


def test_small_heads_pad_the_dot_operand_to_16():
    """A compiled tl.dot needs K >= 16 (the interpreter does not check it): tiny models' 8-wide heads
    run in a 16-wide tile with the dims past head_dim masked, and skip the fused rotary append
    (which pairs dims unmasked) and TMA (whose box is head_dim wide)."""
    from kernels.triton_attention import attention_dim_pad, fuses_new_kv

    assert [attention_dim_pad(d) for d in (4, 8, 12, 16, 96, 128)] == [16, 16, 16, 16, 128, 128]
    assert not fuses_new_kv(8) and fuses_new_kv(16) and not fuses_new_kv(96) and fuses_new_kv(128)


@pytest.mark.gpu
def test_tiny_heads_match_reference(device):
    """head_dim 8 (the tiny hybrid and encoder-decoder models): prefill chunks and split decodes."""
    run_attention_case(device, torch.float32, (4, 2, 8), 16, [(0, 19), (16, 1)])
    run_attention_case(device, torch.float32, (4, 2, 8), 16, [(0, 1), (40, 1)], num_splits=2)
