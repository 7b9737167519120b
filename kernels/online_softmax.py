"""The step of a flash-attention loop that the latent (kernels/mla_attention.py) and chunked
(kernels/chunked_attention.py) attention kernels share: fold one tile of keys into a running
softmax-weighted sum without holding every score (the online softmax)."""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def online_softmax_step(scores, values, m, denom, acc, DOT_PRECISION: tl.constexpr):
    """scores (ROWS, N) float32, -inf where a key is hidden; values (N, D); m, denom (ROWS,) and acc
    (ROWS, D) float32, the running max, denominator and sum -> their updates (DOT_PRECISION: the
    value product's, "ieee" for float32 operands). The loop's first tile
    must show every row at least one key (m then becomes finite and stays so)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    probs = tl.exp(scores - m_new[:, None])
    return m_new, denom * alpha + tl.sum(probs, 1), acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values,
                                                                input_precision=DOT_PRECISION)
