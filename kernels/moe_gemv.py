"""Decode-sized routed experts (1-8 tokens) as two GEMV launches that stream the chosen experts' weights:
model-dtype, FP8 per-channel, FP8 128 x 128 block, 4-bit grouped or MXFP4 (gpt-oss) experts, the weights widened
in registers (W8A16 / W4A16), with the experts' biases and clamped SwiGLU where the model has them (gpt-oss).

Why: at one token the grouped path (kernels/fused_moe.py, fused_moe_fp8.py) pays ~26-29 us a Qwen3-30B-A3B
layer whatever the bytes (H200, 2026-11-29: bf16 9.44 MB an expert at 2.57 TB/s, block-FP8 4.72 MB at 1.39):
FP8 quantizes x and the SwiGLU output in launches of their own (four launches where bf16 has two), and its
tensor-core tiles pad one row to 16. Here a token's experts are a matrix-vector product each: no
activation quantization, no padding rows, two launches a layer whatever the weight kind.

Shapes (T tokens, H hidden, E experts, I expert width on this rank, K experts a token, a = t * K + k):
    x (T, H); router_logits (T, E) (or topk_ids / topk_weights (T, K) given);
    gate_up (E, 2I, H) rows [gate | up]; down (E, H, I); FP8 scales as kernels/fused_moe_fp8.py's:
    per channel (E, 2I) / (E, H), blocks (E, 2I / 128, ceil(H / 128)) / (E, ceil(H / 128), I / 128);
    4 bits: kernels/fused_moe_wna16.py's kernel layout, codes (E, 2I, H / 2) / (E, H, I / 2) (byte j of a row:
    columns j and K / 2 + j), scale float32 and zero uint8 (E, K / G, N); MXFP4: kernels/fused_moe_mxfp4.py's
    kernel layout, the same byte order of E2M1 codes, E8M0 exponents uint8 (E, K / 32, N) (K % 64 == 0: no padding);
    epilogue (kernels/moe_epilogue.py ExpertEpilogue): gate_up bias (E, 2I), down bias (E, H), silu or swiglu_clamped
    -> out_k (T, K, H) in x's dtype (each token's K weighted expert rows), or their sum (T, H) in x's dtype
    (accumulated in float32, rounded once).

1. gate_up: grid (T * K, ceil(I / BLOCK_N)). Program (a, j) routes token a // K itself where the logits are
   given (softmax top-k of its E logits, kernels/moe_routing.py _top_k_of_row; tile 0 stores slot a's id and
   weight for down), then streams rows [j * BLOCK_N, +BLOCK_N) of its expert's gate and up over all of H in
   BLOCK_K steps of unrolled pieces of up to 128 columns (every piece's loads issued before its FMAs): codes
   widened to float32 (FP8: two F2FP a 4-byte word, then HADD2.F32) and multiplied by x (float32, times the
   piece's 128 x 128 block scale when blocked; 4 bits: (code - zero) * scale of the piece's group; MXFP4: the
   code's value * 2^(exponent - 127) by kernels/mxfp4_codes.py's bits) into a (BLOCK_N, piece) float32
   accumulator, reduced over K once at the end; per channel the row scales multiply the sums. The gate_up bias
   joins the sums, then SiLU(gate) * up (or the clamped SwiGLU) in float32, rounded once: act (T * K, I).
2. down: grid (T * K, ceil(H / BLOCK_N)): rows of expert e's down over all of I against act[a], the scales
   likewise, plus the down bias, times the routing weight in float32, rounded once: out_k[a].

A ``SharedExpert`` (Llama 4's shared expert) is expert E beyond the stacks: rows whose given id is E read its own
tensors, each program choosing its weight and scale bases by a scalar select (a program's rows are one expert's).

Blocked scales need a tile's rows in one scale block: BLOCK_N divides 128 and I % 128 == 0
(``gemv_supported``); 4-bit groups hold whole pieces (``int4_piece``). Tokens that share an expert read its rows once each (from L2 for all but the
first); the load-time choice (kernels/moe_gemv_choice.py) keeps this path only at the token counts
where it times faster than the grouped path. Nothing waits on the host: decode graphs capture it.

Numerics (``moe_gemv_ref``): gate and up in float32 from x and the dequantized weights (plus the bias), the
activation in float32 rounded to x's dtype, down in float32 (plus the bias) times the routing weight, rounded
to x's dtype per (token, expert); the K rows summed in float32 by the consumer. FP8 experts are W8A16 (as
kernels/moe_decode.py): a batch of <= 8 rounds differently from the W8A8 grouped path by about an E4M3
step of the activations.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton
from kernels.fp8 import FP8_DTYPE
from kernels.fp8_block import BLOCK as SCALE_BLOCK
from kernels.linear import _arrival_counters, last_arrival, last_split_pair
from kernels.e4m3_bits import bits_factor, widened_bits
from kernels.moe_decode import _dequantized  # (one expert's weight in float32: codes times scales)
from kernels.moe_epilogue import ACTIVATIONS, PLAIN_SILU, ExpertEpilogue, swiglu_clamped, swiglu_clamped_ref
from kernels.moe_routing import _top_k_of_row
from kernels.mxfp4_codes import exponent_factor, high_codes, low_codes

MAX_TOKENS = 8  # the token counts the load-time choice times (1, 2, 4, 8); more take the grouped path
NO_SCALES, ROW_SCALES, BLOCK_SCALES, INT4_GROUPS, MXFP4_GROUPS = 0, 1, 2, 3, 4
MXFP4_GROUP = 32  # columns an E8M0 exponent scales

# On a gate_up expert tensor: {tokens: (gate_up tiles, down tiles)} for the token counts at which the load-time
# choice found this path faster (kernels/moe_gemv_choice.py); absent or a count missing: the grouped path.
GEMV_ATTR = "_moe_gemv_tiles"

# (BLOCK_N, BLOCK_K, num_warps, num_stages) a GEMV program streams: the load-time choice times these (each
# GEMM apart, per token count). What bounds a one-token GEMV is the bytes each thread has in flight: a step's
# BLOCK_N x BLOCK_K weight tile (two in gate_up) over 32 x warps threads, every 128-column piece's loads issued
# before its FMAs (the loop itself is not software-pipelined: no dot, no shared-memory stages). (16, 512, 4):
# gate_up 128 bytes a thread a step in FP8 (8 x 16-byte loads), 2 x 16 float32 accumulators; Qwen3-30B-A3B at
# one token: gate_up 8 x 48 programs at BLOCK_N 16, down 8 x 128. BLOCK_N divides 128 (blocked scales).
# A fifth element AHEAD ("a"): each step is one BLOCK_K-column piece whose weights, activations and block scales are
# loaded a step ahead (loop-carried registers), so the next step's loads are in flight while this one's FMAs run.
# Why: in the plain loop's sm_90 code ptxas issues a piece's loads only after the previous piece's FMAs (~470
# instructions a thread a step of (16, 512, 4): 128 FP8 weights a thread, each widened (F2FP, HADD2.F32), scaled
# (FMUL) and accumulated (FFMA)), so each step pays its loads' latency and its arithmetic one after the other:
# block-FP8 gate_up read at ~1.8 TB/s (benchmarks/results/kernels.md, 2026-11-30). Model-dtype and FP8 experts
# only; blocked scales need BLOCK_K <= 128 (one scale block a step).
# The load-time choice times them only with $TRITONLLM_MOE_GEMV_AHEAD=1 until an H200 has measured them (each
# candidate is a compile at a cold engine load).
AHEAD = "a"
AHEAD_ENV = "TRITONLLM_MOE_GEMV_AHEAD"
# With STEP_SUMS ("s", blocked scales only) each step's products are summed over the step's 128 columns first and
# the block scale multiplies that sum once a row (a few shuffles a step), where the plain form scales x per weight
# (an FMUL a weight a thread).
STEP_SUMS = "s"
# ONE_LOAD ("l"): each step's BLOCK_K columns (up to all of K) in one load of (BLOCK_N, BLOCK_K / 128, 128), so
# all of a step's 16-byte loads issue back to back before any arithmetic, and each step's products are summed to
# one value a row at once (no float32 accumulator tile carried between steps). Model-dtype and FP8 experts. (sm_90,
# Triton 3.9: 140-172 registers at 64 weights a thread a step; 128 a thread (8 x 2048, 4 warps) took 220, 16 x 2048
# with 8 warps 255 and a stack, 32 x 1024 with 8 warps (bf16 / FP8 gate_up) a 16-224-byte stack.)
ONE_LOAD = "l"
# (H200, 2026-11-30, Qwen3-30B-A3B bf16 experts in the engine's choice: the AHEAD tiles tie the plain ones, 28.1-31.6
# against 26.2 us for gate_up at one token, 42.3 against 42.4 at two; (16, 128, 2) and (32, 128, 8) were the ones
# chosen, the others are gone from the list. Block-FP8 not yet timed.)
AHEAD_TILES = ((16, 128, 2, 1, AHEAD), (32, 128, 8, 1, AHEAD),
               (16, 128, 2, 1, AHEAD + STEP_SUMS), (32, 128, 4, 1, AHEAD + STEP_SUMS),
               (16, 1024, 8, 1, ONE_LOAD), (8, 1024, 4, 1, ONE_LOAD), (32, 512, 8, 1, ONE_LOAD),
               (64, 256, 8, 1, ONE_LOAD))
# DOT ("d"; model-dtype and FP8 experts): each step's (BLOCK_N, BLOCK_K) weights widened to x's dtype (FP8 exactly:
# E4M3 values lie in bfloat16 and float16) and multiplied on the tensor cores, tl.dot against a (BLOCK_K, DOT_COLS)
# tile whose column 0 is x's slice and whose other columns are 0 (masked off, never loaded), so acc (BLOCK_N,
# DOT_COLS) holds the row sums in column 0; blocked scales multiply each step's (BLOCK_K <= 128: one scale block)
# float32 product. Why: with a dot in the loop Triton software-pipelines the loop's loads (num_stages shared-memory
# stages filled by cp.async), so later steps' weights stream while this step's products run, where the plain loop
# issues a step's loads only after the previous step's arithmetic (H200, 2026-12-01, Qwen3-30B-A3B block-FP8 at one
# token: gate_up 14.6 us a layer, ~1.7 TB/s, down ~1.9 TB/s); and the CUDA cores keep only the widening (the plain
# loop's FMUL and FFMA a weight go to the tensor cores). A digit S in the options (DOT tiles only) splits K over S
# programs (grid (..., S)): each stores its float32 row sums, and the tile's last arrival (kernels/linear.py's
# self-resetting arrival counters) adds them in split order (deterministic) and finishes the tile: S times the
# programs (Qwen3-30B-A3B's gate_up at one token: 8 x 48 programs of 16 rows without a split).
# The load-time choice times them unless $TRITONLLM_MOE_GEMV_DOT=0. (H200, 2026-12-01, Qwen3-30B-A3B block-FP8, call
# 7 of session 28: the BITS tiles chosen at every count, the expert pair 17.7 / 28.3 / 47.2 / 85.4 us at 1 / 2 / 4 / 8
# tokens against 21.5 / 30.8 / 57.8 / 95.2 (at 8: the grouped path) before; the Triton-widened FP8 DOT tiles behind
# BITS; a cold load's choices 52.3 s against 12.1 with the dense BITS tilings: benchmarks/results/kernels.md.)
DOT = "d"
DOT_ENV = "TRITONLLM_MOE_GEMV_DOT"
# The x tile's columns: the mma's N (m16n8k16: Triton 3.9 takes N = 8 on sm_90). Against 16 (two n-tiles, the second
# all zeros): (16, 128, 1, 4) BITS gate_up 360 SASS instructions a step against 422 (16 HMMAs, not 32, and fewer
# moves into the B fragments), 78 registers against 128, half the x tile's shared memory (2 KB a stage).
DOT_COLS = 8
BITS = "b"  # (FP8 DOT tiles: the codes widened by bits, kernels/e4m3_bits.py)
# One warp a 16 rows: the mma's warps lie along the rows, so no warp widens another's weights (16 rows on 2 warps:
# each warp widened all 16). sm_90, Triton 3.9, Qwen3-30B-A3B block-FP8 gate_up: (16, 128, 1, 4) mma.sync, 18 KB
# of shared memory (three stages in flight: 12 KB of weights a program); (64, 128, 4, 3) wgmma, 166 registers.
# Triton widens an FP8 weight to bfloat16 in 1.5 conversion-unit instructions (F2FP a float16 pair, F2F a value) and
# a PRMT: BITS_TILES widen by bits instead (loop of (16, 128, 1, 4): 360 SASS instructions a step, 128 weights a
# thread, none of them conversions).
DOT_TILES = ((16, 128, 1, 4, DOT), (32, 128, 2, 4, DOT), (64, 128, 4, 3, DOT), (16, 128, 1, 4, DOT + "2"),
             (32, 128, 2, 4, DOT + "2"), (16, 128, 1, 4, DOT + "4"), (16, 128, 1, 3, DOT + "8"))
# (FP8 experts take BITS_TILES alone: the DOT tiles that widen E4M3 as Triton does (F2FP + F2F) trailed their BITS
# twins at every token count and were dropped from the candidates, as were the BITS splits 4 and 8, which never won:
# H200, 2026-12-01, Qwen3-30B-A3B block-FP8, session 28 call 7; each candidate is two compiles at a cold load.)
# (No 64-row wgmma BITS tile: its A operand from registers took 288 PRMTs a step, 5.3 SASS instructions a weight
# against mma.sync's 3.3; sm_90, Triton 3.9.)
# Lost and dropped (H200, Qwen3-30B-A3B block-FP8, session 29 calls 2 and 4; one-token pair 17.9-18.0 us with
# (16, 128, 1, 4, db)): deeper pipelines, (16, 128, 1, 7 / 9, db) 18.8 / 19.4 (all six down steps or eight of gate_up's
# sixteen in flight); two / four warps a program, each a part of its K range (a batched dot over a parts axis, summed
# at the end: 337 / 330 sm_90 instructions a warp's step), gate_up 19.9 / 19.4 and down 24.2 at one token, behind at
# every count but gate_up at two (28.7 against 28.5).
BITS_TILES = ((16, 128, 1, 4, DOT + BITS), (16, 128, 1, 4, DOT + BITS + "2"), (32, 128, 2, 4, DOT + BITS + "2"))
# BITS tiles whose blocked-scale steps span 2 / 4 scale blocks (_stream_wide_steps): 256 / 512 contiguous bytes a row
# a step, where a 128-column step asks each of a program's rows for 128 (~12,000 such requests in flight at one token
# land on as many DRAM pages). Timed (H200, session 30 call 1, Qwen3-30B-A3B block-FP8, moe_gemv_bench --gemv-tiles,
# the pair's us with down on (16, 128, 1, 4, db)): gate_up on (16, 256, 1, 4, db) 16.9 us at one token and 27.7 at two
# against 17.9 / 29.4, on (16, 512, 1, 3, db) 17.3 / 31.6; down lost on both (20.9 / 22.2 against 16.9). So the
# 256-column tile is a block-FP8 candidate (WIDE_STEP_CANDIDATES, for either product: the choice times each), the
# 512-column one stays out (two compiles a cold load for a tile that never won).
WIDE_STEP_TILES = ((16, 256, 1, 4, DOT + BITS), (16, 512, 1, 3, DOT + BITS))
WIDE_STEP_CANDIDATES = WIDE_STEP_TILES[:1]
GEMV_TILES = ((16, 512, 4, 2), (16, 256, 4, 2), (8, 512, 2, 2), (8, 1024, 4, 2), (16, 1024, 8, 2), (32, 256, 4, 2),
              (32, 512, 8, 2), (64, 256, 8, 2)) + AHEAD_TILES + DOT_TILES + BITS_TILES + WIDE_STEP_CANDIDATES
DEFAULT_TILES = ((16, 512, 4, 2), (16, 256, 4, 2))
# FP8 experts' plain tiles while the DOT tiles are timed: the BITS tiles won at every count but one (Qwen3-30B-A3B
# block-FP8 down at 2 tokens: (16, 256, 4, 2), also the down tile that gate_up's candidates are timed with), and
# (8, 1024, 4, 2), Llama 4 Scout's choice before the BITS tiles (FP8 per channel at every count, block-FP8 at 2).
# Each candidate is two compiles at a cold load (H200, session 29 call 2: the choice took 21.4 s of 42.9).
FP8_PLAIN_TILES = ((16, 256, 4, 2), (8, 1024, 4, 2))
assert all(t in GEMV_TILES for t in DEFAULT_TILES)


def ahead(tile: tuple) -> bool:
    """Whether a GEMV tile loads a step ahead (AHEAD) or a whole step at once (ONE_LOAD): the AHEAD_TILES forms."""
    return any(AHEAD in option or ONE_LOAD in option for option in tile[4:])


def one_load(tile: tuple) -> bool:
    """Whether a GEMV tile loads each step in one load (ONE_LOAD)."""
    return any(ONE_LOAD in option for option in tile[4:])


def dot_tile(tile: tuple) -> bool:
    """Whether a GEMV tile multiplies on the tensor cores (DOT)."""
    return any(DOT in option for option in tile[4:])


def bits_tile(tile: tuple) -> bool:
    """Whether a DOT tile widens FP8 codes by bits (BITS)."""
    return dot_tile(tile) and any(BITS in option for option in tile[4:])


def _dot_candidate(tile: tuple, kind: int) -> bool:
    """Whether candidate_tiles keeps ``tile`` for weights of ``kind`` as far as DOT goes (every other tile: yes)."""
    if not dot_tile(tile):
        return True
    if kind in (INT4_GROUPS, MXFP4_GROUPS) or os.environ.get(DOT_ENV, "1").strip() == "0":
        return False
    if kind == NO_SCALES:
        return not bits_tile(tile)
    if tile in WIDE_STEP_CANDIDATES:
        return kind == BLOCK_SCALES
    if kind == BLOCK_SCALES and tile[1] > SCALE_BLOCK:
        return False
    return bits_tile(tile)


def tile_split(tile: tuple) -> int:
    """The programs a DOT tile splits K over (the digits of its options), 1 without digits."""
    digits = "".join(c for option in tile[4:] for c in option if c.isdigit())
    return int(digits) if digits else 1


def step_sums(tile: tuple) -> bool:
    """Whether an AHEAD tile scales each step's row sums (STEP_SUMS) rather than x."""
    return any(STEP_SUMS in option for option in tile[4:])


def candidate_tiles(kind: int) -> tuple:
    """GEMV_TILES a weight kind compiles without spills (sm_90, Triton 3.9): 4-bit steps of at most 512 bytes
    (1,024 unrolls eight pieces of two activation slices each: 255 registers and a 184-byte stack); AHEAD tiles for
    model-dtype and FP8 experts, blocked scales at BLOCK_K <= 128, with $TRITONLLM_MOE_GEMV_AHEAD=1; unless
    $TRITONLLM_MOE_GEMV_DOT=0, DOT_TILES for model-dtype experts, BITS_TILES for FP8 ones (blocked scales: BLOCK_K <=
    128) with FP8_PLAIN_TILES alone of the plain ones."""
    packed = kind in (INT4_GROUPS, MXFP4_GROUPS)
    timed_ahead = os.environ.get(AHEAD_ENV, "0").strip() == "1"
    fp8_dot = kind in (ROW_SCALES, BLOCK_SCALES) and os.environ.get(DOT_ENV, "1").strip() != "0"
    return tuple(t for t in GEMV_TILES if (not packed or t[1] <= 512) and _dot_candidate(t, kind)
                 and not (fp8_dot and not dot_tile(t) and not ahead(t) and t not in FP8_PLAIN_TILES)
                 and not (ahead(t) and (packed or not timed_ahead
                                        or (kind == BLOCK_SCALES and t[1] > SCALE_BLOCK and not one_load(t))))
                 and not (step_sums(t) and kind != BLOCK_SCALES))


@dataclass
class GemvExperts:
    """One sparse layer's routed experts as this path and its load-time choice take them (a model's
    ``decode_experts``): gate_up / down and their scales and zeros as moe_gemv_triton's arguments, the experts a
    token, the activations' dtype; ``wna16``: 4-bit experts' WNA16Experts pair (kernels/fused_moe_wna16.py), or
    ``mxfp4``: MXFP4 experts' MXFP4Experts pair (kernels/fused_moe_mxfp4.py), the grouped path's arguments, which
    the choice times against; ``epilogue``: the experts' biases and activation (gpt-oss)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    dtype: torch.dtype
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gate_up_zero: torch.Tensor | None = None
    down_zero: torch.Tensor | None = None
    wna16: tuple | None = None
    mxfp4: tuple | None = None
    epilogue: ExpertEpilogue = PLAIN_SILU

    def quantization(self) -> dict:
        """moe_gemv_triton's scale, zero and epilogue keywords."""
        return dict(gate_up_scale=self.gate_up_scale, down_scale=self.down_scale, gate_up_zero=self.gate_up_zero,
                    down_zero=self.down_zero, epilogue=self.epilogue)


class SharedExpert(NamedTuple):
    """An expert outside the stacks that rows with id E (the stacks' expert count) go through, read where it lies
    (Llama 4's shared expert: its Linears' weights; engine/models/llama4.py): gate_up (2I, H), down (H, I) and, FP8,
    their scales, each of the stacks' slot shape, dtype and strides (model-dtype or FP8 experts; no biases).
    Why not a slot of the stacks: an (E + 1) stack is a second copy of the routed experts at load (torch.cat), whose
    freed E stacks fragmented the caching allocator until an H200's Scout FP8 load ran out of memory."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def suits(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
              down_scale: torch.Tensor | None) -> bool:
        """Whether each tensor has its stack's slot shape, dtype and strides (and scales where the stacks have them)."""
        pairs = ((self.gate_up, gate_up), (self.down, down), (self.gate_up_scale, gate_up_scale),
                 (self.down_scale, down_scale))
        return all((mine is None) == (stack is None) and (
            mine is None or (mine.shape == stack.shape[1:] and mine.dtype == stack.dtype
                             and mine.stride() == stack.stride()[1:] and mine.device == stack.device))
            for mine, stack in pairs)


def scale_kind(gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None) -> int:
    """NO_SCALES (model-dtype experts), ROW_SCALES (FP8 per channel), BLOCK_SCALES (FP8 128 x 128), INT4_GROUPS
    (4-bit codes in kernels/fused_moe_wna16.py's kernel layout, uint8, float32 scales) or MXFP4_GROUPS (E2M1 codes
    in kernels/fused_moe_mxfp4.py's kernel layout, uint8 E8M0 exponents)."""
    if gate_up_scale is None:
        return NO_SCALES
    if gate_up.dtype == torch.uint8:
        return MXFP4_GROUPS if gate_up_scale.dtype == torch.uint8 else INT4_GROUPS
    assert gate_up.dtype == FP8_DTYPE, f"scaled GEMV experts are {FP8_DTYPE} or 4-bit codes, got {gate_up.dtype}"
    return ROW_SCALES if gate_up_scale.dim() == 2 else BLOCK_SCALES


def int4_piece(stored: int, group: int, block_k: int) -> int:
    """SUB_K of 4-bit experts: the largest power of two <= min(block_k, 128), at least 16, dividing the group size
    and the stored bytes a row (so each piece's low and high columns lie in one group each); 0 where none does."""
    size = min(block_k, 128)
    while size >= 16:
        if group % size == 0 and stored % size == 0:
            return size
        size //= 2
    return 0


def gemv_supported(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None,
                   down_scale: torch.Tensor | None = None, *, tiles: tuple = DEFAULT_TILES,
                   epilogue: ExpertEpilogue = PLAIN_SILU) -> bool:
    """1..MAX_TOKENS tokens, gated experts in x's dtype, FP8, 4 bits or MXFP4, and scales each of ``tiles`` (tile
    tuples: a (gate_up, down) pair or the candidates) suits: blocked FP8 scales whose 128-row blocks the tiles do
    not straddle; 4-bit and MXFP4 groups that hold whole pieces (int4_piece); a gated activation (not relu2)."""
    if not 1 <= x.shape[0] <= MAX_TOKENS or not epilogue.gated:
        return False
    if gate_up_scale is None:
        return gate_up.dtype == x.dtype
    inter = gate_up.shape[1] // 2
    if gate_up.dtype == torch.uint8:  # (AHEAD is a no-op for 4-bit codes: candidate_tiles leaves such tiles out)
        stored_h, hidden = gate_up.shape[2], x.shape[1]
        if down_scale is None or hidden != 2 * stored_h or inter % 2:
            return False
        group, group_down = hidden // gate_up_scale.shape[1], inter // down_scale.shape[1]
        if gate_up_scale.dtype == torch.uint8 and not (group == group_down == MXFP4_GROUP and inter % 64 == 0):
            return False  # (MXFP4: K_pad == K, the layout's padding to 64 columns absent)
        return all(int4_piece(stored_h, group, t[1]) and int4_piece(inter // 2, group_down, t[1]) for t in tiles)
    if gate_up.dtype != FP8_DTYPE:
        return False
    return gate_up_scale.dim() == 2 or (inter % SCALE_BLOCK == 0 and all(SCALE_BLOCK % t[0] == 0 for t in tiles)
                                        and all(t[1] <= SCALE_BLOCK or (dot_tile(t) and t[1] % SCALE_BLOCK == 0)
                                                for t in tiles if (ahead(t) and not one_load(t)) or dot_tile(t)))


# ---- reference -------------------------------------------------------------------------------

def moe_gemv_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU,
                 shared_expert: SharedExpert | None = None) -> torch.Tensor:
    """The module docstring's numerics, one (token, expert) at a time: out_k (T, K, H) in x's dtype. 4-bit and
    MXFP4 experts: pass them dequantized (their ``dense`` widening), no scales. Id E: ``shared_expert``."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = gate_up.shape[1] // 2
    out = x.new_empty(num_tokens, top_k, hidden)
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(topk_ids[t, k])
            if shared_expert is not None and e == gate_up.shape[0]:
                w_gate_up, w_down, s_gate_up, s_down = shared_expert
            else:
                w_gate_up, w_down = gate_up[e], down[e]
                s_gate_up = None if gate_up_scale is None else gate_up_scale[e]
                s_down = None if down_scale is None else down_scale[e]
            h = x[t].float() @ _dequantized(w_gate_up, s_gate_up).T
            if epilogue.gate_up_bias is not None:
                h = h + epilogue.gate_up_bias[e].float()
            act = _activation_ref(h[:inter], h[inter:], epilogue).to(x.dtype)
            y = act.float() @ _dequantized(w_down, s_down).T
            if epilogue.down_bias is not None:
                y = y + epilogue.down_bias[e].float()
            out[t, k] = (y * float(topk_weights[t, k])).to(x.dtype)
    return out


def _activation_ref(gate: torch.Tensor, up: torch.Tensor, epilogue: ExpertEpilogue) -> torch.Tensor:
    """The gated activation in float32, unrounded (the kernels round it once, with the store)."""
    if epilogue.activation == "silu":
        return F.silu(gate) * up
    return swiglu_clamped_ref(gate, up, epilogue.swiglu_limit)


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _stream_rows(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, TWO: tl.constexpr,
                 BLOCK_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr):
    """(acc, acc_2) (BLOCK_N, SUB_K) float32 plus the products of weight rows ``w_rows`` (pointers (BLOCK_N, 1);
    and ``w_rows_2`` into acc_2 when TWO: gate and up in one pass) with the vector at x_ptr over all K columns,
    BLOCK_K columns a step in SUB_K-column pieces (unrolled: every piece's loads in flight at once). When
    BLOCK_SCALED (SUB_K divides 128) each piece's x is scaled by its 128-column block's scale at s_row / s_row_2
    (the tiles' scale rows), one scalar load a piece. x is loaded as a (BLOCK_N, SUB_K) broadcast in the weight
    tile's layout: repeated addresses hit L1, and no layout conversion goes through shared memory."""
    zero_rows = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            k = k0 + j * SUB_K + tl.arange(0, SUB_K)
            k_ok = (zero_rows + k[None, :]) < K
            w = tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0).to(tl.float32)
            if TWO:
                w_2 = tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0).to(tl.float32)
            xk = tl.load(x_ptr + zero_rows + k[None, :], mask=k_ok, other=0.0).to(tl.float32)
            if BLOCK_SCALED:
                piece_ok = k0 + j * SUB_K < K
                acc += w * (xk * tl.load(s_row + (k0 + j * SUB_K) // 128, mask=piece_ok, other=0.0))
                if TWO:
                    acc_2 += w_2 * (xk * tl.load(s_row_2 + (k0 + j * SUB_K) // 128, mask=piece_ok, other=0.0))
            else:
                acc += w * xk
                if TWO:
                    acc_2 += w_2 * xk
    return acc, acc_2


@jit
def _carried(w, FP8: tl.constexpr):
    """A step's weights as _stream_rows_ahead carries them to the next step: FP8 widened to float16 (exact; two a
    register, where carried FP8 bytes took a register each and a PRMT to pack: sm_90, Triton 3.9), else as loaded."""
    if FP8:
        return w.to(tl.float16)
    else:
        return w


@jit
def _stream_rows_ahead(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, TWO: tl.constexpr,
                       BLOCK_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
                       STEP_SUMS: tl.constexpr):
    """_stream_rows with one BLOCK_K-column piece a step (acc (BLOCK_N, BLOCK_K)), its weights, x and block scales
    loaded a step ahead (GEMV_TILES' AHEAD): the loads of step k + 1 are issued before the FMAs of step k. Blocked
    scales: BLOCK_K divides 128 (one scale a step). The loads past K are masked off (no memory traffic). FP8
    weights are carried as float16 (_carried). STEP_SUMS (blocked scales; acc (BLOCK_N, 1)): each step's products
    summed over its columns, then scaled once a row."""
    zero_rows = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    k = tl.arange(0, BLOCK_K)
    k_ok = (zero_rows + k[None, :]) < K
    w = _carried(tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0), FP8)
    w_2 = w
    if TWO:
        w_2 = _carried(tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0), FP8)
    xk = tl.load(x_ptr + zero_rows + k[None, :], mask=k_ok, other=0.0)
    s = 1.0
    s_2 = 1.0
    if BLOCK_SCALED:
        s = tl.load(s_row)
        s_2 = tl.load(s_row_2)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = (zero_rows + k[None, :]) < K
        w_next = _carried(tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0), FP8)
        w_2_next = w_next
        if TWO:
            w_2_next = _carried(tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok, other=0.0), FP8)
        x_next = tl.load(x_ptr + zero_rows + k[None, :], mask=k_ok, other=0.0)
        s_next = s
        s_2_next = s_2
        if BLOCK_SCALED:
            next_ok = k0 + BLOCK_K < K
            s_next = tl.load(s_row + (k0 + BLOCK_K) // 128, mask=next_ok, other=0.0)
            s_2_next = tl.load(s_row_2 + (k0 + BLOCK_K) // 128, mask=next_ok, other=0.0)
        xf = xk.to(tl.float32)
        if BLOCK_SCALED and STEP_SUMS:  # acc (BLOCK_N, 1): the step's row sums, scaled once
            acc += tl.sum(w.to(tl.float32) * xf, 1, keep_dims=True) * s
            if TWO:
                acc_2 += tl.sum(w_2.to(tl.float32) * xf, 1, keep_dims=True) * s_2
        elif BLOCK_SCALED:
            acc += w.to(tl.float32) * (xf * s)
            if TWO:
                acc_2 += w_2.to(tl.float32) * (xf * s_2)
        else:
            acc += w.to(tl.float32) * xf
            if TWO:
                acc_2 += w_2.to(tl.float32) * xf
        w = w_next
        w_2 = w_2_next
        xk = x_next
        s = s_next
        s_2 = s_2_next
    return acc, acc_2


@jit
def _stream_rows_at_once(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, TWO: tl.constexpr,
                         BLOCK_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_stream_rows for ONE_LOAD tiles (acc (BLOCK_N, 1)): each step one (BLOCK_N, BLOCK_K / 128, 128) load of the
    weight rows (and of up's with TWO) and of x, the pieces' block scales one (1, pieces, 1) load, and the step's
    products summed to one value a row (in-thread, then across threads) into acc. BLOCK_K a multiple of 128."""
    PIECES: tl.constexpr = BLOCK_K // 128
    zero3 = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32)
    piece = tl.arange(0, PIECES)[None, :, None] * 128
    col = tl.arange(0, 128)[None, None, :]
    rows3_ok = rows_ok[:, None, None]
    w3 = w_rows[:, :, None]
    w3_2 = w_rows_2[:, :, None]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + piece + col
        k_ok = (zero3 + k) < K
        w = tl.load(w3 + k, mask=rows3_ok & k_ok, other=0.0)
        w_2 = w
        if TWO:
            w_2 = tl.load(w3_2 + k, mask=rows3_ok & k_ok, other=0.0)
        xk = tl.load(x_ptr + zero3 + k, mask=k_ok, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            piece_ok = k0 + piece < K
            xs = xk * tl.load(s_row + (k0 + piece) // 128, mask=piece_ok, other=0.0)
            acc += tl.sum(tl.sum(w.to(tl.float32) * xs, 2), 1, keep_dims=True)
            if TWO:
                xs_2 = xk * tl.load(s_row_2 + (k0 + piece) // 128, mask=piece_ok, other=0.0)
                acc_2 += tl.sum(tl.sum(w_2.to(tl.float32) * xs_2, 2), 1, keep_dims=True)
        else:
            acc += tl.sum(tl.sum(w.to(tl.float32) * xk, 2), 1, keep_dims=True)
            if TWO:
                acc_2 += tl.sum(tl.sum(w_2.to(tl.float32) * xk, 2), 1, keep_dims=True)
    return acc, acc_2


@jit
def _dot_product(w, xt):
    """(BLOCK_N, DOT_COLS) float32 w @ xt on the tensor cores, w widened to xt's dtype (exact for FP8 weights);
    float32 activations (the interpreter's tests) in IEEE float32, not TF32."""
    if xt.dtype == tl.float32:
        return tl.dot(w.to(tl.float32), xt, input_precision="ieee")
    else:
        return tl.dot(w.to(xt.dtype), xt)


@jit
def _step_product(w, xt, BITS: tl.constexpr, ASM: tl.constexpr):
    """One step's (BLOCK_N, COLS) float32 w @ xt: _dot_product, or with BITS the codes widened by bits
    (kernels/e4m3_bits.py) and the product multiplied back (exact powers of two)."""
    if BITS:
        if xt.dtype == tl.float32:
            return tl.dot(widened_bits(w, tl.float32, ASM), xt, input_precision="ieee") * bits_factor(tl.float32)
        else:
            return tl.dot(widened_bits(w, xt.dtype, ASM), xt) * bits_factor(xt.dtype)
    else:
        return _dot_product(w, xt)


@jit
def _stream_rows_dot(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, k_begin, k_end,
                     TWO: tl.constexpr, BLOCK_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     COLS: tl.constexpr, BITS: tl.constexpr = False, ASM: tl.constexpr = False):
    """_stream_rows for DOT tiles over columns [k_begin, k_end) (k_begin a multiple of BLOCK_K; k_end a multiple
    of it or K): acc (BLOCK_N, COLS) += (w_rows' BLOCK_K columns) @ (x's slice in column 0 of a (BLOCK_K, COLS)
    tile, 0 in the others), and likewise acc_2 with TWO; blocked scales (BLOCK_K divides 128) multiply each step's
    float32 product by its block's scale. Column 0 of acc ends as the rows' sums, the others 0. BITS: FP8 codes
    widened by bits (_step_product). Blocked scales with BLOCK_K a multiple of 128 (WIDE_STEP_TILES): each step's
    128-column blocks loaded together, each its own dot and scale (_stream_wide_steps)."""
    if BLOCK_SCALED and BLOCK_K > 128:
        return _stream_wide_steps(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, k_begin, k_end,
                                  TWO, BLOCK_N, BLOCK_K, COLS, BITS, ASM)
    col = tl.arange(0, COLS)[None, :]
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + k[:, None] + col * 0, mask=k_ok[:, None] & (col == 0), other=0.0)
        w = tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        if TWO:
            w_2 = tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_SCALED:
            acc += _step_product(w, xt, BITS, ASM) * tl.load(s_row + k0 // 128)
            if TWO:
                acc_2 += _step_product(w_2, xt, BITS, ASM) * tl.load(s_row_2 + k0 // 128)
        else:
            acc += _step_product(w, xt, BITS, ASM)
            if TWO:
                acc_2 += _step_product(w_2, xt, BITS, ASM)
    return acc, acc_2


@jit
def _stream_wide_steps(acc, acc_2, x_ptr, w_rows, w_rows_2, rows_ok, s_row, s_row_2, K, k_begin, k_end,
                       TWO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr,
                       BITS: tl.constexpr, ASM: tl.constexpr):
    """_stream_rows_dot with blocked scales and BLOCK_K a multiple of 128: each step's BLOCK_K / 128 blocks of a row
    requested back to back (BLOCK_K contiguous bytes of FP8 a row, where 128-column steps ask each row for 128 bytes a
    step), each block's dot times its own scale. A block past K loads zeros and reads the last block's scale (in
    bounds); splits share whole BLOCK_K steps (_split_columns), so no block straddles a share."""
    col = tl.arange(0, COLS)[None, :]
    for k0 in range(k_begin, k_end, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // 128):
            start = k0 + sub * 128
            k = start + tl.arange(0, 128)
            k_ok = k < K
            xt = tl.load(x_ptr + k[:, None] + col * 0, mask=k_ok[:, None] & (col == 0), other=0.0)
            w = tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            block = tl.minimum(start, K - 1) // 128
            acc += _step_product(w, xt, BITS, ASM) * tl.load(s_row + block)
            if TWO:
                w_2 = tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
                acc_2 += _step_product(w_2, xt, BITS, ASM) * tl.load(s_row_2 + block)
    return acc, acc_2


@jit
def _split_columns(K, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_begin, k_end) of this program's share of K (program_id(2) of SPLIT): whole BLOCK_K steps, the last
    share shorter (or empty)."""
    if SPLIT == 1:
        return 0, K
    else:
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        k_begin = tl.program_id(2) * per_split
        return k_begin, tl.minimum(k_begin + per_split, K)


@jit
def _stream_int4_rows(acc, acc_2, x_ptr, w_rows, w_rows_2, rows, rows_2, rows_ok, s_ptr, z_ptr, stride_sg, KS, group,
                      TWO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                      MXFP4: tl.constexpr):
    """_stream_rows for 4-bit codes in kernels/fused_moe_wna16.py's kernel layout: byte j of a row holds columns j
    (low nibble) and KS + j (high nibble), KS the stored bytes a row; scale / zero (groups, N) of the expert at
    s_ptr / z_ptr (group stride stride_sg), one pair a row a piece (SUB_K divides the group size and KS).
    A code becomes a float by its bits (0x4B000000 | code is 2^23 + code), less 2^23 + zero exactly, times the
    scale: (code - zero) * scale as the reference dequantizes it, in float32. MXFP4: E2M1 codes and E8M0 exponents
    at s_ptr (no zeros), each code's value times 2^(exponent - 127) exactly (_mxfp4_products)."""
    zero_rows = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    for k0 in range(0, KS, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB_K):
            kb = k0 + j * SUB_K
            k = kb + tl.arange(0, SUB_K)
            k_ok = (zero_rows + k[None, :]) < KS
            piece_ok = rows_ok & ((rows * 0 + kb) < KS)
            q = tl.load(w_rows + k[None, :], mask=rows_ok[:, None] & k_ok, other=0).to(tl.int32)
            x_lo = tl.load(x_ptr + zero_rows + k[None, :], mask=k_ok, other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + KS + zero_rows + k[None, :], mask=k_ok, other=0.0).to(tl.float32)
            g_lo = (kb // group) * stride_sg
            g_hi = ((KS + kb) // group) * stride_sg
            if MXFP4:
                acc += _mxfp4_products(q, x_lo, x_hi, s_ptr, g_lo, g_hi, rows, piece_ok)
            else:
                acc += _int4_products(q, x_lo, x_hi, s_ptr, z_ptr, g_lo, g_hi, rows, piece_ok)
            if TWO:
                q_2 = tl.load(w_rows_2 + k[None, :], mask=rows_ok[:, None] & k_ok, other=0).to(tl.int32)
                if MXFP4:
                    acc_2 += _mxfp4_products(q_2, x_lo, x_hi, s_ptr, g_lo, g_hi, rows_2, piece_ok)
                else:
                    acc_2 += _int4_products(q_2, x_lo, x_hi, s_ptr, z_ptr, g_lo, g_hi, rows_2, piece_ok)
    return acc, acc_2


@jit
def _int4_products(q, x_lo, x_hi, s_ptr, z_ptr, g_lo, g_hi, rows, ok):
    """(BLOCK_N, SUB_K) float32: both nibbles of the bytes q dequantized (their groups' scale and zero of each
    row) times their columns of x."""
    s_lo = tl.load(s_ptr + g_lo + rows, mask=ok, other=0.0)[:, None]
    s_hi = tl.load(s_ptr + g_hi + rows, mask=ok, other=0.0)[:, None]
    z_lo = 8388608.0 + tl.load(z_ptr + g_lo + rows, mask=ok, other=0).to(tl.float32)[:, None]
    z_hi = 8388608.0 + tl.load(z_ptr + g_hi + rows, mask=ok, other=0).to(tl.float32)[:, None]
    lo = ((q & 15) | 0x4B000000).to(tl.float32, bitcast=True) - z_lo
    hi = (((q >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - z_hi
    return lo * (x_lo * s_lo) + hi * (x_hi * s_hi)


@jit
def _mxfp4_products(q, x_lo, x_hi, s_ptr, g_lo, g_hi, rows, ok):
    """(BLOCK_N, SUB_K) float32: both E2M1 nibbles of the bytes q as their values * 2^-14 (float16 bits), times
    their columns of x scaled by 2^(exponent - 113) of their group and row: value * 2^(exponent - 127) * x, the
    same float32 product as the dequantized weight's (scaling by powers of two is exact)."""
    f_lo = exponent_factor(tl.load(s_ptr + g_lo + rows, mask=ok, other=0))[:, None]
    f_hi = exponent_factor(tl.load(s_ptr + g_hi + rows, mask=ok, other=0))[:, None]
    lo = low_codes(q).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = high_codes(q).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo * (x_lo * f_lo) + hi * (x_hi * f_hi)


@jit
def _activated(gate, up, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr):
    """_activation_ref in float32: SiLU(gate) * up (ACTIVATION 0) or the clamped SwiGLU (1, gpt-oss)."""
    if ACTIVATION == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    return swiglu_clamped(gate, up, SWIGLU_LIMIT)


@jit
def _expert_bases(expert, e64, w_ptr, s_ptr, shared_w_ptr, shared_s_ptr, num_experts, stride_we, stride_se,
                  HAS_SHARED: tl.constexpr):
    """(expert e's weight base, its scale base): slot e of the stacks, or with HAS_SHARED and e == num_experts the
    shared expert's own tensors (SharedExpert: the stacks' slot shapes and strides). A scalar select a program: each
    program's rows belong to one expert."""
    w_expert = w_ptr + e64 * stride_we
    s_expert = s_ptr + e64 * stride_se
    if HAS_SHARED:
        is_shared = expert == num_experts
        w_expert = tl.where(is_shared, shared_w_ptr, w_expert)
        s_expert = tl.where(is_shared, shared_s_ptr, s_expert)
    return w_expert, s_expert


@jit
def _gemv_gate_up_kernel(
    x_ptr, logits_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, act_ptr, part_ptr, arrivals_ptr,
    shared_w_ptr, shared_s_ptr, num_experts, H, I, group, stride_x, stride_l, stride_we, stride_wn, stride_se,
    stride_sn, stride_be, stride_act,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr,
    RENORMALIZE: tl.constexpr, SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, PDL: tl.constexpr,
    AHEAD: tl.constexpr = False, ONE_LOAD: tl.constexpr = False, DOT: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    BITS: tl.constexpr = False, ASM: tl.constexpr = False, HAS_SHARED: tl.constexpr = False,
):
    """act[a, rows] = SiLU(gate_e . x[t]) * (up_e . x[t]) for assignment a = program_id(0) (token t = a // TOP_K,
    expert e its slot's) and the BLOCK_N rows of tile program_id(1) (module docstring, step 1). DOT tiles with
    SPLIT > 1: program_id(2)'s share of H, its sums in part_ptr ((T * K * SPLIT, 2I) float32), the tile's last
    arrival finishing (DOT_TILES). HAS_SHARED: expert id num_experts reads shared_w_ptr / shared_s_ptr
    (SharedExpert)."""
    pdl_prologue(PDL)
    a = tl.program_id(0)
    tile = tl.program_id(1)
    token = a // TOP_K
    if ROUTE_IN_KERNEL:
        chosen_w, chosen_id = _top_k_of_row(logits_ptr + token.to(tl.int64) * stride_l, num_experts, TOP_K, K_PAD,
                                            E_PAD, RENORMALIZE)
        is_slot = tl.arange(0, K_PAD) == a % TOP_K
        expert = tl.sum(tl.where(is_slot, chosen_id, 0), 0)
        if (tile == 0) & (tl.program_id(2) == 0):  # for the down launch
            tl.store(ids_ptr + a, expert)
            tl.store(weights_ptr + a, tl.sum(tl.where(is_slot, chosen_w, 0.0), 0))
    else:
        expert = tl.load(ids_ptr + a)
    e64 = expert.to(tl.int64)
    w_expert, s_expert = _expert_bases(expert, e64, w_ptr, s_ptr, shared_w_ptr, shared_s_ptr, num_experts, stride_we,
                                       stride_se, HAS_SHARED)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < I
    gate_rows = w_expert + rows.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + token.to(tl.int64) * stride_x
    # the tile's scale rows (blocked: BLOCK_N divides 128 and I % 128 == 0, so gate's and up's rows each lie in one)
    s_gate = s_expert + ((tile * BLOCK_N) // 128) * stride_sn
    s_up = s_expert + ((tile * BLOCK_N + I) // 128) * stride_sn
    acc = tl.zeros([BLOCK_N, SUB_K], dtype=tl.float32)
    if SCALES >= 3:  # H counts stored bytes; scale (/ zero) (E, groups, 2I): stride_sn is the group stride
        acc, acc_up = _stream_int4_rows(acc, acc, x_row, gate_rows, gate_rows + I * stride_wn, rows, rows + I, rows_ok,
                                        s_ptr + e64 * stride_se, z_ptr + e64 * stride_se, stride_sn, H, group, True,
                                        BLOCK_N, BLOCK_K, SUB_K, SCALES == 4)
    elif DOT:  # SUB_K == DOT_COLS
        k_begin, k_end = _split_columns(H, SPLIT, BLOCK_K)
        acc, acc_up = _stream_rows_dot(acc, acc, x_row, gate_rows, gate_rows + I * stride_wn, rows_ok, s_gate, s_up,
                                       H, k_begin, k_end, True, SCALES == 2, BLOCK_N, BLOCK_K, SUB_K, BITS, ASM)
    elif ONE_LOAD:  # SUB_K == 1
        acc, acc_up = _stream_rows_at_once(acc, acc, x_row, gate_rows, gate_rows + I * stride_wn, rows_ok, s_gate,
                                           s_up, H, True, SCALES == 2, BLOCK_N, BLOCK_K)
    elif AHEAD:  # SUB_K == BLOCK_K, or 1 with STEP_SUMS
        acc, acc_up = _stream_rows_ahead(acc, acc, x_row, gate_rows, gate_rows + I * stride_wn, rows_ok, s_gate, s_up,
                                         H, True, SCALES == 2, BLOCK_N, BLOCK_K, SCALES != 0, SUB_K == 1)
    else:
        acc, acc_up = _stream_rows(acc, acc, x_row, gate_rows, gate_rows + I * stride_wn, rows_ok, s_gate, s_up, H,
                                   True, SCALES == 2, BLOCK_N, BLOCK_K, SUB_K)
    gate = tl.sum(acc, 1)
    up = tl.sum(acc_up, 1)
    last, gate, up = last_split_pair(gate, up, part_ptr, arrivals_ptr, a, a * tl.num_programs(1) + tile, rows, rows_ok,
                                     I, SPLIT)
    if last:  # (SPLIT 1: every program)
        if SCALES == 1:
            gate *= tl.load(s_expert + rows, mask=rows_ok, other=0.0)
            up *= tl.load(s_expert + I + rows, mask=rows_ok, other=0.0)
        if HAS_BIAS:  # (E, 2I) rows [gate | up]
            gate += tl.load(bias_ptr + e64 * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
            up += tl.load(bias_ptr + e64 * stride_be + I + rows, mask=rows_ok, other=0.0).to(tl.float32)
        act = _activated(gate, up, ACTIVATION, SWIGLU_LIMIT)
        tl.store(act_ptr + a.to(tl.int64) * stride_act + rows, act.to(act_ptr.dtype.element_ty), mask=rows_ok)


@jit
def _gemv_down_kernel(
    act_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, arrivals_ptr, shared_w_ptr,
    shared_s_ptr, num_experts, H, I, group,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_o,
    SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr, AHEAD: tl.constexpr = False, ONE_LOAD: tl.constexpr = False, DOT: tl.constexpr = False,
    SPLIT: tl.constexpr = 1, BITS: tl.constexpr = False, ASM: tl.constexpr = False, HAS_SHARED: tl.constexpr = False,
):
    """out_k[a, rows] = w_a * (down_e[rows] . act[a]) for assignment a = program_id(0) and the BLOCK_N rows of
    tile program_id(1) (module docstring, step 2). DOT tiles with SPLIT > 1: program_id(2)'s share of I, its sums
    in part_ptr ((T * K * SPLIT, H) float32), the tile's last arrival finishing (DOT_TILES)."""
    pdl_prologue(PDL)
    a = tl.program_id(0)
    tile = tl.program_id(1)
    expert = tl.load(ids_ptr + a)
    e64 = expert.to(tl.int64)
    w_expert, s_expert = _expert_bases(expert, e64, w_ptr, s_ptr, shared_w_ptr, shared_s_ptr, num_experts, stride_we,
                                       stride_se, HAS_SHARED)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < H
    w_rows = w_expert + rows.to(tl.int64)[:, None] * stride_wn
    s_rows = s_expert + ((tile * BLOCK_N) // 128) * stride_sn
    acc = tl.zeros([BLOCK_N, SUB_K], dtype=tl.float32)
    act_row = act_ptr + a.to(tl.int64) * stride_act
    if SCALES >= 3:  # I counts stored bytes; scale (/ zero) (E, groups, H)
        acc, _ = _stream_int4_rows(acc, acc, act_row, w_rows, w_rows, rows, rows, rows_ok, s_ptr + e64 * stride_se,
                                   z_ptr + e64 * stride_se, stride_sn, I, group, False, BLOCK_N, BLOCK_K, SUB_K,
                                   SCALES == 4)
    elif DOT:  # SUB_K == DOT_COLS
        k_begin, k_end = _split_columns(I, SPLIT, BLOCK_K)
        acc, _ = _stream_rows_dot(acc, acc, act_row, w_rows, w_rows, rows_ok, s_rows, s_rows, I, k_begin, k_end, False,
                                  SCALES == 2, BLOCK_N, BLOCK_K, SUB_K, BITS, ASM)
    elif ONE_LOAD:  # SUB_K == 1
        acc, _ = _stream_rows_at_once(acc, acc, act_row, w_rows, w_rows, rows_ok, s_rows, s_rows, I, False,
                                      SCALES == 2, BLOCK_N, BLOCK_K)
    elif AHEAD:  # SUB_K == BLOCK_K, or 1 with STEP_SUMS
        acc, _ = _stream_rows_ahead(acc, acc, act_row, w_rows, w_rows, rows_ok, s_rows, s_rows, I, False, SCALES == 2,
                                    BLOCK_N, BLOCK_K, SCALES != 0, SUB_K == 1)
    else:
        acc, _ = _stream_rows(acc, acc, act_row, w_rows, w_rows, rows_ok, s_rows, s_rows, I, False, SCALES == 2,
                              BLOCK_N, BLOCK_K, SUB_K)
    y = tl.sum(acc, 1)
    if SPLIT > 1:
        tl.store(part_ptr + (a * SPLIT + tl.program_id(2)).to(tl.int64) * H + rows, y, mask=rows_ok)
        if last_arrival(arrivals_ptr, a * tl.num_programs(1) + tile, SPLIT):
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT):  # (in split order: deterministic)
                y += tl.load(part_ptr + (a * SPLIT + split).to(tl.int64) * H + rows, mask=rows_ok, other=0.0,
                             cache_modifier=".cg")
            _finish_down(y, s_expert, bias_ptr, weights_ptr, out_ptr, a, e64, rows, rows_ok, stride_be, stride_o,
                         SCALES, HAS_BIAS)
    else:
        _finish_down(y, s_expert, bias_ptr, weights_ptr, out_ptr, a, e64, rows, rows_ok, stride_be, stride_o, SCALES,
                     HAS_BIAS)


@jit
def _finish_down(y, s_expert, bias_ptr, weights_ptr, out_ptr, a, e64, rows, rows_ok, stride_be, stride_o,
                 SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row sums y (BLOCK_N,) float32 -> per-channel scales (s_expert: the expert's (H,)), bias, routing weight,
    rounded: out_k[a, rows]."""
    if SCALES == 1:
        y *= tl.load(s_expert + rows, mask=rows_ok, other=0.0)
    if HAS_BIAS:  # (E, H): the expert's row joins before its routing weight scales it
        y += tl.load(bias_ptr + e64 * stride_be + rows, mask=rows_ok, other=0.0).to(tl.float32)
    y *= tl.load(weights_ptr + a)
    tl.store(out_ptr + a.to(tl.int64) * stride_o + rows, y.to(out_ptr.dtype.element_ty), mask=rows_ok)


def moe_gemv_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, top_k: int,
                    router_logits: torch.Tensor | None = None, renormalize: bool = False,
                    topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                    gate_up_zero: torch.Tensor | None = None, down_zero: torch.Tensor | None = None,
                    tiles: tuple | None = None, sum_experts: bool = True,
                    epilogue: ExpertEpilogue = PLAIN_SILU, shared_expert: SharedExpert | None = None) -> torch.Tensor:
    """The two launches: out_k (T, K, H), or summed over K (T, H) with ``sum_experts`` (in x's dtype, accumulated in
    float32). Routing from ``router_logits`` (T, E) inside gate_up's launch, or ``topk_weights`` / ``topk_ids``
    (T, K) given.
    ``tiles``: (gate_up's, down's) (BLOCK_N, BLOCK_K, num_warps, num_stages[, options]: AHEAD, ONE_LOAD,
    STEP_SUMS, DOT with its split), else DEFAULT_TILES; split DOT tiles use kernels/linear.py's arrival counters
    (allocated at the first such call: an eager one, as the load-time choice's, before any graph capture). 4-bit experts:
    gate_up / down uint8 (E, 2I, H / 2) / (E, H, I / 2), scales float32 and zeros uint8 (E, K / G, N)
    (kernels/fused_moe_wna16.py's kernel layout); MXFP4 experts: the same codes' shapes, E8M0 exponents uint8
    (E, K / 32, N) (kernels/fused_moe_mxfp4.py's kernel layout), no zeros; BLOCK_K counts stored bytes.
    ``epilogue``: biases (gate_up (E, 2I), down (E, H), x's dtype) and the activation (silu, swiglu_clamped).
    ``shared_expert``: rows with id E (given ids only) go through it, read in place (SharedExpert)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    kind = scale_kind(gate_up, gate_up_scale)
    tiles = tiles or DEFAULT_TILES
    assert gemv_supported(x, gate_up, gate_up_scale, down_scale, tiles=tiles, epilogue=epilogue) and x.stride(1) == 1
    packed = kind in (INT4_GROUPS, MXFP4_GROUPS)
    k_gate_up, k_down = (hidden // 2, inter // 2) if packed else (hidden, inter)  # columns or bytes a row
    assert gate_up.is_contiguous() and down.is_contiguous() and down.shape == (num_experts, hidden, k_down)
    (gn, gk, gw, gs), (dn, dk, dw, ds) = tiles[0][:4], tiles[1][:4]
    gate_up_ahead, down_ahead = (ahead(t) and not one_load(t) and not packed for t in tiles)
    gate_up_once, down_once = (one_load(t) and not packed for t in tiles)
    gate_up_dot, down_dot = (dot_tile(t) and not packed for t in tiles)
    gate_up_bits, down_bits = (bits_tile(t) and kind in (ROW_SCALES, BLOCK_SCALES) for t in tiles)
    g_split, d_split = (tile_split(t) if on else 1 for t, on in zip(tiles, (gate_up_dot, down_dot)))
    group = group_down = 0
    gate_up_piece, down_piece = (
        DOT_COLS if on_dot else 1 if once else (1 if step_sums(t) and kind == BLOCK_SCALES else k) if ahead_t
        else min(k, 128)
        for t, k, ahead_t, once, on_dot in ((tiles[0], gk, gate_up_ahead, gate_up_once, gate_up_dot),
                                            (tiles[1], dk, down_ahead, down_once, down_dot)))
    if packed:
        assert gate_up_scale.is_contiguous() and down_scale.is_contiguous()
        assert kind == MXFP4_GROUPS or (gate_up_zero.shape == gate_up_scale.shape and down_zero.shape == down_scale.shape)
        group, group_down = hidden // gate_up_scale.shape[1], inter // down_scale.shape[1]
        gate_up_piece, down_piece = int4_piece(k_gate_up, group, gk), int4_piece(k_down, group_down, dk)
    route = router_logits is not None
    if route:
        assert router_logits.shape == (num_tokens, num_experts) and router_logits.stride(1) == 1
        ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=x.device)
        weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=x.device)
    else:
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        weights = topk_weights.reshape(-1).float().contiguous()
    gu_s, d_s = (gate_up_scale, down_scale) if kind else (weights, weights)  # (unread without scales)
    gu_z, d_z = (gate_up_zero, down_zero) if kind == INT4_GROUPS else (gate_up, down)  # (unread without zeros)
    gu_b, d_b = epilogue.gate_up_bias, epilogue.down_bias
    if shared_expert is not None:
        assert not route and kind in (NO_SCALES, ROW_SCALES, BLOCK_SCALES) and gu_b is None and d_b is None
        assert shared_expert.suits(gate_up, down, gate_up_scale, down_scale)
    shared_w = (gate_up, down) if shared_expert is None else shared_expert[:2]  # (unread without a shared expert)
    shared_s = (gu_s, d_s) if shared_expert is None or not kind else shared_expert[2:]
    limit = float(epilogue.swiglu_limit) if epilogue.swiglu_limit is not None else 0.0
    gu_s3 = gu_s[..., None] if kind == ROW_SCALES else gu_s  # (per channel: the row index is added in the kernel)
    d_s3 = d_s[..., None] if kind == ROW_SCALES else d_s
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_options(x)
    gu_tiles, d_tiles = triton.cdiv(inter, gn), triton.cdiv(hidden, dn)
    arrivals = weights  # (unread without splits)
    if g_split > 1 or d_split > 1:
        arrivals = _arrival_counters(x.device, num_tokens * top_k * max(gu_tiles, d_tiles))
    gu_part = torch.empty(num_tokens * top_k * g_split, two_inter, dtype=torch.float32, device=x.device) \
        if g_split > 1 else weights
    _gemv_gate_up_kernel[(num_tokens * top_k, gu_tiles, g_split)](
        x, router_logits if route else x, ids, weights, gate_up, gu_s, gu_z, x if gu_b is None else gu_b, act,
        gu_part, arrivals, shared_w[0], shared_s[0],
        num_experts, k_gate_up, inter, group, x.stride(0), router_logits.stride(0) if route else 0, gate_up.stride(0),
        gate_up.stride(1), gu_s3.stride(0) if kind else 0, gu_s3.stride(1) if kind else 0,
        0 if gu_b is None else gu_b.stride(0), act.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
        ROUTE_IN_KERNEL=route, RENORMALIZE=renormalize, SCALES=kind, BLOCK_N=gn, BLOCK_K=gk, SUB_K=gate_up_piece,
        HAS_BIAS=gu_b is not None, ACTIVATION=ACTIVATIONS[epilogue.activation], SWIGLU_LIMIT=limit,
        AHEAD=gate_up_ahead, ONE_LOAD=gate_up_once, DOT=gate_up_dot, SPLIT=g_split, BITS=gate_up_bits,
        ASM=x.is_cuda, HAS_SHARED=shared_expert is not None, num_warps=gw, num_stages=gs, **pdl)
    out_k = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    d_part = torch.empty(num_tokens * top_k * d_split, hidden, dtype=torch.float32, device=x.device) \
        if d_split > 1 else weights
    _gemv_down_kernel[(num_tokens * top_k, d_tiles, d_split)](
        act, ids, weights, down, d_s, d_z, act if d_b is None else d_b, out_k, d_part, arrivals, shared_w[1],
        shared_s[1], num_experts, hidden, k_down, group_down,
        act.stride(0), down.stride(0), down.stride(1), d_s3.stride(0) if kind else 0, d_s3.stride(1) if kind else 0,
        0 if d_b is None else d_b.stride(0), out_k.stride(0),
        SCALES=kind, BLOCK_N=dn, BLOCK_K=dk, SUB_K=down_piece, HAS_BIAS=d_b is not None, AHEAD=down_ahead,
        ONE_LOAD=down_once, DOT=down_dot, SPLIT=d_split, BITS=down_bits, ASM=x.is_cuda,
        HAS_SHARED=shared_expert is not None, num_warps=dw, num_stages=ds, **pdl)
    out_k = out_k.view(num_tokens, top_k, hidden)
    return out_k.sum(dim=1) if sum_experts else out_k  # (torch sums half types in float32, rounds once)


def gemv_tiles(gate_up: torch.Tensor, num_tokens: int) -> tuple | None:
    """The tiles the load-time choice marked on ``gate_up`` for this many tokens, or None (the grouped path)."""
    marks = getattr(gate_up, GEMV_ATTR, None)
    return None if marks is None else marks.get(num_tokens)


def mark_gemv(gate_up: torch.Tensor, chosen: dict[int, tuple]) -> None:
    """gate_up's forwards of T tokens take this path with chosen[T]'s tiles; a count between two timed ones
    (3, 5-7) follows the next larger timed count."""
    marks = {}
    timed = sorted(chosen)
    for tokens in range(1, MAX_TOKENS + 1):
        above = [t for t in timed if t >= tokens]
        if above and chosen[above[0]] is not None:
            marks[tokens] = chosen[above[0]]
    setattr(gate_up, GEMV_ATTR, marks)
