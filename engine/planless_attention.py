"""torch's fused attention without cuDNN for models whose attention shapes change from call to call.

On an H200 torch 2.11 picks cuDNN for 16-bit scaled_dot_product_attention, and cuDNN builds and tunes a plan for
each new shape it meets: 115-657 ms of host time for a vision tower's forward of an image count not seen before
(benchmarks/results/engine.md, 2026-11-30 session 22), against 13-48 ms once planned. An encoder-decoder's encoder
meets a new batch of inputs with nearly every encoder pass the executor schedules (Whisper large-v3, 64 clips: the
encoder's device time in the run 0.84-0.86 s against 0.31 s for the same pass once warm, calls 30-31 on 2026-11-30),
and Llama 3.2 Vision's cross-attention a new (rows, image tokens) shape with each step. "Planless" asks torch for
flash, memory-efficient or math attention (flash for 16-bit inputs without a mask, memory-efficient for masks and
float32), which launch at once for any shape; in steady state flash and cuDNN measured the same on the towers.

$TRITONLLM_PLANLESS_SDPA=0 restores torch's own choice (cuDNN included), for A/B runs.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PLANLESS_ENV = "TRITONLLM_PLANLESS_SDPA"
PLANLESS_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def planless_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, scale) ((batch, heads, L, head_dim) operands) on a
    backend that plans nothing per shape (CUDA; elsewhere torch's choice). sdpa_kernel sets torch's process-wide
    backend flags for the call; another thread's attention caught in that window still finds a kernel among
    the three (math takes anything)."""
    if not q.is_cuda or os.environ.get(PLANLESS_ENV, "1") == "0":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    with sdpa_kernel(PLANLESS_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
