"""W4A16 for 17-256 rows (decode at serving concurrency) from the SAME operand-order words as the
1-16-row kernel (kernels/wna16_mma.py: int32 [N/16][K/64][32 lanes][4 slices], mma.m16n8k16's A
fragment order; meta int32 (groups, N_pad) = fp16 scale bits << 16 | zero). So an INT4 layer keeps
one copy of its codes for every batch, and 17-256 rows need not dequantize the whole weight into
kernels/wna16_mma_dense.py's scratch first (that writes and re-reads N * K * 2 bytes whatever M).

Per program: WARPS warps x TN 16-row weight tiles (block_n = 16 * WARPS * TN rows of out.T) against
one 32-row block of x (four n8 blocks, NB = 4), over a range of K chunks (split-K as in wna16_mma).
Per 16-column slice each thread turns its word into the four A registers and subtracts the zero in
the MMA's own type (``(OFF + q) - (OFF + z)`` = q - z exactly, one SUB a pair; so no sum_x MMA as
in the decode kernel), then issues the four n8 blocks' MMAs: the dequantization is shared by 32
rows of x and each x fragment by TN weight tiles. Per chunk (one group, or 128 columns per
channel) the float32 sums fold into the totals as total += s * acc.

x side: ``fragment_order(x)`` copies x (M, K) so that, within each 64-column k block, lane c's
eight pairs (slices j = 0..3, halves f = 0..1: columns 16j + 8f + 2c + {0, 1}) are 32 contiguous
bytes: a thread reads its block's B fragments with two 16-byte loads instead of eight 4-byte
gathers (eight 128-byte lines a warp each).

Correctness rests on the same Triton layout facts as kernels/wna16_mma.py (every tensor the PTX
sees is 1-D with element t * S + s on lane s % 32 of warp s // 32; (S, 4) int32 loads give each
thread its 16 contiguous bytes). ``EMULATE`` (Triton's CPU interpreter) replaces the two PTX pieces
by plain Triton ops that gather the warp's fragments into 16 x 16 / 16 x 8 matrices by the PTX ISA
fragment table, so the CPU tests run everything else of the kernel (addresses, x order, zeros,
scales, folds, stores, split-K) against the reference; the PTX text itself is checked by compiling
for sm_90 ahead of time and on the GPU.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import _arrival_counters
from kernels.wna16_mma import KB_COLUMNS, _pick, _spread, _split_sum, _store_sums, split_plan

NB = 4  # n8 blocks of x a program multiplies: 32 rows
ROWS_PER_BLOCK = 8 * NB
MAX_ROWS = 256  # the dispatch's bound (kernels/wna16.py); the kernel itself takes any M


def fragment_order(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) 16-bit, K % 64 == 0 -> int32 pairs (M, K / 2): in each 64-column block, pair
    8c + 2j + f = columns 16j + 8f + 2c + {0, 1} (lane c's B fragments of slices j, halves f)."""
    m, k = x.shape
    order = x.reshape(m, k // KB_COLUMNS, 4, 2, 4, 2).permute(0, 1, 4, 2, 3, 5)  # m, block, c, j, f, e
    return order.contiguous().view(m, k).view(torch.int32)


def _rows_asm(fp16: bool) -> str:
    """One weight word ($16), the (OFF + z) pairs of rows g ($17) and g + 8 ($18), four n8 blocks' x
    fragments ($19..$26: b0, b1 per block) and 16 sums in ($27..$42) -> 16 sums out ($0..$15, four
    per block: d0..d3)."""
    magic = "0x64006400" if fp16 else "0x43004300"
    kind = "f16.f16" if fp16 else "bf16.bf16"
    sub = "sub.rn.f16x2" if fp16 else "sub.rn.bf16x2"
    lines = ["{", ".reg .b32 a0, a1, a2, a3, t;", f"lop3.b32 a0, $16, 0x000f000f, {magic}, 0xea;"]
    for p in (1, 2, 3):
        lines += [f"shr.u32 t, $16, {4 * p};", f"lop3.b32 a{p}, t, 0x000f000f, {magic}, 0xea;"]
    # a0, a2: row g; a1, a3: row g + 8 (the A fragment's rows)
    lines += [f"{sub} a0, a0, $17;", f"{sub} a1, a1, $18;", f"{sub} a2, a2, $17;", f"{sub} a3, a3, $18;"]
    for b in range(NB):
        d = ", ".join(f"${4 * b + i}" for i in range(4))
        c = ", ".join(f"${27 + 4 * b + i}" for i in range(4))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32 "
                     f"{{{d}}}, {{a0, a1, a2, a3}}, {{${19 + 2 * b}, ${20 + 2 * b}}}, {{{c}}};")
    return "\n".join(lines + ["}"])


if tl is not None:
    _ROWS_BF16 = tl.constexpr(_rows_asm(False))
    _ROWS_F16 = tl.constexpr(_rows_asm(True))
    _C_ROWS = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 11 + ["f"] * 16))


@jit
def _halves(p, FP16: tl.constexpr):
    """EMULATE: int32 pairs of 16-bit floats -> (low, high) float32."""
    lo = p & 0xFFFF
    hi = (p >> 16) & 0xFFFF
    if FP16:
        lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (lo << 16).to(tl.float32, bitcast=True)
        hi = (hi << 16).to(tl.float32, bitcast=True)
    return lo, hi


@jit
def _emu_a(w, p: tl.constexpr, zz, FP16: tl.constexpr):
    """EMULATE the asm's register a_p: ((w >> 4p) & 0x000F000F | OFF pair) - (OFF + z) pair, as (low, high) float32."""
    magic = 0x64006400 if FP16 else 0x43004300
    q_lo, q_hi = _halves(((w >> (4 * p)) & 0x000F000F) | magic, FP16)
    z_lo, z_hi = _halves(zz, FP16)
    return q_lo - z_lo, q_hi - z_hi


@jit
def _emu_mma(a, b0, b1, c0, c1, c2, c3, FP16: tl.constexpr, E: tl.constexpr):
    """EMULATE mma.m16n8k16 per warp (32 consecutive elements): ``a`` (E, 2 e, 2 h, 2 f) float32 A values
    (register a_{h + 2f}, half e: row g + 8h, column 2c + 8f + e of lane 4g + c); b0, b1 int32 pairs
    (B rows 2c + e, 8 + 2c + e, column g); D lane 4g + c: d_{2h + e} = row g + 8h, column 2c + e."""
    G: tl.constexpr = E // 32
    A = tl.reshape(tl.permute(tl.reshape(a, (G, 8, 4, 2, 2, 2)), (0, 4, 1, 5, 2, 3)), (G, 16, 16))  # G, (h g), (f c e)
    b0l, b0h = _halves(b0, FP16)
    b1l, b1h = _halves(b1, FP16)
    b = tl.join(tl.join(b0l, b0h), tl.join(b1l, b1h))  # E, e, f
    B = tl.reshape(tl.permute(tl.reshape(b, (G, 8, 4, 2, 2)), (0, 4, 2, 3, 1)), (G, 16, 8))  # G, (f c e), g
    D = tl.sum(A[:, :, :, None] * B[:, None, :, :], axis=2)  # G, (h g), (c e)
    d = tl.reshape(tl.permute(tl.reshape(D, (G, 2, 8, 4, 2)), (0, 2, 3, 1, 4)), (E, 2, 2))  # E, h, e
    d_e0, d_e1 = tl.split(d)
    d0, d2 = tl.split(d_e0)
    d1, d3 = tl.split(d_e1)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@jit
def _emu_dequant(w, zz_lo, zz_hi, FP16: tl.constexpr):
    """EMULATE: the four A registers' values as one (E, 2 e, 2 h, 2 f) tensor (see _emu_mma)."""
    a0l, a0h = _emu_a(w, 0, zz_lo, FP16)
    a1l, a1h = _emu_a(w, 1, zz_hi, FP16)
    a2l, a2h = _emu_a(w, 2, zz_lo, FP16)
    a3l, a3h = _emu_a(w, 3, zz_hi, FP16)
    f0 = tl.join(tl.join(a0l, a0h), tl.join(a1l, a1h))  # E, e, h
    f1 = tl.join(tl.join(a2l, a2h), tl.join(a3l, a3h))
    return tl.join(f0, f1)  # E, e, h, f


@jit
def _rows_mma(w, zz_lo, zz_hi, x0, x1, x2, x3, x4, x5, x6, x7,
              c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
              FP16: tl.constexpr, EMULATE: tl.constexpr, E: tl.constexpr):
    """One word a thread (E,) -> its tile's A fragment (zero subtracted), times the four x blocks'
    fragments (x0, x1 block 0; ...): the 16 sums (block b: c(4b)..c(4b + 3)) plus the products."""
    if EMULATE:
        a = _emu_dequant(w, zz_lo, zz_hi, FP16)
        c0, c1, c2, c3 = _emu_mma(a, x0, x1, c0, c1, c2, c3, FP16, E)
        c4, c5, c6, c7 = _emu_mma(a, x2, x3, c4, c5, c6, c7, FP16, E)
        c8, c9, c10, c11 = _emu_mma(a, x4, x5, c8, c9, c10, c11, FP16, E)
        c12, c13, c14, c15 = _emu_mma(a, x6, x7, c12, c13, c14, c15, FP16, E)
        return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15
    else:
        f = tl.float32
        args = [w, zz_lo, zz_hi, x0, x1, x2, x3, x4, x5, x6, x7,
                c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15]
        if FP16:
            return tl.inline_asm_elementwise(_ROWS_F16, _C_ROWS, args, dtype=(f,) * 16, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_ROWS_BF16, _C_ROWS, args, dtype=(f,) * 16, is_pure=True, pack=1)


@jit
def _x_loads(xb0, xb1, xb2, xb3, ok0, ok1, ok2, ok3, kb):
    """The four x blocks' fragments of k block ``kb``: two 16-byte reads a thread and block, (S, 4) int32
    each (fragment_order: pairs (j, f) = 2j + f of the thread's 8), as (lo, hi) per block."""
    lo0 = tl.load(xb0 + kb * 32, mask=ok0, other=0)  # (S, 4): (j0 f0, j0 f1, j1 f0, j1 f1)
    hi0 = tl.load(xb0 + (kb * 32 + 4), mask=ok0, other=0)
    lo1 = tl.load(xb1 + kb * 32, mask=ok1, other=0)
    hi1 = tl.load(xb1 + (kb * 32 + 4), mask=ok1, other=0)
    lo2 = tl.load(xb2 + kb * 32, mask=ok2, other=0)
    hi2 = tl.load(xb2 + (kb * 32 + 4), mask=ok2, other=0)
    lo3 = tl.load(xb3 + kb * 32, mask=ok3, other=0)
    hi3 = tl.load(xb3 + (kb * 32 + 4), mask=ok3, other=0)
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3


@jit
def _x_block(lo, hi):
    """One x block's B fragments (S,) each: (b0, b1) of slices 0..3, from its two (S, 4) reads."""
    lo_f0, lo_f1 = tl.split(tl.reshape(lo, (lo.shape[0], 2, 2)))
    hi_f0, hi_f1 = tl.split(tl.reshape(hi, (hi.shape[0], 2, 2)))
    b0_0, b0_1 = tl.split(lo_f0)
    b1_0, b1_1 = tl.split(lo_f1)
    b0_2, b0_3 = tl.split(hi_f0)
    b1_2, b1_3 = tl.split(hi_f1)
    return b0_0, b1_0, b0_1, b1_1, b0_2, b1_2, b0_3, b1_3


@jit
def _pick2(j: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """Slice j's (b0, b1) of _x_block's eight."""
    if j == 0:
        return v0, v1
    elif j == 1:
        return v2, v3
    elif j == 2:
        return v4, v5
    else:
        return v6, v7


@jit
def _k_block(words, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, zz_lo, zz_hi,
             a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
             FP16: tl.constexpr, EMULATE: tl.constexpr, TN: tl.constexpr, S: tl.constexpr):
    """The four slices of one k block: ``words`` (E, 4) this thread's word per slice; lo0..hi3 the x
    blocks' fragments (_x_loads)."""
    E: tl.constexpr = TN * S
    u0, v0, u1, v1, u2, v2, u3, v3 = _x_block(lo0, hi0)
    p0, q0, p1, q1, p2, q2, p3, q3 = _x_block(lo1, hi1)
    r0, s0, r1, s1, r2, s2, r3, s3 = _x_block(lo2, hi2)
    y0, z0, y1, z1, y2, z2, y3, z3 = _x_block(lo3, hi3)
    wa, wb = tl.split(tl.reshape(words, (E, 2, 2)))
    w0, w2 = tl.split(wa)
    w1, w3 = tl.split(wb)
    for j in tl.static_range(4):
        b00, b01 = _pick2(j, u0, v0, u1, v1, u2, v2, u3, v3)
        b10, b11 = _pick2(j, p0, q0, p1, q1, p2, q2, p3, q3)
        b20, b21 = _pick2(j, r0, s0, r1, s1, r2, s2, r3, s3)
        b30, b31 = _pick2(j, y0, z0, y1, z1, y2, z2, y3, z3)
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _rows_mma(
            _pick(j, w0, w1, w2, w3), zz_lo, zz_hi,
            _spread(b00, TN, S), _spread(b01, TN, S), _spread(b10, TN, S), _spread(b11, TN, S),
            _spread(b20, TN, S), _spread(b21, TN, S), _spread(b30, TN, S), _spread(b31, TN, S),
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, FP16, EMULATE, E)
    return a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15


@jit
def _scaled(t, a, s):
    return t + s * a


@jit
def _store_block(t0, t1, t2, t3, n_lo, n_hi, m, M, N, out_ptr, part_ptr, bias_ptr, stride_om,
                 SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr):
    """One n8 block's totals (d0: row n_lo, x row m; d1: n_lo, m + 1; d2: n_hi, m; d3: n_hi, m + 1)."""
    _store_sums(t0, n_lo, m, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, FINAL)
    _store_sums(t1, n_lo, m + 1, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, FINAL)
    _store_sums(t2, n_hi, m, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, FINAL)
    _store_sums(t3, n_hi, m + 1, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS, FINAL)


@jit(do_not_specialize=["M", "M_BLOCKS"])
def _mma_rows_kernel(
    xp_ptr, w_ptr, meta_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, N_PAD, BLOCKS, CHUNKS_PER_SPLIT, M_BLOCKS, stride_om,
    HAS_BIAS: tl.constexpr, TN: tl.constexpr, WARPS: tl.constexpr, CHUNK_KB: tl.constexpr, SPLIT_K: tl.constexpr,
    FP16: tl.constexpr, PER_CHANNEL: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, split), i = weight block * M_BLOCKS + x block (x blocks of one weight block run
    side by side, so its words are read from HBM about once): out.T rows [weight block * 16 * WARPS * TN,
    +16 * WARPS * TN) x out rows [x block * 32, +32), over chunks [split * CHUNKS_PER_SPLIT, +CHUNKS_PER_SPLIT).
    xp_ptr: fragment_order(x) (BLOCKS * 32 pairs a row). Element layout as kernels/wna16_mma's kernel."""
    S: tl.constexpr = WARPS * 32
    E: tl.constexpr = TN * S
    MAGIC: tl.constexpr = 0x64006400 if FP16 else 0x43004300
    pid = tl.program_id(0)
    m0 = (pid % M_BLOCKS) * 32
    e = tl.arange(0, E)
    s_idx = e % S
    lane = s_idx % 32
    tile = (pid // M_BLOCKS) * (WARPS * TN) + (e // S) * WARPS + s_idx // 32
    n_lo = tile * 16 + lane // 4
    n_hi = n_lo + 8
    w_base = w_ptr + (tile.to(tl.int64) * (BLOCKS * 128) + lane * 4)[:, None] + tl.arange(0, 4)[None, :]  # (E, 4)
    lane_s = tl.arange(0, S) % 32
    row0 = m0 + lane_s // 4  # x rows of block b: row0 + 8b
    x_base = xp_ptr + ((lane_s % 4) * 8)[:, None] + tl.arange(0, 4)[None, :]  # (S, 4)
    xb0 = x_base + (row0.to(tl.int64) * (BLOCKS * 32))[:, None]
    xb1 = x_base + ((row0 + 8).to(tl.int64) * (BLOCKS * 32))[:, None]
    xb2 = x_base + ((row0 + 16).to(tl.int64) * (BLOCKS * 32))[:, None]
    xb3 = x_base + ((row0 + 24).to(tl.int64) * (BLOCKS * 32))[:, None]
    ok0 = (row0 < M)[:, None]
    ok1 = (row0 + 8 < M)[:, None]
    ok2 = (row0 + 16 < M)[:, None]
    ok3 = (row0 + 24 < M)[:, None]
    m_out = m0 + 2 * (lane % 4)  # d0 / d2's x row within block 0 (E,)
    chunk_begin = tl.program_id(1) * CHUNKS_PER_SPLIT
    chunk_end = tl.minimum(chunk_begin + CHUNKS_PER_SPLIT, BLOCKS // CHUNK_KB)
    zero = tl.zeros([E], dtype=tl.float32)
    t0, t1, t2, t3, t4, t5, t6, t7 = zero, zero, zero, zero, zero, zero, zero, zero
    t8, t9, t10, t11, t12, t13, t14, t15 = zero, zero, zero, zero, zero, zero, zero, zero
    last_kb = chunk_end * CHUNK_KB - 1
    pdl_prologue(PDL)
    words_a = tl.load(w_base + chunk_begin * (CHUNK_KB * 128))  # the chunk's first k block, (E, 4)
    grp = 0 if PER_CHANNEL else chunk_begin  # a chunk is one group, or 128 columns of the one group
    meta_lo_a = tl.load(meta_ptr + grp * N_PAD + n_lo)
    meta_hi_a = tl.load(meta_ptr + grp * N_PAD + n_hi)
    # PREFETCH 2: the next k block's words and x fragments are read before this one is multiplied
    # (x_a*: the split's first k block's here, then each k block's successor; the last re-reads itself)
    if PREFETCH == 2:
        xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _x_loads(xb0, xb1, xb2, xb3, ok0, ok1, ok2, ok3,
                                                          chunk_begin * CHUNK_KB)
    for chunk in range(chunk_begin, chunk_end):
        if PREFETCH:
            meta_lo = meta_lo_a
            meta_hi = meta_hi_a
        else:
            grp = 0 if PER_CHANNEL else chunk
            meta_lo = tl.load(meta_ptr + grp * N_PAD + n_lo)
            meta_hi = tl.load(meta_ptr + grp * N_PAD + n_hi)
        zz_lo = MAGIC | (meta_lo & 0xFF) | ((meta_lo & 0xFF) << 16)  # (OFF + z) in both halves
        zz_hi = MAGIC | (meta_hi & 0xFF) | ((meta_hi & 0xFF) << 16)
        kb0 = chunk * CHUNK_KB
        if PREFETCH:  # the next chunk's meta (PREFETCH 1: and first words), read before this chunk's MMAs
            following = tl.minimum(chunk + 1, chunk_end - 1)  # (the last re-reads itself)
            if PREFETCH == 1:
                next_a = tl.load(w_base + following * (CHUNK_KB * 128))
            grp_next = 0 if PER_CHANNEL else following
            next_lo = tl.load(meta_ptr + grp_next * N_PAD + n_lo)
            next_hi = tl.load(meta_ptr + grp_next * N_PAD + n_hi)
        a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
        a8, a9, a10, a11, a12, a13, a14, a15 = zero, zero, zero, zero, zero, zero, zero, zero
        for kk in tl.static_range(CHUNK_KB):
            if PREFETCH == 2:  # this k block's words and x from the step before; its successor's read now
                words = words_a
                x0, x1, x2, x3, x4, x5, x6, x7 = xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7
                successor = tl.minimum(kb0 + kk + 1, last_kb)
                words_a = tl.load(w_base + successor * 128)
                xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _x_loads(xb0, xb1, xb2, xb3, ok0, ok1, ok2, ok3, successor)
            else:
                if kk == 0 and PREFETCH == 1:
                    words = words_a
                else:
                    words = tl.load(w_base + (kb0 + kk) * 128)
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_loads(xb0, xb1, xb2, xb3, ok0, ok1, ok2, ok3, kb0 + kk)
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _k_block(
                words, x0, x1, x2, x3, x4, x5, x6, x7, zz_lo, zz_hi,
                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, FP16, EMULATE, TN, S)
        s_lo = (meta_lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s_hi = (meta_hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        t0, t1, t2, t3 = _scaled(t0, a0, s_lo), _scaled(t1, a1, s_lo), _scaled(t2, a2, s_hi), _scaled(t3, a3, s_hi)
        t4, t5, t6, t7 = _scaled(t4, a4, s_lo), _scaled(t5, a5, s_lo), _scaled(t6, a6, s_hi), _scaled(t7, a7, s_hi)
        t8, t9 = _scaled(t8, a8, s_lo), _scaled(t9, a9, s_lo)
        t10, t11 = _scaled(t10, a10, s_hi), _scaled(t11, a11, s_hi)
        t12, t13 = _scaled(t12, a12, s_lo), _scaled(t13, a13, s_lo)
        t14, t15 = _scaled(t14, a14, s_hi), _scaled(t15, a15, s_hi)
        if PREFETCH:
            if PREFETCH == 1:
                words_a = next_a
            meta_lo_a = next_lo
            meta_hi_a = next_hi
    final = SPLIT_K == 1
    _store_block(t0, t1, t2, t3, n_lo, n_hi, m_out, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K, HAS_BIAS,
                 final)
    _store_block(t4, t5, t6, t7, n_lo, n_hi, m_out + 8, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K,
                 HAS_BIAS, final)
    _store_block(t8, t9, t10, t11, n_lo, n_hi, m_out + 16, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K,
                 HAS_BIAS, final)
    _store_block(t12, t13, t14, t15, n_lo, n_hi, m_out + 24, M, N, out_ptr, part_ptr, bias_ptr, stride_om, SPLIT_K,
                 HAS_BIAS, final)
    if SPLIT_K > 1:
        # kernels/wna16_layout.finish_tile's scheme (as wna16_mma): sums stored, then the count; the
        # last program to arrive adds the splits in split order.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for q in tl.static_range(8):  # 2 * NB: x rows m_out + 8 (q // 2) + q % 2 (NB is no constexpr here)
                m = m_out + 8 * (q // 2) + (q % 2)
                _store_sums(_split_sum(n_lo, m, M, N, part_ptr, SPLIT_K), n_lo, m, M, N, out_ptr, part_ptr, bias_ptr,
                            stride_om, SPLIT_K, HAS_BIAS, True)
                _store_sums(_split_sum(n_hi, m, M, N, part_ptr, SPLIT_K), n_hi, m, M, N, out_ptr, part_ptr, bias_ptr,
                            stride_om, SPLIT_K, HAS_BIAS, True)
            tl.store(arrivals_ptr + pid, 0)


def mma_rows_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], n: int, group_size: int,
                    bias: torch.Tensor | None = None, *, tiles: int = 1, num_warps: int = 4, split_k: int = 1,
                    prefetch: int = 1, emulate: bool | None = None) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ the weight (N, K) in the operand-order ``layout``.T (+ bias) -> (M, N) in x's
    dtype, any M (meant for 17-256). Programs of ``num_warps`` warps x ``tiles`` 16-row weight tiles
    x 32 rows of x, K split over ``split_k`` programs (capped at the chunks there are). ``prefetch``: 0
    every k block's words and x read where multiplied; 1 the next chunk's first words and scales read
    before this chunk's MMAs; 2 also each next k block's words and x fragments (one k block ahead:
    the loads' latency hides behind a block's MMAs, for 32 + 4 * tiles more registers). ``emulate``
    (default: x on the CPU, i.e. TRITON_INTERPRET=1): the PTX replaced by its plain-Triton emulation."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xp = fragment_order(x)
    bias, = dense(bias)  # read at bias_ptr + feature (the layout's tensors are packed at load)
    n_pad = layout["meta"].shape[1]
    blocks, chunk_kb, per_split, split_k = split_plan(layout, k, group_size, split_k)
    assert blocks * KB_COLUMNS == k
    block_n = num_warps * tiles * 16
    assert n_pad % block_n == 0
    m_blocks = triton.cdiv(m, ROWS_PER_BLOCK)
    programs = n_pad // block_n * m_blocks
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    arrivals = _arrival_counters(x.device, programs) if split_k > 1 else out
    _mma_rows_kernel[(programs, split_k)](
        xp, layout["words"], layout["meta"], bias if bias is not None else out, out, part, arrivals,
        m, n, n_pad, blocks, per_split, m_blocks, out.stride(0),
        HAS_BIAS=bias is not None, TN=tiles, WARPS=num_warps, CHUNK_KB=chunk_kb, SPLIT_K=split_k,
        FP16=x.dtype == torch.float16, PER_CHANNEL=group_size == k, PREFETCH=int(prefetch),
        EMULATE=(not x.is_cuda) if emulate is None else emulate, num_warps=num_warps, num_stages=1,
        **pdl_options(x))
    return out
