"""T5's attention with its relative position bias computed in the kernel: the decoder's paged
causal self-attention (decode rows and prompt chunks) and the encoder's dense bidirectional one.

T5 adds ``table[bucket(k - q), head]`` to every score (kernels/relative_position_bias.py) and does
not scale the scores (scale 1.0, an argument anyway). The bucket depends only on the key-minus-query
distance d, and every |d| >= max_distance lands in the last bucket of its side (the log-spaced
bucket reaches num_buckets at max_distance and is clamped), so the bias of a head is a function of
``clamp(d, -max_distance, max_distance)``: ``distance_bias`` tabulates it once per weight as a
(num_heads, 2 * max_distance + 1) float32 table, row h, column ``clamp(d) + max_distance``, through
the same torch bucket code transformers' numbers were checked against. The kernels then load the
bias of each score from that small table (it stays in L1/L2): exactly the reference's bias, no
log in the kernel to round differently at a bucket edge.

- ``t5_paged_attention``: the packed, ragged batch of kernels/attention.py (block tables, causal
  over the cached prefix and the new tokens), heads == KV heads (T5), the causal table. One
  program per (tile of BLOCK_M new tokens, sequence, head); BLOCK_M is 16 (the tensor-core minimum)
  when every sequence has one new token, else 64. The grid depends only on the batch size and
  ``meta.max_seqlen_q`` (1 for decode steps), never on device values: a decode step is CUDA-graph
  safe. Scores, bias and the online softmax in float32 (base 2), the products in the pool's dtype.
  Decode steps (``meta.max_seqlen_q == 1``) take kernels/one_query_attention.py's kernel instead
  (with this table as its bias; the cross-attention's decode kernel too, without): one program per
  (sequence, group of HEADS_PER_PROGRAM heads), one query row per head, its dot products plain
  float32 multiply-and-sum over the head dim on (heads, keys, dim) tiles. The tensor-core path
  spent a 16-row tile on each one-row query (15 rows wasted) and one program per head: ~86 us a
  launch at 256 rows of 32 x 64 heads over contexts up to 128 on an H200 (2026-11-29), ~3x its K/V
  bytes' time. ``decode_kernel=False`` (or $TRITONLLM_T5_DECODE_KERNEL=0 in the engine) keeps it.
- ``t5_dense_attention``: q, k, v (batch, L, heads, head_dim) of a padded batch (views of the
  projections are fine), keys at or past ``lengths[b]`` hidden, the bidirectional table; one
  program per (tile of BLOCK_M queries, batch row, head). Rows past a length are computed over the
  row's valid keys (finite; the encoder drops them). ``_t5_dense_split_kernel`` (DENSE_KERNEL
  "split"): its bias comes from ``dense_distance_bias``, a per-call table with a column per distance
  of the input in log2 units, in 4 shifted copies so that each query row's keys are one aligned
  run (no clamp, no per-score index math); key tiles whose every distance is at or
  past max_distance on one side (about 40% at 512 tokens) add that side's one value with no load and
  fold it into the exponent's FMA; only the partial last key tile masks. "ahead" is the same kernel
  issuing each key tile's q k^T one tile early, so that ptxas runs the tensor cores' product among the
  previous tile's exponentials; "tma" reads q, K and V through TMA descriptors. BIAS_VECTOR (default
  DENSE_BIAS_VECTOR 2) reads the bias in 8-byte pieces, which Triton copies through L1, where a tile's
  bias rows (shifted copies of each other) hit; 16-byte copies (4) bypass L1 and took twice the time on
  an H200. ``_t5_dense_kernel`` ("old") gathers a clamped index
  and masks on every tile (kept for A/B). Made per call (cached per table and length), the table is a
  few KB a head.

Plain-torch references: ``t5_paged_attention_ref`` (kernels/relative_position_bias.py's
``paged_attention_bias_ref``) and ``t5_dense_attention_ref``; the public entries dispatch on the
device (Triton on CUDA, references elsewhere; tests run the kernels on the CPU with TRITON_INTERPRET=1
through the ``*_triton`` functions).
"""
from __future__ import annotations

import torch

from kernels._triton import TensorDescriptor, dense, jit, tl, triton, use_triton
from kernels.attention_metadata import AttentionMetadata
from kernels.one_query_attention import one_query_attention_triton
from kernels.relative_position_bias import paged_attention_bias_ref, relative_position_bucket

_LOG2E = 1.4426950408889634


def distance_bias(table: torch.Tensor, *, bidirectional: bool, max_distance: int) -> torch.Tensor:
    """(num_heads, 2 * max_distance + 1) float32: column c holds every head's bias at key-minus-query
    distance c - max_distance (the ends stand for all farther distances). ``table``: (num_buckets, num_heads)."""
    distance = torch.arange(-max_distance, max_distance + 1, device=table.device)
    buckets = relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=table.shape[0],
                                       max_distance=max_distance)
    return table.float()[buckets].t().contiguous()


def bias_of_distances(bias: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """The reference lookup: (num_heads, *distance.shape) float32 from a ``distance_bias`` table."""
    reach = (bias.shape[1] - 1) // 2
    return bias[:, distance.clamp(-reach, reach) + reach]


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------

def t5_paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, table: torch.Tensor, max_distance: int) -> torch.Tensor:
    """The paged causal attention with T5's causal bias of ``table`` (num_buckets, heads); fp32 math."""
    return paged_attention_bias_ref(q, k_cache, v_cache, meta, scale, table, max_distance)


def t5_dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                           bias: torch.Tensor) -> torch.Tensor:
    """q, k, v: (batch, L, heads, head_dim); lengths (batch,); bias a bidirectional ``distance_bias``
    table -> (batch, L, heads, head_dim) in q's dtype; float32 scores and softmax."""
    length = q.shape[1]
    positions = torch.arange(length, device=q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    scores = scores + bias_of_distances(bias, positions.view(1, -1) - positions.view(-1, 1)).unsqueeze(0)
    hidden = positions.view(1, -1) >= lengths.view(-1, 1)  # (batch, keys)
    scores = scores.masked_fill(hidden.view(hidden.shape[0], 1, 1, length), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@jit
def _softmax_start(BLOCK_M: tl.constexpr, DIM_PAD: tl.constexpr):
    """(running max, running sum, accumulator) of an online softmax that has seen no key."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32))


@jit
def _softmax_step(q, k, v, k_pos, q_pos, visible, m_i, l_i, acc, bias_row, scale_log2,
                  REACH: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2): scores q k^T * scale + bias(k - q), hidden
    where not ``visible`` -> (m_i, l_i, acc). Every row has seen a visible key by its first tile."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    distance = tl.minimum(tl.maximum(k_pos[None, :] - q_pos[:, None], -REACH), REACH) + REACH
    scores += tl.load(bias_row + distance) * 1.4426950408889634
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@jit(do_not_specialize=["stride_bt"])
def _t5_paged_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bias_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt, stride_bias,
    REACH: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (m tile, sequence, head): the sequence's new tokens [m * BLOCK_M, +BLOCK_M) of one head
    attend causally over its paged keys [0, their last position]."""
    m_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = m_tile * BLOCK_M
    if first >= q_len:
        return
    prefix = tl.load(context_lens_ptr + seq) - q_len
    rows = first + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = prefix + tl.minimum(rows, q_len - 1)  # padding rows repeat the last token (never all-masked)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token_rows = (q_start + rows).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    kv_end = prefix + tl.minimum(first + BLOCK_M, q_len)  # one past the tile's last position
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    bias_row = bias_ptr + head * stride_bias
    m_i, l_i, acc = _softmax_start(BLOCK_M, DIM_PAD)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + cols
        k_valid = k_pos < kv_end
        block = tl.load(block_row + k_pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        in_page = (k_pos % PAGE_SIZE)[:, None]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_page * stride_ks + head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_page * stride_vs + head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, k_pos, q_pos, visible, m_i, l_i, acc, bias_row, scale_log2,
                                      REACH, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@jit
def _t5_dense_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bias_ptr, lengths_ptr, scale_log2,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_bias, seq_len,
    REACH: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (m tile, batch row, head): queries [m * BLOCK_M, +BLOCK_M) over keys [0, lengths[b])."""
    m_tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    length = tl.load(lengths_ptr + b)
    q_pos = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = q_pos < seq_len
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + b * stride_qb + q_pos[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    bias_row = bias_ptr + head * stride_bias
    m_i, l_i, acc = _softmax_start(BLOCK_M, DIM_PAD)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, length, BLOCK_N):
        k_pos = start + cols
        k_valid = k_pos < length
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_ptr + b * stride_kb + k_pos[:, None] * stride_kt + head * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + k_pos[:, None] * stride_vt + head * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        visible = k_valid[None, :] & (q_pos >= 0)[:, None]
        m_i, l_i, acc = _softmax_step(q, k, v, k_pos, q_pos, visible, m_i, l_i, acc, bias_row, scale_log2,
                                      REACH, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + b * stride_ob + q_pos[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@jit
def _dense_key_tiles(q, scores_ahead, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, start, end,
                     length, far_bias, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NEAR: tl.constexpr,
                     TAIL: tl.constexpr, AHEAD: tl.constexpr, TMA: tl.constexpr):
    """Key tiles [start, end) (a multiple of BLOCK_N apart unless TAIL) into the online softmax (base 2) of one
    query tile -> (scores_ahead, m_i, l_i, acc). NEAR: each score's bias loaded from ``bias_rows[row] + key``
    (a ``dense_distance_bias`` table, log2 units, every distance of the input in range: no clamp; 16-byte
    aligned runs of keys: vector loads); else every score of these tiles has the bias ``far_bias`` (log2
    units), added once per row to the max and folded into the exponent's FMA, no load. TAIL: keys at or past
    ``length`` hidden by the bias load's -inf (no other mask work: full tiles take none). AHEAD: the tile's
    scores q k^T came in ``scores_ahead`` (computed by the tile before, or the kernel for the first), and each
    tile issues the next tile's product (its keys clamped to the input: past the end, wasted but in bounds)
    before its own softmax, so that the tensor cores run it during the exponentials. TMA: K and V tiles read
    through the descriptors ``k_desc`` / ``v_desc`` over the batch's (token, head x dim) rows, key j of this
    input at row ``desc_row`` + j, this head's dims at column ``desc_col`` (rows past the input are the next
    input's or zeros: finite, their scores hidden by the TAIL's bias like masked keys)."""
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = (dims < HEAD_DIM)[None, :]
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + cols
        if AHEAD:
            scores = scores_ahead
        elif TMA:
            k = k_desc.load([desc_row + start_n, desc_col])
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        else:
            k_offsets = k_pos[:, None] * stride_kt + dims[None, :]
            if TAIL or HEAD_DIM != DIM_PAD:
                k = tl.load(k_rows + k_offsets, mask=(k_pos < length)[:, None] & dim_mask, other=0.0)
            else:
                k = tl.load(k_rows + k_offsets)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if NEAR:  # (AHEAD: the bias read before the next product, whose wait would hold the read back)
            if TAIL:
                bias = tl.load(bias_rows[:, None] + k_pos[None, :], mask=(k_pos < length)[None, :],
                               other=float("-inf"))
            else:
                bias = tl.load(bias_rows[:, None] + k_pos[None, :])
            scores = scores * scale_log2 + bias
        if AHEAD:
            next_keys = tl.minimum(k_pos + BLOCK_N, length - 1)[:, None] * stride_kt + dims[None, :]
            if HEAD_DIM != DIM_PAD:
                k_next = tl.load(k_rows + next_keys, mask=dim_mask, other=0.0)
            else:
                k_next = tl.load(k_rows + next_keys)
            scores_ahead = tl.dot(q, tl.trans(k_next), input_precision=PRECISION)
        v_offsets = k_pos[:, None] * stride_vt + dims[None, :]
        if TMA:
            v = v_desc.load([desc_row + start_n, desc_col])
        elif TAIL or HEAD_DIM != DIM_PAD:
            v = tl.load(v_rows + v_offsets, mask=(k_pos < length)[:, None] & dim_mask, other=0.0)
        else:
            v = tl.load(v_rows + v_offsets)
        if NEAR:
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
        else:  # scale > 0: the max of scores * scale + c is (max of scores) * scale + c
            m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2 + far_bias)
            p = tl.math.exp2(scores * scale_log2 + (far_bias - m_new)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return scores_ahead, m_i, l_i, acc


@jit
def _t5_dense_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bias_ptr, lengths_ptr, scale_log2, q_desc, k_desc, v_desc,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_bias, bias_width, bias_zero, seq_len,
    REACH: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLIT_FAR: tl.constexpr,
    AHEAD: tl.constexpr, BIAS_VECTOR: tl.constexpr, TMA: tl.constexpr,
):
    """Program (m tile, batch row, head): queries [m * BLOCK_M, +BLOCK_M) over keys [0, lengths[b]), the bias
    from a ``dense_distance_bias`` table (log2 units; query row i reads copy i % BIAS_VECTOR from column
    bias_zero - BIAS_VECTOR * (i // BIAS_VECTOR), key j at + j: a run of keys is loads of BIAS_VECTOR floats
    (4: 16-byte cp.async, which bypass L1; 2: 8-byte ones, cached in L1, where the tile's bias rows,
    shifted copies of each other, hit). Key tiles
    run in loops by kind: with SPLIT_FAR, the tiles whose every distance is at or past -REACH (left)
    or +REACH (right) take their side's one bias value (no load); the rest (near) load theirs; the
    partial last tile alone masks. AHEAD: each tile's q k^T is issued by the tile before (across the
    loops), overlapping the tensor cores with the softmax. TMA: q, K and V tiles through the descriptors
    (``_dense_key_tiles``; q rows past seq_len are the next input's or zeros). Rows past seq_len repeat the
    last query (finite; not stored)."""
    m_tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    length = tl.load(lengths_ptr + b)
    first = m_tile * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    q_pos = tl.minimum(rows, seq_len - 1)
    dims = tl.arange(0, DIM_PAD)
    q_ptrs = q_ptr + b * stride_qb + q_pos[:, None] * stride_qt + head * stride_qh + dims[None, :]
    desc_row = (b * seq_len).to(tl.int32)
    desc_col = head * HEAD_DIM
    if TMA:
        q = q_desc.load([desc_row + first, desc_col])
    elif HEAD_DIM != DIM_PAD:
        q = tl.load(q_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs)
    bias_head = bias_ptr + head * stride_bias
    bias_rows = (bias_head + (rows % BIAS_VECTOR) * bias_width + bias_zero
                 - (rows // BIAS_VECTOR) * BIAS_VECTOR)  # key 0 of each query row
    k_rows = k_ptr + b * stride_kb + head * stride_kh
    v_rows = v_ptr + b * stride_vb + head * stride_vh
    m_i, l_i, acc = _softmax_start(BLOCK_M, DIM_PAD)
    if AHEAD:  # the first tile's scores (its keys clamped to the input; an input of no tokens reads key 0)
        first_keys = tl.minimum(tl.arange(0, BLOCK_N), tl.maximum(length - 1, 0))[:, None] * stride_kt + dims[None, :]
        if HEAD_DIM != DIM_PAD:
            k_first = tl.load(k_rows + first_keys, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        else:
            k_first = tl.load(k_rows + first_keys)
        scores = tl.dot(q, tl.trans(k_first), input_precision=PRECISION)
    else:
        scores = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # unused
    full_end = length // BLOCK_N * BLOCK_N
    if SPLIT_FAR:
        q_last = tl.minimum(first + BLOCK_M, seq_len) - 1
        left_end = tl.minimum(tl.maximum(first - REACH + 1, 0) // BLOCK_N * BLOCK_N, full_end)
        right_start = tl.maximum(tl.minimum((q_last + REACH + BLOCK_N - 1) // BLOCK_N * BLOCK_N, full_end), left_end)
        far_left = tl.load(bias_head)  # copy 0's first column: a distance <= -REACH when far tiles exist
        far_right = tl.load(bias_head + bias_width - 1)  # its last: >= REACH
        scores, m_i, l_i, acc = _dense_key_tiles(
            q, scores, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, 0, left_end, length,
            far_left, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM, DIM_PAD, BLOCK_N, PRECISION, False,
            False, AHEAD, TMA)
        scores, m_i, l_i, acc = _dense_key_tiles(
            q, scores, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, left_end, right_start, length,
            0.0, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM, DIM_PAD, BLOCK_N, PRECISION, True, False,
            AHEAD, TMA)
        scores, m_i, l_i, acc = _dense_key_tiles(
            q, scores, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, right_start, full_end, length,
            far_right, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM, DIM_PAD, BLOCK_N, PRECISION, False,
            False, AHEAD, TMA)
    else:
        scores, m_i, l_i, acc = _dense_key_tiles(
            q, scores, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, 0, full_end, length,
            0.0, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM, DIM_PAD, BLOCK_N, PRECISION, True, False,
            AHEAD, TMA)
    scores, m_i, l_i, acc = _dense_key_tiles(
        q, scores, m_i, l_i, acc, k_rows, v_rows, stride_kt, stride_vt, bias_rows, full_end, length, length,
        0.0, scale_log2, k_desc, v_desc, desc_row, desc_col, HEAD_DIM, DIM_PAD, BLOCK_N, PRECISION, True, True,
        AHEAD, TMA)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0: an input of no tokens
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < seq_len)[:, None] & (dims < HEAD_DIM)[None, :])


# Decode steps' tiling (HEADS_PER_PROGRAM, BLOCK_N keys, warps, stages): one head, 32 keys a step, one warp.
# The H200 sweep of benchmarks/kernels/t5_attention_bench.py (2026-11-30, commit 18133af; Flan-T5-XL heads, bf16
# pool, every row its full context) timed it fastest at every shape: 256 rows x 128 keys 68.1 us (3.9 TB/s of K/V,
# the copy rate) against 103.7 for the first guess (2, 64, 4, 1) and 111.3 for the tensor-core path; 64 x 128
# 24.6 against 36.2; 256 x 32 24.0 against 49.9. Many small programs (one per head) keep every SM's loads in flight
# where 4-warp programs over two heads left them idle between steps.
DECODE_TILING = (1, 32, 1, 1)
# Default tilings: decode rows / prompt chunks (BLOCK_N, warps, stages); encoder inputs of at least
# 128 tokens, per DENSE_KERNELS entry (BLOCK_M, BLOCK_N, warps, stages[, maxnreg]), shorter ones 64 x 64 over 4
# warps. The H200 sweeps (benchmarks/kernels/t5_attention_bench.py, 2026-11-30, Flan-T5-XL heads, 256 x 512):
# split fastest at (64, 32, 4, 3), 4.69 ms = 117 TFLOPS (6528c29; 108 registers on sm_90: four 4-warp programs an
# SM), (128, 32, 8, 2) 5.08, (128, 64, 8, 2) 6.68 (162 registers, one program an SM), the old kernel 8.35-8.52 (66);
# ahead fastest at (64, 32, 4, 2), 4.71 ms (125 registers).
PAGED_TILING = (64, 4, 2)
DENSE_TILINGS = {"split": (64, 32, 4, 3), "ahead": (64, 32, 4, 2), "tma": (64, 32, 4, 3),
                 "gather": (128, 64, 8, 2, 128), "old": (128, 64, 8, 2)}
# The encoder's kernel: "split" (_t5_dense_split_kernel, far key tiles without bias loads), "ahead" (the same,
# each tile's q k^T issued by the tile before), "tma" (the same reading q, K and V through TMA descriptors where
# the views allow: _tma_rows; else as split), "gather" (split's kernel loading every tile's bias) or "old"
# (_t5_dense_kernel: clamped bias gathers and masks on every tile).
DENSE_KERNELS = ("split", "ahead", "tma", "gather", "old")
DENSE_KERNEL = "split"
# Floats a bias load of the new kernels (4 or 2; dense_distance_bias has 4 shifted copies, enough for each). 1 is
# refused: on an H200 (2026-11-30 suite) its 4-byte runs faulted with a misaligned address (Triton vectorized
# them as if the row starts, zero - i, were aligned). 2:
# 8-byte copies, cached in L1, where a near tile's bias rows (shifted copies of each other) hit; 16-byte ones
# bypass L1 and read every row from L2 (twice the tile's K/V bytes). H200, 256 x 512 (call 28, cbbbda0): split
# (64, 32, 4, 3) 2.43 ms = 226 TFLOPS at 2 against 4.69 at 4; tma 2.65 against 4.89; the same kernel with no bias
# work (max_distance 1) 2.30, torch's flash attention without a bias 2.14.
DENSE_BIAS_VECTOR = 2


def _dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # a compiled tl.dot needs K >= 16


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 engines get fp32 dots


def t5_paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, bias: torch.Tensor, *, tiling: tuple[int, int, int] | None = None,
                              decode_kernel: bool = True, decode_tiling: tuple[int, int, int, int] | None = None
                              ) -> torch.Tensor:
    """q: (num_tokens, heads, head_dim), last dim contiguous; pools (blocks, page, heads, head_dim)
    by strides; ``bias`` a causal ``distance_bias`` table -> out like q. Decode steps
    (``meta.max_seqlen_q == 1``) run kernels/one_query_attention.py's kernel (one split) unless
    ``decode_kernel`` is False (the tensor-core path, for A/B). ``tiling``: (BLOCK_N keys, warps, stages) of the tensor-core path,
    ``decode_tiling``: (HEADS_PER_PROGRAM, BLOCK_N keys, warps, stages) of the decode kernel,
    instead of the defaults (sweeps)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    num_seqs = meta.context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert k_cache.shape[2] == num_heads, "T5 attention: heads == KV heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and bias.is_contiguous()
    tables, cu, lens = dense(meta.block_tables, meta.cu_seqlens_q, meta.context_lens)  # read at ptr + i
    if meta.max_seqlen_q == 1 and decode_kernel:
        return one_query_attention_triton(q, k_cache, v_cache, tables, lens, scale, cu_seqlens_q=cu, bias=bias,
                                          tiling=decode_tiling or DECODE_TILING, max_context_len=meta.max_context_len,
                                          splits=1)
    block_m = 16 if meta.max_seqlen_q == 1 else 64
    block_n, warps, stages = tiling or PAGED_TILING
    _t5_paged_kernel[(triton.cdiv(meta.max_seqlen_q, block_m), num_seqs, num_heads)](
        q, k_cache, v_cache, out, bias, tables, cu, lens,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], tables.stride(0), bias.stride(0),
        REACH=(bias.shape[1] - 1) // 2, HEAD_DIM=head_dim, DIM_PAD=_dim_pad(head_dim), PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), num_warps=warps, num_stages=stages)
    return out


def dense_distance_bias(bias: torch.Tensor, length: int, block_m: int) -> tuple[torch.Tensor, int]:
    """The split kernel's bias table for inputs padded to ``length`` in query tiles of ``block_m``, from a
    bidirectional ``distance_bias`` table: (table, zero), table (num_heads, 4, width) float32 in log2 units
    (times log2 e), copy s column x holding each head's bias at key-minus-query distance x - s - zero, for every
    distance of the input and its padding query rows (clamped: no clamp in the kernel). With bias loads of V
    floats (the kernel's BIAS_VECTOR: 4 or 2; the 4 copies serve each) query row i reads copy i % V from
    column zero - V * (i // V): each row's keys are a contiguous run starting at a multiple of V columns (V-float
    vector loads). width and zero are multiples of 16."""
    reach = (bias.shape[1] - 1) // 2
    zero = triton.cdiv(triton.cdiv(length, block_m) * block_m, 16) * 16
    width = triton.cdiv(zero + length, 16) * 16
    columns = torch.arange(width, device=bias.device)
    distance = columns.view(1, -1) - torch.arange(4, device=bias.device).view(-1, 1) - zero
    return (bias[:, distance.clamp_(-reach, reach) + reach] * _LOG2E).contiguous(), zero


# dense_distance_bias tables made by t5_dense_attention_triton, newest last: (id(bias), length, BLOCK_M) -> (bias,
# its version counter then, table, zero). The entry holds ``bias`` itself, so its id cannot be reused while cached;
# an in-place change bumps the version and remakes the table. Inference tensors (made under torch.inference_mode,
# as the executor's are) keep no version counter: theirs is None, and a table made from one is kept as long as that
# tensor (T5's distance tables are made once per weight and never written after). A stack's 24 encoder layers share
# one table a length instead of making it (seven small launches) each call.
_DENSE_TABLES: dict[tuple[int, int, int], tuple[torch.Tensor, int | None, torch.Tensor, int]] = {}
_DENSE_TABLES_KEPT = 8


def _cached_dense_distance_bias(bias: torch.Tensor, length: int, block_m: int) -> tuple[torch.Tensor, int]:
    key = (id(bias), length, block_m)
    cached = _DENSE_TABLES.pop(key, None)
    version = None if bias.is_inference() else bias._version
    if cached is None or cached[0] is not bias or cached[1] != version:
        cached = (bias, version, *dense_distance_bias(bias, length, block_m))
    _DENSE_TABLES[key] = cached  # newest last
    while len(_DENSE_TABLES) > _DENSE_TABLES_KEPT:
        del _DENSE_TABLES[next(iter(_DENSE_TABLES))]
    return cached[2], cached[3]


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether TMA can read the (batch, L, heads, head_dim) view ``t`` as (batch x L, heads x head_dim) rows:
    Triton's host descriptors, inputs packed one after another (views of a projection's output are), heads
    adjacent, a power-of-two head dim (a tile of one head's dims), 16-byte aligned base and row stride."""
    batch, length, heads, dim = t.shape
    size = t.element_size()
    return (TensorDescriptor is not None and t.stride(3) == 1 and t.stride(2) == dim and dim == _dim_pad(dim)
            and (batch == 1 or t.stride(0) == length * t.stride(1)) and t.data_ptr() % 16 == 0
            and t.stride(1) * size % 16 == 0)


def t5_dense_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
                              bias: torch.Tensor, *, tiling: tuple[int, ...] | None = None,
                              kernel: str | None = None, bias_vector: int | None = None) -> torch.Tensor:
    """q, k, v: (batch, L, heads, head_dim), last dim contiguous; lengths (batch,) int32 on the
    device; ``bias`` a bidirectional ``distance_bias`` table -> (batch, L, heads, head_dim) contiguous.
    ``tiling``: (BLOCK_M queries, BLOCK_N keys, warps, stages[, most registers a thread]) instead of the
    default (sweeps; the register cap, ptxas' maxnreg, can fit two 8-warp programs on an SM);
    ``kernel``: one of DENSE_KERNELS instead of DENSE_KERNEL (A/B); ``bias_vector``: floats a bias load (4 or
    2) of the new kernels instead of DENSE_BIAS_VECTOR (sweeps)."""
    batch, length, num_heads, head_dim = q.shape
    out = torch.empty(batch, length, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    kernel = kernel or DENSE_KERNEL
    assert kernel in DENSE_KERNELS, kernel
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and bias.is_contiguous()
    lengths, = dense(lengths)  # read at lengths_ptr + sequence
    block_m, block_n, warps, stages, *max_registers = tiling or (DENSE_TILINGS[kernel] if length >= 128 else
                                                                 (64, 64, 4, 2))
    launch = dict(num_warps=warps, num_stages=stages, **({"maxnreg": max_registers[0]} if max_registers else {}))
    grid = (triton.cdiv(length, block_m), batch, num_heads)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    if kernel == "old":
        _t5_dense_kernel[grid](
            q, k, v, out, bias, lengths, scale * _LOG2E, *strides, bias.stride(0), length,
            REACH=(bias.shape[1] - 1) // 2, HEAD_DIM=head_dim, DIM_PAD=_dim_pad(head_dim),
            BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), **launch)
        return out
    assert scale > 0, "the far tiles' max assumes a positive scale"
    vector = bias_vector or DENSE_BIAS_VECTOR
    assert vector in (2, 4), f"bias loads of 4 or 2 floats, not {vector}"
    table, zero = _cached_dense_distance_bias(bias, length, block_m)
    tma = kernel == "tma" and all(_tma_rows(t) for t in (q, k, v))  # else the same kernel's pointer loads
    rows_shape = [batch * length, num_heads * head_dim]
    q_desc, k_desc, v_desc = ((TensorDescriptor(t, rows_shape, [t.stride(1), 1], [rows, head_dim])
                               for t, rows in ((q, block_m), (k, block_n), (v, block_n))) if tma else (None,) * 3)
    _t5_dense_split_kernel[grid](
        q, k, v, out, table, lengths, scale * _LOG2E, q_desc, k_desc, v_desc, *strides, table.stride(0), table.shape[2],
        zero, length,
        REACH=(bias.shape[1] - 1) // 2, HEAD_DIM=head_dim, DIM_PAD=_dim_pad(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), SPLIT_FAR=kernel != "gather",
        AHEAD=kernel == "ahead", BIAS_VECTOR=vector, TMA=tma, **launch)
    return out


# ----------------------------------------------------------------------------------------------
# public entries: Triton on CUDA, the references elsewhere
# ----------------------------------------------------------------------------------------------

def t5_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, table: torch.Tensor, max_distance: int, bias: torch.Tensor) -> torch.Tensor:
    """T5's decoder self-attention over the paged pool; ``table`` (num_buckets, heads) feeds the
    reference, ``bias`` (its causal ``distance_bias``) the kernel."""
    if use_triton(q):
        return t5_paged_attention_triton(q, k_cache, v_cache, meta, scale, bias)
    return t5_paged_attention_ref(q, k_cache, v_cache, meta, scale, table, max_distance)


def t5_dense_attention(q, k, v, lengths, scale: float, bias: torch.Tensor) -> torch.Tensor:
    """T5's encoder attention (bidirectional ``distance_bias`` table ``bias``)."""
    if use_triton(q):
        return t5_dense_attention_triton(q, k, v, lengths, scale, bias)
    return t5_dense_attention_ref(q, k, v, lengths, scale, bias)
