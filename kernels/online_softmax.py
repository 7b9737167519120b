"""The step of a flash-attention loop that the latent (kernels/mla_attention.py) and chunked
(kernels/chunked_attention.py) attention kernels share: fold one tile of keys into a running
softmax-weighted sum without holding every score (the online softmax)."""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def online_softmax_step(scores, values, m, denom, acc, DOT_PRECISION: tl.constexpr):
    """scores (ROWS, N) float32, -inf where a key is hidden; values (N, D); m, denom (ROWS,) and acc
    (ROWS, D) float32, the running max, denominator and sum -> their updates (DOT_PRECISION: the
    value product's, "ieee" for float32 operands). A row that has seen no key yet (m = -inf, also
    after this tile: every key so far hidden, as a token tree's split can be) keeps m = -inf and
    denom = acc = 0 instead of NaN: it subtracts 0 for its max."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m - m_sub)
    probs = tl.exp(scores - m_sub[:, None])
    return m_new, denom * alpha + tl.sum(probs, 1), acc * alpha[:, None] + tl.dot(probs.to(values.dtype), values,
                                                                input_precision=DOT_PRECISION)
