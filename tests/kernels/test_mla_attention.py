"""Latent attention (kernels/mla_attention.py): the torch reference against per-head attention with
the up-projections expanded (what transformers computes), over prefill chunks on shuffled pages and
cached prefixes; then the Triton kernels (GPU, or TRITON_INTERPRET=1 on CPU) against the reference,
decode rows and mixed chunks, model dtypes and an FP8 pool, and the latent write skipping slot -1.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip, strides_but_block_table
from kernels.attention import KV_FP8_DTYPE
from kernels.attention_metadata import AttentionMetadata
from kernels import mla_attention as mla_attention_module
from kernels.mla_attention import (MIN_SPAN, mla_attention_ref, mla_attention_triton, write_latent_cache_ref,
                                   write_latent_cache_triton)
from kernels.mla_expanded import expanded_min_tokens, mla_expanded_prefill, split_long

HEADS, RANK, ROPE, NOPE, V_DIM, PAGE = 5, 24, 8, 12, 10, 4


def paged_batch(context_lens: list[int], q_lens: list[int], *, device: str = "cpu", num_blocks: int = 64,
                seed: int = 0, dtype=torch.float32, cache_dtype=None, page: int = PAGE, rank: int = RANK,
                rope: int = ROPE):
    """Sequences whose new tokens are the last q_len of context_len, on shuffled pages; every cached
    row (prefix and new) written through write_latent_cache_ref. Returns (rows (keys, R + P) per
    sequence, cache, meta); rows of ``rank`` + ``rope`` values (the module's small shape unless given)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, slots, rows = [], [], []
    for context_len in context_lens:
        table = [free.pop() for _ in range(-(-context_len // page))]
        tables.append(table)
        seq_rows = torch.randn(context_len, rank + rope, generator=gen).to(dtype)
        rows.append(seq_rows)
        slots.append(torch.tensor([table[p // page] * page + p % page for p in range(context_len)]))
    cache = torch.zeros(num_blocks, page, rank + rope, dtype=cache_dtype or dtype)
    for seq_rows, seq_slots in zip(rows, slots):
        write_latent_cache_ref(seq_rows[:, :rank], seq_rows[:, rank:], cache, seq_slots)
    width = max(len(t) for t in tables)
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens), max_context_len=max(context_lens), is_decode_only=max(q_lens) == 1,
        cu_seqlens_q_host=cu, context_lens_host=list(context_lens))
    return rows, cache.to(device), meta


def expanded_attention(q_nope, q_rope, rows, w_uk, w_uv, scale, new_visible=None):
    """One sequence, per-head K = [W_UK c | k_r], V = W_UV c, float64, causal over the last q_len
    (``new_visible`` (q_len, q_len) bool: which new tokens each row sees instead)."""
    latent, k_rope = rows[:, :RANK].double(), rows[:, RANK:].double()
    keys = torch.cat([torch.einsum("hnr,kr->khn", w_uk.double(), latent),
                      k_rope[:, None, :].expand(-1, HEADS, -1)], dim=-1)
    values = torch.einsum("hvr,kr->khv", w_uv.double(), latent)
    query = torch.cat([q_nope.double(), q_rope.double()], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    q_len, num_keys = query.shape[0], keys.shape[0]
    q_pos = torch.arange(num_keys - q_len, num_keys)[:, None]
    hidden = torch.arange(num_keys)[None, :] > q_pos
    if new_visible is not None:
        hidden[:, num_keys - q_len:] = ~new_visible
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), values)


def test_reference_follows_a_token_tree_mask():
    """A verify step's token tree (parents -1, 0, 0, 2 over a cached prefix of 9) beside a decode row:
    each new token sees the prefix and its ancestors only (the dispatcher takes the reference for
    such steps on CUDA too)."""
    from kernels.mla_attention import mla_attention

    rows, cache, meta = paged_batch([13, 6], [4, 1])
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    meta.tree_mask = torch.zeros(5, 4, dtype=torch.bool)
    meta.tree_mask[:4], meta.tree_mask[4, 0] = visible, True
    w_uk, w_uv, q_nope, q_rope, scale = up_projections_and_queries(5)
    out = mla_attention(torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope, cache, meta, scale)
    out = torch.einsum("thr,hvr->thv", out, w_uv)
    want = expanded_attention(q_nope[:4], q_rope[:4], rows[0], w_uk, w_uv, scale, visible)
    assert (out[:4].double() - want).abs().max().item() < 1e-5
    assert (out[4:].double() - expanded_attention(q_nope[4:], q_rope[4:], rows[1], w_uk, w_uv, scale)).abs().max() < 1e-5


def up_projections_and_queries(num_tokens: int):
    """(w_uk (H, N, R), w_uv (H, V, R), q_nope (T, H, N), q_rope (T, H, P), scale), seeded."""
    gen = torch.Generator().manual_seed(1)
    w_uk, w_uv = torch.randn(HEADS, NOPE, RANK, generator=gen) * 0.3, torch.randn(HEADS, V_DIM, RANK, generator=gen)
    q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=gen)
    q_rope = torch.randn(num_tokens, HEADS, ROPE, generator=gen)
    return w_uk, w_uv, q_nope, q_rope, (NOPE + ROPE) ** -0.5


@pytest.mark.parametrize("context_lens,q_lens", [([13, 7, 1], [13, 7, 1]), ([22, 9, 5], [6, 1, 1])])
def test_reference_equals_expanded_per_head_attention(context_lens, q_lens):
    """Absorbing W_UK into the query and W_UV after the sum is the same attention (float32 within
    1e-5 of float64): whole prompts, then chunks over cached prefixes with decode rows beside them."""
    rows, cache, meta = paged_batch(context_lens, q_lens)
    w_uk, w_uv, q_nope, q_rope, scale = up_projections_and_queries(sum(q_lens))
    out = mla_attention_ref(torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope, cache, meta, scale)
    out = torch.einsum("thr,hvr->thv", out, w_uv)
    for i, seq_rows in enumerate(rows):
        start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
        want = expanded_attention(q_nope[start:end], q_rope[start:end], seq_rows, w_uk, w_uv, scale)
        assert (out[start:end].double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("context_lens,q_lens", [([13, 7, 1], [13, 7, 1]), ([22, 9, 30, 5], [6, 1, 7, 1])])
def test_long_chunks_expanded_and_the_rest_absorbed_equal_per_head_attention(context_lens, q_lens):
    """kernels/mla_expanded.py: sequences with >= 6 new tokens (a whole prompt, chunks over cached
    prefixes) attend expanded, the others absorbed over the split-off metadata; every row within 1e-5
    of float64 per-head attention. The threshold formula: V3's shape expands from 171 new tokens."""
    rows, cache, meta = paged_batch(context_lens, q_lens)
    w_uk, w_uv, q_nope, q_rope, scale = up_projections_and_queries(sum(q_lens))
    long, short_rows, short_meta = split_long(meta, 6)
    assert [i for i, _, _, _ in long] == [i for i, q in enumerate(q_lens) if q >= 6]
    out = torch.zeros(sum(q_lens), HEADS, V_DIM)
    for i, start, end, context_len in long:
        out[start:end] = mla_expanded_prefill(q_nope[start:end], q_rope[start:end], cache, meta.block_tables[i],
                                              context_len, w_uk, w_uv, scale)
    if short_rows is not None:
        short = mla_attention_ref(torch.einsum("thn,hnr->thr", q_nope[short_rows], w_uk), q_rope[short_rows], cache,
                                  short_meta, scale)
        out[short_rows] = torch.einsum("thr,hvr->thv", short, w_uv)
    for i, seq_rows in enumerate(rows):
        start, end = meta.cu_seqlens_q_host[i], meta.cu_seqlens_q_host[i + 1]
        want = expanded_attention(q_nope[start:end], q_rope[start:end], seq_rows, w_uk, w_uv, scale)
        assert (out[start:end].double() - want).abs().max().item() < 1e-5
    assert expanded_min_tokens(512, 128, 128) == 171 and expanded_min_tokens(32, 64, 64) is None
    assert split_long(meta, 31)[0] == []  # nothing that long: the step stays absorbed


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
                                               (torch.bfloat16, KV_FP8_DTYPE)])
@pytest.mark.parametrize("context_lens,q_lens", [([37, 5, 70], [1, 1, 1]), ([30, 9, 2], [11, 1, 2])])
def test_triton_kernel_equals_reference(device, dtype, cache_dtype, context_lens, q_lens):
    """Decode rows (contexts across several 32-key steps) and mixed chunks, in one key span or split
    (the splits combined by log-sum-exp); heads not a multiple of the kernel's 16, latent and rope
    widths not powers of two; bf16 and an FP8 pool."""
    if dtype not in low_precision_dtypes(device) + [torch.float32]:
        pytest.skip("the interpreter emulates bf16 dots loosely (kernel_testing.low_precision_dtypes); GPU only")
    _, cache, meta = paged_batch(context_lens, q_lens, device=device, dtype=dtype, cache_dtype=cache_dtype)
    gen = torch.Generator().manual_seed(2)
    q_latent = torch.randn(sum(q_lens), HEADS, RANK, generator=gen).to(dtype).to(device)
    q_rope = torch.randn(sum(q_lens), HEADS, ROPE, generator=gen).to(dtype).to(device)
    want = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    # one span; three of >= 1 tile (some empty at short contexts); the batch's own (up to 128) of the
    # default >= 1 tile and of >= 64 keys (most of them end at once). All-decode batches (q_lens 1) run
    # the kernel's DECODE form (no token map).
    for splits, min_span in ((1, 32), (3, 32), (None, MIN_SPAN), (None, 64)):
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, min_span=min_span)
        assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[dtype] * (3 if cache_dtype else 1)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, KV_FP8_DTYPE)])
@pytest.mark.parametrize("tiling,keys_major", [((16, 4, 2), False), ((16, 4, 0), False), ((32, 4, 0), False),
                                               ((32, 4, 2), True)])
def test_decode_kernel_equals_reference_and_the_general_kernel(device, dtype, cache_dtype, tiling, keys_major):
    """kernels/mla_decode.py on a decode step over pages of 32 (contexts of one partial tile, several
    pages, a page's last key): pipelined (STAGES 2) and register-prefetched (STAGES 0) tilings, one
    split (DIRECT), three and the batch's own (some past short contexts); the products with the keys as rows
    (keys_major); equal to the reference and to the general kernel (decode_kernel=False, the path before);
    and through W_UV in the combine."""
    if dtype not in low_precision_dtypes(device) + [torch.float32]:
        pytest.skip("the interpreter emulates bf16 dots loosely (kernel_testing.low_precision_dtypes); GPU only")
    context_lens = [37, 5, 96, 64]
    _, cache, meta = paged_batch(context_lens, [1] * 4, device=device, dtype=dtype, cache_dtype=cache_dtype, page=32)
    gen = torch.Generator().manual_seed(6)
    q_latent = torch.randn(4, HEADS, RANK, generator=gen).to(dtype).to(device)
    q_rope = torch.randn(4, HEADS, ROPE, generator=gen).to(dtype).to(device)
    w_uv = torch.randn(HEADS, V_DIM, RANK, generator=gen) * RANK ** -0.5
    want = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    tolerance = TOLERANCE[dtype] * (3 if cache_dtype else 1)
    for splits in (1, 3, None):
        kw = dict(splits=splits, min_span=tiling[0], decode_tiling=tiling, keys_major=keys_major)
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, decode_kernel=True, **kw)
        half = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, decode_kernel=True, half_partials=True, **kw)
        assert relative_error(half.cpu().float(), want.float()) < tolerance, splits
        general = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, decode_kernel=False, **kw)
        assert torch.isfinite(out).all()
        assert relative_error(out.cpu().float(), want.float()) < tolerance, splits
        assert relative_error(out.cpu().float(), general.cpu().float()) < tolerance, splits
    values = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=3, min_span=tiling[0],
                                  decode_tiling=tiling, decode_kernel=True, w_uv=w_uv.to(device).to(dtype),
                                  keys_major=keys_major)
    want_values = torch.einsum("thr,hvr->thv", want.float(), w_uv)
    assert relative_error(values.cpu().float(), want_values) < tolerance


def fp8_extremes(device: str, dtype: torch.dtype, heads: int = HEADS, rank: int = RANK, rope: int = ROPE,
                 seed: int = 11):
    """A decode step over an FP8 pool at its extremes (pages of 64): sequence 0's keys E4M3 subnormals alone (k *
    2^-9) under large queries, sequence 1's with +-448 among normal values under tiny queries, sequence 2 under huge
    queries (one-hot softmax), sequence 3 with a head of zero queries. Returns (cache, meta, q_latent, q_rope on
    ``device``, the reference's output on the CPU)."""
    _, cache, meta = paged_batch([70, 37, 64, 45], [1] * 4, device=device, dtype=torch.float32,
                                 cache_dtype=KV_FP8_DTYPE, page=64, rank=rank, rope=rope)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(cache.shape, generator=gen) * 4
    tables = meta.block_tables.cpu().long()
    subnormal_blocks = tables[0, :2]
    values[subnormal_blocks] = torch.randint(-7, 8, values[subnormal_blocks].shape, generator=gen) * 2.0 ** -9
    edge_blocks = tables[1, :1]
    values[edge_blocks, :, :6] = 448.0 * torch.sign(torch.randn(values[edge_blocks, :, :6].shape, generator=gen))
    values[edge_blocks, :, -2:] = -448.0
    cache = values.to(KV_FP8_DTYPE).to(device)
    assert (cache.float().abs() == 448).any() and (cache.float()[subnormal_blocks].abs().max() < 2.0 ** -6)
    big, tiny = (2.0 ** 6, 2.0 ** -12) if dtype == torch.float16 else (2.0 ** 60, 2.0 ** -60)
    factors = torch.tensor([2.0 ** 8 if dtype != torch.float16 else 2.0 ** 4, tiny, big, 1.0])[:, None, None]
    q_latent = (torch.randn(4, heads, rank, generator=gen) * factors).to(dtype)
    q_rope = (torch.randn(4, heads, rope, generator=gen) * factors).to(dtype)
    q_latent[3, 1], q_rope[3, 1] = 0, 0
    want = mla_attention_ref(q_latent, q_rope, cache.cpu(), _on_cpu(meta), 0.2)
    assert torch.isfinite(want).all()
    return cache, meta, q_latent.to(device), q_rope.to(device), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiling,keys_major", [((16, 4, 2), False), ((32, 4, 0), False), ((64, 4, 2), True)])
def test_decode_kernel_widens_an_fp8_pool_by_bits_at_its_extremes(device, dtype, tiling, keys_major):
    """An FP8 pool's codes widened by bits (kernels/e4m3_bits.py, fp8_bits=True) against the reference
    and Triton's conversion (fp8_bits=False): a sequence of E4M3 subnormals alone (k * 2^-9) under large
    queries, one of +-448 among normal values under tiny queries, one under huge queries (one-hot
    softmax), one with a head of zero queries; float16 queries take the 2^-8 widening, the others 2^-120
    with each head's queries scaled to [2^120, 2^121) (float32: the interpreter's stand-in for bfloat16); three
    splits' partials in float32 and in the queries' 16-bit dtype (half_partials)."""
    if dtype not in low_precision_dtypes(device) + [torch.float32] and dtype != torch.float16:
        pytest.skip("the interpreter emulates bf16 dots loosely (kernel_testing.low_precision_dtypes); GPU only")
    if dtype == torch.float32 and device == "cuda":
        pytest.skip("float32 queries keep Triton's conversion on the GPU (widens_by_bits)")
    cache, meta, q_latent, q_rope, want = fp8_extremes(device, dtype)
    tolerance = TOLERANCE[dtype] * 3
    for splits, half in ((1, False), (3, False), (3, True)):  # half: the splits' partials in the queries' dtype
        kw = dict(splits=splits, min_span=tiling[0], decode_tiling=tiling, decode_kernel=True, half_partials=half,
                  keys_major=keys_major)
        by_bits = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, fp8_bits=True, **kw).cpu().float()
        converted = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, fp8_bits=False, **kw).cpu().float()
        assert torch.isfinite(by_bits).all()
        for seq in range(4):  # each sequence alone: the subnormal one's outputs are ~2^-7 of the others'
            assert relative_error(by_bits[seq], want[seq].float()) < tolerance, (splits, seq)
            assert relative_error(by_bits[seq], converted[seq]) < tolerance, (splits, seq)


DEEPSEEK_RANK, DEEPSEEK_ROPE = 512, 64  # kv_lora_rank and qk_rope_head_dim of DeepSeek-V2-Lite and V3


@pytest.mark.parametrize("heads,dtype,pool", [(16, torch.float32, "fp8"), (32, torch.float16, "fp8"),
                                              (16, torch.bfloat16, "fp8"),
                                              pytest.param(32, torch.float32, "16-bit", marks=pytest.mark.extended),
                                              (16, torch.bfloat16, "16-bit")])
def test_decode_kernel_in_column_parts_equals_the_reference_at_deepseeks_shapes(device, heads, dtype, pool):
    """kernels/mla_decode_parts.py: the latent in 2, 4 and 8 column parts at DeepSeek's 512 + 64 per row, V2-Lite's 16
    heads and a V3-like 32 (two head blocks); one split (DIRECT) at DECODE_TILING_PARTS' and three (some past the
    shorter contexts) at (32, 4, 2); an FP8 pool widened by bits at its extremes (fp8_extremes: float16 queries the
    2^-8 widening, float32 the interpreter's stand-in for bfloat16's 2^-120, each head scaled over all its parts)
    and a 16-bit pool; equal to the reference and to the one-part kernel (kernels/mla_decode.py)."""
    if dtype not in low_precision_dtypes(device) + [torch.float32] and dtype != torch.float16:
        pytest.skip("the interpreter emulates bf16 dots loosely (kernel_testing.low_precision_dtypes); GPU only")
    if dtype == torch.float32 and device == "cuda" and pool == "fp8":
        pytest.skip("float32 queries keep Triton's conversion on the GPU (widens_by_bits)")
    shape = dict(rank=DEEPSEEK_RANK, rope=DEEPSEEK_ROPE)
    if pool == "fp8":
        cache, meta, q_latent, q_rope, want = fp8_extremes(device, dtype, heads, **shape)
        tolerance = TOLERANCE[dtype] * 3
    else:
        _, cache, meta = paged_batch([70, 37, 64, 45], [1] * 4, device=device, dtype=dtype, page=64, **shape)
        gen = torch.Generator().manual_seed(12)
        q_latent = (torch.randn(4, heads, DEEPSEEK_RANK, generator=gen) * 0.3).to(dtype)
        q_rope = (torch.randn(4, heads, DEEPSEEK_ROPE, generator=gen) * 0.3).to(dtype)
        want = mla_attention_ref(q_latent, q_rope, cache.cpu(), _on_cpu(meta), 0.2)
        q_latent, q_rope = q_latent.to(device), q_rope.to(device)
        tolerance = TOLERANCE[dtype]
    kw = dict(min_span=32, decode_kernel=True, fp8_bits=pool == "fp8")
    one_part = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=1, parts=1, **kw).cpu().float()
    # three splits (the interpreter's combine is its slow launch) once a case: 2 parts at 16 heads, 8 at 32
    for splits, parts, tiling in ((1, 2, None), (1, 4, None), (1, 8, None), (3, 2 if heads == 16 else 8, (32, 4, 2))):
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, parts=parts,
                                   decode_tiling=tiling, **kw).cpu().float()
        assert torch.isfinite(out).all()
        assert relative_error(out, one_part) < tolerance, (splits, parts)
        for seq in range(4):  # each sequence alone (fp8_extremes: the subnormal one's outputs ~2^-7 the others')
            assert relative_error(out[seq], want[seq].float()) < tolerance, (splits, parts, seq)


@pytest.mark.parametrize("kernel", ["keys as columns", "keys as rows", "2 column parts"])
def test_tile_pages_looked_up_a_tile_ahead_give_the_same_attention(device, kernel):
    """table_ahead=True (kernels/mla_decode.py DECODE_TABLE_AHEAD: each tile's page a loop-carried lookup a tile
    ahead) in the decode kernel with the keys as the products' columns (16, 4, 3) and rows (32, 4, 3), and in the
    column-parts kernel: contexts of one partial tile, several pages and a page's last key, pages of 32 shuffled,
    one split and three (some past the shorter contexts): equal to the reference."""
    context_lens = [37, 5, 96, 64]
    rank = DEEPSEEK_RANK if kernel == "2 column parts" else RANK
    _, cache, meta = paged_batch(context_lens, [1] * 4, device=device, page=32, rank=rank)
    gen = torch.Generator().manual_seed(7)
    q_latent = torch.randn(4, HEADS, rank, generator=gen).to(device)
    q_rope = torch.randn(4, HEADS, ROPE, generator=gen).to(device)
    want = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    tiling, kw = {"keys as columns": ((16, 4, 3), {}), "keys as rows": ((32, 4, 3), dict(keys_major=True)),
                  "2 column parts": ((16, 4, 3), dict(parts=2))}[kernel]
    for splits in (1, 3):
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, min_span=tiling[0],
                                   decode_tiling=tiling, decode_kernel=True, table_ahead=True, **kw)
        assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[torch.float32], (splits, kernel)


def test_column_parts_by_the_grid_unless_asked_and_must_fit(monkeypatch):
    """mla_attention_triton's ``parts``: unasked and without a tiling, kernels/mla_decode.py DECODE_COLUMN_PARTS (8)
    where the launch's grid holds at least DECODE_PARTS_PROGRAMS_PER_SM (6) programs an SM (132 off CUDA) and the
    latent is wide enough (parts of >= 16 columns), else the one-part kernel; asked for, 2, 4 or 8 parts at
    DECODE_TILING_PARTS unless a tiling is given, and a clear ValueError for a latent too narrow, a register-prefetch
    tiling, keys as rows or a count other than 1, 2, 4. Which launch ran (and its tiling, parts) is recorded; nothing
    runs."""
    from kernels import mla_decode

    launched = []
    monkeypatch.setattr(mla_attention_module, "mla_decode_launch", lambda *a: launched.append(("one", a[11])))
    monkeypatch.setattr(mla_attention_module, "mla_decode_parts_launch",
                        lambda *a: launched.append((a[12], a[11]) + ((a[14],) if a[14] else ())))
    monkeypatch.setattr(mla_attention_module, "_combine", lambda q, part, lse, out, *a: out)  # many splits' combine

    def launch(rank, splits=1, **kw):
        _, cache, meta = paged_batch([40, 9], [1, 1], page=64, rank=rank, cache_dtype=KV_FP8_DTYPE)
        launched.clear()
        mla_attention_triton(torch.zeros(2, HEADS, rank), torch.zeros(2, HEADS, ROPE), cache, meta, 0.2,
                             splits=splits, decode_kernel=True, **kw)
        return launched[0]

    assert (mla_decode.DECODE_COLUMN_PARTS, mla_decode.DECODE_PARTS_PROGRAMS_PER_SM) == (8, 6)
    assert mla_decode.DECODE_TILING_FP8_BITS == mla_decode.DECODE_TILING_PARTS[8]  # the same tile: the splits stand
    many = 6 * 132 // 2  # 2 sequences x 1 head block x this many splits: 6 programs an SM
    assert launch(128, splits=many) == (8, mla_decode.DECODE_TILING_PARTS[8])
    assert launch(128, splits=many - 1) == ("one", mla_decode.DECODE_TILING_FP8_BITS)
    assert launch(64, splits=many) == ("one", mla_decode.DECODE_TILING_FP8_BITS)  # parts of 8 columns: too narrow
    assert launch(128, splits=many, decode_tiling=(32, 4, 3)) == ("one", (32, 4, 3))  # a tiling asked for
    assert launch(128, splits=many, parts=1) == ("one", mla_decode.DECODE_TILING_FP8_BITS)
    assert launch(64) == ("one", mla_decode.DECODE_TILING_FP8_BITS)
    assert launch(64, parts=4) == (4, mla_decode.DECODE_TILING_PARTS[4])
    assert launch(128, parts=8) == (8, mla_decode.DECODE_TILING_PARTS[8])
    assert launch(64, parts=2, decode_tiling=(32, 4, 2)) == (2, (32, 4, 2))
    # another parts tile whose keys divide the default's (the splits stand); pages looked up ahead where asked
    monkeypatch.setattr(mla_decode, "DECODE_TILING_PARTS", {**mla_decode.DECODE_TILING_PARTS, 8: (16, 4, 4)})
    assert launch(128, splits=many) == (8, (16, 4, 4))
    assert launch(128, splits=many, table_ahead=True) == (8, (16, 4, 4), True)
    assert launch(128, splits=many - 1) == ("one", mla_decode.DECODE_TILING_FP8_BITS)
    monkeypatch.setattr(mla_decode, "DECODE_TILING_PARTS", {**mla_decode.DECODE_TILING_PARTS, 8: (64, 4, 2)})
    assert launch(128, splits=many) == ("one", mla_decode.DECODE_TILING_FP8_BITS)  # 64 keys: not within 32-key spans
    monkeypatch.setattr(mla_decode, "DECODE_COLUMN_PARTS", 1)
    assert launch(128, splits=many) == ("one", mla_decode.DECODE_TILING_FP8_BITS)
    for asked, why in ((dict(rank=RANK, parts=4), "this latent: 24"), (dict(rank=64, parts=3), "1, 2, 4 or 8"),
                       (dict(rank=64, parts=8), "this latent: 64"),
                       (dict(rank=64, parts=2, decode_tiling=(32, 8, 0)), "STAGES >= 1"),
                       (dict(rank=64, parts=2, keys_major=True), "keys_major=True")):
        with pytest.raises(ValueError, match="parts=") as raised:
            launch(**asked)
        assert why in str(raised.value), (asked, str(raised.value))


def test_split_policy_is_each_kernels_own_unless_given():
    """mla_attention_triton's max_splits / min_span / programs_per_sm left None: the general kernel's
    MAX_SPLITS, MIN_SPAN, 2 or the decode kernel's DECODE_SPLITS (longer splits once batched); given ones
    kept; min_span a whole tile."""
    from kernels.mla_attention import MAX_SPLITS, split_policy
    from kernels.mla_decode import DECODE_BATCHED_MIN_SPAN, DECODE_BATCHED_PROGRAMS, DECODE_SPLITS

    assert split_policy(False, 32) == split_policy(False, 32, programs=64) == (MAX_SPLITS, MIN_SPAN, 2)
    assert split_policy(True, 16) == (DECODE_SPLITS[0], max(DECODE_SPLITS[1], 16), DECODE_SPLITS[2])
    # from DECODE_BATCHED_PROGRAMS (token x head-block) programs on, longer splits
    batched = split_policy(True, 16, programs=DECODE_BATCHED_PROGRAMS)
    assert batched == (DECODE_SPLITS[0], DECODE_BATCHED_MIN_SPAN, DECODE_SPLITS[2]) and batched[1] > DECODE_SPLITS[1]
    assert split_policy(True, 16, programs=DECODE_BATCHED_PROGRAMS - 1)[1] == DECODE_SPLITS[1]
    assert split_policy(True, 64, 7, 128, 3) == (7, 128, 3)
    assert split_policy(False, 64, min_span=16) == (MAX_SPLITS, 64, 2)  # raised to one tile
    with pytest.raises(AssertionError):
        split_policy(True, 64, min_span=96)  # not whole tiles


def test_decode_splits_cover_the_gpu_8_times_only_with_long_enough_splits():
    """launch_splits for the decode kernel (132 SMs off CUDA, V2-Lite's 16 heads): the grid covers the GPU 8
    times where each split then gets DECODE_LONG_SPAN keys, else 4 times (the cases kernels/mla_decode.py
    measured); long_span=0 is the policy before (always 8 times); a given programs_per_sm is kept; the general
    kernel's policy is unchanged."""
    from kernels.mla_attention import launch_splits

    def splits(batch, context, **kw):
        return launch_splits(batch, 16, 16, "cpu", True, 32, context, **kw)[0]

    assert [splits(b, c) for b, c in ((1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (8, 32768), (32, 1024),
                                      (32, 8192), (32, 32768), (64, 8192), (64, 32768))] == \
        [32, 128, 128, 32, 66, 66, 8, 17, 33, 17, 17]
    assert [splits(b, c, long_span=0) for b, c in ((8, 8192), (8, 32768), (32, 8192))] == [128, 128, 33]
    assert splits(32, 8192, programs_per_sm=8) == 33 and splits(32, 8192, programs_per_sm=2) == 9
    assert launch_splits(32, 16, 16, "cpu", False, 32, 8192) == (9, MIN_SPAN)


def test_decode_kernel_is_taken_only_where_its_tile_fits(monkeypatch):
    """The decode kernel serves decode-only steps whose page its BLOCK_N divides; a mixed step or pages
    of 4 keep the general kernel (which launch ran is recorded); unasked, the environment's switch or
    the module default decides, and an FP8 pool's batched steps keep the general kernel."""
    from kernels import mla_decode

    taken = []
    monkeypatch.setattr(mla_attention_module, "mla_decode_launch", lambda *a, **k: taken.append("decode"))
    monkeypatch.setattr(mla_attention_module, "_mla_general_launch", lambda *a, **k: taken.append("general"))
    q = torch.zeros(2, HEADS, RANK)
    rope = torch.zeros(2, HEADS, ROPE)
    for page, q_lens, want in ((32, [1, 1], "decode"), (4, [1, 1], "general"), (32, [2], "general")):
        _, cache, meta = paged_batch([40, 9][:len(q_lens)], q_lens, page=page)
        taken.clear()
        mla_attention_triton(q, rope, cache, meta, 0.2, splits=1, decode_kernel=True)
        assert taken == [want], (page, q_lens)
    taken.clear()
    mla_attention_triton(q, rope, cache, meta, 0.2, splits=1, decode_kernel=False)
    assert taken == ["general"]
    assert mla_decode.decode_tile_fits(64, 32) and not mla_decode.decode_tile_fits(16, 32)
    # decode_kernel unset: TRITONLLM_MLA_DECODE picks (A/B runs), else USE_DECODE_KERNEL
    _, cache, meta = paged_batch([40, 9], [1, 1], page=32)
    for env, default, want in (("1", False, "decode"), ("0", True, "general"), ("", True, "decode"),
                               ("", False, "general")):
        monkeypatch.setenv(mla_attention_module.MLA_DECODE_ENV, env)
        monkeypatch.setattr(mla_attention_module, "USE_DECODE_KERNEL", default)
        taken.clear()
        mla_attention_triton(q, rope, cache, meta, 0.2, splits=1)
        assert taken == [want], (env, default)
    # FP8 pools: widened by bits (TRITONLLM_MLA_FP8_BITS unset or 1), the decode kernel at every batch; widened
    # by Triton's conversion (0), only below DECODE_BATCHED_PROGRAMS programs (5 heads: one head block a token)
    # unless asked for by name
    monkeypatch.setenv(mla_attention_module.MLA_DECODE_ENV, "")
    monkeypatch.setattr(mla_attention_module, "USE_DECODE_KERNEL", True)
    batched = mla_decode.DECODE_BATCHED_PROGRAMS
    for bits_env, batch, asked, want in (("", 2, None, "decode"), ("", batched, None, "decode"),
                                         ("1", batched, None, "decode"), ("0", 2, None, "decode"),
                                         ("0", batched, None, "general"), ("0", batched, True, "decode")):
        monkeypatch.setenv(mla_decode.FP8_BITS_ENV, bits_env)
        _, cache, meta = paged_batch([9] * batch, [1] * batch, page=32, cache_dtype=KV_FP8_DTYPE)
        taken.clear()
        mla_attention_triton(torch.zeros(batch, HEADS, RANK), torch.zeros(batch, HEADS, ROPE), cache, meta, 0.2,
                             splits=1, decode_kernel=asked)
        assert taken == [want], (bits_env, batch, asked)


def test_keys_major_products_where_a_16_bit_pools_grid_fits_one_wave(monkeypatch):
    """kernels/mla_attention.py decode_tiling_for: a 16-bit pool's decode steps take DECODE_TILING_ONE_WAVE with the
    keys as rows where its tile fits the page and the grid holds at most one program an SM (132 off CUDA), else
    DECODE_TILING; FP8 pools never; keys_major= and decode_tiling= override it (the launch records both);
    DECODE_ONE_WAVE_KEYS_MAJOR False turns it off."""
    from kernels import mla_decode
    from kernels.mla_attention import decode_tiling_for

    wave, plain = mla_decode.DECODE_TILING_ONE_WAVE, mla_decode.DECODE_TILING
    assert decode_tiling_for(False, False, 64, 1, 16, 16, "cpu", 32768) == (wave, True)  # 128 splits x 1
    assert decode_tiling_for(False, False, 64, 8, 16, 16, "cpu", 1024) == (wave, True)  # 16 x 8
    assert decode_tiling_for(False, False, 64, 8, 16, 16, "cpu", 8192) == (plain, False)  # 66 x 8
    assert decode_tiling_for(False, False, 64, 32, 16, 16, "cpu", 1024) == (plain, False)  # 8 x 32
    assert decode_tiling_for(False, False, 32, 1, 16, 16, "cpu", 1024) == (plain, False)  # a 64-key tile won't fit
    assert decode_tiling_for(True, True, 64, 1, 16, 16, "cpu", 1024) == (mla_decode.DECODE_TILING_FP8_BITS, False)
    assert decode_tiling_for(False, False, 64, 1, 16, 16, "cpu", 1024, splits=200) == (plain, False)
    launched = []
    monkeypatch.setattr(mla_attention_module, "mla_decode_launch", lambda *a: launched.append((a[11], a[13])))
    for cache_dtype, asked, tiling, want in ((None, None, None, (wave, True)),
                                             (KV_FP8_DTYPE, None, None, (mla_decode.DECODE_TILING_FP8_BITS, False)),
                                             (None, False, None, (wave, False)),
                                             (None, None, (32, 4, 3), ((32, 4, 3), False))):
        _, cache, meta = paged_batch([40, 9], [1, 1], page=64, cache_dtype=cache_dtype)
        launched.clear()
        mla_attention_triton(torch.zeros(2, HEADS, RANK), torch.zeros(2, HEADS, ROPE), cache, meta, 0.2, splits=1,
                             decode_kernel=True, keys_major=asked, decode_tiling=tiling)
        assert launched == [want], (cache_dtype, asked, tiling)
    monkeypatch.setattr(mla_decode, "DECODE_ONE_WAVE_KEYS_MAJOR", False)
    assert decode_tiling_for(False, False, 64, 1, 16, 16, "cpu", 32768) == (plain, False)


def test_fp8_pools_widen_by_bits_where_the_queries_allow(monkeypatch):
    """kernels/mla_decode.py widens_by_bits: FP8 pools only; bfloat16 / float16 queries (float32 only off
    CUDA: the interpreter); TRITONLLM_MLA_FP8_BITS "0" turns it off, "1" or unset (USE_FP8_BITS) on; an
    argument overrides both."""
    from kernels import mla_decode

    monkeypatch.setenv(mla_decode.FP8_BITS_ENV, "")
    assert mla_decode.widens_by_bits(True, torch.bfloat16, True)
    assert mla_decode.widens_by_bits(True, torch.float16, True)
    assert not mla_decode.widens_by_bits(False, torch.bfloat16, True)
    assert not mla_decode.widens_by_bits(True, torch.float32, True) and mla_decode.widens_by_bits(True, torch.float32,
                                                                                                  False)
    monkeypatch.setenv(mla_decode.FP8_BITS_ENV, "0")
    assert not mla_decode.widens_by_bits(True, torch.bfloat16, True)
    assert mla_decode.widens_by_bits(True, torch.bfloat16, True, asked=True)
    monkeypatch.setenv(mla_decode.FP8_BITS_ENV, "1")
    monkeypatch.setattr(mla_decode, "USE_FP8_BITS", False)
    assert mla_decode.widens_by_bits(True, torch.bfloat16, True)
    assert not mla_decode.widens_by_bits(True, torch.bfloat16, True, asked=False)
    monkeypatch.setenv(mla_decode.FP8_BITS_ENV, "")
    assert not mla_decode.widens_by_bits(True, torch.bfloat16, True)


@pytest.mark.parametrize("context_lens,q_lens", [([37, 5, 70], [1, 1, 1]), ([30, 9, 2], [11, 1, 2])])
def test_combine_applies_w_uv(device, context_lens, q_lens, monkeypatch):
    """w_uv given: (T, H, V) = the reference's latent output through W_UV per head, whether the splits'
    combine applies it (splits > 1; at 128 of them, with the budget cut, the latent row in two chunks)
    or head_matmul after (one split); the combine's loads a chunk of 2 splits (several passes over the live
    ones), the default chunk, or all the grid's splits at once (0); without w_uv the plain combine alike."""
    monkeypatch.setattr(mla_attention_module, "COMBINE_VALUES", 2048)
    _, cache, meta = paged_batch(context_lens, q_lens, device=device)
    gen = torch.Generator().manual_seed(5)
    q_latent = torch.randn(sum(q_lens), HEADS, RANK, generator=gen).to(device)
    q_rope = torch.randn(sum(q_lens), HEADS, ROPE, generator=gen).to(device)
    w_uv = torch.randn(HEADS, V_DIM, RANK, generator=gen) * RANK ** -0.5
    want = torch.einsum("thr,hvr->thv", mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta),
                                                           0.2), w_uv)
    want_latent = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    for splits, chunk in ((1, None), (3, 0), (None, None), (None, 2), (128, None)):
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, w_uv=w_uv.to(device),
                                   combine_chunk=chunk)
        assert out.shape == want.shape and relative_error(out.cpu(), want) < TOLERANCE[torch.float32], (splits, chunk)
        if splits != 128:  # (the interpreter's slowest launch)
            latent = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, combine_chunk=chunk)
            assert relative_error(latent.cpu(), want_latent) < TOLERANCE[torch.float32], (splits, chunk)


def tree_mask_of(parents_per_seq: list[list[int]]) -> torch.Tensor:
    """(num_tokens, max q_len) bool in AttentionMetadata.tree_mask's layout: row t sees its ancestors
    and itself among its sequence's new tokens (parents[j] < j, -1 for a root)."""
    width = max(len(parents) for parents in parents_per_seq)
    rows = []
    for parents in parents_per_seq:
        for j in range(len(parents)):
            row, node = torch.zeros(width, dtype=torch.bool), j
            while node >= 0:
                row[node], node = True, parents[node]
            rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_follows_a_token_tree_mask(device, dtype):
    """Tree verify steps on the kernel: a 10-node tree whose new keys cross a 32-key tile (prefix 27),
    a 4-node tree over a prefix of 3, a decode row; one span, three (splits whose keys the tree hides
    entirely for some rows) and the batch's own; equal to the reference, which tests above hold to
    per-head attention."""
    if dtype not in low_precision_dtypes(device) + [torch.float32]:
        pytest.skip("the interpreter emulates bf16 dots loosely (kernel_testing.low_precision_dtypes); GPU only")
    trees = [[-1, 0, 0, 1, 2, 2, 4, 0, 7, 3], [-1, 0, 1, 0], [-1]]
    _, cache, meta = paged_batch([37, 7, 12], [10, 4, 1], device=device, dtype=dtype)
    meta.tree_mask = tree_mask_of(trees).to(device)
    gen = torch.Generator().manual_seed(3)
    q_latent = torch.randn(15, HEADS, RANK, generator=gen).to(dtype).to(device)
    q_rope = torch.randn(15, HEADS, ROPE, generator=gen).to(dtype).to(device)
    cpu_meta = _on_cpu(meta)
    cpu_meta.tree_mask = meta.tree_mask.cpu()
    want = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), cpu_meta, 0.2)
    causal = mla_attention_ref(q_latent.cpu(), q_rope.cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    assert relative_error(causal.float(), want.float()) > 0.01  # the mask matters in this batch
    for splits, chunk in ((1, None), (3, None), (3, 1), (None, None), (None, 1)):  # chunk 1: a split a combine load
        out = mla_attention_triton(q_latent, q_rope, cache, meta, 0.2, splits=splits, min_span=32,
                                   combine_chunk=chunk)
        assert torch.isfinite(out).all()
        assert relative_error(out.cpu().float(), want.float()) < TOLERANCE[dtype], (splits, chunk)


def test_triton_kernel_gives_zeros_for_a_prefill_graphs_padding_tokens(device):
    """A prefill graph's step (engine/executor/prefill_graphs.py): tokens padded to the bucket (16)
    past the real ones, cu_seqlens over max_batch_size rows ending at the real count, stale context
    lengths in the unused rows. The real rows equal the reference; the padding rows read no sequence
    and come out 0 (not NaN, which the combine of all -inf splits would give)."""
    _, cache, meta = paged_batch([30, 9], [5, 2], device=device)
    gen = torch.Generator().manual_seed(4)
    q_latent = torch.randn(16, HEADS, RANK, generator=gen).to(device)
    q_rope = torch.randn(16, HEADS, ROPE, generator=gen).to(device)
    want = mla_attention_ref(q_latent[:7].cpu(), q_rope[:7].cpu(), cache.cpu(), _on_cpu(meta), 0.2)
    padded = AttentionMetadata(
        slot_mapping=torch.tensor([0] * 7 + [-1] * 9, device=device),
        block_tables=torch.cat([meta.block_tables, meta.block_tables.flip(0)]),
        cu_seqlens_q=torch.tensor([0, 5, 7, 7, 7], dtype=torch.int32, device=device),
        context_lens=torch.tensor([30, 9, 4000, 31], dtype=torch.int32, device=device),
        max_seqlen_q=16, max_context_len=4096, is_decode_only=False)
    for splits in (1, 3, None):
        out = mla_attention_triton(q_latent, q_rope, cache, padded, 0.2, splits=splits, min_span=32).cpu()
        assert relative_error(out[:7].float(), want.float()) < TOLERANCE[torch.float32]
        assert bool((out[7:] == 0).all())


def test_num_sms_takes_a_device_name():
    """Benchmarks pass their --device string (mla_kernel_bench crashed on "cuda"): a name or a
    torch.device; off CUDA (Triton's interpreter) a plausible 132."""
    from kernels._triton import num_sms
    from kernels.mla_attention import mla_splits

    assert num_sms("cpu") == num_sms(torch.device("cpu")) == 132
    assert mla_splits(1, 16, 16, "cpu") == 128 and mla_splits(512, 128, 16, "cpu") == 1
    # never more splits than the longest context fills with min_span keys; one (no combine) at <= min_span
    assert mla_splits(1, 16, 16, "cpu", max_context_len=1024) == 1024 // MIN_SPAN
    assert mla_splits(1, 16, 16, "cpu", max_context_len=1024, min_span=64) == 16
    assert mla_splits(1, 16, 16, "cpu", max_context_len=MIN_SPAN) == mla_splits(1, 16, 16, "cpu", max_context_len=1) == 1


def test_triton_latent_write_skips_padding_rows(device):
    """Rows with slot -1 (a CUDA graph's padding) leave the pool as it was; the others land whole."""
    cache = torch.full((4, PAGE, RANK + ROPE), 7.0, device=device)
    latent, k_rope = torch.randn(3, RANK, device=device), torch.randn(3, ROPE, device=device)
    slots = torch.tensor([5, -1, 14], device=device)
    write_latent_cache_triton(latent, k_rope, cache, slots)
    flat = cache.view(-1, RANK + ROPE).cpu()
    assert torch.equal(flat[5], torch.cat([latent[0], k_rope[0]]).cpu())
    assert torch.equal(flat[14], torch.cat([latent[2], k_rope[2]]).cpu())
    untouched = [s for s in range(flat.shape[0]) if s not in (5, 14)]
    assert bool((flat[untouched] == 7.0).all())


def _on_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=meta.slot_mapping.cpu(), block_tables=meta.block_tables.cpu(),
                             cu_seqlens_q=meta.cu_seqlens_q.cpu(), context_lens=meta.context_lens.cpu(),
                             max_seqlen_q=meta.max_seqlen_q, max_context_len=meta.max_context_len,
                             is_decode_only=meta.is_decode_only, cu_seqlens_q_host=meta.cu_seqlens_q_host,
                             context_lens_host=meta.context_lens_host)


@AOT_SM90
@pytest.mark.parametrize("pool,bits,q,keys_major", [
    ("*bf16", False, "*bf16", False), ("*fp8e4nv", False, "*bf16", False), ("*fp8e4nv", True, "*bf16", False),
    ("*fp8e4nv", True, "*fp16", False), ("*bf16", False, "*bf16", True)])
@pytest.mark.parametrize("direct", [False, True])
def test_decode_kernel_compiles_for_sm90_without_spills(pool, bits, q, keys_major, direct, tmp_path):
    """Triton's compiler and ptxas (no GPU) on the decode kernel at its default tiling for the pool,
    DeepSeek's 512 + 64 per row, 16 heads, pages of 64: no local memory (spills); the bf16 pool's tile
    loads pipelined as cp.async copies (the point of its STAGES); an FP8 pool widened by bits has PRMTs
    and no E4M3 conversion or byte-wise shared-memory read left; the products with the keys as rows at
    (64, 4, 2) are warpgroup MMAs."""
    from kernels.mla_decode import DECODE_TILING, DECODE_TILING_FP8, DECODE_TILING_FP8_BITS, _mla_decode_kernel

    block_n, warps, stages = ((64, 4, 2) if keys_major else DECODE_TILING if pool == "*bf16"
                              else DECODE_TILING_FP8_BITS if bits else DECODE_TILING_FP8)
    pointers = dict(q_lat_ptr=q, q_rope_ptr=q, cache_ptr=pool, part_ptr=q if direct else "*fp32",
                    lse_ptr="*fp32", block_tables_ptr="*i32", ctx_ptr="*i32")
    const = dict(RANK=512, ROPE=64, RANK_PAD=512, ROPE_PAD=64, PAGE=64, BLOCK_H=16, BLOCK_N=block_n,
                 STAGES=max(1, stages), PREFETCH=stages == 0, DIRECT=direct, DOT_PRECISION="tf32", PDL=False,
                 BITS=bits, ASM=bits, KEYS_MAJOR=keys_major)
    compiled = compile_for_sm90(_mla_decode_kernel, pointers, const, warps=warps, stages=1, floats=("scale_log2",),
                                aligned_int=strides_but_block_table)
    ptx = compiled.asm["ptx"]
    if pool == "*bf16" or stages:
        assert "cp.async" in ptx
    if bits:  # widened once where loaded (not pure): no byte-wise shared-memory reads for the value product
        assert "prmt.b32" in ptx and "e4m3x2" not in ptx and "ld.shared.b8" not in ptx
    assert ("wgmma.mma_async" in ptx) == keys_major
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage, usage


def loop_bodies(ptx: str) -> list[str]:
    """The PTX of each loop: from a label to a later branch back to it."""
    lines = ptx.splitlines()
    starts = {line.strip().split(":")[0]: i for i, line in enumerate(lines) if line.strip().startswith("$L__BB")}
    bodies = []
    for i, line in enumerate(lines):
        words = line.replace(";", " ").split()
        if "bra" in words and words[-1] in starts and starts[words[-1]] < i:
            bodies.append("\n".join(lines[starts[words[-1]]:i]))
    return bodies


@AOT_SM90
@pytest.mark.parametrize("pool,q,bits,parts", [("*fp8e4nv", "*bf16", True, 4), ("*fp8e4nv", "*fp16", True, 4),
                                               ("*bf16", "*bf16", False, 4), ("*fp8e4nv", "*bf16", True, 8),
                                               ("*bf16", "*bf16", False, 8)])
@pytest.mark.parametrize("direct", [False, True])
def test_column_parts_decode_kernel_fits_three_programs_an_sm(pool, q, bits, parts, direct, tmp_path):
    """kernels/mla_decode_parts.py at DECODE_TILING_PARTS' in 4 parts ((16, 4, 3)) and 8 ((32, 4, 3)), DeepSeek's
    512 + 64, 16 heads, pages of 64 (ptxas for sm_90, no GPU): at most 168 registers a thread (3 programs of 4 warps
    an SM; the one-part FP8 kernel takes 255, 2 an SM) and 3 programs' shared memory, no spills (stack or local
    memory), the tile's loads pipelined (cp.async), and in the loop no byte loads from shared memory; FP8 codes
    widened by PRMTs, no E4M3 conversion. (float16 queries in 8 parts at (32, 4, 3) take 178: not asserted.)"""
    from kernels.mla_decode import DECODE_TILING_PARTS
    from kernels.mla_decode_parts import _mla_decode_parts_kernel
    from sm90_compile import registers, stack_bytes

    block_n, warps, stages = DECODE_TILING_PARTS[parts]
    pointers = dict(q_lat_ptr=q, q_rope_ptr=q, cache_ptr=pool, part_ptr=q if direct else "*fp32",
                    lse_ptr="*fp32", block_tables_ptr="*i32", ctx_ptr="*i32")
    const = dict(RANK=512, ROPE=64, RANK_PAD=512, ROPE_PAD=64, PAGE=64, BLOCK_H=16, BLOCK_N=block_n, STAGES=stages,
                 DIRECT=direct, DOT_PRECISION="tf32", PDL=False, PARTS=parts, BITS=bits, ASM=bits)
    compiled = compile_for_sm90(_mla_decode_parts_kernel, pointers, const, warps=warps, stages=1,
                                floats=("scale_log2",), aligned_int=strides_but_block_table)
    ptx = compiled.asm["ptx"]
    assert "cp.async" in ptx
    loops = loop_bodies(ptx)
    assert loops and not any("ld.shared.b8" in body or "ld.shared.u8" in body for body in loops)
    if bits:
        assert "prmt.b32" in ptx and "e4m3x2" not in ptx
    assert 3 * compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage and stack_bytes(usage) == 0, usage
    assert registers(usage) <= 168, usage


@AOT_SM90
@pytest.mark.parametrize("pool,bits", [("*bf16", False), ("*fp8e4nv", True)])
def test_decode_tiles_are_multi_buffered_only_with_their_page_looked_up_ahead(pool, bits):
    """Why kernels/mla_decode.py DECODE_TABLE_AHEAD exists (sm_90 compile, the decode kernel at (32, 4, 3) and
    (32, 4, 4), V2-Lite's 512 + 64): with each tile's page looked up in its own step, Triton's pipeliner gives the
    tile one shared-memory buffer whatever STAGES is (its copy cannot start before the step's products read the
    last one); looked up a tile ahead, STAGES - 1."""
    import re

    from kernels.mla_decode import _mla_decode_kernel

    for stages in (3, 4):
        for ahead in (False, True):
            pointers = dict(q_lat_ptr="*bf16", q_rope_ptr="*bf16", cache_ptr=pool, part_ptr="*fp32", lse_ptr="*fp32",
                            block_tables_ptr="*i32", ctx_ptr="*i32")
            const = dict(RANK=512, ROPE=64, RANK_PAD=512, ROPE_PAD=64, PAGE=64, BLOCK_H=16, BLOCK_N=32, STAGES=stages,
                         PREFETCH=False, DIRECT=False, DOT_PRECISION="tf32", PDL=False, BITS=bits, ASM=bits,
                         KEYS_MAJOR=False, TABLE_AHEAD=ahead)
            compiled = compile_for_sm90(_mla_decode_kernel, pointers, const, warps=4, stages=stages,
                                        floats=("scale_log2",), aligned_int=strides_but_block_table)
            buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x32x512x", compiled.asm["ttgir"])
            assert buffers == [str(stages - 1 if ahead else 1)], (stages, ahead, buffers)

