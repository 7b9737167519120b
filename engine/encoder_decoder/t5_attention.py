"""T5's self-attention with its relative position bias: the kernels of kernels/t5_bias_attention.py
on CUDA, the torch paths elsewhere.

Both stacks of a T5 hold a bias table (num_buckets, heads) (model.py ``_Stack.position_bias``); the
kernels read it as ``distance_bias`` tables (heads, 2 * max_distance + 1), the encoder's
bidirectional and the decoder's causal, made once per table weight and kept on the stack
(``stack_distance_bias``; a CUDA graph's warm-up runs make the decoder's before its capture).

- decoder: the paged causal self-attention of every step, decode rows and prompt chunks alike
  (``decoder_self_attention``), after the step's K/V were written to the pool;
- encoder: the padded batch's bidirectional attention with each input's length (``encoder_attention``).

$TRITONLLM_T5_KERNELS=0 keeps the torch paths on CUDA too (the encoder's fused attention with a
dense bias, the decoder's batched torch decode attention): an A/B switch, read at every call.
$TRITONLLM_T5_DECODE_KERNEL=0 runs decode steps through the paged kernel's tensor-core path
instead of its decode kernel (kernels/t5_bias_attention.py): an A/B switch too, read at every call
(a CUDA graph keeps the path it was captured with).
$TRITONLLM_T5_DENSE_KERNEL picks the encoder's kernel among kernels/t5_bias_attention.py DENSE_KERNELS
(split, ahead, tma, gather; "old": the kernel before the split one; unset: DENSE_KERNEL), for A/B, read at
every call.
"""
from __future__ import annotations

import os

import torch

from kernels._triton import use_triton
from kernels.attention_metadata import AttentionMetadata
from kernels.relative_position_bias import decode_attention_bias, paged_attention_bias_ref
from kernels.t5_bias_attention import distance_bias, t5_dense_attention_triton, t5_paged_attention_triton

T5_KERNELS_ENV = "TRITONLLM_T5_KERNELS"
T5_DECODE_KERNEL_ENV = "TRITONLLM_T5_DECODE_KERNEL"
T5_DENSE_KERNEL_ENV = "TRITONLLM_T5_DENSE_KERNEL"


def kernels_enabled(x: torch.Tensor) -> bool:
    return use_triton(x) and os.environ.get(T5_KERNELS_ENV, "1") != "0"


def stack_distance_bias(stack: torch.nn.Module, *, bidirectional: bool) -> torch.Tensor:
    """The stack's ``distance_bias`` table, made on first use and kept (keyed by the weight's storage,
    so reloaded weights make a new one; weights are not edited in place after load)."""
    weight = stack.position_bias.weight
    key = (bidirectional, weight.data_ptr())
    cached = getattr(stack, "_t5_distance_bias", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, distance_bias(weight, bidirectional=bidirectional,
                                         max_distance=stack.spec.relative_max_distance))
        stack._t5_distance_bias = cached
    return cached[1]


def decoder_self_attention(stack: torch.nn.Module, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim) of a decoder step whose K/V are in the pool -> same shape."""
    if kernels_enabled(q):
        return t5_paged_attention_triton(q, k_cache, v_cache, meta, scale,
                                         stack_distance_bias(stack, bidirectional=False),
                                         decode_kernel=os.environ.get(T5_DECODE_KERNEL_ENV, "1") != "0")
    table, distance = stack.position_bias.weight, stack.spec.relative_max_distance
    if meta.is_decode_only:  # batched, device tensors only: CUDA-graph safe
        return decode_attention_bias(q, k_cache, v_cache, meta, scale, table, distance)
    return paged_attention_bias_ref(q, k_cache, v_cache, meta, scale, table, distance)


def encoder_attention(stack: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k, v: (batch, L, heads, head_dim) of a padded batch; lengths (batch,) int32 -> like q."""
    return t5_dense_attention_triton(q, k, v, lengths, scale, stack_distance_bias(stack, bidirectional=True),
                                     kernel=os.environ.get(T5_DENSE_KERNEL_ENV) or None)
