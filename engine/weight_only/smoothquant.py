"""SmoothQuant (Xiao et al. 2023) as a float-to-float transform of a Hugging Face model, run before
W8A8 INT8 quantization (kernels/int8_sq.py: int8 weights per output channel, int8 activations per
token).

Per-token activation quantization fails where a few input channels carry outliers 10-100x the
rest: every token's scale is set by them. SmoothQuant moves that range into the weights, which are
quantized per output channel and so absorb it cheaply: for each group of linears reading one input,
per input channel c,

    s[c] = max|X[:, c]| ** alpha / max|W[:, c]| ** (1 - alpha)      (alpha 0.5 by default),

over the calibration rows X and the group's stacked weights W; the producer's output channels (the
norm's weight, or the rows of v / up) are divided by s and the consumers' columns multiplied by it,
so the float model computes the same function. The groups, the calibration text and the folding
are engine/weight_only/awq.py's (``awq_transform`` with this closed form as its ``scale_fn``, no
clipping): input_layernorm -> q, k, v; v -> o without grouped-query attention; the MLP norm ->
gate, up; up -> down.
"""
from __future__ import annotations

from functools import partial

import torch

from engine.weight_only.awq import awq_transform

DEFAULT_ALPHA = 0.5
MIN_FACTOR = 1e-5  # keeps a dead channel (all-zero activations or weights) from a zero or infinite scale


def smoothing_scale(x: torch.Tensor, weight: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """x (rows, K) the group's calibration inputs, weight (N, K) its stacked weights -> s (K,)."""
    act = x.abs().amax(dim=0).float().clamp(min=MIN_FACTOR)
    peak = weight.abs().amax(dim=0).float().clamp(min=MIN_FACTOR)
    return (act ** alpha / peak ** (1 - alpha)).clamp(min=MIN_FACTOR)


def smoothquant_transform(hf_model, tokenizer, *, alpha: float = DEFAULT_ALPHA, text: str | None = None,
                          max_tokens: int = 512, device=None, progress: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict (HF names, float32) with SmoothQuant's scales folded in; ``hf_model``
    is not modified (``awq_transform``'s contract)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be within [0, 1], got {alpha}")
    return awq_transform(hf_model, tokenizer, group_size=0, text=text, max_tokens=max_tokens, device=device,
                         progress=progress, clip=False, scale_fn=partial(smoothing_scale, alpha=alpha),
                         name="SmoothQuant")
