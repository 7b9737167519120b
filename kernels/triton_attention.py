"""OpenAI Triton kernels for the paged KV cache: the KV write and one attention kernel for all batches.

The contract (shapes, causality, GQA, block tables) is ``kernels/attention.py``; its torch
references are the oracle ``tests/kernels/test_attention.py`` compares these kernels against.

One attention kernel serves prefill chunks, decode tokens and mixed batches. A program owns
one sequence, one KV head and a tile of query *rows*, where a row is a (new token, query head
of that KV head's group) pair::

    row r  ->  token  m_tile * TOKENS_PER_TILE + r // GROUP,   head  kv_head * GROUP + r % GROUP

so the K/V tiles a program loads from the pool serve every query head that shares them (GQA
reads each KV byte once per tile, not once per query head). The program walks the keys
``[0, last position of its tile]`` in tiles of BLOCK_N tokens that may span several pages
(each key row is gathered through the block table), with an online softmax in fp32.

A layer with a sliding window W starts that walk at ``first position of its tile - W + 1``
instead of 0: the blocks before it are never read (their table entries may be freed slots, -1),
and each row masks the keys of the walk that are older than its own window. Logit soft-capping
(Gemma 2) maps the base-2 scores z to ``C * tanh(z / C)`` with ``C = cap * log2(e)``, which is
``cap * tanh(s / cap)`` of the natural-base scores s, before the mask.

Chunked local attention (Llama 4's rope layers, CHUNK = C, decode tiles only): a row at p sees the keys
``p // C * C .. p``, so the walk starts at its chunk's first key; every key of it is visible to the tile's one
token, so the walk stays unmasked but for its last tile. With ``new_kv`` the decode kernel also takes Llama 4's
q/k L2 norm (QK_L2: after the rotation, no weight) and its NoPE layers' attention temperature (TEMPERATURE).

Attention sinks (gpt-oss): a row's sink logit joins its softmax denominator only. The online
softmax starts from it instead of from nothing (running max ``sink * log2(e)``, running sum 1,
accumulator 0), which is the softmax over [scores..., sink] without the sink's column. With
split-K only split 0 starts so; the merge by log-sum-exp then counts the sink once. A layer
without sinks compiles without them (HAS_SINKS is a constexpr).

ALiBi (BLOOM, MPT): each score gains ``slope_h * (k_pos - q_pos)`` (kernels/attention.py), added in
base 2 (the slope times log2(e)) after the scale and soft-cap, on masked and unmasked tiles alike;
the bias is finite, so an unmasked tile's running max stays finite. Split-K needs nothing more: each
split's partial log-sum-exp already holds its keys' biases. HAS_ALIBI is a constexpr, so the kernels
of layers without ALiBi compile as before.

Image spans (Gemma 3, ``meta.span_ahead``): a prompt row also sees the next span_ahead[token] new keys
(the rest of its image's run in the chunk), so its last visible key is ``q_pos + span_ahead`` instead
of ``q_pos``; a tile's walk ends at its rows' furthest such key, and only the masked walk (the causal
diagonal on) reads the bound, so the tiles before the diagonal stay unmasked. A window still counts
back from q_pos. HAS_SPANS is a constexpr: other layers' and steps' kernels compile as before.

A mixed batch runs in two launches of the kernel: one over its prompt chunks (sequences with
several new tokens) with prefill tiles, one over its decode rows with decode tiles; each launch's
programs return at once on the other kind's sequences. Within a program, the key tiles that every
row sees whole are walked without masks; only the tiles at the causal diagonal or past the
context (and every tile of a windowed layer) are masked.

Decode (one new token per sequence) uses a 16-row tile and, for long contexts or small
batches, splits the keys of each (sequence, KV head) into NUM_SPLITS contiguous ranges run by
separate programs ("split-K" / flash-decoding); a second kernel merges the partial results by
their log-sum-exp. The grid depends only on the batch size and on ``meta.max_context_len``
(never on device values), so a decode step can be captured in a CUDA graph: the runner captures
with ``max_context_len`` set to the longest context the graph will serve.

A decode-only batch of a rope layer may pass its q, k and v unrotated (``new_kv``,
kernels/rope_attention.py): each program rotates its query rows, and the split that holds the new
token's position writes its rotated K and its V to the token's slot, then reads them back with the
rest of its keys. That is the work of kernels/rotary.py's fused kernel, one launch fewer per layer.

A short mixed step (few query tiles: a tree or chain verify step at small batch) splits its keys as
decode does and merges per token (``_short_step_splits``); where its sequences are one query tile
each it may take ``new_kv`` too (``short_step_appends``): rows rotated at their own positions, each
new key written by the split that holds it (the only program that reads it).

A prefill or mixed batch's grid depends on its longest prompt chunk and its sequence count. A
CUDA graph of such steps (engine/executor/prefill_graphs.py) passes a tile map instead
(``meta.tile_seq`` / ``meta.tile_m``): program p runs the tile the map names, so the grid is the
map's fixed length and programs past the batch's tiles return at once.

Decode tiles that lie within one page of a head-major pool (the runner's) may be fetched by the
tensor-memory accelerator instead of per-thread pointer loads (``_tma_readable``): one TMA box of
BLOCK_N rows of a head's page each for K and V, which frees the program's threads of the gather's
address arithmetic. Only the unmasked walk reads so; the masked tail keeps the pointer loads, and
with the in-kernel append the tile the new key closes is masked too (a key stored by the program's
own threads is not visible to the TMA unit without a proxy fence).

An FP8 pool (E4M3, scale 1) is read with fp16 math: E4M3 widens to fp16 exactly in one
instruction where bf16 takes two, and q enters the dot pre-multiplied by the softmax scale and
saturated to fp16's range, so a large query cannot become inf (fp32 engines keep fp32 math).

Cache slots < 0 in ``slot_mapping`` are skipped by the KV write: CUDA-graph padding rows use
slot -1 so they write nothing.
"""
from __future__ import annotations

import math
import os

import torch

from kernels._triton import (TensorDescriptor, dense, device_capability, hopper_or_later, jit, num_sms, pdl_options,
                             pdl_prologue, power_of_2_floor, resident_programs, tl, triton)
from kernels.attention_metadata import AttentionMetadata
from kernels.e4m3_bits import bits_factor
from kernels.keys_major_decode import keys_major_decode, keys_major_decode_chosen, keys_major_own_residency
from kernels.paged_kv_math import cache_value, paged_kv_tile, rotate_neox, slot_row, widened_kv

_LOG2E = 1.4426950408889634
# Which sequences one launch of the attention kernel serves (SEQ_KIND): a mixed batch runs its
# prompt chunks with prefill tiles and its decode rows with decode tiles, in two launches.
ALL_SEQS, MULTI_TOKEN, ONE_TOKEN = 0, 1, 2
# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


@jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One program per new token: copy its (kv_heads, head_dim) K and V rows to its slot (block
    slot // PAGE_SIZE, row slot % PAGE_SIZE of it: the pool's strides say where that is)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(slot_row(k_cache_ptr, slot, stride_cb, stride_cs, PAGE_SIZE) + heads * stride_ch + dims,
             cache_value(k, k_cache_ptr), mask=mask)
    tl.store(slot_row(v_cache_ptr, slot, stride_vcb, stride_vcs, PAGE_SIZE) + heads * stride_vch + dims,
             cache_value(v, v_cache_ptr), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: (num_tokens, kv_heads, head_dim), last dim contiguous (views of the fused qkv are fine)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "K/V rows must be contiguous in head_dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    slot_mapping, = dense(slot_mapping)  # read at slot_ptr + token
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=attention_dim_pad(head_dim),
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@jit
def _head_inv_rms(x, n, eps, AXIS: tl.constexpr):
    """1 / rms of x's heads over AXIS (n values each) in float32, as kernels/rmsnorm.py _rms_normalized takes it."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, AXIS, keep_dims=True) / n + eps)


@jit
def _head_normed(x, inv_rms, weight):
    """weight * (x * inv_rms rounded to x's dtype), rounded to x's dtype: kernels/rmsnorm.py qk_rms_norm's value."""
    return (weight * (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)).to(x.dtype)


@jit
def _attend_keys(
    q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_row, kv_head, lo, hi, kv_hi,
    qk_scale, window, softcap_log2, alibi_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP16_MATH: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr, HAS_ALIBI: tl.constexpr,
    tree_ptr, tree_rows, prefix_len, stride_tm, HAS_TREE: tl.constexpr, q_last,
    tree_words, TREE_AS_BITS: tl.constexpr, K_BITS: tl.constexpr, V_WIDEN: tl.constexpr, ASM: tl.constexpr,
    FP8_QK: tl.constexpr,
):
    """The online softmax over keys [lo, hi) in tiles of BLOCK_N -> (m_i, l_i, acc). MASKED: some key
    of a tile may lie at or past kv_hi, or be hidden from some row (causality, window); unmasked
    walks cover whole tiles every row sees, so they load and score without masks.

    TMA (unmasked walks only): each tile is one run of BLOCK_N rows of a head's page, fetched by
    the tensor-memory accelerator through k_desc / v_desc, 2-D views (rows, HEAD_DIM) of the pools
    whose row for (block b, KV head h, page row r) is b * stride_kb / HEAD_DIM + h * stride_kh /
    HEAD_DIM + r (the wrapper checks the pool is laid out so: _tma_descriptors).

    HAS_TREE (masked walks only): a new key (position >= prefix_len) is seen by a row only where
    the token tree mask says so: tree_ptr[tree_rows[row], key - prefix_len] (AttentionMetadata.tree_mask),
    or with TREE_AS_BITS bit (key - prefix_len) % 32 of word tree_ptr[tree_rows[row], (key - prefix_len) // 32]
    (AttentionMetadata.tree_bits; tree_words words a row).

    q_last (BLOCK_M,): each row's last visible key position: q_pos, or past it by the row's
    AttentionMetadata.span_ahead (image spans); a window still counts back from q_pos.

    FP8 pools (FP16_MATH), how the E4M3 tiles widen to float16 (kernels/e4m3_bits.py; ASM False under the
    interpreter): K_BITS: K by bit moves (widened_bits, value * 2^-8) in the dot operand's layout, the scores
    multiplied back by 2^8 here; else by Triton's conversion. V_WIDEN: V_BY_TRITON, V_BY_BITS (widened_bits kept in
    the loaded layout: acc stays at 2^-8 of its value, the kernel multiplies it back before dividing by l) or
    V_BY_CVT (converted_f16, the conversion kept in the loaded layout). Exact either way: powers of two, and
    q * k * 2^-8 and p * v * 2^-8 stay far from float32's subnormals (fp16 q and p are >= 2^-24, k and v
    bits >= 2^-17: products >= 2^-41)."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols
        if TMA and not MASKED:
            block_id = tl.load(block_row + start // PAGE_SIZE).to(tl.int64)
            in_page = start % PAGE_SIZE
            k = k_desc.load([(block_id * (stride_kb // HEAD_DIM) + kv_head * (stride_kh // HEAD_DIM)
                              + in_page).to(tl.int32), 0])
            v = v_desc.load([(block_id * (stride_vb // HEAD_DIM) + kv_head * (stride_vh // HEAD_DIM)
                              + in_page).to(tl.int32), 0])
        else:
            k, v, k_valid = paged_kv_tile(k_cache_ptr, v_cache_ptr, block_row, kv_head, k_pos, kv_hi, stride_kb,
                                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, DIM_PAD,
                                          PAGE_SIZE, BLOCK_N, MASKED)
        k_codes = k
        k, v = widened_kv(k, v, tl.float16 if FP8_QK else q.dtype, K_BITS, V_WIDEN, ASM)
        if FP8_QK:  # q is E4M3 as well (the kernel's FP8_QK): the pool's K codes go into the product as they are
            scores = tl.dot(q, tl.trans(k_codes))
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if K_BITS:  # exact (above)
            scores = scores * bits_factor(tl.float16)
        if not FP16_MATH:  # (fp16 math scaled q instead)
            scores = scores * qk_scale
        if HAS_SOFTCAP:  # C * tanh(z / C), tanh(x) = 2 * sigmoid(2x) - 1
            scores = softcap_log2 * (2.0 * tl.sigmoid(2.0 * scores / softcap_log2) - 1.0)
        if HAS_ALIBI:  # alibi_log2: (BLOCK_M,) each row's head's slope * log2(e)
            scores += alibi_log2[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        if MASKED:
            visible = (k_pos[None, :] <= q_last[:, None]) & k_valid[None, :]
            if HAS_WINDOW:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            if HAS_TREE:  # new keys: only the row's tree ancestors (and itself; with spans, its span's too)
                new_key = k_pos - prefix_len
                if TREE_AS_BITS:
                    # The mask as bits (tree_bits): each row's few 32-key words that cover this tile, loaded
                    # as row vectors and spread over the tile's columns, instead of a byte gather a score.
                    seen = tl.maximum(new_key, 0)  # (negative new keys are cached keys: visible below)
                    first_word = tl.maximum(start - prefix_len, 0) // 32
                    word_of_key = seen // 32 - first_word  # 0 .. BLOCK_N // 32
                    words = tl.zeros(scores.shape, dtype=tl.int32)
                    for j in tl.static_range((BLOCK_N + 31) // 32 + 1):
                        word = tl.load(tree_ptr + tree_rows * stride_tm + first_word + j,
                                       mask=tree_rows * 0 + first_word + j < tree_words, other=0)
                        words = tl.where((word_of_key == j)[None, :], word[:, None], words)
                    ancestor = ((words >> (seen % 32)[None, :]) & 1) != 0
                    visible = visible & (ancestor | (new_key < 0)[None, :])
                else:
                    in_tree = tl.load(tree_ptr + tree_rows[:, None] * stride_tm + new_key[None, :],
                                      mask=((new_key >= 0) & k_valid)[None, :], other=1)
                    visible = visible & (in_tree != 0)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every score of the tile is
            m_safe = m_new
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@jit(do_not_specialize=["stride_bt", "tree_words"])  # the block-table and tree widths change every batch: one compile
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_desc, v_desc,  # TMA descriptors of the pools (read when TMA; _tma_descriptors)
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, tile_seq_ptr, tile_m_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr,  # read when ROTARY_APPEND
    sinks_ptr,  # (num_heads,) sink logits, natural base (read when HAS_SINKS)
    alibi_ptr,  # (num_heads,) float32 ALiBi slopes, natural base (read when HAS_ALIBI)
    active_splits_ptr,  # (1,) int32 (read when DYNAMIC_SPLITS)
    tree_ptr,  # (num_tokens, max q_len) int8 token tree mask, or its bits (TREE_AS_BITS) (read when HAS_TREE)
    stride_tm,
    tree_words,  # TREE_AS_BITS: 32-key words a row of tree_ptr holds
    span_ptr,  # (num_tokens,) int32 AttentionMetadata.span_ahead (read when HAS_SPANS)
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    window,  # sliding window W (read when HAS_WINDOW): row at position p sees keys p - W < k <= p
    softcap_log2,  # logit soft-cap * log2(e) (read when HAS_SOFTCAP)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ps, stride_pt, stride_ph,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    FP16_MATH: tl.constexpr, ROTARY_APPEND: tl.constexpr,
    ROTATE: tl.constexpr,  # with ROTARY_APPEND: rotate q and the new k (False: ALiBi / learned positions, append only)
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TILE_MAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SEQ_KIND: tl.constexpr,  # ALL_SEQS, or only the sequences with several (MULTI_TOKEN) or one (ONE_TOKEN) new tokens
    TMA: tl.constexpr,  # the unmasked key tiles come through k_desc / v_desc (decode tiles within a page)
    DYNAMIC_SPLITS: tl.constexpr,  # the splits in use are min(active_splits_ptr[0], NUM_SPLITS) (a decode graph's)
    PDL: tl.constexpr,
    HAS_TREE: tl.constexpr = False,  # token trees (tree verification): meta.tree_mask hides non-ancestors
    TREE_AS_BITS: tl.constexpr = False,  # tree_ptr holds the mask as int32 words of 32 keys (tree_bits)
    HAS_SPANS: tl.constexpr = False,  # image spans: a row also sees span_ptr[token] later new keys
    APPEND_ROWS: tl.constexpr = False,  # ROTARY_APPEND's work for a short step whose sequences are one tile each
    q_norm_ptr=None, k_norm_ptr=None, qk_eps=0.0,  # (head_dim,) per-head RMSNorm weights and eps (read when QK_NORM)
    QK_NORM: tl.constexpr = False,  # with ROTARY_APPEND: q and the new k come unnormalized (Qwen3's q/k norms)
    CHUNK: tl.constexpr = 0,  # > 0, decode tiles only: chunked local attention (Llama 4), keys p // CHUNK * CHUNK .. p
    QK_L2: tl.constexpr = False,  # with ROTARY_APPEND: q and the new k divided by their RMS after the rotation
    temp_floor=1, temp_scale=0.0,  # read when TEMPERATURE
    TEMPERATURE: tl.constexpr = False,  # with ROTARY_APPEND: q times 1 + temp_scale * log1p((p + 1) // temp_floor)
    K_BITS: tl.constexpr = False,  # with FP16_MATH: how E4M3 K and V widen (_attend_keys; FP8_WIDEN_ENV)
    V_WIDEN: tl.constexpr = 0,
    ASM: tl.constexpr = False,  # K_BITS / V_WIDEN by inline PTX (CUDA); False: the same values without (interpreter)
    FP8_QK: tl.constexpr = False,  # with FP16_MATH: q rounded to E4M3 and Q K^T an FP8 product (PREFILL_FP8_QK_ENV)
):
    pdl_prologue(PDL)  # before the early returns too: every program must wait (kernels/_triton.py)
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    if HAS_TILE_MAP:  # a fixed grid (CUDA graph): which tile this program runs is data
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        if seq < 0:
            return
        m_tile = tl.load(tile_m_ptr + tl.program_id(0))
    else:
        m_tile = tl.program_id(0)
        seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    active_splits = NUM_SPLITS
    if DYNAMIC_SPLITS:  # the merge reads only these splits' partials
        # Split-major here: the programs of splits past the active count come last in launch order,
        # so they return in the tail of the launch, not between the programs that read keys.
        num_kv_heads = tl.num_programs(2) // NUM_SPLITS
        kv_head = tl.program_id(2) % num_kv_heads
        split = tl.program_id(2) // num_kv_heads
        active_splits = tl.minimum(tl.load(active_splits_ptr), NUM_SPLITS)
        if split >= active_splits:
            return

    if ROTARY_APPEND:  # decode only: sequence i's one new token is row i (cu_seqlens_q is 0, 1, 2, ...)
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_token = m_tile * TOKENS_PER_TILE
    if first_token >= q_len:
        return
    if SEQ_KIND == 1:  # MULTI_TOKEN (a jit function reads no module globals)
        if q_len == 1:
            return
    if SEQ_KIND == 2:  # ONE_TOKEN
        if q_len != 1:
            return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token_in_seq = first_token + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS_PER_TILE * GROUP) & (token_in_seq < q_len)
    # Padding rows take the tile's last valid position, so they never see an all-masked row.
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
    q_pos = prefix_len + tl.where(row_valid, token_in_seq, last_token)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token_rows = (q_start + token_in_seq).to(tl.int64)
    q_rows = q_ptr + token_rows[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if ROTARY_APPEND:
        # Decode only (one new token, at cache position prefix_len): rotate the query rows here
        # instead of in kernels/rotary.py's kernel, and have the one split whose keys end at that
        # position put the token's rotated K and its V into the cache before reading its keys.
        # HEAD_DIM == DIM_PAD here (the wrapper checks), so every dim has its partner.
        HALF: tl.constexpr = HEAD_DIM // 2
        first_half = dims < HALF
        partner = (dims + HALF) % HEAD_DIM
        if QK_NORM:  # each row one head: kernels/rmsnorm.py qk_rms_norm's roundings, before the rotation
            q_inv = _head_inv_rms(q, HEAD_DIM, qk_eps, 1)
            if ROTATE:
                q_partner = _head_normed(tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0), q_inv,
                                         tl.load(q_norm_ptr + partner).to(tl.float32)[None, :])
            q = _head_normed(q, q_inv, tl.load(q_norm_ptr + dims).to(tl.float32)[None, :])
        if ROTATE:
            position = tl.load(positions_ptr + q_start).to(tl.int64)
            cos = tl.load(cos_sin_ptr + position * stride_cos + dims % HALF)
            sin = tl.load(cos_sin_ptr + position * stride_cos + HALF + dims % HALF)
            if not QK_NORM:
                q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
            q = rotate_neox(q, q_partner, cos[None, :], sin[None, :], first_half[None, :])
        if QK_L2:  # Llama 4's q/k L2 norm: each rotated head (rounded) over its RMS in float32, no weight
            q = (q.to(tl.float32) * _head_inv_rms(q, HEAD_DIM, qk_eps, 1)).to(q.dtype)
        if TEMPERATURE:  # Llama 4's NoPE layers (kernels/chunked_attention.py attention_temperature)
            floors = (tl.load(positions_ptr + q_start).to(tl.int64) + 1) // temp_floor
            q = (q.to(tl.float32) * (tl.log(1.0 + floors.to(tl.float32)) * temp_scale + 1.0)).to(q.dtype)
    if APPEND_ROWS:
        # A short step of one query tile a sequence (short_step_appends): each row rotated at its own
        # token's position; the new keys are written below, by the split holding each.
        HALF_R: tl.constexpr = HEAD_DIM // 2
        first_half_r = dims < HALF_R
        partner_r = (dims + HALF_R) % HEAD_DIM
        if ROTATE:
            row_position = tl.load(positions_ptr + token_rows, mask=row_valid, other=0).to(tl.int64)
            cos_r = tl.load(cos_sin_ptr + row_position[:, None] * stride_cos + (dims % HALF_R)[None, :])
            sin_r = tl.load(cos_sin_ptr + row_position[:, None] * stride_cos + HALF_R + (dims % HALF_R)[None, :])
            q = rotate_neox(q, tl.load(q_rows + partner_r[None, :], mask=q_mask, other=0.0), cos_r, sin_r,
                            first_half_r[None, :])
    if FP16_MATH:
        # An FP8 pool's E4M3 values widen to fp16 in one instruction (to bf16 in two), and exactly.
        # q carries qk_scale into fp16 (|q| shrinks ~8x for 128-wide heads) and saturates at fp16's
        # largest value instead of becoming inf: a query that saturates scores > 65504 * |k| already.
        q = tl.minimum(tl.maximum(q.to(tl.float32) * qk_scale, -65504.0), 65504.0).to(tl.float16)
        if FP8_QK:  # that fp16 q rounded to E4M3 (saturated at its largest value) for an FP8 Q K^T
            q = tl.minimum(tl.maximum(q.to(tl.float32), -448.0), 448.0).to(tl.float8e4nv)

    # Keys this tile may see: [kv_start, kv_end), kv_start 0 without a window (else the first row's
    # oldest visible key); this split takes one contiguous run of whole BLOCK_N tiles of it. Split 0
    # starts at kv_start, which every row of a decode tile (one token) sees: its merge weight is finite.
    kv_end = prefix_len + last_token + 1
    q_last = q_pos
    if HAS_SPANS:  # image spans: a row sees on to its span's last key, which is within this chunk
        q_last = q_pos + tl.load(span_ptr + token_rows, mask=row_valid, other=0)
        kv_end = tl.minimum(tl.maximum(kv_end, tl.max(q_last, 0) + 1), context_len)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix_len + first_token - window + 1, 0)
    if CHUNK > 0:  # a decode tile's one token: every key of its chunk up to it is visible (unmasked walk)
        kv_start = (prefix_len + first_token) // CHUNK * CHUNK
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), active_splits)
    kv_lo = kv_start + split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)
    if ROTARY_APPEND:
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
        if (kv_lo <= prefix_len) & (prefix_len < kv_hi) & (slot >= 0):  # slot -1: a graph's padding row
            new_row = q_start.to(tl.int64)
            k_row = k_new_ptr + new_row * stride_knt + kv_head * stride_knh
            k_new = tl.load(k_row + dims)
            if QK_NORM:
                k_inv = _head_inv_rms(k_new, HEAD_DIM, qk_eps, 0)
                if ROTATE:
                    k_partner = _head_normed(tl.load(k_row + partner), k_inv,
                                             tl.load(k_norm_ptr + partner).to(tl.float32))
                k_new = _head_normed(k_new, k_inv, tl.load(k_norm_ptr + dims).to(tl.float32))
            if ROTATE:
                if not QK_NORM:
                    k_partner = tl.load(k_row + partner)
                k_new = rotate_neox(k_new, k_partner, cos, sin, first_half)
            if QK_L2:
                k_new = (k_new.to(tl.float32) * _head_inv_rms(k_new, HEAD_DIM, qk_eps, 0)).to(k_new.dtype)
            v_new = tl.load(v_new_ptr + new_row * stride_vnt + kv_head * stride_vnh + dims)
            tl.store(slot_row(k_cache_ptr, slot, stride_kb, stride_ks, PAGE_SIZE) + kv_head * stride_kh + dims,
                     cache_value(k_new, k_cache_ptr))
            tl.store(slot_row(v_cache_ptr, slot, stride_vb, stride_vs, PAGE_SIZE) + kv_head * stride_vh + dims,
                     cache_value(v_new, v_cache_ptr))
        # The walk below reads that slot back: a block barrier orders this program's stores before
        # its loads (no other program reads this key of this KV head in this step). Adding the key
        # from registers instead, after a walk that skips it, measured no faster on an H100.
        tl.debug_barrier()

    if APPEND_ROWS:
        # The first row of each token's GROUP rows writes that token's rotated K and its V for this KV
        # head, if the key (cache position prefix_len + token) is in this split's range: one program of
        # each KV head writes each new key, and only that program reads it (its sequence is this one
        # tile), after the barrier below.
        key_pos = prefix_len + token_in_seq
        writes = row_valid & (rows % GROUP == 0) & (key_pos >= kv_lo) & (key_pos < kv_hi)
        new_slot = tl.load(slot_ptr + token_rows, mask=writes, other=-1).to(tl.int64)
        writes = writes & (new_slot >= 0)  # slot -1: a graph's padding token
        w_mask = writes[:, None] & dim_valid[None, :]
        k_row = k_new_ptr + token_rows[:, None] * stride_knt + kv_head * stride_knh
        k_new = tl.load(k_row + dims[None, :], mask=w_mask, other=0.0)
        if ROTATE:
            k_new = rotate_neox(k_new, tl.load(k_row + partner_r[None, :], mask=w_mask, other=0.0), cos_r, sin_r,
                                first_half_r[None, :])
        v_new = tl.load(v_new_ptr + token_rows[:, None] * stride_vnt + kv_head * stride_vnh + dims[None, :],
                        mask=w_mask, other=0.0)
        safe_slot = tl.where(writes, new_slot, 0)
        k_dst = slot_row(k_cache_ptr, safe_slot, stride_kb, stride_ks, PAGE_SIZE) + kv_head * stride_kh
        v_dst = slot_row(v_cache_ptr, safe_slot, stride_vb, stride_vs, PAGE_SIZE) + kv_head * stride_vh
        tl.store(k_dst[:, None] + dims[None, :], cache_value(k_new, k_cache_ptr), mask=w_mask)
        tl.store(v_dst[:, None] + dims[None, :], cache_value(v_new, v_cache_ptr), mask=w_mask)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink's one term of the denominator: exp2(sink - m_i) * l_i = 1
            m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    alibi_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        alibi_log2 = tl.load(alibi_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every row sees the keys up to its tile's first position (without a window): the whole tiles
    # of this split below that bound skip the causal and length masks, the rest of the walk keeps them.
    # A decode tile (one token) is then unmasked but for its last partial tile.
    unmasked_end = kv_lo
    if not HAS_WINDOW:
        seen_by_all = tl.minimum(prefix_len + first_token + 1, kv_hi)
        if ROTARY_APPEND and TMA:
            # The new key was stored above through the generic proxy; the TMA unit (the async proxy)
            # would need a proxy fence to see it. Its tile takes the masked (pointer) walk instead.
            seen_by_all = tl.minimum(prefix_len, kv_hi)
        if HAS_TREE:  # a tree node may not see an earlier node: new keys past the first take the masked walk
            seen_by_all = tl.minimum(seen_by_all, prefix_len + 1)
        unmasked_end = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
    tree_rows = (q_start + q_pos - prefix_len).to(tl.int64)  # each row's token (padding rows: the tile's last)
    m_i, l_i, acc = _attend_keys(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_row, kv_head, kv_lo, unmasked_end,
        kv_hi, qk_scale, window, softcap_log2, alibi_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N, PRECISION, FP16_MATH, HAS_WINDOW, HAS_SOFTCAP, False, TMA,
        HAS_ALIBI, tree_ptr, tree_rows, prefix_len, stride_tm, False, q_last, tree_words, TREE_AS_BITS,
        K_BITS, V_WIDEN, ASM, FP8_QK)
    m_i, l_i, acc = _attend_keys(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_desc, v_desc, block_row, kv_head, unmasked_end, kv_hi,
        kv_hi, qk_scale, window, softcap_log2, alibi_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
        stride_vh, HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N, PRECISION, FP16_MATH, HAS_WINDOW, HAS_SOFTCAP, True, False,
        HAS_ALIBI, tree_ptr, tree_rows, prefix_len, stride_tm, HAS_TREE, q_last, tree_words, TREE_AS_BITS,
        K_BITS, V_WIDEN, ASM, FP8_QK)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if V_WIDEN == 1:  # V_BY_BITS: acc is at 2^-8 of its value; back exactly, then divided as otherwise
        acc = acc * bits_factor(tl.float16)
    out = acc / l_safe[:, None]
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        # Base-2 log-sum-exp of this split's scores; -inf when the split saw no key.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        # Partial results are rows of part_out by token; a ONE_TOKEN launch's by sequence (its sequences
        # have one row each, so its buffers hold num_seqs rows, not every token of the mixed batch).
        part_row = seq.to(tl.int64) + token_rows * 0 if SEQ_KIND == 2 else token_rows
        part = split * stride_ps + part_row * stride_pt + head * stride_ph
        tl.store(part_out_ptr + part[:, None] + dims[None, :], out, mask=out_mask)
        # part_lse is part_out without its last axis, so its offsets are part's over DIM_PAD.
        tl.store(part_lse_ptr + part // DIM_PAD, lse, mask=row_valid)


@jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_seqlens_q_ptr, active_splits_ptr,
    stride_ps, stride_pt, stride_ph, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, BY_SEQUENCE: tl.constexpr,
    DYNAMIC_SPLITS: tl.constexpr, PDL: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program per (token, head): softmax-weighted sum of the splits' normalized outputs.
    NUM_SPLITS may be any count (a policy of any split count: split_counts); SPLITS_PAD is it rounded up to a
    power of two (merge_splits_pad; a tl.arange's length), and the padded splits get weight 0 and are never read.
    DYNAMIC_SPLITS: only the first min(active_splits_ptr[0], NUM_SPLITS) splits ran (the attention
    kernel's).
    BY_SEQUENCE (the decode rows of a mixed batch, whose partial results are rows by sequence): one
    program per (sequence, head) instead, which merges the sequence's token if it has exactly one new
    token and returns otherwise (the prompt chunks' rows were never split)."""
    pdl_prologue(PDL)
    if BY_SEQUENCE:
        seq = tl.program_id(0)
        first = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - first != 1:
            return
        token = first.to(tl.int64)
        part_row = seq.to(tl.int64)
    else:
        token = tl.program_id(0).to(tl.int64)
        part_row = token
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    base = splits * stride_ps + part_row * stride_pt + head * stride_ph
    if DYNAMIC_SPLITS:  # (clamped: with a padded range a count past NUM_SPLITS would read past the partials)
        ran = tl.minimum(tl.load(active_splits_ptr), NUM_SPLITS)
        lse = tl.load(part_lse_ptr + base // DIM_PAD, mask=splits < ran, other=float("-inf"))
    elif SPLITS_PAD > NUM_SPLITS:
        lse = tl.load(part_lse_ptr + base // DIM_PAD, mask=splits < NUM_SPLITS, other=float("-inf"))
    else:
        lse = tl.load(part_lse_ptr + base // DIM_PAD)
    lse_max = tl.max(lse, 0)  # split 0 saw the first visible key, so this is finite
    weights = tl.math.exp2(lse - lse_max)  # 0 for the splits past the count (their lse -inf): never read below
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(part_out_ptr + base[:, None] + dims[None, :], mask=weights[:, None] > 0, other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def merge_splits_pad(num_splits: int) -> int:
    """_merge_splits_kernel's SPLITS_PAD for ``num_splits`` key splits: the next power of two (itself for one)."""
    return triton.next_power_of_2(num_splits)


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int, block_n: int,
                       resident_per_sm: int | None = None) -> int:
    """Key splits of a decode launch: a power of two (any count up to the policy's most under a policy of any
    count: split_counts), at most MAX_DECODE_SPLITS, no split shorter than 2 key tiles. Until ``resident_per_sm``
    is known (the tiling's programs one SM holds, known once it has run: _DECODE_RESIDENT), and for batches of
    fewer programs than twice the SMs: enough programs to cover the GPU twice. Then (the policy of
    $TRITONLLM_DECODE_SPLIT_POLICY, SPLIT_POLICIES): 1 for a batch of the policy's unsplit waves or more (its last
    partial wave is a small share of the time, and so many sequences in one pool have short contexts, which
    splits only slow down); else the count of least _decode_split_cost, within one wave too ("h200"; "h100":
    a batch the GPU holds at once covers it twice instead).

    Why within one wave on the H200 (2026-12-01, FP8 pool, Llama-8B heads, 64-key tiles over 2 warps and 5 stages:
    5 programs an SM, 660 on the GPU; benchmarks/kernels/attention_kernel_bench.py --grid, us a layer for 1 / 2 / 4 /
    8 splits): 48 x 21,000 (384 programs) 785 / 683 / 614 / 635, the covering rule's 1 split 1.28x the best, where
    64 x 20,480 (512) took 777 / 806 / 812 / 831. Each program streams its keys at ~6.8 GB/s under load (a wave of
    384 read 2.6 TB/s, of 512 3.45): a wave is only as fast as its programs are many. (On an H100 the cost's choice
    within one wave did not hold up as served: 48 x 21,000's kernel went from 800 to 707 us a layer with 4 splits,
    but its decode graph in the bucket of 56 took 30.31 ms against 29.25; such graphs now take their count per
    replay: _decode_config.)
    A decode graph of a mid-size bucket captures DYNAMIC_SPLITS_CAPTURED splits and lets each replay use
    decode_active_splits' count (_decode_config)."""
    programs = num_seqs * num_kv_heads
    most = _most_decode_splits(max_context_len, block_n)
    capacity = None if resident_per_sm is None else resident_per_sm * num_sms
    share, per_sm, unsplit_waves, within_wave = split_policy()
    if capacity is None or programs < 2 * num_sms or (programs <= capacity and not within_wave):
        wanted = max(1, (2 * num_sms + programs - 1) // programs)
        return min(triton.next_power_of_2(wanted), most)
    if programs >= unsplit_waves * capacity:
        return 1
    # A wave of fewer programs than this takes as long as one of this many (the policy's floor).
    floor = min(per_sm * num_sms, capacity) if per_sm else share * capacity
    return min(split_counts(most), key=lambda splits: _decode_split_cost(programs, splits, capacity, max_context_len,
                                                                           floor))


def split_counts(most: int) -> list[int]:
    """The split counts the policy's cost chooses among, up to ``most`` (_most_decode_splits: a power of two):
    1, 2, 4, ... most; under a policy of any count (ANY_COUNT_POLICIES) every count 1, 2, 3, ... up to
    min(most, its most) instead, which its mid-size decode graphs capture (captured_splits)."""
    any_most = ANY_COUNT_POLICIES.get(split_policy_name())
    if any_most:
        return list(range(1, min(most, any_most) + 1))
    return [1 << i for i in range(most.bit_length())]


def captured_splits() -> int:
    """The key splits a decode graph of a mid-size bucket captures in its grid (its replays use up to this many,
    _decode_config): DYNAMIC_SPLITS_CAPTURED, or a policy of any count's most (ANY_COUNT_POLICIES), so that its
    replays can take each count its cost may pick."""
    return ANY_COUNT_POLICIES.get(split_policy_name(), DYNAMIC_SPLITS_CAPTURED)


def _most_decode_splits(keys: int, block_n: int) -> int:
    """The most key splits worth launching over ``keys`` keys: a power of two, none shorter than 2
    tiles of ``block_n`` keys, at most MAX_DECODE_SPLITS."""
    return min(triton.next_power_of_2(max(1, keys // (2 * block_n))), MAX_DECODE_SPLITS)


def decode_active_splits(plan: tuple[int, int, int], num_seqs: int, longest_context: int) -> int:
    """The key splits a decode graph's replay uses for ``num_seqs`` real sequences whose longest
    context is ``longest_context``: _decode_num_splits' choice by waves for exactly that batch
    (a graph's padding rows return at once) and those keys, not for the bucket it was captured for
    and the longest context it may serve. ``plan``: AttentionMetadata.decode_split_plan. Each
    launch clamps the count to the splits its grid holds (DYNAMIC_SPLITS)."""
    num_kv_heads, capacity, num_sms = plan
    return _decode_num_splits(num_seqs, num_kv_heads, longest_context, num_sms, 64, capacity // num_sms)


def _decode_split_cost(programs: int, splits: int, capacity: int, keys: int,
                       floor: float | None = None) -> float:
    """Relative time of a decode launch of ``programs`` (sequence, KV head) pairs over ``splits`` key
    ranges each, on a GPU that holds ``capacity`` programs at once, for contexts of ``keys`` keys (a
    CUDA graph's launch is sized for its longest: the case that matters, short contexts taking
    little time whatever the split).

    Equal programs run in waves of ``capacity``; a wave of n programs takes as long as
    max(n, floor) programs' worth of HBM bytes (fewer keep too few reads in flight to use the bandwidth;
    ``floor``: the policy's, SPLIT_POLICIES; None: SATURATING_SHARE * capacity), each program 1 / splits of a
    whole range's bytes; every doubling of the splits adds SPLIT_COST_KEYS / keys (the merge, each program's start
    and partials): log2(splits) times that, which counts between powers of two (split_counts) take in between.

    On an H100 (2026-11-26, benchmarks/kernels/attention_kernel_bench.py --splits, FP8 pool, 64-key tiles
    over 2 warps and 5 stages: 4 programs an SM, 528 on the GPU) one split over 5,250 keys read
    2.83-2.90 TB/s at 128, 194 and 256 sequences (1,024, 1,552 and 2,048 programs: nearly whole
    waves) but 2.51 at 208 (1,664: three waves and 80 programs) and 2.55 at 160; 4 splits took 208
    to 2.78, 2 splits 160 to 2.78 and 96 x 6,000 from 2.35 to 2.74, 4 splits 48 x 21,000 from
    2.58 to 2.92. SATURATING_SHARE and SPLIT_COST_KEYS were fitted to these 11 cases; the cost then
    picks the fastest of 1, 2 and 4 splits in each. The H200's figures: SPLIT_POLICIES."""
    floor = SATURATING_SHARE * capacity if floor is None else floor
    total = programs * splits
    full_waves, rest = divmod(total, capacity)
    slots = full_waves * capacity + (max(rest, floor) if rest else 0)
    return slots / splits * (1.0 + SPLIT_COST_KEYS / max(keys, 1) * math.log2(splits))


# A partial wave of fewer programs than this share of the GPU's capacity takes as long as one of
# this many (their reads in flight do not fill HBM): with one split, 384 programs of 48 x 21,000
# read 2.58 TB/s where whole waves read 2.9, i.e. ~0.8 of a 528-program wave saturates.
SATURATING_SHARE = 0.8
# Each doubling of the key splits costs about this many keys of every sequence's walk: at 5,250
# keys, 128 and 256 sequences (whole waves either way) took 3.3-3.9% longer with 2 splits than 1.
SPLIT_COST_KEYS = 210
# Batches of at least this many waves of programs are never split (the "h100" policy's).
UNSPLIT_WAVES = 4
# How decode launches split their keys once a tiling's residency is known (_decode_num_splits), by
# $TRITONLLM_DECODE_SPLIT_POLICY (read at every call; unset: DECODE_SPLIT_POLICY_DEFAULT): (saturating share of
# the capacity, or saturating programs an SM, unsplit waves, the cost model within one wave). "h100": the H100's fit
# above (a partial wave costs SATURATING_SHARE of a full one, UNSPLIT_WAVES; a batch the GPU holds at once covers it
# twice). "h200": refit to the H200's decode kernels (2026-12-01, FP8 pool, 64-key tiles over 2 warps and 5 stages;
# us a layer, attention_kernel_bench.py --grid): 8 x 20,480 1 / 2 / 4 / 8 splits 487 / 248 / 137 / 108; 64 x
# 20,480 777 / 806 / 812 / 831; 48 x 21,000 785 / 683 / 614 / 635; 256 x 20,480 ~3,170 with 1 against 3,283 with
# 8; 256 x 8,192 ~1,250 against 1,380 (8); 256 x 2,048 ~336 against 366 (2). A program streams ~6.8 GB/s under
# load whatever else the SM holds (a wave of 384 read 2.6 TB/s, of 512 3.45), so the floor is a count of
# programs an SM, not a share of the capacity: the same kernel's residency read 4 or 5 programs an SM as its
# compile varied (NUM_SPLITS), and a share of 0.65 kept 48 x 21,000 at 1 split with 4 (call 4: 792 us). 3.0-4.4
# programs an SM with 2-3 unsplit waves pick within 3.5% of the fastest measured count in all six cases at either
# residency (48 x 21,000: 4 splits with 4 an SM, 8 with 5).
# "h200-any" (the default since 2026-12-02, issue 51): "h200"'s figures, its cost choosing among every count up to 8
# (split_counts), not only powers of two, and its mid-size decode graphs capturing 8 splits (captured_splits). Why: at
# 20000/2000's plateau (~91 sequences x ~21k keys, 8 KV heads: 728 programs; the FP8 keys-major tiling 64 x 2 x 5, 4
# programs an SM, 528 at once) "h200" takes 2 splits, 1,456 programs in 3 waves the last 76% full (92% of the slots
# used), where 5 splits are 3,640 programs in 6.89 waves (98.5%); at 85 and 100 sequences it takes 16, which a graph
# clamps to DYNAMIC_SPLITS_CAPTURED (4), where "h200-any" takes 3 and 7 (tests/kernels/test_decode_split_waves.py). On
# one H200 (2026-12-02, benchmarks/engine/lanes/s32_c2/split51.sh, FP8 head-major pool, us a layer, eager / as a
# decode graph's replay): 91 x 21,000 "h200" 1,112 / 1,154 against "h200-any" 1,038 / 1,085 (5 splits, 88% of copy);
# 85 x 21,000 1,013 / 1,145 against 982 / 1,029 (3); 100 x 21,000 1,188 / 1,331 against 1,168 / 1,221 (7); 64 and 128
# x 20,480 within 0.5% either way. So it is the default; "h200" keeps the powers of two.
DECODE_SPLIT_POLICY_ENV = "TRITONLLM_DECODE_SPLIT_POLICY"
SPLIT_POLICIES = {"h200": (0.0, 3.5, 3, True), "h100": (SATURATING_SHARE, 0.0, UNSPLIT_WAVES, False),
                  "h200-any": (0.0, 3.5, 3, True)}
# The policies whose cost picks among every split count up to this many (not only powers of two).
ANY_COUNT_POLICIES = {"h200-any": 8}
DECODE_SPLIT_POLICY_DEFAULT = "h200-any"


def split_policy_name() -> str:
    """$TRITONLLM_DECODE_SPLIT_POLICY (read at every call; unset or empty: DECODE_SPLIT_POLICY_DEFAULT), a key of
    SPLIT_POLICIES; anything else a clear error."""
    chosen = os.environ.get(DECODE_SPLIT_POLICY_ENV, "").strip() or DECODE_SPLIT_POLICY_DEFAULT
    if chosen not in SPLIT_POLICIES:
        raise ValueError(f"${DECODE_SPLIT_POLICY_ENV}={chosen!r}: one of {', '.join(SPLIT_POLICIES)}")
    return chosen


def split_policy() -> tuple[float, float, int, bool]:
    """(saturating share, saturating programs an SM, unsplit waves, cost within one wave) of
    $TRITONLLM_DECODE_SPLIT_POLICY (SPLIT_POLICIES)."""
    return SPLIT_POLICIES[split_policy_name()]

# The key splits a decode graph of a mid-size batch captures in its grid (its replays use up to
# this many): the most the cost above chose at 48-256 sequences on an H100. A replay that uses
# fewer leaves the rest of the grid's programs to return at once. (A policy of any count captures
# its own most: captured_splits.)
DYNAMIC_SPLITS_CAPTURED = 4

# Decode programs one SM holds, per (device index, tiling): read from the compiled kernel after a
# tiling's first decode launch (kernels/_triton.py resident_programs). Until then that tiling's
# launches take the covering rule; a decode graph's warm-up runs launch it before the capture.
_DECODE_RESIDENT: dict[tuple, int] = {}


# Eager steps had shown the waves before the cost above explained them (H100, FP8 pool,
# step_profile.py --sweep_splits): 48 sequences over 21k keys 32.7-34.5 ms a step with 1 split,
# 36.9-38.1 with 2, 31.8-32.2 with 4 (384, 768 and 1,536 programs on a GPU that holds 528); 100
# sequences over 4k keys 18.9 ms with 1, 21.8 with 2, 21.3 with 4 (the cost picks 1 there too).
# A cap on the decode splits. H100, Llama-8B shape, FP8 pool, contexts 128-384 in a graph captured
# for 4,096 (2026-11-25, one lease each): at batch 1, 16 splits made the decode step 1% faster than
# 32 (the merge reads half the partial results; 128 programs are one wave) and 8 splits slower; at
# batch 8, 8 splits (512 programs) beat 2 by 4%. So the cap, not fewer programs in general.
MAX_DECODE_SPLITS = 16


def attention_dim_pad(head_dim: int) -> int:
    """The kernels' head_dim tile (DIM_PAD): the next power of two, and at least 16, because a compiled
    tl.dot needs K >= 16 (Triton's interpreter does not check it, so tiny test models with 8-wide
    heads ran on CPU and failed to compile on CUDA); the dims past head_dim are masked to zero."""
    return max(16, triton.next_power_of_2(head_dim))


def fuses_new_kv(head_dim: int) -> bool:
    """Whether the decode kernel can rotate and append the new K/V itself (``new_kv``): it pairs
    dim d with d + head_dim / 2 unmasked, so head_dim must fill its tile (a power of two >= 16)."""
    return head_dim == attention_dim_pad(head_dim)


def prefill_tokens_per_tile(group: int, head_dim: int = 128, kv_itemsize: int = 2,
                            device: torch.device | None = None) -> int:
    """New tokens of one sequence that one prefill program covers (the tile map's unit) on ``device``, the one the
    launches will run on (None: CPU / the interpreter, the tiles of every GPU but sm_90's). Whoever builds a tile map
    passes the device its launches get (q's): the rows differ by device (_prefill_config), and a map counted in
    other rows than the kernel's runs the wrong tokens."""
    return _prefill_config(group, attention_dim_pad(head_dim), kv_itemsize, device)[0] // group


def _decode_config(meta: AttentionMetadata, group: int, num_kv_heads: int, device: torch.device,
                   num_splits: int | None, sliding_window: int | None, dim_pad: int,
                   kv_itemsize: int, tma_pages: bool = False, plain_decode: bool = False,
                   fp32_queries: bool = False) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M rows, BLOCK_N keys, warps, stages, splits, TMA) of decode rows: the smallest row tile that
    holds a GQA group (16, the tensor-core minimum) and key splits to fill the GPU (a window caps the
    keys a token reads, so it caps the splits too; a Python constant per layer, so CUDA graphs keep
    one grid per layer).

    Heads of 256 (Gemma) double every tile's bytes: 2 K/V stages instead of 3 (3 stages of 64 x 256
    K and V tiles would nearly fill an H100's 227 KB of shared memory). An FP8 pool with heads up to
    128 wide walks 32 keys at a time with one warp over 3 stages: on an H100 (2026-11-25, Llama-8B
    heads, a sweep of 27 tilings) that took batch 1024 at context 192 from 267 to 198 us per layer
    and batch 256 at context 1024 from 290 to 245 us (small programs, so more of them fit on an SM to
    keep reads in flight). A bf16 pool already reads at ~2.8 TB/s with the default tiling; heads of
    256 keep 4 warps (one warp's accumulator would spill). Smaller FP8 batches: FP8_SHORT_CONTEXT_BATCH.

    On FP8 pools the splits go by the residency of the kernel that will run the tiling: ``plain_decode`` (a
    decode-only batch of a layer kernels/keys_major_decode.py can take) with ``fp32_queries`` (an fp32 engine's) is
    what keys_major_decode_chosen needs to say whether that is the keys-major kernel (its own _DECODE_RESIDENT
    entry). 16-bit pools split by the default kernel's residency whichever runs (keys_major_own_residency)."""
    wide = dim_pad > 128
    block_m = max(16, triton.next_power_of_2(group))
    tiling = _decode_tiling(meta.num_seqs, block_m, wide, kv_itemsize, tma_pages)
    if num_splits is None:
        keys_read = meta.max_context_len if sliding_window is None else min(meta.max_context_len, sliding_window)
        # (An fp32 engine's FP8 pool launches unwidened, under another key: not found here, it splits by covering.)
        widening = fp8_widening(tiling[0]) if kv_itemsize == 1 else (False, V_BY_TRITON)
        keys_major = plain_decode and keys_major_own_residency(kv_itemsize) and keys_major_decode_chosen(
            group, plain_layer=True, kv_itemsize=kv_itemsize, fp32_queries=fp32_queries, tiling=tiling)
        resident = _DECODE_RESIDENT.get(_decode_tiling_key(device, block_m, tiling, dim_pad, kv_itemsize, widening,
                                                           keys_major))
        sms = num_sms(device)
        num_splits = _decode_num_splits(meta.num_seqs, num_kv_heads, keys_read, sms, 64, resident)
        capacity = None if resident is None else resident * sms
        _, _, unsplit_waves, within_wave = split_policy()
        smallest = 2 * sms if within_wave else capacity
        if meta.decode_splits is not None and capacity is not None and (
                smallest < meta.num_seqs * num_kv_heads < unsplit_waves * capacity):
            # A decode graph of a mid-size bucket: its grid holds the most splits a replay may ask
            # for, and each replay uses decode_active_splits' count for its real batch and contexts.
            # (Small buckets, whose programs cover the GPU less than twice, keep their one count: reading it from
            # memory cost a batch-1 step 2-3%.)
            meta.decode_split_plan = (num_kv_heads, capacity, sms)
            num_splits = min(_most_decode_splits(keys_read, 64), captured_splits())
    block_n, warps, stages, tma = tiling
    return block_m, block_n, warps, stages, num_splits, tma


def _decode_tiling(num_seqs: int, block_m: int, wide: bool, kv_itemsize: int,
                   tma_pages: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_N keys, warps, stages, TMA) of _decode_config."""
    if kv_itemsize == 1:
        if block_m > 16 or wide:
            return 32, 4, 2, False
        if tma_pages and FP8_TMA_BATCH <= num_seqs < FP8_SHORT_CONTEXT_BATCH:
            return 32, 1, 6, True
        if num_seqs >= FP8_SHORT_CONTEXT_BATCH:
            return 32, 1, 3, False
        return 64, 2, 5, False
    return 64, 4, (2 if wide else 3), False


def _decode_tiling_key(device: torch.device, block_m: int, tiling: tuple, dim_pad: int, kv_itemsize: int,
                       widening: tuple = (False, 0), keys_major: bool = False) -> tuple:
    """_DECODE_RESIDENT's key: what decides a decode program's registers and shared memory (widening: an FP8
    pool's (K_BITS, V_WIDEN), fp8_widening; keys_major: kernels/keys_major_decode.py's kernel runs the tiling, not
    _paged_attention_kernel)."""
    return (device.index, block_m, *tiling, dim_pad, kv_itemsize, *widening, keys_major)


def _record_residency(compiled, key: tuple, device: torch.device) -> None:
    """_DECODE_RESIDENT[key] = how many programs of the launched decode kernel ``compiled`` an SM holds, once a key
    (nothing under Triton's interpreter)."""
    if key not in _DECODE_RESIDENT:
        resident = resident_programs(compiled, device)
        if resident is not None:
            _DECODE_RESIDENT[key] = resident


# FP8 pools, heads up to 128 wide: decode batches of at least this many sequences walk 32 keys at a
# time with one warp over 3 stages, smaller ones 64 keys with two warps over 5 stages. A CUDA graph
# fixes the tiling for every context it will serve, so the choice goes by the batch, which the pool
# bounds the contexts of (an 8B FP8 pool of ~1M tokens holds 768 sequences of at most ~1.4k): on an
# H100 (benchmarks/kernels/attention_kernel_bench.py, 2026-11-26) 64 x 2 x 5 read 194 x 5,250 contexts at
# 2.74 TB/s against 2.48 and 532 x 1,500 at 2.60 against 2.48, but 1,024 x 192 at 2.05 against 2.32
# (three 64-key tiles leave a 5-stage pipeline empty).
FP8_SHORT_CONTEXT_BATCH = 768
# FP8 pools the TMA unit can read 32 keys of a head's page at a time (_tma_readable): decode
# batches from FP8_TMA_BATCH up to FP8_SHORT_CONTEXT_BATCH sequences walk 32 keys with one warp over
# 6 stages, their whole tiles fetched by TMA. H100, Llama-8B FP8 with the FP8 head-major pool, the
# whole decode step's CUDA graph (2026-11-26): 544 x 1,500 29.60 -> 28.35 ms, 512 x 1,100 21.20 ->
# 19.96, 384 x 1,700 21.89 -> 21.37. The kernel alone (attention_kernel_bench.py): 532 x 1,500 583
# us against 599 for the pointer walk of 64 x 2 x 5. Not below: at 194 x 5,250 one warp keeps too
# few bytes in flight (854 us against 721) and two warps over 6 stages through TMA (715) were
# within 1% of the pointer walk. Not from 768: at 1,024 x 192 the step was 0.7% slower (the
# served form's new key closes its tile on the pointer walk, a large share of 6 tiles).
FP8_TMA_BATCH = 384


def _prefill_config(group: int, dim_pad: int, kv_itemsize: int,
                    device: torch.device | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, warps, stages, 1) of prompt chunks (BLOCK_M // group tokens of
    every head of a group a tile), never split. On ``device`` an sm_90 GPU: PREFILL_SM90_TILINGS' tiling
    for the pool where it has one, heads up to 128 wide, groups of up to 64 query heads (the 64-row
    default's), at every context length, so BLOCK_M depends on the device alone (and the model and pool):
    the tile maps, prefill_tokens_per_tile, count in it with the same device. None: every other GPU's.

    H100, Llama-8B heads (benchmarks/kernels/attention_kernel_bench.py, 2026-11-26): an FP8 pool takes
    128 x 128 tiles over 8 warps, 2 stages: four 2,048-token prompts 574 -> 502 us a layer and an
    8,192-token chunk over a 12k prefix 7.5 -> 5.9 ms against 64 x 64 over 4 warps (its fp16 math
    has room for the larger tile; 128 x 64 over 4 warps, 3 stages, came second). A bf16 pool keeps
    64 x 64 over 4 warps, 2 stages off sm_90: no tiling of that sweep beat it on the 2k prompts. Heads of 256
    walk 32 keys at a time with 8 warps (a 64 x 256 fp32 accumulator over 4 warps would spill)."""
    block_m = 64 if group <= 64 else triton.next_power_of_2(group)
    if dim_pad > 128:
        return block_m, 32, 8, 2, 1
    sm90 = _sm90_prefill_tiling(group, dim_pad, kv_itemsize, device)
    if sm90 is not None:
        return (*sm90, 1)
    if kv_itemsize == 1:
        return max(block_m, 128), 128, 8, 2, 1
    return block_m, 64, 4, 2, 1


# Prompt chunks on an sm_90 GPU (compute capability 9.0: H100 and H200, one SM architecture; the H200 differs in its
# memory), by the pool's bytes a value: (BLOCK_M rows, BLOCK_N keys, warps, stages) in place of _prefill_config's, at
# every context length (rows that went by the context would make a tile map's unit depend on the step). bf16: H200,
# Llama-8B heads, one layer, paged pool with the served tile map, from CUDA graphs
# (benchmarks/engine/lanes/s32_c2/fa51.sh, attention_kernel_bench.py --sweep_prefill, issue 51), us a layer, 64 x 64
# over 4 warps, 2 stages -> 128 x 128 over 8 warps, 3 stages: an 8,192-token chunk over 8,192 keys 1,552 -> 1,379,
# over 16,384 4,544 -> 3,908, over 20,000 5,931 -> 5,060; the last 3,616 of a 20k prompt 3,084 -> 2,612; four
# 2,048-token prompts 458 -> 448; 1,024 over 2,048 96 -> 91. The other candidates (64:64:4:3, 64:128:4:2, 128:64:8:2,
# 128:64:8:3) were 0.75-1.00x. As the served default (lanes/s33_c1/pf51.sh, the same day, another lease): 1.11 / 1.17
# / 1.17 / 1.19 / 1.03 / 1.06x over 64 x 64 x 4 x 2 at those six cases, its GPU tests 61 passed. Measured on the H200
# only; the H100 shares the SM, and sm_90 choices here go by capability (kernels/fp8_block.py,
# kernels/fused_moe_fp8.py). FP8 pools: no entry, the same sweep found nothing faster than their default 128 x 128 x 8
# x 2 (128:128:8:3 0.97x).
PREFILL_SM90_TILINGS: dict[int, tuple[int, int, int, int]] = {2: (128, 128, 8, 3)}


def _sm90_prefill_tiling(group: int, dim_pad: int, kv_itemsize: int,
                         device: torch.device | None) -> tuple[int, int, int, int] | None:
    """PREFILL_SM90_TILINGS' tiling where it replaces _prefill_config's: on an sm_90 ``device``, a pool it has an
    entry for, heads up to 128 wide, groups of up to 64 query heads (the 64-row default's); else None."""
    sm90 = PREFILL_SM90_TILINGS.get(kv_itemsize)
    if sm90 is None or group > 64 or dim_pad > 128 or device is None or not _is_sm90(device):
        return None
    return sm90


def _is_sm90(device: torch.device) -> bool:
    """``device`` is a CUDA GPU of compute capability 9.0."""
    if device.type != "cuda":
        return False
    return device_capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)


def _short_step_config(group: int, dim_pad: int, kv_itemsize: int,
                       device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, warps, stages) of a short step's split launch (a tree or chain verify
    step: _short_step_splits) on ``device``: the prefill tile's (a CUDA graph's tile map counts in its rows), unless
    $TRITONLLM_SHORT_STEP_TILING=short (read at every call): then bf16 / fp16 / fp32 pools with heads up
    to 128 wide walk 32 keys at a time over 8 warps, 3 stages.

    sm_90's 128-row tiles of 16-bit pools (PREFILL_SM90_TILINGS, rows the device-less config does not have): the
    rows stay the tile map's, the keys, warps and stages become 64 x 8 x 2, a thread's share of the 64 x 64 x 4 x 2
    tiling these steps ran in before (same accumulator and score registers a thread; the prompt's 128 x 128 x 8 x 3
    would double the scores' and take ~224 KB of shared memory, next to the split's spills below). Not measured
    on its own; "short" (64 rows) does not apply to them.

    Why the switch: with the split, the tree mask and the in-launch rotary and KV write, the prefill
    tiling needs more than 255 registers a thread (Triton 3.9's ptxas for sm_90, Llama-8B heads: 255
    and 568 bytes of spills a thread, 416 without the write; a prompt chunk's launch 228 and none), so
    the tree rows' key walk goes through local memory. 64 x 32 over 8 warps takes 218 and spills
    nothing. H200, 2026-11-30 (benchmarks/results/speculative.md): the tree rows' attention alone 22.6 ->
    12.0 us a layer at 15 nodes (decode 7.5), 19.4 -> 13.6 at 16. It is opt-in because in that call
    tree_bench's forced runs of the loop tree (16 nodes, 17 tokens) stopped reproducing their continuation
    (measured length 2.79 against 3.80); the next call showed the same drop with this switch off (2.97),
    so the tiling is not its cause, but no GPU run has yet checked it against the reference
    (tests/kernels/test_tree_attention.py's "short" cases) or in the forced loop. (64 x 64 over 8 warps,
    decode's key tiles: 254 registers, no spill, not measured.) FP8 pools (128-row tiles) and heads of
    256 spill in every tiling tried and keep the prefill tiling."""
    block_m, block_n, warps, stages, _ = _prefill_config(group, dim_pad, kv_itemsize, device)
    if _sm90_prefill_tiling(group, dim_pad, kv_itemsize, device) is not None:
        return block_m, 64, 8, 2
    if (kv_itemsize != 1 and dim_pad <= 128 and block_m == 64
            and os.environ.get(SHORT_STEP_TILING_ENV) == "short"):
        return block_m, 32, 8, 3
    return block_m, block_n, warps, stages


SHORT_STEP_TILING_ENV = "TRITONLLM_SHORT_STEP_TILING"
# "1": prompt tiles over an FP8 pool (fp16 math) round their fp16 q (softmax scale in it) to E4M3 and take Q K^T as an
# FP8 product of it and the pool's K codes (no K widening; Hopper's FP8 MMA, twice fp16's rate); P V stays fp16. An
# opt-in A/B switch (issue 51's prompt side), read at every call: q loses precision (3 mantissa bits), so its
# outputs differ from the fp16 path's (tests/kernels/test_prefill_fp8_qk.py bounds by how much).
PREFILL_FP8_QK_ENV = "TRITONLLM_PREFILL_FP8_QK"
# "0": the attention kernel reads a token tree's mask as bytes (meta.tree_mask), one load a (row, key) of
# its masked tiles, even where the step's producer packed its bits (AttentionMetadata.tree_bits); else it
# reads the bits: a few row-vector loads a tile. An A/B switch, read at every call. H200, Llama-8B shape,
# the 65-token tree step's launch alone (keys split 8 ways, its K/V write and merge included): 29.0 us a
# layer as bytes (255 registers and 70 spilled a thread), 18.0 as bits (255, 14); 17 tokens 16.8 -> 10.2.
TREE_BITS_ENV = "TRITONLLM_TREE_BITS"


# How decode tiles over an FP8 pool (fp16 math) widen its E4M3 K/V to float16 (_attend_keys' K_BITS, V_WIDEN):
# "0": Triton's conversion for both (F2FP.F16.E4M3 in the MMA operands' layouts, so V, read across its rows, comes
# out of shared memory a byte at a time: 128 LDS.U8 a 32-key tile); "v": V by bits in its loaded layout, then to
# the MMA by ldmatrix.trans; "kv": K by bits as well; "vcvt": V by the conversion unit in its loaded layout;
# "auto" (FP8_WIDEN_DEFAULT): "vcvt" for tiles of 64 keys and more, "0" for the 32-key ones. An A/B switch, read at
# every call; prompt tiles always widen by Triton's conversion. Same values (on the GPU an MMA's k-order may differ
# between them: a few bf16 outputs in 10^4 one rounding apart).
FP8_WIDEN_ENV = "TRITONLLM_ATTN_FP8_BITS"
V_BY_TRITON, V_BY_BITS, V_BY_CVT = 0, 1, 2
FP8_WIDENINGS = {"0": (False, V_BY_TRITON), "v": (False, V_BY_BITS), "kv": (True, V_BY_BITS),
                 "vcvt": (False, V_BY_CVT)}
# sm_90 (Triton 3.9, Llama-8B heads, 32-key tiles over one warp, 3 stages): the unmasked walk's loop 823 SASS
# instructions a tile with "0" (128 LDS.U8, 136 F2FP, 175 registers), 730 with "v" (36 LDS, 25 LDSM, 72 F2FP; 238
# registers), 595 with "vcvt", 877 with "kv" (255 registers and a 48-byte stack). H200 (2026-12-01, session 29 call
# 4, attention_kernel_bench.py --grid, FP8 pool, us a layer, "0" -> "vcvt" at the same splits): the 64 x 2 x 5
# tiling 0.5-5% faster (69 x 21,000 937 -> 901, 256 x 20,480 3,211 -> 3,115, 256 x 2,048 336 -> 326, 8 x 2,048
# 17.0 -> 16.2; 256 x 8,192 1,251 -> 1,266 the one loss), the 32 x 1 x 3 one 7% slower (1,024 x 2,048 1,145 ->
# 1,223): hence "auto".
FP8_WIDEN_DEFAULT = "auto"


def fp8_widening(block_n: int) -> tuple[bool, int]:
    """(K_BITS, V_WIDEN) of an FP8 pool's decode tiles of ``block_n`` keys: FP8_WIDEN_ENV's entry of FP8_WIDENINGS,
    else (unset or "auto") "vcvt" from 64 keys a tile, "0" below."""
    chosen = os.environ.get(FP8_WIDEN_ENV, "").strip() or FP8_WIDEN_DEFAULT
    if chosen == "auto":
        chosen = "vcvt" if block_n >= 64 else "0"
    if chosen not in FP8_WIDENINGS:
        raise ValueError(f"${FP8_WIDEN_ENV}={chosen!r}: one of {', '.join(FP8_WIDENINGS)}, auto")
    return FP8_WIDENINGS[chosen]


# "0": decode tiles never read the pool through TMA descriptors; "all": every decode tiling that fits
# in a page does (sweeps); else the rule of _decode_config. An A/B switch, read at every call.
DECODE_TMA_ENV = "TRITONLLM_DECODE_TMA"


def _tma_readable(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether decode tiles of ``block_n`` keys can read these pools through TMA descriptors: the
    head-major pool (engine/executor/runner.py: a page's rows of one KV head adjacent, so stride(1)
    == head_dim and the block and head strides are whole rows), tiles within a page (page_size a
    multiple of block_n), 16-byte-aligned rows of a power-of-two head_dim, and a Hopper-class GPU
    (or Triton's interpreter). $TRITONLLM_DECODE_TMA=0 turns it off (read at every call)."""
    if TensorDescriptor is None or os.environ.get(DECODE_TMA_ENV, "1") == "0":
        return False
    if k_cache.is_cuda and not hopper_or_later(k_cache):
        return False
    page_size, _, head_dim = k_cache.shape[1:]
    if page_size % block_n or head_dim != attention_dim_pad(head_dim):  # a box fills the K/V tile
        return False
    for cache in (k_cache, v_cache):
        stride_b, stride_s, stride_h, _ = cache.stride()
        if (stride_s != head_dim or stride_b % head_dim or stride_h % head_dim
                or head_dim * cache.element_size() % 16 or cache.data_ptr() % 16):
            return False
    return True


def _tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int):
    """(k_desc, v_desc): 2-D views (rows, head_dim) of the pools, read a box of block_n rows of one
    head's page at a time, or None where ``_tma_readable`` says no."""
    if not _tma_readable(k_cache, v_cache, block_n):
        return None
    head_dim = k_cache.shape[3]
    descs = []
    for cache in (k_cache, v_cache):
        extent = sum((n - 1) * st for n, st in zip(cache.shape, cache.stride())) + 1
        rows = torch.as_strided(cache, (extent // head_dim, head_dim), (head_dim, 1))
        descs.append(TensorDescriptor(rows, list(rows.shape), [head_dim, 1], [block_n, head_dim]))
    return tuple(descs)


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, num_splits: int | None = None, sliding_window: int | None = None, logit_softcap: float | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, chunk_size: int | None = None,
    qk_l2_eps: float | None = None, temperature: tuple[int, float] | None = None,
) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim), last dim contiguous -> out: (num_tokens, num_heads, head_dim).

    ``num_splits`` overrides the decode rows' split count (any count; tests use it to force
    the split path at short contexts), in mixed batches too; prompt chunks never split. ``sliding_window``,
    ``logit_softcap``, ``sinks`` (num_heads,) and ``alibi_slopes`` (num_heads,) float32:
    kernels/attention.py (None: the layer has none).

    ``new_kv = (k, v, positions, cos_sin_cache)``, decode-only batches with power-of-two heads:
    q and k arrive unrotated; the kernel rotates them (neox halves, kernels/rotary.py's table and
    math) and writes the rotated k and v to ``meta.slot_mapping`` before attending, which is
    ``rotary_and_write_kv`` + this function in one kernel. q and k are left as they were.
    ``cos_sin_cache`` None: nothing is rotated (ALiBi, learned positions): ``write_kv_cache`` + this
    function in one kernel.

    ``qk_norm = (q_weight, k_weight, eps)`` (with ``new_kv``, decode-only batches): q and k arrive before their
    per-head RMSNorms (Qwen3, Gemma 3: (head_dim,) weights), which the kernel applies before the rotation as
    kernels/rmsnorm.py ``qk_rms_norm`` does: that launch folded into this one.

    Llama 4 (kernels/chunked_attention.py), decode-only batches: ``chunk_size`` C, chunked local attention (a
    token at p sees keys p // C * C .. p: the decode walk starts at its chunk's first key); ``qk_l2_eps`` (with
    ``new_kv`` rotating): q and the new k, once rotated and rounded, divided by their heads' RMS (no weight);
    ``temperature = (floor_scale, attn_scale)`` (with ``new_kv``; an integral floor_scale): q times
    1 + attn_scale * log1p((p + 1) // floor_scale) at its position p (``new_kv``'s positions).
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = meta.context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    dim_pad = attention_dim_pad(head_dim)
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    assert alibi_slopes is None or (alibi_slopes.shape == (num_heads,) and alibi_slopes.is_contiguous())
    if new_kv is not None:
        new_k, new_v, positions, cos_sin_cache = new_kv
        rotate = cos_sin_cache is not None
        assert fuses_new_kv(head_dim) and new_k.stride(-1) == 1 and new_v.stride(-1) == 1
        assert not rotate or (cos_sin_cache.shape[1] == head_dim and cos_sin_cache.dtype == torch.float32)
        if not rotate:
            cos_sin_cache = q  # unread
        # read at positions_ptr + sequence (rotary.py says why a view must not be); unread without a rotation or
        # a temperature (then possibly None)
        positions = q if positions is None else dense(positions)[0]
        new_kv_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))
    else:
        new_k = new_v = positions = cos_sin_cache = q  # unused
        new_kv_strides = (0, 0, 0, 0)
        rotate = False
    kv_itemsize = k_cache.element_size()
    append_rows = new_kv is not None and not meta.is_decode_only  # a short step's (short_step_appends)
    assert qk_norm is None or (new_kv is not None and meta.is_decode_only), "qk_norm: decode-only batches with new_kv"
    norm_args = {}
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.is_contiguous() and k_weight.is_contiguous()
        norm_args = dict(q_norm_ptr=q_weight, k_norm_ptr=k_weight, qk_eps=float(eps), QK_NORM=True)
    if chunk_size is not None:
        assert meta.is_decode_only and chunk_size > 0, "chunk_size: decode-only batches (one token a tile)"
        norm_args["CHUNK"] = int(chunk_size)
    if qk_l2_eps is not None:
        assert qk_norm is None and rotate and meta.is_decode_only, "qk_l2_eps: decode-only batches rotating new_kv"
        norm_args.update(qk_eps=float(qk_l2_eps), QK_L2=True)
    if temperature is not None:
        floor_scale, attn_scale = temperature
        assert new_kv is not None and meta.is_decode_only and floor_scale == int(floor_scale) >= 1, (
            "temperature: decode-only batches with new_kv, an integral floor_scale")
        norm_args.update(temp_floor=int(floor_scale), temp_scale=float(attn_scale), TEMPERATURE=True)
    # Token trees (tree verification): the mask as bits where the step's producer packed them
    # (meta.tree_bits) and $TRITONLLM_TREE_BITS is not 0, else as bytes; the decode launch's rows are
    # one token each (a root alone sees all its keys), so only the prefill launch reads it.
    tree_as_bits = (meta.tree_mask is not None and meta.tree_bits is not None
                    and os.environ.get(TREE_BITS_ENV, "1") != "0")
    if tree_as_bits:
        tree = meta.tree_bits
    else:
        tree = None if meta.tree_mask is None else meta.tree_mask.to(torch.int8)
    # Image spans: a row of a sequence with one new token sees nothing ahead, so likewise prefill only.
    spans = meta.span_ahead
    assert spans is None or (spans.dtype == torch.int32 and spans.shape == (num_tokens,))
    # The kernels read these at ptr + i (block_tables and tree: + row * row stride + j), so views become dense.
    tables, cu, lens, slots, tile_seq, tile_m, active_splits, spans, tree = dense(
        meta.block_tables, meta.cu_seqlens_q, meta.context_lens, meta.slot_mapping, meta.tile_seq, meta.tile_m,
        meta.decode_splits, spans, tree)

    def launch(config: tuple, grid: tuple[int, int, int], seq_kind: int, tile_map: bool,
               decode_tiles: bool = True) -> None:
        # decode_tiles: a decode config (ONE_TOKEN rows, or a decode-only batch's); False for prefill tiles,
        # split or not (a short step's ALL_SEQS launch, _short_step_splits).
        decode_tiles = decode_tiles and seq_kind != MULTI_TOKEN
        # Only prefill tiles read the tree (above); a decode tiling gets no tree arguments, so a tree step's
        # one-token launch is the plain decode launch's compile (TREE_AS_BITS and stride_tm are in its key).
        reads_tree = tree is not None and not decode_tiles
        block_m, block_n, num_warps, num_stages, num_splits = config[:5]
        # A decode config's sixth element asks for TMA reads; $TRITONLLM_DECODE_TMA=all has every
        # decode tiling that fits a page take them (benchmarks/kernels/attention_kernel_bench.py's sweeps).
        # A decode graph's launch uses the splits its replay's host asks for (decode_active_splits).
        dynamic = decode_tiles and num_splits > 1 and meta.decode_split_plan is not None
        wants_tma = decode_tiles and (
            (len(config) > 5 and config[5]) or os.environ.get(DECODE_TMA_ENV) == "all")
        # A chunk's walk starts at its first key: TMA boxes (block_n rows within a page) need it tile-aligned.
        wants_tma = wants_tma and (chunk_size is None or chunk_size % block_n == 0)
        if num_splits > 1:
            rows = num_seqs if seq_kind == ONE_TOKEN else num_tokens  # (see the kernel's part_row)
            part_out = torch.empty(num_splits, rows, num_heads, dim_pad, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_splits, rows, num_heads, dtype=torch.float32, device=q.device)
            ps, pt, ph = part_out.stride(0), part_out.stride(1), part_out.stride(2)
        else:
            part_out = part_lse = out  # unused
            ps = pt = ph = 0
        descs = _tma_descriptors(k_cache, v_cache, block_n) if wants_tma else None
        fp16_math = kv_itemsize == 1 and q.dtype != torch.float32
        k_bits, v_widen = fp8_widening(block_n) if fp16_math and decode_tiles else (False, V_BY_TRITON)
        compiled = _paged_attention_kernel[grid[0], grid[1], grid[2] * num_splits](
            q, k_cache, v_cache, out, part_out, part_lse, *(descs or (k_cache, v_cache)),
            tables, cu, lens, tile_seq if tile_map else cu, tile_m if tile_map else cu,
            new_k, new_v, positions, cos_sin_cache, slots, q if sinks is None else sinks,
            q if alibi_slopes is None else alibi_slopes,
            active_splits if dynamic else lens,
            tree if reads_tree else lens, tree.stride(0) if reads_tree else 0,
            tree.shape[1] if reads_tree and tree_as_bits else 0,
            lens if spans is None else spans,
            scale * _LOG2E, sliding_window or 0, (logit_softcap or 1.0) * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            tables.stride(0), ps, pt, ph, *new_kv_strides, cos_sin_cache.stride(0),
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, PAGE_SIZE=page_size,
            BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 engines get fp32 dots
            FP16_MATH=fp16_math, K_BITS=k_bits, V_WIDEN=v_widen, ASM=q.is_cuda,
            FP8_QK=fp16_math and not decode_tiles and os.environ.get(PREFILL_FP8_QK_ENV) == "1",
            ROTARY_APPEND=new_kv is not None and not append_rows,
            APPEND_ROWS=append_rows,
            ROTATE=rotate,
            HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None, HAS_TILE_MAP=tile_map,
            HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None, SEQ_KIND=seq_kind, TMA=descs is not None, DYNAMIC_SPLITS=dynamic,
            HAS_TREE=reads_tree, TREE_AS_BITS=reads_tree and tree_as_bits,
            HAS_SPANS=spans is not None and not decode_tiles,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl_options(q), **norm_args,
        )
        if decode_tiles and q.is_cuda:  # a decode tiling: how many of its programs an SM holds
            tiling = (block_n, num_warps, num_stages, len(config) > 5 and bool(config[5]))
            _record_residency(compiled, _decode_tiling_key(q.device, block_m, tiling, dim_pad, kv_itemsize,
                                                           (k_bits, v_widen)), q.device)
        if num_splits > 1:
            by_sequence = seq_kind == ONE_TOKEN
            _merge_splits_kernel[(num_seqs if by_sequence else num_tokens, num_heads)](
                part_out, part_lse, out, cu, active_splits if dynamic else cu,
                ps, pt, ph, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, BY_SEQUENCE=by_sequence,
                DYNAMIC_SPLITS=dynamic, SPLITS_PAD=merge_splits_pad(num_splits), num_warps=1,
                **pdl_options(q),
            )

    keys_bound = sliding_window if chunk_size is None else chunk_size  # the most keys a decode row reads
    # A decode-only batch of a layer the keys-major kernel can take (kernels/keys_major_decode.py's scope).
    plain_decode = meta.is_decode_only and (sliding_window is None and logit_softcap is None and sinks is None
                                            and alibi_slopes is None and not norm_args)
    decode_config = _decode_config(meta, group, num_kv_heads, q.device, num_splits, keys_bound, dim_pad, kv_itemsize,
                                   tma_pages=kv_itemsize == 1 and _tma_readable(k_cache, v_cache, 32),
                                   plain_decode=plain_decode, fp32_queries=q.dtype == torch.float32)
    if meta.is_decode_only:
        tiling = (*decode_config[1:4], len(decode_config) > 5 and bool(decode_config[5]))
        if plain_decode and keys_major_decode_chosen(group, plain_layer=True, kv_itemsize=kv_itemsize,
                                                     fp32_queries=q.dtype == torch.float32, tiling=tiling,
                                                     splits=decode_config[4]):
            # The keys as the products' rows (FP8 pools in the 64-key 2-warp tiling, 16-bit pools' split launches,
            # unless $TRITONLLM_DECODE_KEYS_MAJOR says otherwise): same config, splits and merge.
            _decode_keys_major(q, k_cache, v_cache, out, meta, tables, lens, active_splits, slots, scale,
                               decode_config, dim_pad,
                               None if new_kv is None else (new_k, new_v, positions, cos_sin_cache if rotate else None))
            return out
        launch(decode_config, (1, num_seqs, num_kv_heads), ALL_SEQS, tile_map=False)
        return out
    # A mixed batch: its prompt chunks take prefill tiles, its decode rows (sequences with one new
    # token) decode tiles in a second launch. One prefill tiling for all would spend a 64-row tile's
    # dots and softmax on each decode row's 1-8 rows: on an H100 the ~480 decode rows of a 2048/128
    # step (2k-token contexts) took longer than its four 2,048-token prompts.
    prefill_config = _prefill_config(group, dim_pad, kv_itemsize, q.device)
    # A tile map names tiles of tile_tokens tokens; in tiles of other rows its programs would run other tokens.
    assert meta.tile_seq is None or meta.tile_tokens in (None, prefill_config[0] // group), (
        f"a tile map of {meta.tile_tokens}-token tiles for {prefill_config[0] // group}-token prompt tiles "
        f"(prefill_tokens_per_tile without the launches' device?)")
    grid, splits, one_launch = _short_step_plan(meta, num_tokens, group, num_kv_heads, head_dim, kv_itemsize,
                                                q.device, sliding_window, num_splits)
    tile_map = meta.tile_seq is not None
    assert not append_rows or one_launch, "new_kv for a step that is not a short one-tile step (short_step_appends)"
    if splits > 1:
        # A short step (a tree or chain verify step, a small chunk): its keys split like a decode launch's,
        # then merged per token.
        short_config = _short_step_config(group, dim_pad, kv_itemsize, q.device) + (splits,)
        if one_launch:
            # Few sequences can be in it: one launch over all, the one-token rows riding in prefill tiles.
            launch(short_config, grid, ALL_SEQS, tile_map=tile_map, decode_tiles=False)
            return out
        # Possibly many one-token rows: they keep their decode launch, which runs after this one and so
        # overwrites the rows this launch's merge wrote for them from partials it never stored.
        launch(short_config, grid, MULTI_TOKEN, tile_map=tile_map)
    else:
        launch(prefill_config, grid, MULTI_TOKEN, tile_map=tile_map)
    launch(decode_config, (1, num_seqs, num_kv_heads), ONE_TOKEN, tile_map=False)
    return out


def _decode_keys_major(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                       meta: AttentionMetadata, tables: torch.Tensor, lens: torch.Tensor,
                       active_splits: torch.Tensor | None, slots: torch.Tensor, scale: float, config: tuple,
                       dim_pad: int, new_kv: tuple | None) -> None:
    """A decode-only batch by kernels/keys_major_decode.py's kernel (paged_attention_triton's arguments, dense),
    its splits' partial results merged by _merge_splits_kernel as the default kernel's are."""
    num_seqs, num_heads, head_dim = q.shape
    num_splits = config[4]
    dynamic = num_splits > 1 and meta.decode_split_plan is not None  # a decode graph's replay picks its splits
    parts = None
    if num_splits > 1:
        parts = (torch.empty(num_splits, num_seqs, num_heads, dim_pad, dtype=torch.float32, device=q.device),
                 torch.empty(num_splits, num_seqs, num_heads, dtype=torch.float32, device=q.device))
    fp16_math = k_cache.element_size() == 1 and q.dtype != torch.float32
    widening = fp8_widening(config[1]) if fp16_math else (False, V_BY_TRITON)
    compiled = keys_major_decode(q, k_cache, v_cache, out, parts, tables, lens, active_splits if dynamic else None,
                                 scale * _LOG2E, config, dim_pad, widening, new_kv, slots)
    if q.is_cuda:  # its programs an SM, under its own key: the splits of its next FP8 launches go by them
        tiling = (*config[1:4], len(config) > 5 and bool(config[5]))
        _record_residency(compiled, _decode_tiling_key(q.device, config[0], tiling, dim_pad, k_cache.element_size(),
                                                       widening, keys_major=True), q.device)
    if parts is not None:
        part_out, part_lse = parts
        ps, pt, ph = part_out.stride()[:3]
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, lens, active_splits if dynamic else lens, ps, pt, ph, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, BY_SEQUENCE=False, DYNAMIC_SPLITS=dynamic,
            SPLITS_PAD=merge_splits_pad(num_splits), num_warps=1, **pdl_options(q))


def _short_step_plan(meta: AttentionMetadata, num_tokens: int, group: int, num_kv_heads: int, head_dim: int,
                     kv_itemsize: int, device: torch.device, sliding_window: int | None,
                     num_splits: int | None) -> tuple[tuple[int, int, int], int, bool]:
    """(grid before the split, key splits, one launch) of a mixed step's prefill-tile launch: splits > 1 for a
    short step (_short_step_splits, or ``num_splits`` forced); one launch: its one-token rows ride in it."""
    tokens_per_tile = prefill_tokens_per_tile(group, head_dim, kv_itemsize, device)
    num_seqs = meta.num_seqs
    tiles = triton.cdiv(num_tokens, tokens_per_tile)  # the fewest tiles with work; the most (each sequence
    most_tiles = tiles + min(num_seqs, num_tokens)    # wastes at most one partial one, at most a sequence a token)
    if meta.tile_seq is not None:  # a CUDA graph's fixed grid
        grid = (meta.tile_seq.shape[0], 1, num_kv_heads)
    else:
        grid = (triton.cdiv(meta.max_seqlen_q, tokens_per_tile), num_seqs, num_kv_heads)
        tiles = max(tiles, num_seqs)
    if tiles * num_kv_heads >= SHORT_STEP_PROGRAMS:
        return grid, 1, False
    keys = meta.max_context_len if sliding_window is None else min(meta.max_context_len, sliding_window)
    block_n = _prefill_config(group, attention_dim_pad(head_dim), kv_itemsize)[1]
    forced = int(os.environ.get(SHORT_STEP_SPLITS_ENV, "0") or 0)
    splits = num_splits or forced or _short_step_splits(tiles * num_kv_heads, grid[0] * grid[1] * grid[2],
                                                        num_tokens, keys, block_n, num_sms(device))
    return grid, splits, splits > 1 and most_tiles * num_kv_heads <= SHORT_STEP_ONE_LAUNCH


def short_step_appends(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
                       sliding_window: int | None = None) -> bool:
    """Whether paged_attention_triton takes ``new_kv`` for this mixed step (a short step in one launch
    whose sequences are one query tile each: a batch-1 verify step of up to 16 tokens with 4 query heads
    a KV head): each program rotates its rows and the split holding a new key writes it, as at decode."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if meta.is_decode_only or not fuses_new_kv(head_dim) or num_tokens == 0:
        return False
    if meta.max_seqlen_q > prefill_tokens_per_tile(group, head_dim, k_cache.element_size(), q.device):
        return False
    _, splits, one_launch = _short_step_plan(meta, num_tokens, group, num_kv_heads, head_dim,
                                             k_cache.element_size(), q.device, sliding_window, None)
    return one_launch


# A power of two: every short step (a mixed step of fewer than SHORT_STEP_PROGRAMS prefill programs) splits
# its keys this many ways instead of _short_step_splits' count (8 is the 65-token tree step's count before
# that rule took SHORT_STEP_RESIDENT). An A/B switch for benchmarks, read at every call.
SHORT_STEP_SPLITS_ENV = "TRITONLLM_SHORT_STEP_SPLITS"
# A short step's split programs one SM holds: the 64-row tiles with the tree mask take 215-255 registers a
# thread over 4 warps (Triton 3.9, sm_90), two programs an SM.
SHORT_STEP_RESIDENT = 2
# A mixed step whose prefill tiles number fewer programs than this (tiles x KV heads) splits its keys
# (_short_step_splits); 132 SMs of an H200 hold a few programs each.
SHORT_STEP_PROGRAMS = 128
# A short step whose prefill tiles may number at most this many programs (tiles x KV heads, each of
# its sequences in tiles of its own) runs its one-token rows in the same launch: 16 rows in 64-row
# tiles waste little; a 128-token graph bucket's up to 128 decode rows would each spend a 64-row tile's
# dots, which can take as long as reading their keys (hence the separate decode launch of a mixed batch).
SHORT_STEP_ONE_LAUNCH = 256
# The most (split, token) rows of partial results a short step's launch keeps: 1,024 x 32 heads x 128
# dims of fp32 are 16 MiB.
SHORT_STEP_PART_ROWS = 1024
# The most programs a short step's split grid launches, most of a CUDA graph's returning at once (its
# tile map has an entry per sequence the bucket may hold).
SHORT_STEP_GRID = 8192


def _short_step_splits(programs: int, grid_programs: int, num_tokens: int, keys: int, block_n: int,
                       sms: int) -> int:
    """Key splits of a mixed step's prefill-tile launch of ``programs`` (tile, KV head) pairs with work
    (``grid_programs`` in its grid before the split) over contexts up to ``keys`` keys: the most (a power
    of two) whose programs the GPU holds at once, SHORT_STEP_RESIDENT an SM, none shorter than 2 tiles of
    ``block_n`` keys, at most MAX_DECODE_SPLITS, SHORT_STEP_PART_ROWS // num_tokens and
    SHORT_STEP_GRID // grid_programs; 1 (no split) for steps of SHORT_STEP_PROGRAMS programs or more.

    Why split: a batch-1 tree verify step of 16 tokens (Llama-8B shape: 4 query heads a KV head, so one
    64-row tile a KV head) launched 8 programs, each walking the whole context alone: ~34 us a layer at
    512 keys on an H200 where the decode step's split launch took a few (benchmarks/results/speculative.md).
    Why no more than one wave: the 65-token step (5 tiles a KV head, 40 programs) took 8 splits under the
    earlier rule (enough to cover the GPU twice, next power of two: 320 programs, two waves) and ran 18.2 us
    a layer against 15.2 with 4 (H200, its launch alone with the mask as bits, the K/V write and merge
    included); 17 tokens (16 programs) 10.6 with 8, 11.4 with 4; 33 tokens 11.6 with 4, 12.4 with 8."""
    if programs >= SHORT_STEP_PROGRAMS:
        return 1
    wanted = power_of_2_floor(SHORT_STEP_RESIDENT * sms // programs)
    by_rows = power_of_2_floor(SHORT_STEP_PART_ROWS // max(num_tokens, 1))
    by_grid = power_of_2_floor(SHORT_STEP_GRID // max(grid_programs, 1))
    return min(wanted, _most_decode_splits(keys, block_n), by_rows, by_grid)
