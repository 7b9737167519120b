"""Chunked local attention (Llama 4's rope layers) over the paged KV pool of kernels/attention.py.

Positions fall in chunks of C (``attention_chunk_size``): the query at position p sees the keys at
positions ``(p // C) * C <= k <= p``, its own chunk up to itself (transformers'
create_chunked_causal_mask). Unlike a sliding window the visible span restarts at every chunk
boundary, so it depends on the query's position, not only on the layer. Only the blocks from the
first visible key of the step's first query on are read; older blocks stay in the pool (a later
chunk boundary makes them unreadable, but the pool keeps them: prefix caching may share them).

Same call shape as kernels/attention.py ``paged_attention`` (q (tokens, heads, D), the layer's K and
V caches (blocks, tokens_per_block, kv_heads, D) with any strides, AttentionMetadata), plus C.
``chunked_attention`` dispatches: a decode-only batch on CUDA to kernels/triton_attention.py's paged
kernel with the chunk as its walk's start (split-K over the chunk's keys, as a global layer's decode: the
kernel below has one program per token and KV head, 8 programs at batch 1, and took 19.9 us a call against
the paged kernel's 5.9 on Scout's shape, H200, 2026-12-01); other batches on CUDA to the Triton kernel below
(one program per token and KV head, that head's query group at once, online softmax; no host sync, so
CUDA graphs may hold it); the plain-torch reference elsewhere and as the tests' oracle.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, tl, triton, use_triton
from kernels.attention import paged_attention_ref
from kernels.attention_metadata import AttentionMetadata
from kernels.online_softmax import online_softmax_step
from kernels.triton_attention import paged_attention_triton


def chunked_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, chunk_size: int) -> torch.Tensor:
    """The module docstring's attention in plain torch: kernels/attention.py's reference with a window
    of C (which holds every key of a query's chunk, and only the blocks it spans are gathered) and a
    bias of -inf on the keys of earlier chunks."""
    def earlier_chunks(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:  # (q,), (k,) -> (q, k)
        other = (k_pos[None, :] // chunk_size) != (q_pos[:, None] // chunk_size)
        return torch.zeros(other.shape, device=q_pos.device).masked_fill_(other, float("-inf"))

    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=chunk_size,
                               position_bias=earlier_chunks)


@jit
def _chunked_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, token_seq_ptr, cu_ptr, ctx_ptr,
                              scale, group, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                              stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
                              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                              PAGE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """Program (t, kv head): the query heads of that KV head for token t, over keys chunk_start .. p."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    q_pos = tl.load(ctx_ptr + seq) - (tl.load(cu_ptr + seq + 1) - token)
    chunk_start = q_pos // CHUNK * CHUNK
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * group + rows
    d = tl.arange(0, D_PAD)
    q_ok = (rows < group)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    m = tl.full([GROUP_PAD], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    for start in range(chunk_start, q_pos + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys <= q_pos
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        offset = (keys % PAGE).to(tl.int64)
        kv_ok = key_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_ok, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_ok, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (GROUP_PAD, BLOCK_N) float32
        scores = tl.where(key_ok[None, :], scores * scale, -float("inf"))
        m, denom, acc = online_softmax_step(scores, v, m, denom, acc, DOT_PRECISION)
    out = acc / denom[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_ok)


def chunked_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                             scale: float, chunk_size: int, *, block_n: int = 32) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # read at ptr + i (block_tables: + row * its row stride + j)
    tables, token_seq, cu, lens = dense(meta.block_tables, meta.token_sequences(num_tokens), meta.cu_seqlens_q,
                                        meta.context_lens)
    _chunked_attention_kernel[(num_tokens, num_kv_heads)](
        q, k_cache, v_cache, out, tables, token_seq, cu, lens, scale, group,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=k_cache.shape[1], CHUNK=chunk_size, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def chunked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, chunk_size: int) -> torch.Tensor:
    """Chunked local attention (module docstring): Triton on CUDA (decode-only batches through the paged
    kernel), else the reference."""
    if use_triton(q) and meta.is_decode_only:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, chunk_size=chunk_size)
    if use_triton(q):
        return chunked_attention_triton(q, k_cache, v_cache, meta, scale, chunk_size)
    return chunked_attention_ref(q, k_cache, v_cache, meta, scale, chunk_size)
