"""What every rope attention layer runs between its qkv product and its o_proj: rotary on q and k,
the new k and v into the paged cache, then paged attention.

``rope_paged_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta, scale, ...)``
equals ``rotary_and_write_kv`` (kernels/rotary.py) followed by ``paged_attention``
(kernels/attention.py); shapes and the cache contract are theirs.

Why one entry: at decode the attention kernel can do the other two itself (one launch less per
layer, and the step's critical path at batch 1 is a chain of such few-microsecond kernels). Each
program rotates its own query rows, and the one split whose keys end at the new token's position
writes that token's rotated K and its V into the cache, then reads them back with the rest. So does a
short mixed step whose sequences are one query tile each (a batch-1 tree verify step of up to 16
tokens: kernels/triton_attention.py short_step_appends), each row rotated at its own position. Other
prefill and mixed batches, GPT-J-style pairs and heads that are not a power of two keep the two kernels.
Neither path promises anything about q and k afterwards (the split path rotates q in place).

``append_paged_attention`` is the same for layers with no rotary (ALiBi, learned positions):
``write_kv_cache`` + ``paged_attention``, one kernel at decode.
"""
from __future__ import annotations

import torch

from kernels import triton_attention
from kernels._triton import use_triton
from kernels.attention import paged_attention, write_kv_cache
from kernels.attention_metadata import AttentionMetadata
from kernels.rmsnorm import rms_norm
from kernels.rotary import rotary_and_write_kv


def fuses_rotary_into_attention(q: torch.Tensor, meta: AttentionMetadata, is_neox: bool) -> bool:
    head_dim = q.shape[-1]
    return use_triton(q) and meta.is_decode_only and is_neox and triton_attention.fuses_new_kv(head_dim)


def rope_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
    sliding_window: int | None = None, logit_softcap: float | None = None, is_neox: bool = True,
    sinks: torch.Tensor | None = None, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """q: (num_tokens, heads, dim), k and v: (num_tokens, kv_heads, dim) unrotated, last dim
    contiguous (column views of the fused qkv output are fine) -> out: (num_tokens, heads, dim).
    ``sliding_window``, ``logit_softcap``, ``sinks``: kernels/attention.py. ``qk_norm = (q_weight, k_weight,
    eps)``: q and k come before their per-head RMSNorms (Qwen3), applied here first: inside the one decode kernel
    where it runs (``fuses_rotary_into_attention``), else by kernels/rmsnorm.py's norm of each head."""
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap, "sinks": sinks}
    if qk_norm is not None and fuses_rotary_into_attention(q, meta, is_neox):
        return triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale,
                                                       new_kv=(k, v, positions, cos_sin_cache), qk_norm=qk_norm,
                                                       **options)
    if qk_norm is not None:
        q, k = (rms_norm(t.reshape(-1, t.shape[-1]), weight, qk_norm[2])[0].view(t.shape)
                for t, weight in ((q, qk_norm[0]), (k, qk_norm[1])))
    if fuses_rotary_into_attention(q, meta, is_neox) or (
            use_triton(q) and is_neox and triton_attention.short_step_appends(q, k_cache, meta, sliding_window)):
        return triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale,
                                                       new_kv=(k, v, positions, cos_sin_cache), **options)
    q = rotary_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, is_neox=is_neox)
    return paged_attention(q, k_cache, v_cache, meta, scale, **options)


def append_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new k and v into the paged cache, then paged attention (shapes as rope_paged_attention's,
    nothing rotated); a decode-only batch with power-of-two heads (>= 16 wide) on CUDA in one kernel, whose
    split holding the new token's slot writes it before reading its keys."""
    head_dim = q.shape[-1]
    if use_triton(q) and meta.is_decode_only and triton_attention.fuses_new_kv(head_dim):
        return triton_attention.paged_attention_triton(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                                       new_kv=(k, v, None, None), alibi_slopes=alibi_slopes)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, alibi_slopes=alibi_slopes)
