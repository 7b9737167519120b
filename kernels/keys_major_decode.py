"""Decode attention with the keys as the tensor-core products' rows ("keys-major", swap-AB), for GQA layers whose
query-head group is smaller than the MMA's 16 rows: a variant of kernels/triton_attention.py's decode tiles, the
default for FP8 pools in the 64-key 2-warp tiling (below).

Why: the default decode tile puts a KV head's GROUP query heads (Llama-3.1-8B: 4) as the MMA's M rows, padded to 16,
so 3/4 of every QK^T and PV product is padding; an FP8 pool moves twice the keys a second of a bf16 one for the same
work a key, and its decode reads at 79-82% of the copy bandwidth where bf16 pools read at ~100% (issue 51, session 29
results/kernels.md). Here one program (sequence, KV head, split) computes

    scores^T (BLOCK_N, G_PAD)  = K_tile (BLOCK_N, D) @ q^T (D, G_PAD)
    acc^T    (D, G_PAD)       += V_tile^T (D, BLOCK_N) @ P^T (BLOCK_N, G_PAD)

with G_PAD = the group padded to KEYS_MAJOR_MIN_COLUMNS at least (an MMA's N can be 8; its M then is BLOCK_N keys
and D = 128 dims, no padding), the online softmax running down the keys (axis 0) with one running max / sum a query
head (a column). Same split ranges (whole BLOCK_N tiles a split, split 0 from key 0), same partial results and
merge (triton_attention._merge_splits_kernel) and the same page walk (block table read a tile) as the default.

Scope (keys_major_decode_supported): decode-only batches (one new token a sequence, its query row = its sequence
index), without a window, soft-cap, sinks, ALiBi, chunked attention, q/k norms, L2 norm or temperature; ``new_kv``
(the served rotary append) with a rotation or without. Anything else runs the default kernel.

FP8 pools (E4M3, scale 1): fp16 math as the default's (q pre-scaled by the softmax scale, saturated to fp16's
range); K and V widened as triton_attention.fp8_widening says (kernels/e4m3_bits.py: Triton's conversion, V by bits
or by the conversion unit kept in its loaded layout, K by bits). Exact either way (powers of two).

Where it runs (keys_major_decode_chosen, $TRITONLLM_DECODE_KEYS_MAJOR read at every call): unset or "auto" (the
served default) where it measured faster: FP8 pools read with fp16 math in the 64-key 2-warp tiling
(KEYS_MAJOR_AUTO_FP8), and 16-bit pools in their 64-key 4-warp 3-stage tiling (KEYS_MAJOR_AUTO_16BIT) when the launch
splits the keys; "1" wherever it can run (the bench's A/B); "0" never.
FP8, H200 (2026-12-01, session 30 calls 1 and 4, Llama-3.1-8B heads, head-major pool, the same 64 x 2 x 5 tiling and
splits as the default kernel; us a layer): 48 x 21,000 609 -> 563 (80 -> 87% of the copy bandwidth), 64 x 20,480
768 -> 727, 256 x 20,480 3,037 -> 2,847 (84 -> 90%), 8 x 20,480 106 -> 99, 256 x 8,192 1,224 -> 1,146, 64 x 8,192
313 -> 295, 8 x 8,192 47.5 -> 43.9, 256 x 2,048 321 -> 298, 64 x 2,048 84 -> 79; the served rotary form alike. It
lost in the 32 x 1 x 3 tiling of 1,024 x 2,048 (1,130 -> 1,401 us), and in 4-warp tilings (64 x 4 x 3, 128 x 4 x 3,
64 x 4 x 5: 5-15% slower than the default kernel at 64 x 2 x 5), so those keep the default kernel.
bf16 (call 4, 64 x 4 x 3 both): 8 x 8,192 89.0 -> 71.2 us (71 -> 89% of copy), 8 x 20,480 213 -> 162 (74 -> 98%),
both 8 splits; unsplit batches were within 4% either way (256 x 8,192 2,092 -> 2,166, 256 x 2,048 577 -> 554), so
16-bit pools take it only for split launches. Their splits go by the default kernel's residency (3 programs an SM),
not its own (4): with its own, 64 x 8,192 took 1 split where the default took 16 (681 against 553 us).
"""
from __future__ import annotations

import os

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.e4m3_bits import bits_factor
from kernels.paged_kv_math import cache_value, paged_kv_tile, rotate_neox, slot_row, widened_kv

DECODE_KEYS_MAJOR_ENV = "TRITONLLM_DECODE_KEYS_MAJOR"
# The fewest columns (padded query heads) of a keys-major product: an MMA's N of 8 (mma.sync m16n8k16; sm_90's
# warpgroup MMA takes N = 8 too). Triton 3.9 accepts 16-bit dots with N of 1 and pads them itself.
KEYS_MAJOR_MIN_COLUMNS = 8


# (BLOCK_N keys, warps) of the decode tilings whose FP8-pool launches take this kernel by default ("auto"), and
# (BLOCK_N, warps, stages) of the 16-bit pools' tiling whose split launches do.
KEYS_MAJOR_AUTO_FP8 = (64, 2)
KEYS_MAJOR_AUTO_16BIT = (64, 4, 3)
DECODE_KEYS_MAJOR_MODES = ("auto", "0", "1")


def keys_major_decode_mode() -> str:
    """$TRITONLLM_DECODE_KEYS_MAJOR (read at every call): "auto" (also when unset or empty), "0" or "1"; anything
    else a clear error naming the variable and the values it takes."""
    chosen = os.environ.get(DECODE_KEYS_MAJOR_ENV, "").strip() or "auto"
    if chosen not in DECODE_KEYS_MAJOR_MODES:
        raise ValueError(f"${DECODE_KEYS_MAJOR_ENV}={chosen!r}: auto (the default: FP8 pools in the 64-key 2-warp "
                         f"decode tiling), 0 (the default kernel always) or 1 (keys-major decode wherever it runs)")
    return chosen


def keys_major_decode_chosen(group: int, *, plain_layer: bool, kv_itemsize: int, fp32_queries: bool, tiling: tuple,
                             splits: int = 1) -> bool:
    """Whether a decode-only launch runs this kernel: keys_major_decode_supported, then
    $TRITONLLM_DECODE_KEYS_MAJOR: "1" yes, "0" no, "auto" for 16-bit queries (not an fp32 engine's) over an FP8 pool
    (``kv_itemsize`` 1) in a tiling of KEYS_MAJOR_AUTO_FP8's keys and warps, or over a 16-bit pool (2) in
    KEYS_MAJOR_AUTO_16BIT's tiling with ``splits`` > 1, without TMA reads either way. ``tiling``: the decode config's
    (BLOCK_N, warps, stages[, TMA]) (triton_attention._decode_tiling); ``splits``: its key splits."""
    mode = keys_major_decode_mode()
    if mode == "0" or not keys_major_decode_supported(group, plain_layer=plain_layer):
        return False
    if mode == "1":
        return True
    if fp32_queries or (len(tiling) > 3 and bool(tiling[3])):
        return False
    if kv_itemsize == 1:
        return tuple(tiling[:2]) == KEYS_MAJOR_AUTO_FP8
    return kv_itemsize == 2 and tuple(tiling[:3]) == KEYS_MAJOR_AUTO_16BIT and splits > 1


def keys_major_own_residency(kv_itemsize: int) -> bool:
    """Whether a keys-major launch's splits go by its own programs an SM (FP8 pools: 4, as the default kernel's at 64
    x 2 x 5) rather than the default kernel's in that tiling (16-bit pools: see the module's docstring)."""
    return kv_itemsize == 1


def keys_major_columns(group: int) -> int:
    """G_PAD: a KV head's query heads padded to a power of two, at least KEYS_MAJOR_MIN_COLUMNS."""
    return max(KEYS_MAJOR_MIN_COLUMNS, triton.next_power_of_2(group))


@jit
def _attend_keys_major(
    q_t, m_i, l_i, acc_t, k_cache_ptr, v_cache_ptr, block_row, kv_head, lo, hi, kv_hi,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SCALE_SCORES: tl.constexpr, qk_scale, MASKED: tl.constexpr,
    K_BITS: tl.constexpr, V_WIDEN: tl.constexpr, ASM: tl.constexpr,
):
    """The online softmax over keys [lo, hi) in tiles of BLOCK_N, keys as rows -> (m_i, l_i, acc_t).
    q_t (DIM_PAD, G_PAD); m_i, l_i (G_PAD,); acc_t (DIM_PAD, G_PAD) float32. MASKED: the tile's keys at or past
    kv_hi are hidden (a decode row sees every key before kv_hi); each masked tile holds a visible key (the caller
    walks only the one partial tile masked), so the running max is finite after it. SCALE_SCORES: multiply the
    scores by qk_scale (16/32-bit pools; fp16 math pre-scaled q). K_BITS / V_WIDEN: triton_attention._attend_keys'."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols
        k, v, k_valid = paged_kv_tile(k_cache_ptr, v_cache_ptr, block_row, kv_head, k_pos, kv_hi, stride_kb,
                                      stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, DIM_PAD,
                                      PAGE_SIZE, BLOCK_N, MASKED)
        k, v = widened_kv(k, v, q_t.dtype, K_BITS, V_WIDEN, ASM)
        scores = tl.dot(k, q_t, input_precision=PRECISION)  # (BLOCK_N, G_PAD) float32
        if K_BITS:
            scores = scores * bits_factor(tl.float16)
        if SCALE_SCORES:
            scores = scores * qk_scale
        if MASKED:
            scores = tl.where(k_valid[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.math.exp2(scores - m_new[None, :])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc_t


@jit
def _keys_major_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, context_lens_ptr, active_splits_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr,  # read when ROTARY_APPEND
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ps, stride_pt, stride_ph,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    FP16_MATH: tl.constexpr, ROTARY_APPEND: tl.constexpr, ROTATE: tl.constexpr, DYNAMIC_SPLITS: tl.constexpr,
    PDL: tl.constexpr, K_BITS: tl.constexpr = False, V_WIDEN: tl.constexpr = 0, ASM: tl.constexpr = False,
):
    """Program (0, seq, kv_head * NUM_SPLITS + split) (DYNAMIC_SPLITS: split-major, as the default kernel's) of a
    decode-only batch: sequence seq's one query row (token seq), the GROUP query heads of kv_head as the columns of
    q_t, keys [split's range) of its context. ROTARY_APPEND: q and the new k arrive unrotated (ROTATE: neox halves at
    positions_ptr[seq]); the split holding the new key's position writes its rotated K and its V to slot_ptr[seq]
    first (slot < 0: a graph's padding row, nothing written), as triton_attention's ROTARY_APPEND."""
    pdl_prologue(PDL)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    active_splits = NUM_SPLITS
    if DYNAMIC_SPLITS:
        num_kv_heads = tl.num_programs(2) // NUM_SPLITS
        kv_head = tl.program_id(2) % num_kv_heads
        split = tl.program_id(2) // num_kv_heads
        active_splits = tl.minimum(tl.load(active_splits_ptr), NUM_SPLITS)
        if split >= active_splits:
            return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - 1  # the new token's position

    cols = tl.arange(0, G_PAD)
    head = kv_head * GROUP + cols
    head_valid = cols < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = seq.to(tl.int64)
    q_cols = q_ptr + token * stride_qt + head[None, :] * stride_qh
    q_mask = dim_valid[:, None] & head_valid[None, :]
    q_t = tl.load(q_cols + dims[:, None], mask=q_mask, other=0.0)  # (DIM_PAD, G_PAD): the queries as columns
    if ROTARY_APPEND:
        HALF: tl.constexpr = HEAD_DIM // 2  # HEAD_DIM == DIM_PAD (the wrapper checks)
        first_half = dims < HALF
        partner = (dims + HALF) % HEAD_DIM
        if ROTATE:
            position = tl.load(positions_ptr + token).to(tl.int64)
            cos = tl.load(cos_sin_ptr + position * stride_cos + dims % HALF)
            sin = tl.load(cos_sin_ptr + position * stride_cos + HALF + dims % HALF)
            q_partner = tl.load(q_cols + partner[:, None], mask=q_mask, other=0.0)
            q_t = rotate_neox(q_t, q_partner, cos[:, None], sin[:, None], first_half[:, None])
    if FP16_MATH:  # as the default kernel: qk_scale carried into fp16, saturated, never inf
        q_t = tl.minimum(tl.maximum(q_t.to(tl.float32) * qk_scale, -65504.0), 65504.0).to(tl.float16)

    # This split's keys: one contiguous run of whole BLOCK_N tiles of [0, context_len); split 0 starts at key 0.
    tiles_per_split = tl.cdiv(tl.cdiv(context_len, BLOCK_N), active_splits)
    kv_lo = split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(context_len, kv_lo + tiles_per_split * BLOCK_N)
    if ROTARY_APPEND:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if (kv_lo <= prefix_len) & (prefix_len < kv_hi) & (slot >= 0):
            k_row = k_new_ptr + token * stride_knt + kv_head * stride_knh
            k_new = tl.load(k_row + dims)
            if ROTATE:
                k_new = rotate_neox(k_new, tl.load(k_row + partner), cos, sin, first_half)
            v_new = tl.load(v_new_ptr + token * stride_vnt + kv_head * stride_vnh + dims)
            tl.store(slot_row(k_cache_ptr, slot, stride_kb, stride_ks, PAGE_SIZE) + kv_head * stride_kh + dims,
                     cache_value(k_new, k_cache_ptr))
            tl.store(slot_row(v_cache_ptr, slot, stride_vb, stride_vs, PAGE_SIZE) + kv_head * stride_vh + dims,
                     cache_value(v_new, v_cache_ptr))
        tl.debug_barrier()  # this program's stores before its loads of that slot (no other program reads it)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc_t = tl.zeros([DIM_PAD, G_PAD], dtype=tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    whole_end = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N  # the whole tiles: no masks
    m_i, l_i, acc_t = _attend_keys_major(
        q_t, m_i, l_i, acc_t, k_cache_ptr, v_cache_ptr, block_row, kv_head, kv_lo, whole_end, kv_hi,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N,
        PRECISION, not FP16_MATH, qk_scale, False, K_BITS, V_WIDEN, ASM)
    m_i, l_i, acc_t = _attend_keys_major(
        q_t, m_i, l_i, acc_t, k_cache_ptr, v_cache_ptr, block_row, kv_head, whole_end, kv_hi, kv_hi,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, HEAD_DIM, DIM_PAD, PAGE_SIZE, BLOCK_N,
        PRECISION, not FP16_MATH, qk_scale, True, K_BITS, V_WIDEN, ASM)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a split that saw no key (past a short context)
    if V_WIDEN == 1:  # V_BY_BITS: acc_t is at 2^-8 of its value
        acc_t = acc_t * bits_factor(tl.float16)
    out_t = acc_t / l_safe[None, :]  # (DIM_PAD, G_PAD)
    out_mask = dim_valid[:, None] & head_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token * stride_ot + head[None, :] * stride_oh + dims[:, None],
                 out_t.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = split * stride_ps + token * stride_pt + head * stride_ph  # (G_PAD,)
        tl.store(part_out_ptr + part[None, :] + dims[:, None], out_t, mask=out_mask)
        tl.store(part_lse_ptr + part // DIM_PAD, lse, mask=head_valid)


def keys_major_decode_supported(group: int, *, plain_layer: bool) -> bool:
    """Whether a decode-only launch can take the keys-major kernel: a layer without window, soft-cap, sinks, ALiBi,
    chunks, q/k norms, L2 norm or temperature (``plain_layer``; ``new_kv`` only where the default kernel takes it
    too), and a group of at most 64 query heads."""
    return plain_layer and group <= 64


def keys_major_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      parts: tuple[torch.Tensor, torch.Tensor] | None, tables: torch.Tensor, lens: torch.Tensor,
                      active_splits: torch.Tensor | None, qk_scale: float, config: tuple, dim_pad: int,
                      widening: tuple[bool, int], new_kv: tuple | None, slots: torch.Tensor):
    """Decode-only attention by the keys-major kernel: into ``out`` (num_seqs, num_heads, head_dim) with one split,
    else into ``parts`` = (part_out (splits, num_seqs, num_heads, dim_pad), part_lse (splits, num_seqs, num_heads))
    float32 for triton_attention's merge. ``config``: the default decode config (BLOCK_M, BLOCK_N, warps, stages,
    splits[, TMA]) whose keys a tile, warps, stages and splits it takes (TMA ignored: pointer loads).
    ``qk_scale``: the softmax scale times log2(e). ``tables``, ``lens``, ``slots``: dense block tables, context
    lengths and slots (read at ptr + i); ``active_splits``: a decode graph's dynamic split count
    (meta.decode_splits) or None; ``widening``: an FP8 pool's (K_BITS, V_WIDEN) (triton_attention.fp8_widening);
    ``new_kv``: paged_attention_triton's (k, v, positions, cos_sin_cache or None), positions dense.
    Returns the launched compiled kernel (its registers and shared memory: the caller records its residency)."""
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    _, block_n, num_warps, num_stages, num_splits = config[:5]
    assert (parts is None) == (num_splits == 1)
    dynamic = num_splits > 1 and active_splits is not None
    part_out, part_lse = parts if parts is not None else (out, out)  # unused with one split
    ps, pt, ph = part_out.stride()[:3] if parts is not None else (0, 0, 0)
    if new_kv is not None:
        new_k, new_v, positions, cos_sin = new_kv
        rotate = cos_sin is not None
        assert head_dim == dim_pad, "new_kv: power-of-two heads (each dim's rotary partner unmasked)"
        cos_sin = q if cos_sin is None else cos_sin  # unread without a rotation
        positions = q if positions is None else positions
        new_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))
    else:
        new_k = new_v = positions = cos_sin = q  # unread
        new_strides = (0, 0, 0, 0)
        rotate = False
    k_bits, v_widen = widening
    return _keys_major_decode_kernel[(1, num_seqs, num_kv_heads * num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, tables, lens, active_splits if dynamic else lens,
        new_k, new_v, positions, cos_sin, slots,
        qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), tables.stride(0), ps, pt, ph, *new_strides, cos_sin.stride(0),
        GROUP=group, G_PAD=keys_major_columns(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad, PAGE_SIZE=page_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_MATH=k_cache.element_size() == 1 and q.dtype != torch.float32, ROTARY_APPEND=new_kv is not None,
        ROTATE=rotate, DYNAMIC_SPLITS=dynamic, K_BITS=k_bits, V_WIDEN=v_widen, ASM=q.is_cuda,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(q),
    )
