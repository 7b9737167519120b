"""How an MLA attention program hands its split's result to the combine (kernels/mla_attention.py's
_combine): the one layout both MLA kernels (the general one there, kernels/mla_decode.py's decode
kernel) write and the combine launches read.

DIRECT (one split): the normalized output (T, H, R) in the output's dtype. Otherwise partials (float32,
or the queries' 16-bit dtype: kernels/mla_attention.py HALF_PARTIALS) at row (token * splits + split) *
num_heads + head of a (T, splits, H, R) buffer, only where the split saw keys, and the split's log-sum-exp
in natural-log units at (token * num_heads + head) * splits + split of a (T, H, splits) buffer, -inf for a
split of no keys (weight 0 in the combine)."""
from __future__ import annotations

from kernels._triton import jit, tl


@jit
def store_split_output(part_ptr, lse_ptr, acc, denom, lse, token, heads, head_ok, r, num_heads, splits, split,
                       RANK: tl.constexpr, DIRECT: tl.constexpr, LSE: tl.constexpr = True):
    """acc (BLOCK_H, RANK_PAD) the unnormalized weighted sum of token ``token``'s heads ``heads`` over this
    split's keys, denom (BLOCK_H,) its softmax denominator (0: no keys), ``lse`` (BLOCK_H,) its log-sum-exp in
    natural-log units where denom > 0 (read nowhere else). A kernel holding the sum in column parts calls this once
    a part: acc (BLOCK_H, W) its columns ``r`` (those of the whole row, < RANK written), ``LSE`` True for one part."""
    has_keys = denom > 0
    out = acc / tl.where(has_keys, denom, 1.0)[:, None]
    if DIRECT:
        tl.store(part_ptr + (token * num_heads + heads)[:, None] * RANK + r[None, :],
                 out.to(part_ptr.dtype.element_ty), mask=head_ok[:, None] & (r < RANK)[None, :])
    else:
        row_out = (token * splits + split) * num_heads + heads
        tl.store(part_ptr + row_out[:, None] * RANK + r[None, :], out.to(part_ptr.dtype.element_ty),
                 mask=(head_ok & has_keys)[:, None] & (r < RANK)[None, :])
        if LSE:
            tl.store(lse_ptr + (token * num_heads + heads) * splits + split, tl.where(has_keys, lse, -float("inf")),
                     mask=head_ok)
