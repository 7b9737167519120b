"""Fused mixture-of-experts MLP: each token's top-k experts (SwiGLU MLPs) in two grouped GEMMs.

Shapes (T tokens, H hidden, E experts, I expert width on this rank, K experts per token):
    x (T, H); gate_up (E, 2I, H), expert e's rows [gate_e | up_e]; down (E, H, I);
    topk_ids (T, K) int, topk_weights (T, K) float32  ->  out (T, H) in x's dtype, where

    out[t] = sum_k topk_weights[t, k] * down[e] @ (silu(gate_e @ x[t]) * (up_e @ x[t])),  e = topk_ids[t, k]

(Other activations: kernels/moe_epilogue.py. Its non-gated relu2, Nemotron-H's experts, takes gate_up
(E, I, H) of up rows only, and runs the block-tiled path at every size.)

An "assignment" is one (token, slot) pair, numbered a = t * K + k (T * K of them).

The Triton path (CUDA):
1. ``route_tokens``: router logits (T, E) -> softmax in float32 -> top-k -> optional renormalisation
   (one program per token; for a single token, inside the gate_up launch: ``moe_forward``).
2. ``moe_align`` (kernels/moe_align.py): the assignments sorted by expert, each expert's run padded to a multiple of
   BLOCK_M with the sentinel T * K, so every BLOCK_M-row block of the sorted list belongs to one
   expert. Worked example, K = 2, E = 3, BLOCK_M = 4, topk_ids = [[2, 0], [0, 2], [1, 0]]:

       assignments a:    0  1  2  3  4  5          (a = t * K + k)
       expert of a:      2  0  0  2  1  0
       sorted_ids:       1  2  5  6 | 4  6  6  6 | 0  3  6  6      (6 = T * K: padding)
       block_expert:     0          | 1          | 2
       num_padded:       12 (the grid covers the worst case; blocks past num_padded exit at once)

   An expert no token chose gets no block at all. (On CUDA past a few assignments the order
   within an expert may differ: kernels/moe_align.py says why that changes nothing.)
3. ``_grouped_gemm_kernel`` twice: program (block b, column tile n) multiplies the rows of block b
   by column tile n of expert block_expert[b]'s weight, so each weight tile is streamed once per
   block of tokens that chose it. gate_up reads token rows x[a // K] and applies SiLU-and-mul in
   its epilogue: act (T * K, I). down reads act[a], scales by topk_weights[a]: out_k (T * K, H).
4. out = out_k.view(T, K, H).sum(1), accumulated in float32; or, with ``sum_experts=False``, out_k
   as (T, K, H) for the norm after the layer to sum in its own pass (kernels/rmsnorm.py).

From 64 rows an expert on average (GROUPED_MM_MIN_ROWS_PER_EXPERT: prefill chunks), steps 2-4 give
way to sorted rows and torch._grouped_mm (kernels/moe_grouped_mm.py), where torch has it for the
dtype and GPU.

A single token (batch-1 decode) skips step 2: its K experts are distinct, so each assignment is
a block of its own. Nothing in the Triton path waits on the device (grids depend on T, K, E only), so a decode step
with MoE layers is captured in a CUDA graph like any other.

``fused_moe_ref`` is the plain-torch reference (the CPU path and the tests' oracle): the same
sorted grouping, one loop over the experts that received tokens, with the kernel's roundings.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.moe_epilogue import ACTIVATIONS, PLAIN_SILU, ExpertEpilogue, activate_ref
from kernels.moe_align import (  # noqa: F401  (re-exported: the other expert kernels align through here)
    ALIGN_KERNEL_MAX_ASSIGNMENTS, max_padded_assignments, moe_align, moe_align_torch, moe_align_triton)
from kernels.moe_decode import decode_supported, fused_decode_enabled, moe_decode_triton
from kernels.moe_gemv import gemv_tiles, moe_gemv_triton
from kernels.moe_blocks import (activation_tiles, expert_block_launch, expert_block_tile, past_padded_blocks,
                                 store_rows)
from kernels.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_supported
from kernels.moe_routing import (  # noqa: F401  (re-exported: the other expert kernels route through here)
    route_tokens, route_tokens_ref, route_tokens_triton)

# Average rows per expert (T * K / E) from which the sorted rows and grouped GEMMs of
# kernels/moe_grouped_mm.py run instead of this file's block-tiled kernel. Measured on an H200
# (benchmarks/kernels/moe_kernel_bench.py, Qwen3-30B-A3B's experts, with the parallel alignment): at 64
# rows an expert (1,024 tokens) the block-tiled kernel takes 422 us and the grouped path 555; at
# 512 (8,192 tokens) 1,781 against 1,526; the two meet near 192 (~3,000 tokens).
GROUPED_MM_MIN_ROWS_PER_EXPERT = 192
# Assignments (tokens x top-k) from which per-channel FP8 experts on an sm90 GPU take
# torch._scaled_grouped_mm instead of their Triton kernel (kernels/fused_moe_fp8.py; defined here
# so that warm_up_token_counts covers it). benchmarks/quantization/moe_fp8_bench.py, Qwen3-30B-A3B's experts:
# H100 (2026-11-26) Triton 471.9 / 633.0 / 797.3 / 1,460.7 us at 2,048 / 3,072 / 4,096 / 8,192 tokens x
# top-8, _scaled_grouped_mm 566.7 / 632.8 / 784.6 / 1,279.5: even from 3,072 tokens (24,576
# assignments), ahead beyond. (H200: 530.9 / 522.4 at 2,048 tokens, 1,528.3 / 1,296.6 at 8,192.)
SCALED_GROUPED_MM_MIN_ASSIGNMENTS = 24576



# ---- grouped GEMMs ---------------------------------------------------------------------------

@jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_ids_ptr, topk_weights_ptr,
    logits_ptr, bias_ptr, num_experts, N, K, num_assignments, stride_am, stride_we, stride_wn, stride_om, stride_be,
    TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr,
    K_PAD: tl.constexpr, E_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """out[a, n] = a_row(a) . w[expert, n, :] for the BLOCK_M assignments of block program_id(0)
    and the BLOCK_N columns of tile program_id(1): blocks, ONE_PER_BLOCK and ROUTE_IN_KERNEL as
    kernels/moe_blocks.py makes them (expert_block_tile), a_row(a) = a_ptr row a // TOP_K when
    ROWS_PER_TOKEN (x: one row per token), else row a (act). GATED, MUL_WEIGHT, HAS_BIAS,
    ACTIVATION, SWIGLU_LIMIT: store_rows' (GATED: w has 2N rows per expert [gate | up])."""
    pdl_prologue(PDL)  # before the early return too: every program must wait (kernels/_triton.py)
    if past_padded_blocks(num_padded_ptr, ONE_PER_BLOCK, BLOCK_M):
        return
    ids, row_ok, expert, a_rows, cols, col_ok, _, w_base = expert_block_tile(
        w_ptr, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N,
        num_assignments, stride_we, stride_wn, TOP_K, ROWS_PER_TOKEN, GATED, ONE_PER_BLOCK, ROUTE_IN_KERNEL,
        RENORMALIZE, K_PAD, E_PAD, BLOCK_M, BLOCK_N)
    a_base, acc, acc_up = activation_tiles(a_ptr, a_rows, stride_am, False, BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_base + N * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)
    store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, bias_ptr, expert,
               stride_be, N, GATED, MUL_WEIGHT, HAS_BIAS, ACTIVATION, SWIGLU_LIMIT)


def choose_block_m(num_assignments: int, num_experts: int) -> int:
    """Rows per block: 16 (the smallest tensor-core tile) while an expert gets few rows on
    average (decode), up to 64 for long prefill chunks, where padding costs little."""
    per_expert = num_assignments / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def gemm_config(block_m: int) -> dict:
    """Tile shape and launch options of the grouped GEMMs per block_m. Small blocks stream
    weights (decode): narrow column tiles so there are programs for every SM; large blocks
    are compute-bound: wider tiles reuse each loaded weight tile over more rows."""
    if block_m <= 16:  # Qwen3-30B-A3B at batch 1: gate_up 8 blocks x 24 tiles, down 8 x 64 programs
        return {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if block_m <= 32:
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


# On a gate_up expert tensor: the (gate_up, down) tile configs its single-token GEMMs take, chosen at
# load by timing (kernels/moe_decode_tiles.py); absent: the table's (model_dtype_tiling).
DECODE_TILES_ATTR = "_moe_decode_tiles"

# A single token's (gate_up, down) tiles: each of its K assignments is a block of its own
# (moe_single_token_triton). Qwen3-30B-A3B: gate_up 8 blocks x 24 column tiles, down 8 x 64.
SINGLE_TOKEN_TILES = (gemm_config(16), gemm_config(16))

# The model-dtype kernel's (block_m, tiles) by average rows an expert: (most rows, block_m,
# BLOCK_N, BLOCK_K, warps, stages). From benchmarks/kernels/moe_kernel_bench.py --sweep on an H200
# (2026-11-26, Qwen3-30B-A3B's experts): 256 tokens (16 rows an expert) 377 us against 400 with
# the (16, 32, 128) tiles; 512 tokens (32) 417 against 434; 768 tokens (48) 445 against 521.
# 128-row blocks from 97 rows an expert: 2,048 tokens (128 rows) 565 us against 618 for the 64-row row's
# tiles (H200, 2026-12-01, --sweep with 128-row candidates; SGLang's H200 table takes 128-row blocks there too).
# Past GROUPED_MM_MIN_ROWS_PER_EXPERT the grouped-GEMM path runs instead where it can.
MODEL_DTYPE_TILINGS = ((8, 16, 32, 128, 4, 4), (24, 32, 64, 128, 4, 3), (96, 64, 128, 64, 8, 4),
                       (None, 128, 128, 64, 8, 3))


def model_dtype_tiling(num_assignments: int, num_experts: int) -> tuple[int, dict]:
    """(block_m, tile config) of fused_moe_triton for this many assignments (MODEL_DTYPE_TILINGS)."""
    per_expert = num_assignments / num_experts
    for most_rows, block_m, block_n, block_k, warps, stages in MODEL_DTYPE_TILINGS:
        if most_rows is None or per_expert <= most_rows:
            return block_m, {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
    raise AssertionError("the table ends with a catch-all row")


def warm_up_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """Token counts at which a forward over routed experts takes each of its variants, here and in
    the other expert kernels that share this file's routing and alignment: one token; the
    one-program and the parallel alignment; each block size of MODEL_DTYPE_TILINGS and of
    choose_block_m; the sorted-rows grouped GEMMs (GROUPED_MM_MIN_ROWS_PER_EXPERT); FP8's grouped
    GEMM (SCALED_GROUPED_MM_MIN_ASSIGNMENTS). Those above ``max_tokens`` (no forward gets them) are
    left out.
    A warm-up runs each once, so no request waits for a kernel to compile."""
    counts = {1, 2, -(-ALIGN_KERNEL_MAX_ASSIGNMENTS // top_k) + 1,
              -(-SCALED_GROUPED_MM_MIN_ASSIGNMENTS // top_k)}
    tiling_starts = {most_rows + 1 for most_rows, *_ in MODEL_DTYPE_TILINGS if most_rows is not None}
    rows_per_expert = {1, 17, 65, GROUPED_MM_MIN_ROWS_PER_EXPERT + 1} | tiling_starts  # 17, 65: choose_block_m's
    counts |= {-(-rows * num_experts // top_k) for rows in rows_per_expert}
    return sorted(count for count in counts if count <= max_tokens)


def _grouped_gemm(a, w, out, blocks, topk_ids, topk_weights, *, n: int, top_k: int, rows_per_token: bool,
                  gated: bool, mul_weight: bool, block_m: int, config: dict,
                  router_logits: torch.Tensor | None = None, renormalize: bool = False,
                  bias: torch.Tensor | None = None, epilogue: ExpertEpilogue = PLAIN_SILU) -> None:
    """blocks, router_logits: kernels/moe_blocks.expert_block_launch's. bias: this GEMM's
    per-expert bias rows (E, n or 2n), or None."""
    cfg = dict(config)
    pdl = pdl_options(a)
    launch = expert_block_launch(blocks, topk_ids, topk_weights, n=n, num_experts=w.shape[0], top_k=top_k,
                                 rows_per_token=rows_per_token, gated=gated, mul_weight=mul_weight, block_m=block_m,
                                 block_n=cfg.pop("BLOCK_N"), router_logits=router_logits, renormalize=renormalize)
    bias, = dense(bias)  # read at bias_ptr + expert * stride + column
    _grouped_gemm_kernel[launch.grid](
        a, w, out, *launch.pointers, bias if bias is not None else topk_weights,
        w.shape[0], n, a.shape[1], out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[epilogue.activation],
        SWIGLU_LIMIT=float(epilogue.swiglu_limit or 0.0), DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **launch.constexprs, **cfg, **pdl,
    )


def moe_single_token_triton(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor, top_k: int, renormalize: bool, *,
                            config: dict | None = None, down_config: dict | None = None,
                            epilogue: ExpertEpilogue = PLAIN_SILU, sum_experts: bool = True) -> torch.Tensor:
    """route_tokens + fused_moe for one token (batch-1 decode) in three launches: gate_up with
    the routing inside, down, and the sum over the K experts (two with ``sum_experts=False``:
    moe_forward). ``config`` / ``down_config``: the two GEMMs' tiles (SINGLE_TOKEN_TILES)."""
    hidden = x.shape[1]
    inter = gate_up.shape[1] // 2
    assert x.shape[0] == 1 and x.stride(1) == 1 and router_logits.is_contiguous()
    assert gate_up.is_contiguous() and down.is_contiguous()
    config = config or SINGLE_TOKEN_TILES[0]
    down_config = down_config or SINGLE_TOKEN_TILES[1]
    ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, act, None, ids, weights, n=inter, top_k=top_k, rows_per_token=True, gated=True,
                  mul_weight=False, block_m=16, config=config, router_logits=router_logits, renormalize=renormalize,
                  bias=epilogue.gate_up_bias, epilogue=epilogue)
    out_k = torch.empty(top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, out_k, None, ids, weights, n=hidden, top_k=top_k, rows_per_token=False,
                  gated=False, mul_weight=True, block_m=16, config=down_config, bias=epilogue.down_bias,
                  epilogue=epilogue)
    return out_k.sum(dim=0, keepdim=True) if sum_experts else out_k.unsqueeze(0)


def fused_moe_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, block_m: int | None = None, config: dict | None = None,
                     down_config: dict | None = None, epilogue: ExpertEpilogue = PLAIN_SILU,
                     sum_experts: bool = True) -> torch.Tensor:
    """``config``: both GEMMs' tiles (down's: ``down_config`` where given); by default the table's
    (model_dtype_tiling), or at one token the pair chosen at load for ``gate_up``
    (DECODE_TILES_ATTR: kernels/moe_decode_tiles.py)."""
    num_tokens, hidden = x.shape
    if config is None and num_tokens == 1 and getattr(gate_up, DECODE_TILES_ATTR, None) is not None:
        config, down_config = getattr(gate_up, DECODE_TILES_ATTR)
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2 if epilogue.gated else two_inter, topk_ids.shape[1]
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    assert down.shape == (num_experts, hidden, inter) and topk_weights.shape == topk_ids.shape
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    default_block_m, default_config = model_dtype_tiling(num_assignments, num_experts)
    block_m = block_m or default_block_m
    if config is None:  # the table's tiles are sized for 2-byte operands (float32 ones overflow shared memory)
        config = default_config if block_m == default_block_m and x.element_size() == 2 else gemm_config(block_m)
    # One token (batch-1 decode): its K experts are distinct, so each assignment is its own block
    # and the alignment launch is skipped. Otherwise blocks of tokens grouped by expert.
    blocks = None if num_tokens == 1 else moe_align(topk_ids, num_experts, block_m)
    flat_ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, act, blocks, flat_ids, weights, n=inter, top_k=top_k, rows_per_token=True,
                  gated=epilogue.gated, mul_weight=False, block_m=block_m, config=config, bias=epilogue.gate_up_bias,
                  epilogue=epilogue)
    out_k = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
    # (relu2's activation belongs to the up GEMM only: the down GEMM's epilogue is the plain one)
    _grouped_gemm(act, down, out_k, blocks, flat_ids, weights, n=hidden, top_k=top_k, rows_per_token=False,
                  gated=False, mul_weight=True, block_m=block_m, config=down_config or config, bias=epilogue.down_bias,
                  epilogue=epilogue if epilogue.gated else PLAIN_SILU)
    out_k = out_k.view(num_tokens, top_k, hidden)
    return out_k.sum(dim=1) if sum_experts else out_k


# ---- reference and public entry --------------------------------------------------------------

def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """The module docstring's sum in plain torch, grouped by expert like the kernel: experts no
    token chose are skipped; each routed product is scaled in float32 and rounded once, and the
    K products of a token are summed in float32. With an ExpertEpilogue's biases each GEMM adds
    its expert's bias row (before the activation, before the routing weight)."""
    num_tokens, hidden = x.shape
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out_k = x.new_zeros(num_tokens * top_k, hidden)
    gate_up_bias, down_bias = epilogue.gate_up_bias, epilogue.down_bias
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        assignments = order[start:start + count]
        start += count
        gate_up_rows = F.linear(x[assignments // top_k], gate_up[expert],
                                None if gate_up_bias is None else gate_up_bias[expert])
        product = F.linear(activate_ref(gate_up_rows, epilogue), down[expert],
                           None if down_bias is None else down_bias[expert])
        out_k[assignments] = (product.float() * flat_weights[assignments, None]).to(x.dtype)
    return out_k.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None, activation: str = "silu",
              swiglu_limit: float | None = None, sum_experts: bool = True) -> torch.Tensor:
    """The routed experts' output (T, H) (module docstring): Triton on CUDA, else the reference.
    gate_up_bias (E, 2I), down_bias (E, H), activation, swiglu_limit: ExpertEpilogue's.
    ``sum_experts=False``: the block-tiled path returns the K weighted rows of each token unsummed,
    (T, K, H), for a consumer that sums them in its own pass (kernels/rmsnorm.py takes them as its x);
    the other paths sum as before and return (T, H)."""
    epilogue = ExpertEpilogue(gate_up_bias, down_bias, activation, swiglu_limit)
    if not use_triton(x):
        return fused_moe_ref(x, gate_up, down, topk_weights, topk_ids, epilogue)
    many_rows = topk_ids.numel() >= GROUPED_MM_MIN_ROWS_PER_EXPERT * gate_up.shape[0]
    if many_rows and epilogue.gated and grouped_mm_supported(x, gate_up, down):  # (gated activations only)
        return fused_moe_grouped_mm(x, gate_up, down, topk_weights, topk_ids, epilogue)
    return fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, epilogue=epilogue, sum_experts=sum_experts)


def moe_forward(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, *, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, activation: str = "silu",
                swiglu_limit: float | None = None, sum_experts: bool = True) -> torch.Tensor:
    """A sparse MLP after its router: route_tokens then fused_moe; one token on CUDA (batch-1
    decode) routes inside the gate_up launch (moe_single_token_triton). Biases, activation and
    ``sum_experts`` (then (T, H) or (T, K, H)): fused_moe's. With TRITONLLM_MOE_DECODE=fused, 1-16
    tokens on CUDA take kernels/moe_decode.py's one launch instead (summed: (T, H)); else gated experts (biases
    and the clamped SwiGLU too) take kernels/moe_gemv.py's two GEMV launches at the token counts the load-time choice
    marked on ``gate_up``."""
    epilogue = ExpertEpilogue(gate_up_bias, down_bias, activation, swiglu_limit)
    if use_triton(x) and fused_decode_enabled() and decode_supported(x, epilogue):  # opt-in (kernels/moe_decode.py)
        return moe_decode_triton(x, gate_up, down, top_k=top_k, router_logits=router_logits, renormalize=renormalize,
                                 epilogue=epilogue)
    if use_triton(x) and epilogue.gated and (tiles := gemv_tiles(gate_up, x.shape[0])) is not None:  # chosen at load
        return moe_gemv_triton(x, gate_up, down, top_k=top_k, router_logits=router_logits, renormalize=renormalize,
                               tiles=tiles, sum_experts=sum_experts, epilogue=epilogue)
    if use_triton(x) and x.shape[0] == 1 and activation != "relu2":
        config, down_config = getattr(gate_up, DECODE_TILES_ATTR, None) or (None, None)  # (moe_decode_tiles)
        return moe_single_token_triton(x, router_logits, gate_up, down, top_k, renormalize, epilogue=epilogue,
                                       sum_experts=sum_experts, config=config, down_config=down_config)
    topk_weights, topk_ids = route_tokens(router_logits, top_k, renormalize)
    return fused_moe(x, gate_up, down, topk_weights, topk_ids, gate_up_bias=gate_up_bias, down_bias=down_bias,
                     activation=activation, swiglu_limit=swiglu_limit, sum_experts=sum_experts)
