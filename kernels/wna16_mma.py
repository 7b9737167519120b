"""A W4A16 decode kernel (1-16 rows) with the weights stored in the tensor cores' operand order
(Marlin's idea, in Triton): every thread loads, with one 16-byte read, words that already hold
the codes its ``mma.m16n8k16`` A fragments need, turns them into bf16/fp16 pairs with one shift
and one LOP3 per two weights, and issues the MMA itself (inline PTX). No layout change, no
per-weight float arithmetic: about one instruction a weight, against 5-7 for kernels/wna16_decode.py.

Product: out (M, N) = x (M, K) @ W.T with W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // G.
The MMA computes W'.T x.T tiles (weights as the 16x16 A operand, rows of x as the n8 B operand;
``NB`` n8 blocks cover M <= 8 * NB), with W' = OFF + q exactly (q OR-ed into the mantissa of
OFF: 128 in bfloat16, 0x4300; 1024 in float16, 0x6400). A second MMA per slice with an all-ones A
gives sum_x per row of x, and per chunk of K (one group, or 128 columns per channel) the float32
sums fold as  s * (acc - (OFF + z) * sum_x),  exactly the factored form of kernels/wna16_decode.py.

Layout (``pack_mma_layout``; N padded to PAD_ROWS, K to PAD_COLUMNS with zero codes):
- ``words`` int32 [N / 16][K / 64][32 lanes][4 slices]: for row tile t (16 rows), k block b (64
  columns), lane L (g = L // 4, c = L % 4) and slice j (16 columns), the word holds in nibble
  h + 2f + 4e the code of row 16t + g + 8h, column 64b + 16j + 8f + 2c + e. So (word >> 4p) &
  0x000F000F is the pair (e = 0 low half, e = 1 high) of fragment register a_p (p = h + 2f: a0 rows
  g / cols 2c.., a1 rows g + 8, a2 cols 2c + 8.., a3 both), and one lane's four slices are 16
  contiguous bytes; a warp's 512.
- ``meta`` int32 (K / G, N_pad): float16 scale bits << 16 | zero.

Correctness rests on Triton giving element s of the kernels' (.., S) tensors (S = 32 * warps) to
lane s % 32 of warp s // 32 (its default blocked layout for these shapes; the GPU tests check the
result against the reference). Triton's CPU interpreter cannot run the PTX: ``mma_layout_reference``
replays the lanes' fragments in torch, the CPU tests' check of the layout.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import _arrival_counters

PAD_ROWS = 256  # the largest BLOCK_N (warps * tiles * 16) divides the padded N
KB_COLUMNS = 64  # columns of one k block (four 16-column slices)
PAD_COLUMNS = 128  # K padded to whole 128-column chunks (the per-channel chunk)


def supports(in_features: int, group_size: int, bits: int, dtype: torch.dtype) -> bool:
    """4-bit codes, 16-bit activations, whole 128-column chunks (x is read unmasked along K), groups of
    whole k blocks (or one group a row)."""
    return (bits == 4 and dtype in (torch.bfloat16, torch.float16) and in_features % PAD_COLUMNS == 0
            and (group_size == in_features or group_size % KB_COLUMNS == 0))


def chunk_blocks(in_features: int, group_size: int) -> int:
    """k blocks a chunk (scale applied once per chunk and row): one group, or 2 per channel."""
    return 2 if group_size == in_features else group_size // KB_COLUMNS


def split_plan(layout: dict[str, torch.Tensor], k: int, group_size: int, split_k: int) -> tuple[int, int, int, int]:
    """(k blocks, k blocks a chunk, chunks a split, splits) of a product over ``layout``'s K: ``split_k``
    capped at the chunks there are, and trimmed so that no split is empty."""
    blocks = layout["words"].numel() // (layout["meta"].shape[1] // 16) // 128
    chunk_kb = chunk_blocks(k, group_size)
    chunks = blocks // chunk_kb
    split_k = max(1, min(split_k, chunks))
    per_split = triton.cdiv(chunks, split_k)
    return blocks, chunk_kb, per_split, triton.cdiv(chunks, per_split)


def pack_mma_layout(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """codes (N, K) uint8 in [0, 16), scale/zero (N, K // G) -> {"words", "meta"} (module docstring)."""
    n, k = codes.shape
    n_pad, k_pad = triton.cdiv(n, PAD_ROWS) * PAD_ROWS, triton.cdiv(k, PAD_COLUMNS) * PAD_COLUMNS
    padded = torch.zeros(n_pad, k_pad, dtype=torch.uint8, device=codes.device)
    padded[:n, :k] = codes
    tiles, blocks = n_pad // 16, k_pad // KB_COLUMNS
    words = torch.empty(tiles, blocks, 32, 4, dtype=torch.int32, device=codes.device)
    # nibble index e * 4 + f * 2 + h after the permute below
    shifts = (4 * torch.arange(8, device=codes.device, dtype=torch.int64)).view(1, 1, 1, 1, 1, 8)
    step = max(1, 4096 // 16)
    for start in range(0, tiles, step):
        c = padded[start * 16:(start + step) * 16].view(-1, 2, 8, blocks, 4, 2, 4, 2)  # t h g b j f c e
        c = c.permute(0, 3, 2, 6, 4, 7, 5, 1).reshape(-1, blocks, 8, 4, 4, 8).long()  # t b g c j (e f h)
        packed = (c << shifts).sum(dim=-1)  # t b g c j, in [0, 2^32)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
        words[start:start + step] = packed.reshape(-1, blocks, 32, 4).to(torch.int32)
    groups = scale.shape[1]
    meta = torch.zeros(groups, n_pad, dtype=torch.int64, device=codes.device)
    bits16 = scale.t().to(torch.float16).contiguous().view(torch.int16).long() & 0xFFFF
    meta[:, :n] = (bits16 << 16) | zero.t().long()
    meta = torch.where(meta >= 1 << 31, meta - (1 << 32), meta).to(torch.int32)
    return {"words": words.view(-1), "meta": meta.contiguous()}


def mma_layout_reference(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, k: int,
                         group_size: int) -> torch.Tensor:
    """The product the kernel computes, from ``layout`` alone, in float32: x (M, K) @ mma_layout_weight.T."""
    return x.float() @ mma_layout_weight(layout, n, k, group_size).t()


def mma_layout_weight(layout: dict[str, torch.Tensor], n: int, k: int, group_size: int) -> torch.Tensor:
    """The weight (N, K) float32 that ``layout`` holds, (q - z) * s: each lane's word decoded as the
    kernel's LOP3s do (pair p: nibble p low half, nibble p + 4 high half) and placed where
    mma.m16n8k16's A fragment puts register a_p of lane L (PTX ISA: rows L // 4 + 8 (p % 2), columns
    2 (L % 4) + 8 (p // 2) + {0, 1}). Independent of ``pack_mma_layout``'s permutation: the CPU tests'
    check of the layout against the dequantized weight, and kernels/wna16_mma_dense.py's reference."""
    n_pad = layout["meta"].shape[1]
    words = (layout["words"].long() & 0xFFFFFFFF).view(n_pad // 16, -1, 32, 4)  # tile, block, lane, slice
    tiles, blocks = words.shape[:2]
    lane = torch.arange(32, device=words.device)
    g, c = lane // 4, lane % 4
    a = torch.zeros(tiles, blocks, 4, 16, 16, dtype=torch.long, device=words.device)  # tile, block, slice, row, column
    for p in range(4):
        for e in range(2):
            nibble = (words >> (4 * p + 16 * e)) & 0xF  # tile, block, lane, slice
            a[:, :, :, g + 8 * (p % 2), 2 * c + 8 * (p // 2) + e] = nibble.permute(0, 1, 3, 2)
    codes = a.permute(0, 3, 1, 2, 4).reshape(n_pad, blocks * KB_COLUMNS)
    meta = layout["meta"].long()
    scale = ((meta >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()  # (groups, n_pad)
    zero = (meta & 0xFF).float()
    group = torch.clamp(torch.arange(blocks * KB_COLUMNS, device=words.device) // group_size, max=scale.shape[0] - 1)
    weight = (codes.float() - zero[group].t()) * scale[group].t()
    return weight[:n, :k].contiguous()


def _mma_asm(nb: int, fp16: bool) -> str:
    """One weight word ($W) and NB n8 blocks of x fragments -> 4 * NB float32 sums: the four A
    registers by shift + LOP3 ((w >> 4p) & 0x000F000F | magic pair), then one MMA per block.
    Operands: outputs $0 .. $(4NB - 1); then $W; then b0, b1 per block; then the 4 * NB sums in."""
    magic = "0x64006400" if fp16 else "0x43004300"
    kind = "f16.f16" if fp16 else "bf16.bf16"
    w = 4 * nb
    lines = ["{", ".reg .b32 a0, a1, a2, a3, t;", f"lop3.b32 a0, ${w}, 0x000f000f, {magic}, 0xea;"]
    for p in (1, 2, 3):
        lines += [f"shr.u32 t, ${w}, {4 * p};", f"lop3.b32 a{p}, t, 0x000f000f, {magic}, 0xea;"]
    for b in range(nb):
        d = ", ".join(f"${4 * b + i}" for i in range(4))
        bb = f"${w + 1 + 2 * b}, ${w + 2 + 2 * b}"
        c = ", ".join(f"${w + 1 + 2 * nb + 4 * b + i}" for i in range(4))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32 "
                     f"{{{d}}}, {{a0, a1, a2, a3}}, {{{bb}}}, {{{c}}};")
    return "\n".join(lines + ["}"])


def _ones_asm(fp16: bool) -> str:
    """x fragments (b0 $4, b1 $5) and 4 sums in ($6..$9) -> the sums + ones(16x16) @ the block: per
    lane, sum_x of rows 2c and 2c + 1 of the block (twice)."""
    one = "0x3c003c00" if fp16 else "0x3f803f80"
    kind = "f16.f16" if fp16 else "bf16.bf16"
    return "\n".join(["{", ".reg .b32 a;", f"mov.b32 a, {one};",
                      f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32 {{$0, $1, $2, $3}}, {{a, a, a, a}}, "
                      "{$4, $5}, {$6, $7, $8, $9};", "}"])


if tl is not None:  # Triton reads module globals that are constexprs
    _MMA1_BF16 = tl.constexpr(_mma_asm(1, False))
    _MMA2_BF16 = tl.constexpr(_mma_asm(2, False))
    _MMA1_F16 = tl.constexpr(_mma_asm(1, True))
    _MMA2_F16 = tl.constexpr(_mma_asm(2, True))
    _ONES_BF16 = tl.constexpr(_ones_asm(False))
    _ONES_F16 = tl.constexpr(_ones_asm(True))
    _C1 = tl.constexpr("=f,=f,=f,=f,r,r,r,f,f,f,f")
    _C2 = tl.constexpr("=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,f,f,f,f,f,f,f,f")
    _C_ONES = tl.constexpr("=f,=f,=f,=f,r,r,f,f,f,f")


@jit
def _tile_mma1(w, b0, b1, c0, c1, c2, c3, FP16: tl.constexpr):
    f = tl.float32
    if FP16:
        return tl.inline_asm_elementwise(_MMA1_F16, _C1, [w, b0, b1, c0, c1, c2, c3], dtype=(f, f, f, f),
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_MMA1_BF16, _C1, [w, b0, b1, c0, c1, c2, c3], dtype=(f, f, f, f),
                                         is_pure=True, pack=1)


@jit
def _tile_mma2(w, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, c6, c7, FP16: tl.constexpr):
    f = tl.float32
    args = [w, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, c6, c7]
    if FP16:
        return tl.inline_asm_elementwise(_MMA2_F16, _C2, args, dtype=(f, f, f, f, f, f, f, f), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_MMA2_BF16, _C2, args, dtype=(f, f, f, f, f, f, f, f), is_pure=True, pack=1)


@jit
def _ones_mma(b0, b1, o0, o1, FP16: tl.constexpr):
    """(o0, o1) + sum over the slice of x rows 2c, 2c + 1 of the block (the MMA's d0, d1)."""
    f = tl.float32
    if FP16:
        r = tl.inline_asm_elementwise(_ONES_F16, _C_ONES, [b0, b1, o0, o1, o0, o1], dtype=(f, f, f, f),
                                      is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise(_ONES_BF16, _C_ONES, [b0, b1, o0, o1, o0, o1], dtype=(f, f, f, f),
                                      is_pure=True, pack=1)
    return r[0], r[1]


@jit
def _x_pairs(x_row, ok, k2):
    """x fragments of one slice, (S,): b0 = x[row, k:k+2], b1 = x[row, k+8:k+10] as int32 pairs, where
    ``x_row`` points at this lane's pair of its row (c) and ``k2`` = k // 2 of the slice's column 0."""
    b0 = tl.load(x_row + k2, mask=ok, other=0)
    b1 = tl.load(x_row + (k2 + 4), mask=ok, other=0)
    return b0, b1


@jit
def _spread(v, TN: tl.constexpr, S: tl.constexpr):
    """(S,) -> (TN * S,): the thread's value for each of its row tiles."""
    return tl.reshape(tl.broadcast_to(v[None, :], (TN, S)), (TN * S,))


@jit
def _fold(total, acc, o, s, bz):
    return total + s * acc - bz * o


@jit
def _store_sums(v, n, m, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                FINAL: tl.constexpr):
    """One fragment register's sums (E,) for output rows ``m``, columns ``n``: to part (this split's
    slice) or, FINAL, to out (+ bias)."""
    mask = (m < M) & (n < N)
    if FINAL:
        if HAS_BIAS:
            v += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + n, v.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (tl.program_id(1) * M + m) * N + n, v, mask=mask)


@jit
def _split_sum(n, m, M, N, part_ptr, SPLIT_K: tl.constexpr):
    mask = (m < M) & (n < N)
    v = tl.zeros(n.shape, dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # in split order: the result does not depend on arrival order
        v += tl.load(part_ptr + (split * M + m) * N + n, mask=mask, other=0.0, cache_modifier=".cg")
    return v


@jit
def _pick(j: tl.constexpr, w0, w1, w2, w3):
    if j == 0:
        return w0
    elif j == 1:
        return w1
    elif j == 2:
        return w2
    else:
        return w3


@jit
def _slice(w, k2, x_lo, x_hi, ok_lo, ok_hi, a0, a1, a2, a3, a4, a5, a6, a7, o0, o1, o2, o3, NB: tl.constexpr,
           FP16: tl.constexpr, TN: tl.constexpr, S: tl.constexpr):
    """One 16-column slice (column 2 * k2 on) of this lane's fragments: the MMAs of every row tile and block."""
    b0, b1 = _x_pairs(x_lo, ok_lo, k2)
    o0, o1 = _ones_mma(b0, b1, o0, o1, FP16)
    if NB == 1:
        a0, a1, a2, a3 = _tile_mma1(w, _spread(b0, TN, S), _spread(b1, TN, S), a0, a1, a2, a3, FP16)
    else:
        b2, b3 = _x_pairs(x_hi, ok_hi, k2)
        o2, o3 = _ones_mma(b2, b3, o2, o3, FP16)
        a0, a1, a2, a3, a4, a5, a6, a7 = _tile_mma2(w, _spread(b0, TN, S), _spread(b1, TN, S), _spread(b2, TN, S),
                                                    _spread(b3, TN, S), a0, a1, a2, a3, a4, a5, a6, a7, FP16)
    return a0, a1, a2, a3, a4, a5, a6, a7, o0, o1, o2, o3


@jit(do_not_specialize=["M"])
def _mma_decode_kernel(
    xi_ptr, w_ptr, meta_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, N_PAD, GROUP, BLOCKS, CHUNKS_PER_SPLIT, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr, NB: tl.constexpr, CHUNK_KB: tl.constexpr,
    SPLIT_K: tl.constexpr, FP16: tl.constexpr, PER_CHANNEL: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, split): rows [i * WARPS * TN * 16, +WARPS * TN * 16) of out.T over chunks
    [split * CHUNKS_PER_SPLIT, +CHUNKS_PER_SPLIT) of K. xi_ptr: x as int32 pairs (stride_xm in pairs).
    Every tensor the PTX sees is 1-D of E = TN * S elements (S = 32 * WARPS), element e = t * S + s
    for row tile t of the program and thread s: with one element a thread per S, Triton's layout
    puts e on lane s % 32 of warp s // 32 (1-D tensors leave it no other choice without vector
    loads, and none of these loads has a mask or pointer pattern that vectorizes)."""
    S: tl.constexpr = WARPS * 32
    E: tl.constexpr = TN * S
    OFF: tl.constexpr = 1024.0 if FP16 else 128.0
    e = tl.arange(0, E)
    s_idx = e % S
    lane = s_idx % 32
    g = lane // 4
    c2 = 2 * (lane % 4)
    tile = tl.program_id(0) * (WARPS * TN) + (e // S) * WARPS + s_idx // 32
    n_lo = tile * 16 + g
    n_hi = n_lo + 8
    w_base = w_ptr + (tile.to(tl.int64) * (BLOCKS * 128) + lane * 4)[:, None] + tl.arange(0, 4)[None, :]  # (E, 4)
    lane_s = tl.arange(0, S) % 32  # the x side: (S,) tensors, spread over the row tiles where multiplied
    g_s = lane_s // 4
    x_lo = xi_ptr + g_s * stride_xm + lane_s % 4  # rows g (block 0) and g + 8 (block 1), pair c
    x_hi = x_lo + 8 * stride_xm
    ok_lo = g_s < M
    ok_hi = g_s + 8 < M
    chunk_begin = tl.program_id(1) * CHUNKS_PER_SPLIT
    chunk_end = tl.minimum(chunk_begin + CHUNKS_PER_SPLIT, BLOCKS // CHUNK_KB)
    zero = tl.zeros([E], dtype=tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7 = zero, zero, zero, zero, zero, zero, zero, zero
    pdl_prologue(PDL)
    # The first two blocks of a chunk are read before its MMAs (two reads in flight); PREFETCH: those
    # of the next chunk are read before this chunk's MMAs too (the last chunk re-reads itself).
    words_a = tl.load(w_base + chunk_begin * (CHUNK_KB * 128))  # (E, 4): slices 0..3, one 16-byte read a thread
    words_b = tl.load(w_base + (chunk_begin * CHUNK_KB + (CHUNK_KB > 1)) * 128)
    for chunk in range(chunk_begin, chunk_end):
        a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
        o0 = tl.zeros([S], dtype=tl.float32)
        o1, o2, o3 = o0, o0, o0
        kb0 = chunk * CHUNK_KB
        if PREFETCH:
            following = tl.minimum(chunk + 1, chunk_end - 1) * CHUNK_KB
            next_a = tl.load(w_base + following * 128)
            next_b = tl.load(w_base + (following + (CHUNK_KB > 1)) * 128)
        else:
            if chunk > chunk_begin:
                words_a = tl.load(w_base + kb0 * 128)
                words_b = tl.load(w_base + (kb0 + (CHUNK_KB > 1)) * 128)
        for kk in tl.static_range(CHUNK_KB):
            kb = kb0 + kk
            if kk == 0:
                words = words_a
            elif kk == 1:
                words = words_b
            else:
                words = tl.load(w_base + kb * 128)
            wa, wb = tl.split(tl.reshape(words, (E, 2, 2)))
            w0, w2 = tl.split(wa)
            w1, w3 = tl.split(wb)
            for j in tl.static_range(4):
                a0, a1, a2, a3, a4, a5, a6, a7, o0, o1, o2, o3 = _slice(
                    _pick(j, w0, w1, w2, w3), kb * 32 + 8 * j, x_lo, x_hi, ok_lo, ok_hi, a0, a1, a2, a3, a4, a5, a6,
                    a7, o0, o1, o2, o3, NB, FP16, TN, S)
        grp = 0 if PER_CHANNEL else chunk  # a chunk is one group, or 128 columns of the one group
        meta_lo = tl.load(meta_ptr + grp * N_PAD + n_lo)
        meta_hi = tl.load(meta_ptr + grp * N_PAD + n_hi)
        s_lo = (meta_lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s_hi = (meta_hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        bz_lo = s_lo * (OFF + (meta_lo & 0xFF).to(tl.float32))
        bz_hi = s_hi * (OFF + (meta_hi & 0xFF).to(tl.float32))
        # fragment d0 (row g, col 2c), d1 (g, 2c + 1), d2 (g + 8, 2c), d3 (g + 8, 2c + 1) of each block
        o0, o1, o2, o3 = _spread(o0, TN, S), _spread(o1, TN, S), _spread(o2, TN, S), _spread(o3, TN, S)
        t0 = _fold(t0, a0, o0, s_lo, bz_lo)
        t1 = _fold(t1, a1, o1, s_lo, bz_lo)
        t2 = _fold(t2, a2, o0, s_hi, bz_hi)
        t3 = _fold(t3, a3, o1, s_hi, bz_hi)
        if NB == 2:
            t4 = _fold(t4, a4, o2, s_lo, bz_lo)
            t5 = _fold(t5, a5, o3, s_lo, bz_lo)
            t6 = _fold(t6, a6, o2, s_hi, bz_hi)
            t7 = _fold(t7, a7, o3, s_hi, bz_hi)
        if PREFETCH:
            words_a, words_b = next_a, next_b
    m0 = c2
    final = SPLIT_K == 1
    _store_sums(t0, n_lo, m0, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
    _store_sums(t1, n_lo, m0 + 1, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
    _store_sums(t2, n_hi, m0, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
    _store_sums(t3, n_hi, m0 + 1, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
    if NB == 2:
        _store_sums(t4, n_lo, m0 + 8, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
        _store_sums(t5, n_lo, m0 + 9, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
        _store_sums(t6, n_hi, m0 + 8, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
        _store_sums(t7, n_hi, m0 + 9, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, final)
    if SPLIT_K > 1:
        # kernels/wna16_layout.finish_tile's scheme: every thread's sums stored before the count goes
        # up; the last program to arrive (acquire) adds the splits in split order and stores out.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for q in tl.static_range(2 * NB):  # (d0, d2), (d1, d3) of each block: rows m0 + q % 2 + 8 (q // 2)
                m = m0 + (q % 2) + 8 * (q // 2)
                _store_sums(_split_sum(n_lo, m, M, N, part_ptr, SPLIT_K), n_lo, m, M, N, out_ptr, part_ptr, bias_ptr,
                            stride_om, SPLIT_K, HAS_BIAS, True)
                _store_sums(_split_sum(n_hi, m, M, N, part_ptr, SPLIT_K), n_hi, m, M, N, out_ptr, part_ptr, bias_ptr,
                            stride_om, SPLIT_K, HAS_BIAS, True)
            tl.store(arrivals_ptr + tl.program_id(0), 0)


def mma_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, group_size: int,
               bias: torch.Tensor | None = None, *, tiles: int = 2, num_warps: int = 4, split_k: int = 1,
               prefetch: bool = False) -> torch.Tensor:
    """x (M, K) bf16/fp16 with unit column stride, M <= 16, @ the weight (N, K) in ``layout``.T (+ bias)
    -> (M, N) in x's dtype. Programs of ``num_warps`` warps x ``tiles`` 16-row tiles each, K split
    over ``split_k`` programs (capped at the chunks there are); ``prefetch``: the next chunk's words
    read before this chunk's MMAs."""
    m, k = x.shape
    assert m <= 16 and x.stride(1) == 1 and k % 2 == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()
    xi = x.view(torch.int32)  # (M, K / 2) pairs
    bias, = dense(bias)  # read at bias_ptr + feature (the layout's tensors are packed at load)
    n_pad = layout["meta"].shape[1]
    blocks, chunk_kb, per_split, split_k = split_plan(layout, k, group_size, split_k)
    block_n = num_warps * tiles * 16
    assert n_pad % block_n == 0
    programs = n_pad // block_n
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    arrivals = _arrival_counters(x.device, programs) if split_k > 1 else out
    _mma_decode_kernel[(programs, split_k)](
        xi, layout["words"], layout["meta"], bias if bias is not None else out, out, part, arrivals,
        m, n, k, n_pad, group_size, blocks, per_split, xi.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, TN=tiles, WARPS=num_warps, NB=1 if m <= 8 else 2, CHUNK_KB=chunk_kb,
        SPLIT_K=split_k, FP16=x.dtype == torch.float16, PER_CHANNEL=group_size == k, PREFETCH=prefetch,
        num_warps=num_warps, num_stages=1, **pdl_options(x))
    return out
