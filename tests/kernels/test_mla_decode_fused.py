"""kernels/mla_decode_fused.py: an MLA decode layer's latent write + W_UK + attention + W_UV in one
launch (GPU, or TRITON_INTERPRET=1 on CPU, float32) against the three launches' references: outputs
and the pool (the new rows written once, a padding row's slot -1 writing nothing)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.mla_decode_fused import SETTINGS, fuses, mla_decode_fused_ref, mla_decode_fused_triton
from kernels.rotary import build_cos_sin_cache
from test_mla_attention import HEADS, NOPE, PAGE, RANK, ROPE, V_DIM, paged_batch


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [(2, 16, 4, True), (2, 4, 4, False)])  # several key tiles a program
def test_one_launch_equals_write_absorb_attention_and_w_uv(device, setting):
    context_lens = [1, 7, 13, 6]  # each row's new token is its last position; row 3 a graph's padding row
    rows, cache, meta = paged_batch(context_lens, [1] * 4, device=device, seed=3)
    gen = torch.Generator().manual_seed(4)
    tables = meta.block_tables.cpu()
    slots = torch.tensor([int(tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for i, n in enumerate(context_lens)])
    slots[3] = -1
    meta = dataclasses.replace(meta, slot_mapping=slots.to(device))
    q = torch.randn(4, HEADS, NOPE + ROPE, generator=gen)
    kv = torch.randn(4, RANK + ROPE, generator=gen)
    weight = 1 + 0.1 * torch.randn(RANK, generator=gen)
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=gen) * NOPE ** -0.5
    w_uv = torch.randn(HEADS, V_DIM, RANK, generator=gen) * RANK ** -0.5
    positions = torch.tensor(context_lens) - 1
    cos_sin = build_cos_sin_cache(64, ROPE, 10000.0, None, "cpu")
    cpu_meta = dataclasses.replace(meta, slot_mapping=slots, block_tables=tables, cu_seqlens_q=meta.cu_seqlens_q.cpu(),
                                   context_lens=meta.context_lens.cpu())
    want_cache = cache.cpu().clone()
    want = mla_decode_fused_ref(q[..., :NOPE], q[..., NOPE:], kv, weight, 1e-6, positions, cos_sin, want_cache, slots,
                                cpu_meta, 0.3, w_uk, w_uv)
    q_dev = q.to(device)
    assert not fuses(q_dev[..., :NOPE], meta)  # 4 rows: the model keeps the three launches (FUSED_MAX_ROWS)
    got = mla_decode_fused_triton(q_dev[..., :NOPE], q_dev[..., NOPE:], kv.to(device), weight.to(device), 1e-6,
                           positions.to(device), cos_sin.to(device), cache, meta.slot_mapping, meta, 0.3,
                           w_uk.to(device), w_uv.to(device), setting)
    torch.testing.assert_close(got[:3].cpu(), want[:3], rtol=1e-5, atol=1e-5)  # row 3: padding, any value
    torch.testing.assert_close(cache.cpu(), want_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q_dev.cpu(), q)  # the query is read, not rotated in place


@pytest.mark.gpu
@pytest.mark.parametrize("cache_fp8", [False, True])
def test_one_launch_equals_the_three_kernels(device, cache_fp8):
    """Against the launches it replaces (latent_rope_write_absorb's, the split attention, its combine +
    W_UV): on a GPU DeepSeek-V2-Lite's head shapes in bf16 (an FP8 pool too) at 1-1000 keys; in the
    interpreter tiny float32 shapes."""
    from kernels.attention import KV_FP8_DTYPE
    from kernels.mla_attention import mla_attention_triton
    from kernels.mla_latent_write import latent_rope_write_triton

    if device != "cuda" and cache_fp8:
        pytest.skip("the FP8 pool on a GPU")
    cuda = device == "cuda"
    shapes = (16, 512, 64, 128, 128, 64) if cuda else (HEADS, RANK, ROPE, NOPE, V_DIM, PAGE)
    heads, rank, rope, nope, v_dim, page = shapes
    dtype = torch.bfloat16 if cuda else torch.float32
    context_lens = [300, 1, 1000, 33] if cuda else [9, 1, 14]
    gen = torch.Generator().manual_seed(7)
    blocks = [-(-n // page) for n in context_lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()  # shuffled pages
    tables, at = torch.zeros(len(blocks), max(blocks), dtype=torch.int32), 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[at:at + n])
        at += n
    slots = torch.tensor([int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(context_lens)])
    cache = (torch.randn(sum(blocks), page, rank + rope, generator=gen) * 0.5).to(dtype)
    if cache_fp8:
        cache = cache.to(KV_FP8_DTYPE)
    t = len(context_lens)
    q = torch.randn(t, heads, nope + rope, generator=gen).to(dtype)
    kv = torch.randn(t, rank + rope, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(rank, generator=gen)).to(dtype)
    w_uk = (torch.randn(heads, nope, rank, generator=gen) * nope ** -0.5).to(dtype)
    w_uv = (torch.randn(heads, v_dim, rank, generator=gen) * rank ** -0.5).to(dtype)
    cos_sin = build_cos_sin_cache(2048, rope, 10000.0, None, "cpu")
    from kernels.attention_metadata import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), max_seqlen_q=1,
        max_context_len=max(context_lens), is_decode_only=True, cu_seqlens_q_host=list(range(t + 1)),
        context_lens_host=list(context_lens))
    q, kv, weight, w_uk, w_uv, cos_sin = (x.to(device) for x in (q, kv, weight, w_uk, w_uv, cos_sin))
    positions = meta.context_lens.long() - 1
    three_cache, one_cache = cache.to(device), cache.to(device)
    q_three = q.clone()
    q_rope, q_latent = latent_rope_write_triton(q_three[..., nope:], kv, weight, 1e-6, positions, cos_sin, three_cache,
                                                meta.slot_mapping, q_three[..., :nope], w_uk)
    want = mla_attention_triton(q_latent, q_rope, three_cache, meta, 0.1, w_uv=w_uv)
    for setting in SETTINGS if cuda else SETTINGS[:1]:  # (the others run by the first test's settings)
        got = mla_decode_fused_triton(q[..., :nope], q[..., nope:], kv, weight, 1e-6, positions, cos_sin, one_cache,
                                      meta.slot_mapping, meta, 0.1, w_uk, w_uv, setting)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(one_cache.view(torch.uint8), three_cache.view(torch.uint8), rtol=0, atol=0)
