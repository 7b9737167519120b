"""Multi-head latent attention of long prefill chunks in the expanded form: per-head K/V made from
the cached latents, then ordinary attention (kernels/mla_attention.py holds the absorbed form and the
pool layout).

For sequence i with q new tokens over a context of n keys (its cached prefix and the new tokens,
whose latents the layer has just written)::

    K_h = [c W_UK_h^T | k_r]   (n, N + P),   V_h = c W_UV_h^T   (n, V)      c, k_r: the pool rows
    out[t, h] = softmax(scale q_h K_h^T, causal) V_h                        (q, H, V)

It is the absorbed form's attention (the same sums in another order). Which is cheaper depends on
q: the absorbed form costs H (2R + P) multiply-adds per (query, key), the expanded one H (N + P + V)
plus the expansion's H R (N + V) per key, once for all q queries; the expanded form wins from
q > R (N + V) / (2R - N - V) new tokens (171 for DeepSeek-V3: R 512, N 128, V 128). ``split_long``
cuts a step into the sequences past the threshold and a metadata of the rest for the absorbed
kernel. Plain torch (scaled_dot_product_attention: flash/efficient kernels on CUDA); eager steps only
(decode-only steps, CUDA graphs and tree masks keep the absorbed form).
"""
from __future__ import annotations

import torch

from kernels.attention import gather_blocks
from kernels.attention_metadata import AttentionMetadata


def expanded_min_tokens(rank: int, nope: int, v_dim: int) -> int | None:
    """New tokens from which a sequence's chunk is cheaper expanded (module docstring); None: never."""
    denominator = 2 * rank - nope - v_dim
    return None if denominator <= 0 else -(-rank * (nope + v_dim) // denominator)


def split_long(meta: AttentionMetadata, min_tokens: int | None
               ) -> tuple[list[tuple[int, int, int, int]], torch.Tensor | None, AttentionMetadata | None]:
    """(the sequences (index, first row, end row, context_len) with >= min_tokens new tokens, the
    rows of the others (None: no others), their metadata) -- ([], None, None) when nothing is long
    or the step cannot be split (decode only, a tree mask or image spans, no host copies: a CUDA graph)."""
    if (min_tokens is None or meta.is_decode_only or meta.tree_mask is not None or meta.span_ahead is not None
            or meta.cu_seqlens_q_host is None
            or meta.max_seqlen_q < min_tokens):
        return [], None, None
    sequences = list(meta.host_sequences())
    long = [s for s in sequences if s[2] - s[1] >= min_tokens]
    if not long:
        return [], None, None
    short = [s for s in sequences if s[2] - s[1] < min_tokens]
    if not short:
        return long, None, None
    device = meta.block_tables.device
    rows = torch.cat([torch.arange(start, end) for _, start, end, _ in short]).to(device)
    index = torch.tensor([i for i, _, _, _ in short], device=device)
    cu = [0]
    for _, start, end, _ in short:
        cu.append(cu[-1] + end - start)
    lens = [ctx for _, _, _, ctx in short]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], block_tables=meta.block_tables[index],
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])), max_context_len=max(lens),
        is_decode_only=all(b - a == 1 for a, b in zip(cu, cu[1:])), cu_seqlens_q_host=cu, context_lens_host=lens)
    return long, rows, sub


def mla_expanded_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                         context_len: int, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's q new tokens: q_nope (q, H, N), q_rope (q, H, P) rotated; cache (blocks,
    tokens_per_block, R + P) with this sequence's rows in ``block_table``; w_uk (H, N, R), w_uv (H, V, R)
    -> (q, H, V) in q_nope's dtype. The new tokens are the last q of context_len keys."""
    q_len, heads, rank = q_nope.shape[0], q_nope.shape[1], w_uk.shape[-1]
    blocks = block_table[:-(-context_len // cache.shape[1])].long()
    rows = gather_blocks(cache, blocks).reshape(-1, cache.shape[-1])[:context_len].to(q_nope.dtype)  # (n, R + P)
    latent, k_rope = rows[:, :rank], rows[:, rank:]
    k = torch.cat([torch.einsum("kr,hnr->hkn", latent, w_uk),
                   k_rope[None].expand(heads, -1, -1)], dim=-1)  # (H, n, N + P)
    v = torch.einsum("kr,hvr->hkv", latent, w_uv)  # (H, n, V)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # (H, q, N + P)
    if q_len == context_len:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # a cached prefix: row t sees keys up to context_len - q_len + t
        mask = (torch.arange(context_len, device=q.device)[None, :]
                <= torch.arange(context_len - q_len, context_len, device=q.device)[:, None])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
