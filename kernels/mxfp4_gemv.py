"""MXFP4 experts (gpt-oss) at 1-8 tokens with the codes read as 32-bit words and multiplied two at a time in
float16 pairs (HFMA2): kernels/moe_gemv.py's decode GEMV, for MXFP4_GROUPS experts only, at ~3 SASS instructions
a code in the row loop (sm_90, gate_up (32, 4, 4): 368 a step for a thread's 128 codes, of which 11-13 integer and
4 HFMA2 a word of 8) where moe_gemv's _mxfp4_products and fused_moe_mxfp4's FMA kernel spend ~8-10 (one nibble at
a time: unpack, widen to float32, scale the activation, FMA; 0.5-0.6 TB/s of codes on an H200, issue 53).

Layout: kernels/fused_moe_mxfp4.py's kernel layout, unpadded (K % 64 == 0: ``moe_gemv.gemv_supported``): byte j
of a row holds column j (low nibble) and KH + j (high nibble), KH = K / 2 the bytes a row; E8M0 exponents (E,
K / 32, N). Word w (bytes 4w..4w+3, read as int32 little-endian) holds nibbles n0..n7 at bits 4i..4i+3:
n0 = column 4w, n1 = KH + 4w, n2 = 4w + 1, n3 = KH + 4w + 1, n4 = 4w + 2, n5 = KH + 4w + 2, n6 = 4w + 3,
n7 = KH + 4w + 3. All eight lie in one scale group on each side (the row's low group w // 8, its high group
KH / 32 + w // 8).

Widening (per word, four stages s = 0..3, t = word << 4s): the top nibble of each 16-bit half of t is a code;
(t & 0x80008000) | ((t >> 3) & 0x0E000E00) places its sign at bit 15 and its exponent and mantissa at bits
11-9 of a float16 pair: each half is the code's value times 2^-14, exactly (kernels/mxfp4_codes.py). Stage s
pairs nibbles (n[3-s], n[7-s]): s = 0: columns (KH + 4w + 1, KH + 4w + 3), 1: (4w + 1, 4w + 3), 2: (KH + 4w,
KH + 4w + 2), 3: (4w, 4w + 2). The activations are prepared once in the same order (``_pair_offsets``): a float16
buffer (rows, 4 stages, KH / 4 words, 2), stage s of word w the float16 pair meeting stage s's codes, so a
stage's pairs of 4 words are one 16-byte load.

Exactness: a code's float16 is exact, so each HFMA2 product is x' * value * 2^-14 rounded to float16 (11
significant bits) and the 8 products a half of a 4-word chunk sum in float16; then the halves are widened to
float32, times the group's exponent factor 2^(s - 113), summed over K in float32 and times 2^-p. x' = x * 2^p,
rounded to float16, where 2^p puts the row's largest |x| in [2^13, 2^14) (``_prepare_kernel``; exact for bf16
activations, which hold 8 significant bits); the activations that down reads are the gate_up launch's, rounded
to x's dtype as the reference rounds them, times 2^DOWN_SHIFT (the clamped SwiGLU bounds them:
|act| <= limit * (limit + 1), ``down_shift``). |x'| < 2^14 and |value| <= 6 keep every float16 product below 6
and a half's sum below 48: no overflow. Against moe_gemv_ref: the float16 roundings of the products and sums,
~2^-12 relative each (tests: < 1e-2 in bf16, as moe_gemv's other kernels' bound; < 2e-3 in float32 on the
interpreter, whose formula variant sums in float32 and so has the activations' float16 rounding alone).

Launches: (1) ``_prepare_kernel``, one program a token: the token's routing (softmax top-k of its logits, as
moe_gemv's gate_up launch does it) and its activations' float16 pairs and 2^-p. (2) gate_up: grid (T * K,
ceil(I / BLOCK_N)), program (a, tile) streams BLOCK_N gate rows and the matching up rows of expert ids[a] over
all KH bytes, GROUPS 32-byte groups a row a step ((BLOCK_N, GROUPS, 8) words, each thread 4 contiguous words =
one 16-byte load); bias, activation, rounded to x's dtype, stored as down's float16 pairs. (3) down: grid
(T * K, ceil(H / BLOCK_N)), the same stream over I against the activation pairs, plus the down bias, times the
routing weight, rounded to x's dtype: out_k (T * K, H) (option "f": grid (T, ...), each program summing its
token's K experts: out (T, H); option "r": the last program of a token's tile to arrive sums its K experts' rows,
each rounded to x's dtype as out_k's are, in expert order: out (T, H) with no summing launch). A digit S in a
tile's options splits each row's groups over S programs (grid (..., S)), each storing its float32 sums; the last
to arrive adds them in split order and finishes the tile (deterministic; kernels/linear.py's self-resetting
arrival counters): S times the programs at 1 token, where ~2.7 programs an SM kept few bytes in flight. (Options
"x", no prepare launch, H200 call 33: 18-27 us slower; "l" / "d", L2 prefetches of a launch's own rows / of down's
codes, never among the load-time choice's candidates: removed, benchmarks/results/kernels.md.)

ASM: the stage arithmetic and HFMA2 run as inline PTX (``tl.inline_asm_elementwise``, pack 4: a thread's 4
contiguous words, which lie in one scale group, chained in float16 and returned as one float32 in the first
element, 0 in the others). That needs Triton to give each thread 4 contiguous words of a row (one 16-byte load):
the kernels state the word strides as multiples of 8 (a row of gpt-oss-20b is 360 words, which Triton does not
specialize; without it the loads were scalar, a pack spanned rows and groups, and the results were wrong: H200
call 27), the sm_90 compile test checks every SWEEP_TILES entry's packs, and the load-time choice marks the path
only where it agrees with the grouped path (kernels/moe_gemv_choice.py WORDS_AGREEMENT). Triton's CPU
interpreter cannot run inline assembly: ``ASM=False`` computes the same
stages with Triton integer ops and float32 sums (the interpreter's tests; the GPU tests run both).
"""
from __future__ import annotations

import math

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.linear import _arrival_counters, last_arrival, last_split_pair
from kernels.moe_epilogue import ACTIVATIONS, ExpertEpilogue, swiglu_clamped
from kernels.moe_routing import _top_k_of_row
from kernels.mxfp4_codes import exponent_factor

# (BLOCK_N rows, GROUPS of 32 bytes a row a step, num_warps[, options]) of the gate_up launch (gate and up rows
# each) and the down launch; options: "p" the codes prefetched a step ahead, "f" (down alone) the K experts summed
# in the launch, a digit S: S programs split each row's groups (more programs, more bytes in flight at 1 token;
# the tile's last arrival adds the S sums), "r" (down alone) the last arrival of a token's tile sums its K experts
# (no summing launch, and S * K programs share the sum). The load-time choice
# (kernels/moe_gemv_choice.py) times WORD_TILES (few: a compile each at every cold engine load); SWEEP_TILES are
# what benchmarks/kernels/moe_gemv_bench.py --word-tiles and the sm_90 compile test cover.
# (H200 call 33, gpt-oss-20b at 1 token, prepare + gate_up + down (+ sum): gate_up (32, 4, 4, "p") 46.2 us and
# (16, 8, 4) 46.1 with down (32, 4, 4), splits 46.5-48.1, "x" 64.2-73.1; then down (16, 8, 4) 39.2, "r" 38.5, "r2"
# 37.9, (32, 4, 4, "p") 43.5. Three candidates: call 34's cold gpt-oss-20b load with five spent 99.0 s in its 18
# load-time choices against call 28's 48.3 s with three.)
WORD_TILES = ((32, 4, 4, "p"), (16, 8, 4), (16, 8, 4, "r2"))
SWEEP_TILES = ((16, 4, 4), (16, 2, 2), (32, 4, 4), (32, 2, 4), (32, 4, 2), (64, 2, 4), (64, 4, 4), (16, 8, 4),
               (32, 1, 2), (64, 1, 4), (16, 4, 4, "p"), (32, 4, 4, "p"), (16, 4, 4, "f"), (32, 4, 4, "f"),
               (16, 4, 4, "fp"), (32, 4, 4, "fp"), (16, 8, 4, "p"), (64, 4, 8, "p"), (32, 4, 4, "p2"),
               (16, 4, 4, "p2"), (16, 8, 4, "p2"), (32, 4, 4, "p3"), (16, 8, 4, "r"), (16, 8, 4, "pr"),
               (16, 8, 4, "r2"), (16, 8, 4, "pr2"), (16, 4, 4, "pr2"), (32, 4, 4, "pr2"), (16, 8, 4, "r3"))
# (The asm's packs need each thread to hold 4 contiguous words of one row and group: tests/kernels/
# test_mxfp4_gemv.py's sm_90 compile checks every SWEEP_TILES entry; (16, 2, 4) (2 words a thread), (8, 8, 2),
# (8, 16, 4), (16, 16, 4) and (8, 32, 8) fail it.)
DEFAULT_WORD_TILES = ((32, 4, 4), (32, 4, 4))
assert all(t in SWEEP_TILES for t in WORD_TILES + DEFAULT_WORD_TILES)
WORDS_ENV = "TRITONLLM_MXFP4_WORDS"  # "0": the load-time choice never takes this path (moe_gemv's and the grouped)
WORD_PATH = "words"  # the first element of a mark (kernels/moe_gemv.py mark_gemv) that takes this path
MAX_X_EXPONENT = 13  # x' = x * 2^p < 2^(MAX_X_EXPONENT + 1)


def word_mark(tiles: tuple) -> tuple:
    """The mark moe_forward_mxfp4 reads as this path's: (WORD_PATH, gate_up tiles, down tiles)."""
    return (WORD_PATH, *tiles)


def tile_split(options: str) -> int:
    """The splits over K a tile's options ask for (their digits, "2": two programs share each row's groups,
    the last arrival finishing; kernels/linear.py's split-K), 1 without digits."""
    digits = "".join(c for c in options if c.isdigit())
    return int(digits) if digits else 1


def is_word_mark(mark) -> bool:
    return mark is not None and len(mark) == 3 and mark[0] == WORD_PATH


def down_shift(epilogue: ExpertEpilogue) -> int | None:
    """p of down's activations (x' = act * 2^p, |x'| < 2^14), or None where they are unbounded (silu): the clamped
    SwiGLU's |(up + 1) * gate * sigmoid(1.702 gate)| <= limit * (limit + 1) (gate <= limit, |up| <= limit)."""
    if epilogue.activation != "swiglu_clamped" or epilogue.swiglu_limit is None:
        return None
    limit = float(epilogue.swiglu_limit)
    bound = max(limit * (limit + 1.0), 1.0)
    return MAX_X_EXPONENT - math.floor(math.log2(bound))


def word_path_supported(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None,
                        epilogue: ExpertEpilogue) -> bool:
    """MXFP4 codes (uint8 with uint8 exponents), 1..8 tokens, rows of whole 32-byte groups on both sides (K % 64 ==
    0 in both products, as moe_gemv.gemv_supported asks), the clamped SwiGLU (bounded activations for down)."""
    if gate_up_scale is None or gate_up.dtype != torch.uint8 or gate_up_scale.dtype != torch.uint8:
        return False
    inter = gate_up.shape[1] // 2
    return (1 <= x.shape[0] <= 8 and x.shape[1] == 2 * gate_up.shape[2] and x.shape[1] % 64 == 0
            and inter % 64 == 0 and down_shift(epilogue) is not None)


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _pair_offsets(cols, half):
    """Each activation column's float16 slot in its row's pair buffer (module docstring): (stage * half / 4 + w) * 2
    + h, columns c < half the low side (stage 3 for c % 4 in (0, 2), 1 for (1, 3)), the rest the high side (2, 0);
    h = (c % 4) // 2."""
    low = cols < half
    c = tl.where(low, cols, cols - half)
    odd = c & 1
    stage = tl.where(low, 3 - 2 * odd, 2 - 2 * odd)
    return (stage * (half // 4) + c // 4) * 2 + (c & 3) // 2


@jit
def _prepare_kernel(x_ptr, logits_ptr, ids_ptr, weights_ptr, pairs_ptr, inv_ptr, num_experts, K, stride_x,
                    stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's routing (ROUTE_IN_KERNEL: ids / weights of its TOP_K slots) and its activations as
    float16 pairs x * 2^p (pairs_ptr: (T, K) float16), 2^-p at inv_ptr[t]."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    if ROUTE_IN_KERNEL:
        chosen_w, chosen_id = _top_k_of_row(logits_ptr + t.to(tl.int64) * stride_l, num_experts, TOP_K, K_PAD,
                                            E_PAD, RENORMALIZE)
        slots = tl.arange(0, K_PAD)
        tl.store(ids_ptr + t * TOP_K + slots, chosen_id, mask=slots < TOP_K)
        tl.store(weights_ptr + t * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    inv = _prepare_row(x_ptr + t.to(tl.int64) * stride_x, pairs_ptr + t.to(tl.int64) * K, K, BLOCK)
    tl.store(inv_ptr + t, inv)


@jit
def _prepare_row(x_row, pairs_row, K, BLOCK: tl.constexpr):
    """One token's activations x (K) as float16 pairs x * 2^p at pairs_row (module docstring); returns 2^-p."""
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 0)
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # amax < 2^(exponent + 1)
    # (not capped low: a row of tiny activations scaled up to 2^13 keeps its products float16 normals, whose
    # precision the sums need; +-100 keeps 2^p and 2^-p float32 normals)
    p = tl.minimum(tl.maximum(13 - exponent, -100), 100)
    scale = ((p + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(pairs_row + _pair_offsets(cols, K // 2), (x * scale).to(tl.float16), mask=ok)
    return ((127 - p) << 23).to(tl.float32, bitcast=True)


# Four words a call (pack 4): $0-$3 out (float32 bits), $4-$7 words, $8-$11 / $12-$15 / $16-$19 / $20-$23 the
# float16 pairs of stages 0-3, $24 / $28 the low / high groups' factors (the same in each of the 4 elements).
# Per word: the odd nibbles spread to float16 high bytes at once, od = (q & 0x80808080) | ((q >> 3) & 0x0E0E0E0E)
# (n1 in byte 0, n3 in byte 1, n5 in 2, n7 in 3: sign at the byte's bit 7, exponent and mantissa at 3-1), the even
# ones likewise from q << 4 and q << 1 (ev: n0, n2, n4, n6); then stage 0 = od's bytes 1 and 3 (an AND), stage 2
# = its bytes 0 and 2 moved up (a PRMT), stages 1 and 3 the same of ev: 11-13 integer instructions and 4 HFMA2
# for 8 codes (the module docstring's per-stage formula, 15 and 4).
_WORD = """
and.b32 od, {q}, 0x80808080;
shr.b32 m, {q}, 3;
and.b32 m, m, 0x0E0E0E0E;
or.b32 od, od, m;
shl.b32 ev, {q}, 4;
and.b32 ev, ev, 0x80808080;
shl.b32 m, {q}, 1;
and.b32 m, m, 0x0E0E0E0E;
or.b32 ev, ev, m;
and.b32 w, od, 0xFF00FF00;
fma.rn.f16x2 hi, w, {x0}, hi;
prmt.b32 w, od, 0, 0x2404;
fma.rn.f16x2 hi, w, {x2}, hi;
and.b32 w, ev, 0xFF00FF00;
fma.rn.f16x2 lo, w, {x1}, lo;
prmt.b32 w, ev, 0, 0x2404;
fma.rn.f16x2 lo, w, {x3}, lo;"""


def _word_asm() -> str:
    body = ["{", ".reg .b32 od, ev, w, m, lo, hi;", ".reg .b16 a, b;", ".reg .f32 fa, fb, sl, sh;",
            "mov.b32 lo, 0;", "mov.b32 hi, 0;"]
    for i in range(4):
        body.append(_WORD.format(q=f"${4 + i}", **{f"x{s}": f"${8 + 4 * s + i}" for s in range(4)}))
    body += ["mov.b32 {a, b}, lo;", "cvt.f32.f16 fa, a;", "cvt.f32.f16 fb, b;", "add.f32 sl, fa, fb;",
             "mov.b32 {a, b}, hi;", "cvt.f32.f16 fa, a;", "cvt.f32.f16 fb, b;", "add.f32 sh, fa, fb;",
             "mul.f32 sl, sl, $24;", "fma.rn.f32 sl, sh, $28, sl;", "mov.b32 $0, sl;", "mov.b32 $1, 0;",
             "mov.b32 $2, 0;", "mov.b32 $3, 0;", "}"]
    return "\n".join(body)


if tl is not None:  # Triton reads module globals that are constexprs
    WORD_ASM = tl.constexpr(_word_asm())


@jit
def _stage_products(q, x, S: tl.constexpr):
    """Stage S of words q against the float16 pairs x (int32 bits): each half's product rounded to float16 as
    HFMA2 rounds it (subnormals included), (first halves, second halves)."""
    t = q << (4 * S)
    w_lo = ((t & 0x8000) | ((t >> 3) & 0x0E00)).to(tl.uint16).to(tl.float16, bitcast=True)
    w_hi = (((t >> 16) & 0x8000) | ((t >> 19) & 0x0E00)).to(tl.uint16).to(tl.float16, bitcast=True)
    x_lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    x_hi = ((x >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    return w_lo * x_lo, w_hi * x_hi


@jit
def _word_products(q, x0, x1, x2, x3, f_lo, f_hi, ASM: tl.constexpr):
    """Float32 of words q's 8 codes times their activation pairs (stages 0-3: x0..x3, int32 float16 pairs), the
    low side's sum times f_lo and the high side's times f_hi; ASM: a thread's 4 words' total in the first of them
    (module docstring)."""
    if ASM:
        return tl.inline_asm_elementwise(
            WORD_ASM, "=r,=r,=r,=r" + ",r" * 28,
            [q, x0, x1, x2, x3, f_lo.to(tl.int32, bitcast=True), f_hi.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=4).to(tl.float32, bitcast=True)
    # the formula: float16 products and a float16 sum of a word's two stages a side, as the asm's HFMA2 chain
    # (which chains 4 words: 8 products a half), so the interpreter sees float16's range and rounding
    h0, h1 = _stage_products(q, x0, 0)
    g0, g1 = _stage_products(q, x2, 2)
    high = (h0 + g0).to(tl.float32) + (h1 + g1).to(tl.float32)
    h0, h1 = _stage_products(q, x1, 1)
    g0, g1 = _stage_products(q, x3, 3)
    low = (h0 + g0).to(tl.float32) + (h1 + g1).to(tl.float32)
    return low * f_lo + high * f_hi


@jit
def _step_words(g0, GROUPS: tl.constexpr):
    """(1, GROUPS, 8) word indices of groups [g0, g0 + GROUPS) in a row, and the groups (GROUPS,)."""
    grp = g0 + tl.arange(0, GROUPS)
    return (grp[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :], grp


@jit
def _step_codes(w_rows, w_rows_2, rows_ok, g_end, g0, TWO: tl.constexpr, GROUPS: tl.constexpr,
                TAIL: tl.constexpr):
    """The words of one step (a full one: masked by the rows alone, no zero fill; TAIL: groups from g_end too)."""
    wk, grp = _step_words(g0, GROUPS)
    if TAIL:
        ok = rows_ok[:, None, None] & (grp < g_end)[None, :, None]
    else:
        ok = rows_ok[:, None, None]
    q = tl.load(w_rows + wk, mask=ok, eviction_policy="evict_first")
    q_2 = q
    if TWO:
        q_2 = tl.load(w_rows_2 + wk, mask=ok, eviction_policy="evict_first")
    return q, q_2


@jit
def _step_products(acc, acc_2, q, q_2, pairs_row, s_base, rows, rows_2, rows_ok, num_rows, groups_k, g_end, g0,
                   TWO: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr, TAIL: tl.constexpr):
    """acc (acc_2) plus one step's words q (q_2) against their activation pairs, times their groups' factors
    (groups_k groups a side of a row). TAIL: groups from g_end read pairs and exponents 0, so the codes' unread
    registers multiply zeros."""
    wk, grp = _step_words(g0, GROUPS)
    half_words = groups_k * 8
    if TAIL:
        grp_ok = grp < g_end
        x_ok = grp_ok[None, :, None]
        f_ok = rows_ok[:, None] & grp_ok[None, :]
        x0 = tl.load(pairs_row + wk, mask=x_ok, other=0)
        x1 = tl.load(pairs_row + half_words + wk, mask=x_ok, other=0)
        x2 = tl.load(pairs_row + 2 * half_words + wk, mask=x_ok, other=0)
        x3 = tl.load(pairs_row + 3 * half_words + wk, mask=x_ok, other=0)
    else:
        f_ok = rows_ok[:, None]
        x0 = tl.load(pairs_row + wk)
        x1 = tl.load(pairs_row + half_words + wk)
        x2 = tl.load(pairs_row + 2 * half_words + wk)
        x3 = tl.load(pairs_row + 3 * half_words + wk)
    s_lo = s_base + grp[None, :] * num_rows
    s_hi = s_base + (groups_k + grp)[None, :] * num_rows
    f_lo = exponent_factor(tl.load(s_lo + rows[:, None], mask=f_ok, other=0))[:, :, None]
    f_hi = exponent_factor(tl.load(s_hi + rows[:, None], mask=f_ok, other=0))[:, :, None]
    acc += _word_products(q, x0, x1, x2, x3, f_lo, f_hi, ASM)
    if TWO:
        f_lo_2 = exponent_factor(tl.load(s_lo + rows_2[:, None], mask=f_ok, other=0))[:, :, None]
        f_hi_2 = exponent_factor(tl.load(s_hi + rows_2[:, None], mask=f_ok, other=0))[:, :, None]
        acc_2 += _word_products(q_2, x0, x1, x2, x3, f_lo_2, f_hi_2, ASM)
    return acc, acc_2


@jit
def _stream_words(acc, acc_2, pairs_row, w_rows, w_rows_2, s_base, rows, rows_2, rows_ok, num_rows, half_words,
                  g_begin, g_end, TWO: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """(acc, acc_2) (BLOCK_N, GROUPS, 8) float32 plus rows ``w_rows`` (int32 word pointers (BLOCK_N, 1, 1); and
    ``w_rows_2`` into acc_2 when TWO) against the pairs at pairs_row (int32: 4 stages of half_words) over groups
    [g_begin, g_end) of each side (all half_words / 8 of them, or a split's share: ``_split_groups``), GROUPS groups
    of 8 words a step (the last, partial one masked); exponents of row r's group g at s_base + g * num_rows + r.
    Rows past the matrix (rows_ok false) sum garbage, never stored. PREFETCH: each full step's words are loaded
    before the previous step's products (twice the bytes in flight a thread)."""
    groups_k = half_words // 8
    full = g_begin + (g_end - g_begin) // GROUPS * GROUPS
    if PREFETCH:
        if full > g_begin:
            q, q_2 = _step_codes(w_rows, w_rows_2, rows_ok, g_end, g_begin, TWO, GROUPS, False)
            for g0 in range(g_begin + GROUPS, full, GROUPS):
                q_next, q_2_next = _step_codes(w_rows, w_rows_2, rows_ok, g_end, g0, TWO, GROUPS, False)
                acc, acc_2 = _step_products(acc, acc_2, q, q_2, pairs_row, s_base, rows, rows_2, rows_ok, num_rows,
                                            groups_k, g_end, g0 - GROUPS, TWO, GROUPS, ASM, False)
                q, q_2 = q_next, q_2_next
            acc, acc_2 = _step_products(acc, acc_2, q, q_2, pairs_row, s_base, rows, rows_2, rows_ok, num_rows,
                                        groups_k, g_end, full - GROUPS, TWO, GROUPS, ASM, False)
    else:
        for g0 in range(g_begin, full, GROUPS):
            q, q_2 = _step_codes(w_rows, w_rows_2, rows_ok, g_end, g0, TWO, GROUPS, False)
            acc, acc_2 = _step_products(acc, acc_2, q, q_2, pairs_row, s_base, rows, rows_2, rows_ok, num_rows,
                                        groups_k, g_end, g0, TWO, GROUPS, ASM, False)
    if full < g_end:
        q, q_2 = _step_codes(w_rows, w_rows_2, rows_ok, g_end, full, TWO, GROUPS, True)
        acc, acc_2 = _step_products(acc, acc_2, q, q_2, pairs_row, s_base, rows, rows_2, rows_ok, num_rows,
                                    groups_k, g_end, full, TWO, GROUPS, ASM, True)
    return acc, acc_2


@jit
def _split_groups(half_words, SPLIT: tl.constexpr, GROUPS: tl.constexpr):
    """[g_begin, g_end) of split program_id(2)'s groups a side: SPLIT shares of whole steps (the last the shorter),
    so a split's packs keep to one group each and its steps start on GROUPS boundaries."""
    groups_k = half_words // 8
    if SPLIT == 1:
        return 0, groups_k
    share = tl.cdiv(tl.cdiv(groups_k, SPLIT), GROUPS) * GROUPS
    g_begin = tl.program_id(2) * share
    return g_begin, tl.maximum(tl.minimum(g_begin + share, groups_k), g_begin)  # (past the row: empty, arrives)


@jit
def _words_gate_up_kernel(
    pairs_ptr, inv_ptr, ids_ptr, w_ptr, s_ptr, bias_ptr, act_pairs_ptr, x_ptr, part_ptr, arrivals_ptr, I, half_words,
    stride_we, stride_wn, stride_se, stride_be, DOWN_SCALE: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (a, tile[, split]): the activation of assignment a's rows [tile * BLOCK_N, +BLOCK_N) (module
    docstring, 2), rounded to x's dtype (x_ptr: read for its dtype alone), stored as down's float16 pairs
    (act_pairs_ptr: (T * K, I) float16) times DOWN_SCALE. SPLIT > 1: each split sums its share of H's groups into
    part_ptr ((T * K * SPLIT, 2I) float32) and the tile's last arrival adds them in split order and finishes."""
    # Word strides are whole 32-byte groups (K % 64 == 0): written as multiples of 8 so Triton knows each row's
    # groups are 16-byte aligned (a row of gpt-oss-20b is 360 words, not a multiple of 16: unspecialized). Then a
    # thread's 4 contiguous words are one 16-byte load and one pack of the inline asm, which relies on them sharing
    # a row and a scale group (it chains them in float16 and applies the first one's factors).
    stride_wn = (stride_wn // 8) * 8
    stride_we = (stride_we // 8) * 8
    half_words = (half_words // 8) * 8
    a = tl.program_id(0)
    tile = tl.program_id(1)
    token = a // TOP_K
    pdl_prologue(PDL)
    e64 = tl.load(ids_ptr + a).to(tl.int64)
    inv = tl.load(inv_ptr + token)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < I
    gate_rows = w_ptr + e64 * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn
    pairs_row = pairs_ptr + token.to(tl.int64) * (4 * half_words)
    g_begin, g_end = _split_groups(half_words, SPLIT, GROUPS)
    acc = tl.zeros([BLOCK_N, GROUPS, 8], dtype=tl.float32)
    acc, acc_up = _stream_words(acc, acc, pairs_row, gate_rows, gate_rows + I * stride_wn, s_ptr + e64 * stride_se,
                                rows, rows + I, rows_ok, 2 * I, half_words, g_begin, g_end, True, GROUPS, ASM,
                                PREFETCH)
    gate = tl.sum(tl.sum(acc, 2), 1)
    up = tl.sum(tl.sum(acc_up, 2), 1)
    last, gate, up = last_split_pair(gate, up, part_ptr, arrivals_ptr, a, a * tl.num_programs(1) + tile, rows, rows_ok,
                                     I, SPLIT)
    if last:  # (SPLIT 1: every program)
        _finish_gate_up(gate, up, inv, bias_ptr, act_pairs_ptr, x_ptr, a, token, e64, rows, rows_ok, I,
                        stride_be, DOWN_SCALE, HAS_BIAS, ACTIVATION, SWIGLU_LIMIT)


@jit
def _finish_gate_up(gate, up, inv, bias_ptr, act_pairs_ptr, x_ptr, a, token, e64, rows, rows_ok, I, stride_be,
                    DOWN_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                    SWIGLU_LIMIT: tl.constexpr):
    """gate and up sums (of x * 2^p; inv: 2^-p) -> the activation's float16 pairs for down (_words_gate_up_kernel)."""
    gate = gate * inv
    up = up * inv
    if HAS_BIAS:  # (E, 2I) rows [gate | up]
        gate += tl.load(bias_ptr + e64 * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + e64 * stride_be + I + rows, mask=rows_ok, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate)) * up
    else:
        act = swiglu_clamped(gate, up, SWIGLU_LIMIT)
    # (rounded as the reference rounds it; exact in float16)
    act = act.to(x_ptr.dtype.element_ty).to(tl.float32) * DOWN_SCALE
    tl.store(act_pairs_ptr + a.to(tl.int64) * I + _pair_offsets(rows, I // 2), act.to(tl.float16), mask=rows_ok)


@jit
def _down_row(total, a, e64, weights_ptr, bias_ptr, rows, rows_ok, stride_be, INV_SCALE: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """w_a * (sum * 2^-p + bias) in float32: one assignment's down row (module docstring, 3)."""
    y = total * INV_SCALE
    if HAS_BIAS:
        y += tl.load(bias_ptr + e64 * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
    return y * tl.load(weights_ptr + a)


@jit
def _words_down_kernel(
    act_pairs_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, H, half_words,
    stride_we, stride_wn, stride_se, stride_be, stride_o, INV_SCALE: tl.constexpr, TOP_K: tl.constexpr,
    FOLD: tl.constexpr, REDUCE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):
    """out_k[a, rows] = w_a * (down_e[rows] . act[a] + bias) (module docstring, 3) for assignment a = program_id(0);
    FOLD: program_id(0) is a token t, and out[t, rows] is the sum over its TOP_K assignments, accumulated in float32
    and rounded once (no out_k, no summing launch). REDUCE: grid (T * K, tiles, SPLIT), each program's sum over its
    split's share of I stored in part_ptr ((T * K * SPLIT, H) float32); the last of a token tile's TOP_K * SPLIT
    arrivals adds them (splits, then experts, in order: deterministic), each expert's row rounded to out's dtype
    as the reference rounds it, into out[t] (no summing launch); SPLIT > 1 without REDUCE: the last of an
    assignment tile's SPLIT arrivals finishes out_k[a]."""
    stride_wn = (stride_wn // 8) * 8  # (as in _words_gate_up_kernel: 16-byte aligned groups, the asm's packs)
    stride_we = (stride_we // 8) * 8
    half_words = (half_words // 8) * 8
    tile = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < H
    pdl_prologue(PDL)
    if FOLD:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            a = tl.program_id(0) * TOP_K + k
            e64 = tl.load(ids_ptr + a).to(tl.int64)
            w_rows = w_ptr + e64 * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn
            pairs_row = act_pairs_ptr + a.to(tl.int64) * (4 * half_words)
            acc = tl.zeros([BLOCK_N, GROUPS, 8], dtype=tl.float32)
            acc, _ = _stream_words(acc, acc, pairs_row, w_rows, w_rows, s_ptr + e64 * stride_se, rows, rows, rows_ok,
                                   H, half_words, 0, half_words // 8, False, GROUPS, ASM, PREFETCH)
            total += _down_row(tl.sum(tl.sum(acc, 2), 1), a, e64, weights_ptr, bias_ptr, rows, rows_ok, stride_be,
                               INV_SCALE, HAS_BIAS)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_o + rows, total.to(out_ptr.dtype.element_ty),
                 mask=rows_ok)
    else:
        a = tl.program_id(0)
        e64 = tl.load(ids_ptr + a).to(tl.int64)
        w_rows = w_ptr + e64 * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn
        pairs_row = act_pairs_ptr + a.to(tl.int64) * (4 * half_words)
        g_begin, g_end = _split_groups(half_words, SPLIT, GROUPS)
        acc = tl.zeros([BLOCK_N, GROUPS, 8], dtype=tl.float32)
        acc, _ = _stream_words(acc, acc, pairs_row, w_rows, w_rows, s_ptr + e64 * stride_se, rows, rows, rows_ok, H,
                               half_words, g_begin, g_end, False, GROUPS, ASM, PREFETCH)
        total = tl.sum(tl.sum(acc, 2), 1)
        if REDUCE or SPLIT > 1:
            tl.store(part_ptr + (a * SPLIT + tl.program_id(2)).to(tl.int64) * H + rows, total, mask=rows_ok)
            token = a // TOP_K
            if REDUCE:  # (the first assignment, and the counter, of the rows the last arrival finishes)
                first = token * TOP_K
                counter = token * tl.num_programs(1) + tile
            else:
                first = a
                counter = a * tl.num_programs(1) + tile
            if last_arrival(arrivals_ptr, counter, TOP_K * SPLIT if REDUCE else SPLIT):
                out = tl.zeros([BLOCK_N], dtype=tl.float32)
                for k in tl.static_range(TOP_K if REDUCE else 1):  # (splits, then experts, in order: deterministic)
                    a_k = first + k
                    part = tl.zeros([BLOCK_N], dtype=tl.float32)
                    for split in tl.static_range(SPLIT):
                        part += tl.load(part_ptr + (a_k * SPLIT + split).to(tl.int64) * H + rows, mask=rows_ok,
                                        other=0.0, cache_modifier=".cg")
                    y = _down_row(part, a_k, tl.load(ids_ptr + a_k).to(tl.int64), weights_ptr, bias_ptr, rows,
                                  rows_ok, stride_be, INV_SCALE, HAS_BIAS)
                    out += y.to(out_ptr.dtype.element_ty).to(tl.float32)  # (each expert's row rounded, as out_k's)
                tl.store(out_ptr + (token if REDUCE else a).to(tl.int64) * stride_o + rows,
                         out.to(out_ptr.dtype.element_ty), mask=rows_ok)
        else:
            y = _down_row(total, a, e64, weights_ptr, bias_ptr, rows, rows_ok, stride_be, INV_SCALE, HAS_BIAS)
            tl.store(out_ptr + a.to(tl.int64) * stride_o + rows, y.to(out_ptr.dtype.element_ty), mask=rows_ok)


def mxfp4_words_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor,
                       down_scale: torch.Tensor, *, top_k: int, epilogue: ExpertEpilogue,
                       router_logits: torch.Tensor | None = None, renormalize: bool = False,
                       topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                       tiles: tuple | None = None, sum_experts: bool = True, asm: bool | None = None) -> torch.Tensor:
    """moe_gemv_triton's contract for MXFP4 experts (codes uint8 (E, 2I, H / 2) / (E, H, I / 2), exponents (E,
    groups, N), kernels/fused_moe_mxfp4.py's unpadded kernel layout): out_k (T, K, H), or summed (T, H), in x's
    dtype. ``tiles``: (gate_up's, down's) (BLOCK_N, GROUPS, num_warps), else DEFAULT_WORD_TILES. ``asm``: the
    inline-PTX stages (default: on CUDA) or the formula variant."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, half_h = gate_up.shape
    inter = two_inter // 2
    assert word_path_supported(x, gate_up, gate_up_scale, epilogue) and x.stride(1) == 1
    assert gate_up.is_contiguous() and down.is_contiguous() and down.shape == (num_experts, hidden, inter // 2)
    assert gate_up_scale.shape == (num_experts, hidden // 32, two_inter) and gate_up_scale.is_contiguous()
    assert down_scale.shape == (num_experts, inter // 32, hidden) and down_scale.is_contiguous()
    asm = x.is_cuda if asm is None else asm
    (gn, gg, gw, *g_opts), (dn, dg, dw, *d_opts) = tiles or DEFAULT_WORD_TILES
    g_opts, d_opts = (g_opts or [""])[0], (d_opts or [""])[0]
    g_split, d_split = tile_split(g_opts), tile_split(d_opts)
    fold = "f" in d_opts and sum_experts
    reduce = "r" in d_opts and sum_experts and not fold
    device = x.device
    route = router_logits is not None
    if route:
        assert router_logits.shape == (num_tokens, num_experts) and router_logits.stride(1) == 1
        ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=device)
        weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=device)
    else:
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
    pairs = torch.empty(num_tokens, hidden, dtype=torch.float16, device=device)
    inv = torch.empty(num_tokens, dtype=torch.float32, device=device)
    pdl = pdl_options(x)
    _prepare_kernel[(num_tokens,)](
        x, router_logits if route else x, ids, weights, pairs, inv, num_experts, hidden, x.stride(0),
        router_logits.stride(0) if route else 0, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts), ROUTE_IN_KERNEL=route, RENORMALIZE=renormalize,
        BLOCK=triton.next_power_of_2(hidden), num_warps=4, **pdl)
    shift = down_shift(epilogue)
    gu_b, d_b = epilogue.gate_up_bias, epilogue.down_bias
    act_pairs = torch.empty(num_tokens * top_k, inter, dtype=torch.float16, device=device)
    gu_words, d_words = gate_up.view(torch.int32), down.view(torch.int32)
    gu_tiles, d_tiles = triton.cdiv(inter, gn), triton.cdiv(hidden, dn)
    arrivals = inv  # (unread without splits or the reduction)
    if g_split > 1 or d_split > 1 or reduce:
        arrivals = _arrival_counters(device, num_tokens * top_k * max(gu_tiles, d_tiles))
    gu_part = torch.empty(num_tokens * top_k * g_split, two_inter, dtype=torch.float32, device=device) \
        if g_split > 1 else inv
    _words_gate_up_kernel[(num_tokens * top_k, gu_tiles, g_split)](
        pairs.view(torch.int32), inv, ids, gu_words, gate_up_scale, x if gu_b is None else gu_b, act_pairs, x,
        gu_part, arrivals, inter, half_h // 4, gu_words.stride(0), gu_words.stride(1), gate_up_scale.stride(0),
        0 if gu_b is None else gu_b.stride(0), DOWN_SCALE=float(2.0 ** shift), TOP_K=top_k, BLOCK_N=gn,
        GROUPS=gg, HAS_BIAS=gu_b is not None, ACTIVATION=ACTIVATIONS[epilogue.activation],
        SWIGLU_LIMIT=float(epilogue.swiglu_limit), PREFETCH="p" in g_opts, SPLIT=g_split, ASM=asm,
        num_warps=gw, **pdl)
    out_k = torch.empty(num_tokens if fold or reduce else num_tokens * top_k, hidden, dtype=x.dtype, device=device)
    d_part = torch.empty(num_tokens * top_k * d_split, hidden, dtype=torch.float32, device=device) \
        if d_split > 1 or reduce else inv
    _words_down_kernel[(num_tokens if fold else num_tokens * top_k, d_tiles, 1 if fold else d_split)](
        act_pairs.view(torch.int32), ids, weights, d_words, down_scale, act_pairs if d_b is None else d_b, out_k,
        d_part, arrivals, hidden, inter // 8, d_words.stride(0), d_words.stride(1), down_scale.stride(0),
        0 if d_b is None else d_b.stride(0), out_k.stride(0), INV_SCALE=float(2.0 ** -shift), TOP_K=top_k,
        FOLD=fold, REDUCE=reduce, SPLIT=1 if fold else d_split, BLOCK_N=dn, GROUPS=dg, HAS_BIAS=d_b is not None,
        PREFETCH="p" in d_opts, ASM=asm, num_warps=dw, **pdl)
    if fold or reduce:
        return out_k
    out_k = out_k.view(num_tokens, top_k, hidden)
    return out_k.sum(dim=1) if sum_experts else out_k
