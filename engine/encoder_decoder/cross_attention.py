"""The decoder's cross-attention over the cross pool: which kernel a step takes.

Every new token is its own one-query sequence over its request's encoder K/V (model.py
``cross_metadata``). Decode-only steps (``meta.is_decode_only`` of the step's self-attention metadata:
CUDA-graph replays and eager decode steps alike) take kernels/cross_attention_decode.py (the one-query
kernel of kernels/one_query_attention.py: no 16-row tensor-core tile per (row, head), key splits where
the rows do not fill the GPU); other steps, and every step with $TRITONLLM_ENCDEC_CROSS_KERNEL=0, the
general paged kernel (kernels/attention.py) as before. The switch is read at every call (a CUDA graph
keeps the path it was captured with: set it for the whole process).
"""
from __future__ import annotations

import os

import torch

from kernels.attention import paged_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.cross_attention_decode import cross_attention_decode

CROSS_KERNEL_ENV = "TRITONLLM_ENCDEC_CROSS_KERNEL"  # "0": decode steps' cross-attention through the paged kernel


def decode_kernel_enabled() -> bool:
    return os.environ.get(CROSS_KERNEL_ENV, "1") != "0"


def cross_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cross_meta: AttentionMetadata,
                    scale: float, *, decode_step: bool) -> torch.Tensor:
    """q: (rows, heads, head_dim), one row a new token; k_pool / v_pool: one layer's cross pool halves
    (blocks, tokens_per_block, heads, head_dim) -> (rows, heads, head_dim)."""
    if decode_step and decode_kernel_enabled():
        return cross_attention_decode(q, k_pool, v_pool, cross_meta.block_tables, cross_meta.context_lens, scale,
                                      cross_meta.max_context_len)
    return paged_attention(q, k_pool, v_pool, cross_meta, scale)
