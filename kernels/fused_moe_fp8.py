"""Mixture-of-experts MLPs with FP8 (E4M3) experts: one grouped GEMM for both scale granularities.

Storage per projection (the engine directory's tensors), gate_up (E, 2I, H) with rows [gate_e | up_e]
and down (E, H, I) as for model-dtype experts (kernels/fused_moe.py), float8_e4m3fn, and a float32
``scale`` beside each, of one of two granularities:

- per channel (``--quantization fp8``): scale (E, N), expert e's weight[n, k] = w[e, n, k] * scale[e, n];
  the activations are quantized per row (kernels.fp8.quantize_rows);
- 128 x 128 blocks (block-FP8 checkpoints, kernels/fp8_block.py): scale (E, ceil(N / 128),
  ceil(K / 128)), weight[n, k] = w[e, n, k] * scale[e, n // 128, k // 128]; the activations are
  quantized per row and 128-column group (kernels.fp8_block.quantize_groups).

Per channel is the special case of one scale per row over all of K, so one kernel covers both with
two constexprs: GROUP_N (weight rows per scale: 1 or 128) and GROUP_K (columns per scale: 0 = all of
K, or 128). With GROUP_K = 128 each 128-column K step's E4M3 dot is scaled by the activation row's
and the weight block's scales and added to a float32 accumulator; with GROUP_K = 0 the dots
accumulate unscaled and the epilogue applies s_x[row] * s_w[col] once.

Routing and alignment are kernels/fused_moe.py's (``route_tokens``, ``moe_align``), the blocks
and the epilogue kernels/moe_blocks.py's (``expert_block_tile``, ``store_rows``): tokens grouped by
expert in blocks of BLOCK_M, gate_up with SiLU-and-mul in its epilogue, down scaled by the routing
weights, the K products of a token summed in float32. The SwiGLU output (rounded to the model
dtype, as the bf16 kernels do) is quantized again for down. W8A8 at every batch size, so a
sequence is rounded the same way in any batch, as for the dense FP8 layers.

Activations are quantized by a quantize launch before each GEMM (kernels.fp8.quantize_rows_triton or
kernels.fp8_block.quantize_groups_triton, exactly the references' rounding). Quantizing inside the
GEMM instead (each program the rows it reads, per channel with a first pass over K for the row's
peak) saved those launches but measured slower at every size on an H200 (Qwen3-30B-A3B's experts,
2026-11-26: 33-35 against 26-27 us per MoE at one token, 121 against 90 at eight), so it is not
kept. A single token (batch-1 decode) routes inside the gate_up launch, as moe_single_token_triton
does.

Prefill-size batches of per-channel experts on Hopper run ``torch._scaled_grouped_mm`` (CUTLASS's
grouped FP8 GEMM with row-wise scales) over kernels/moe_grouped_mm.py's sorted rows instead, from
``SCALED_GROUPED_MM_MIN_ASSIGNMENTS`` (kernels/fused_moe.py, beside the other expert-kernel
thresholds warm_up_token_counts covers). Block-scaled experts
always take the Triton kernel. Nothing anywhere waits on the host, so the decode CUDA graphs capture
every path.

``fused_moe_fp8_ref`` is the plain-torch reference (the CPU path and the tests' oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import device_capability, jit, pdl_options, pdl_prologue, tl, use_triton
from kernels.activation import silu_and_mul
from kernels.fp8 import FAST_ACCUM, FP8_DTYPE, dequantize_rows, quantize_rows, quantize_rows_triton
from kernels.fp8_block import BLOCK, dequantize_blocks, dequantize_groups, quantize_groups, quantize_groups_triton
from kernels.fused_moe import SCALED_GROUPED_MM_MIN_ASSIGNMENTS, choose_block_m, moe_align, route_tokens
from kernels.moe_decode import decode_supported, fused_decode_enabled, moe_decode_triton
from kernels.moe_gemv import gemv_tiles, moe_gemv_triton
from kernels.moe_blocks import (activation_tiles, expert_block_launch, expert_block_tile, past_padded_blocks,
                                 store_rows)
from kernels.moe_grouped_mm import combine, sort_assignments


def scale_groups(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(GROUP_N, GROUP_K) of an expert stack (E, N, K)'s scales: per channel (E, N) -> (1, 0: all of K);
    blocks (E, ceil(N / 128), ceil(K / 128)) -> (128, 128)."""
    experts, rows, cols = weight.shape
    if scale.shape == (experts, rows):
        return 1, 0
    if scale.shape == (experts, -(-rows // BLOCK), -(-cols // BLOCK)):
        return BLOCK, BLOCK
    raise ValueError(f"FP8 expert scales of shape {tuple(scale.shape)} fit neither per channel ({(experts, rows)}) "
                     f"nor 128 x 128 blocks of weights {tuple(weight.shape)}")


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 experts (E', N, K) with their scales -> float32 values."""
    if scale.dim() == weight.dim() - 1:  # per channel
        return weight.float() * scale.float()[..., None]
    return dequantize_blocks(weight, scale)


def quantize_activations(x: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (E4M3 values, scales (R, groups)): per row (group_k 0) or per 1 x 128 group,
    in one Triton launch on CUDA, else the reference (the two agree bit for bit)."""
    triton_ok = use_triton(x) and x.stride(1) == 1
    if group_k:
        return quantize_groups_triton(x) if triton_ok else quantize_groups(x)
    x_q, scale = quantize_rows_triton(x) if triton_ok else quantize_rows(x)
    return x_q, scale[:, None]


# ---- reference -------------------------------------------------------------------------------

def fused_moe_fp8_ref(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                      down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The module's scheme in plain torch, grouped by expert like fused_moe_ref: x quantized (per row
    or per group), each chosen expert dequantized, gate and up in float32 rounded to x's dtype, SiLU
    times up in x's dtype, that quantized again, down in float32 scaled by the routing weight and
    rounded once; a token's K products summed in float32."""
    num_tokens, hidden = x.shape
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    group_k = scale_groups(gate_up, gate_up_scale)[1]
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    runs = []  # (expert, assignments)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            runs.append((expert, order[start:start + count]))
        start += count
    x_deq = _dequantized(x, group_k)
    act = x.new_zeros(num_tokens * top_k, down.shape[2])
    for expert, assignments in runs:
        w = dequantize_experts(gate_up[expert:expert + 1], gate_up_scale[expert:expert + 1])[0]
        gate, up = (x_deq[assignments // top_k] @ w.T).to(x.dtype).chunk(2, dim=-1)
        act[assignments] = F.silu(gate) * up
    act_deq = _dequantized(act, group_k)
    out_k = x.new_zeros(num_tokens * top_k, hidden)
    for expert, assignments in runs:
        w = dequantize_experts(down[expert:expert + 1], down_scale[expert:expert + 1])[0]
        out_k[assignments] = ((act_deq[assignments] @ w.T) * flat_weights[assignments, None]).to(x.dtype)
    return out_k.view(num_tokens, top_k, hidden).sum(dim=1)


def _dequantized(x: torch.Tensor, group_k: int) -> torch.Tensor:
    """x quantized as the kernels quantize it (per row, or per 1 x 128 group), back in float32."""
    if group_k:
        return dequantize_groups(*quantize_groups(x))
    return dequantize_rows(*quantize_rows(x))


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _scaled_dot(acc, a, a_scale, w_ptrs, w_ok, ws_ptrs, ws_ok, GROUP_K: tl.constexpr):
    """acc + a . w^T for one K step: scaled by a_scale[row] * w_scale[col] now when GROUP_K (one
    scale per 128 columns), else unscaled (the epilogue scales the whole sum)."""
    w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    if GROUP_K:
        w_scale = tl.load(ws_ptrs, mask=ws_ok, other=0.0)
        return acc + tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])
    return tl.dot(a, tl.trans(w), acc)


@jit
def _fp8_grouped_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N, K, num_assignments,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    ONE_PER_BLOCK: tl.constexpr, ROUTE_IN_KERNEL: tl.constexpr, RENORMALIZE: tl.constexpr,
    K_PAD: tl.constexpr, E_PAD: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """kernels/fused_moe.py's _grouped_gemm_kernel (same blocks, routing and epilogue) on E4M3
    operands: out[a, n] = s_a . s_w . (a_q(a) . w[expert, n, :]), with the scale granularity of the
    module docstring (GROUP_N, GROUP_K; BLOCK_K == GROUP_K when GROUP_K). a is E4M3 with scales
    a_scale (rows, ceil(K / GROUP_K), or 1 when GROUP_K is 0)."""
    pdl_prologue(PDL)  # before the early return too: every program must wait (kernels/_triton.py)
    if past_padded_blocks(num_padded_ptr, ONE_PER_BLOCK, BLOCK_M):
        return
    ids, row_ok, expert, a_rows, cols, col_ok, _, w_base = expert_block_tile(
        w_ptr, sorted_ids_ptr, block_expert_ptr, topk_ids_ptr, topk_weights_ptr, logits_ptr, num_experts, N,
        num_assignments, stride_we, stride_wn, TOP_K, ROWS_PER_TOKEN, GATED, ONE_PER_BLOCK, ROUTE_IN_KERNEL,
        RENORMALIZE, K_PAD, E_PAD, BLOCK_M, BLOCK_N)
    ws_base = w_scale_ptr + expert * stride_wse + (cols // GROUP_N) * stride_wsn
    ws_up = w_scale_ptr + expert * stride_wse + ((cols + N) // GROUP_N) * stride_wsn
    a_base, acc, acc_up = activation_tiles(a_ptr, a_rows, stride_am, False, BLOCK_M, BLOCK_N)
    if GROUP_K == 0:  # one scale per row over all of K
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as, mask=row_ok, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if GROUP_K:
            a_scale = tl.load(a_scale_ptr + a_rows * stride_as + k0 // GROUP_K, mask=row_ok, other=0.0)
        w_ok = col_ok[:, None] & k_ok[None, :]
        acc = _scaled_dot(acc, a, a_scale, w_base + k[None, :], w_ok, ws_base + k0 // BLOCK_K, col_ok, GROUP_K)
        if GATED:
            acc_up = _scaled_dot(acc_up, a, a_scale, w_base + N * stride_wn + k[None, :], w_ok, ws_up + k0 // BLOCK_K,
                                 col_ok, GROUP_K)
    if GROUP_K == 0:
        acc *= a_scale[:, None] * tl.load(ws_base, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= a_scale[:, None] * tl.load(ws_up, mask=col_ok, other=0.0)[None, :]
    store_rows(acc, acc_up, out_ptr, ids, row_ok, cols, col_ok, topk_weights_ptr, stride_om, topk_weights_ptr, expert,
               0, N, GATED, MUL_WEIGHT, False, 0, 0.0)  # no biases; silu


def fp8_block_m(num_assignments: int, num_experts: int, group_k: int) -> int:
    """Rows per block: kernels.fused_moe.choose_block_m's, but block-scaled experts take 64 from 17
    rows an expert (H100, `moe_fp8_bench.py --sweep_prefill`, 2026-11-26: 512 tokens 298.5 us
    against 327.9 with 32-row blocks)."""
    if group_k and num_assignments > 16 * num_experts:
        return 64
    return choose_block_m(num_assignments, num_experts)


def fp8_gemm_config(block_m: int, group_k: int = 0) -> dict:
    """Tiles per block_m (fp8_block_m). K steps are one 128-column scale block; decode blocks
    stream weights (narrow column tiles, programs for every SM), prefill blocks reuse each weight
    tile over more rows. Block-scaled 64-row blocks take 64-column tiles over 4 warps: each K step's
    dot is scaled before it joins the accumulator, and the smaller tile keeps more programs in
    flight around that (H100 sweep, Qwen3-30B-A3B's experts: 512 / 2,048 / 8,192 tokens 298.5 /
    569.7 / 2,087.3 us against 322.1 / 653.0 / 2,236.2 with 128 columns over 8 warps). Tried and
    slower at every size: two scale groups a K step, both dots issued before either is scaled
    (2,479-4,675 us at 8,192 tokens), and each step's dot scaled one step later (2,716-4,138)."""
    if group_k and block_m == 64:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if block_m <= 16:  # H200 sweep (benchmarks/quantization/moe_fp8_bench.py --sweep 1 8), the best of 7 at 1 and 8 tokens
        return {"BLOCK_N": 32, "num_warps": 2, "num_stages": 5}
    if block_m <= 32:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def _fp8_grouped_gemm(a, a_scale, w, w_scale, out, blocks, topk_ids, topk_weights, *, n: int, top_k: int,
                      rows_per_token: bool, gated: bool, mul_weight: bool, block_m: int, config: dict,
                      router_logits: torch.Tensor | None = None, renormalize: bool = False) -> None:
    """One grouped GEMM (kernels.fused_moe._grouped_gemm's arguments) on E4M3 ``a`` with its scales."""
    group_n, group_k = scale_groups(w, w_scale)
    cfg = dict(config)
    launch = expert_block_launch(blocks, topk_ids, topk_weights, n=n, num_experts=w.shape[0], top_k=top_k,
                                 rows_per_token=rows_per_token, gated=gated, mul_weight=mul_weight, block_m=block_m,
                                 block_n=cfg.pop("BLOCK_N"), router_logits=router_logits, renormalize=renormalize)
    scale_3d = w_scale if group_k else w_scale[..., None]
    _fp8_grouped_gemm_kernel[launch.grid](
        a, a_scale, w, w_scale, out, *launch.pointers, w.shape[0],
        n, a.shape[1], out.shape[0], a.stride(0), a_scale.stride(0),
        w.stride(0), w.stride(1), scale_3d.stride(0), scale_3d.stride(1), out.stride(0),
        GROUP_N=group_n, GROUP_K=group_k, BLOCK_K=BLOCK, **launch.constexprs, **cfg, **pdl_options(a),
    )


def _check_experts(x, gate_up, gate_up_scale, down, down_scale) -> tuple[int, int]:
    """(inter, group_k) after checking the layout the kernels assume."""
    num_experts, two_inter, hidden = gate_up.shape
    assert x.stride(1) == 1 and x.shape[1] == hidden and gate_up.is_contiguous() and down.is_contiguous()
    assert gate_up.dtype == down.dtype == FP8_DTYPE and down.shape == (num_experts, hidden, two_inter // 2)
    group_k = scale_groups(gate_up, gate_up_scale)[1]
    assert scale_groups(down, down_scale)[1] == group_k and gate_up_scale.is_contiguous() and down_scale.is_contiguous()
    return two_inter // 2, group_k


def moe_single_token_fp8_triton(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor,
                                gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                                top_k: int, renormalize: bool, *, config: dict | None = None,
                                sum_experts: bool = True) -> torch.Tensor:
    """route_tokens + fused_moe_fp8 for one token: x quantized, gate_up with the routing inside, the
    SwiGLU output quantized, down, and the sum over the K experts (five launches; four with
    ``sum_experts=False``, kernels/fused_moe.py's fused_moe)."""
    inter, group_k = _check_experts(x, gate_up, gate_up_scale, down, down_scale)
    assert x.shape[0] == 1 and router_logits.is_contiguous()
    config = config or fp8_gemm_config(16)
    ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    act = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    a, a_scale = quantize_activations(x, group_k)
    _fp8_grouped_gemm(a, a_scale, gate_up, gate_up_scale, act, None, ids, weights, n=inter, top_k=top_k,
                      rows_per_token=True, gated=True, mul_weight=False, block_m=16, config=config,
                      router_logits=router_logits, renormalize=renormalize)
    out_k = torch.empty(top_k, x.shape[1], dtype=x.dtype, device=x.device)
    a, a_scale = quantize_activations(act, group_k)
    _fp8_grouped_gemm(a, a_scale, down, down_scale, out_k, None, ids, weights, n=x.shape[1], top_k=top_k,
                      rows_per_token=False, gated=False, mul_weight=True, block_m=16, config=config)
    return out_k.sum(dim=0, keepdim=True) if sum_experts else out_k.unsqueeze(0)


def fused_moe_fp8_triton(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                         down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         block_m: int | None = None, config: dict | None = None,
                         sum_experts: bool = True) -> torch.Tensor:
    """fused_moe_fp8_ref on the Triton grouped GEMMs (routing given); ``sum_experts``: fused_moe's."""
    num_tokens, hidden = x.shape
    inter, group_k = _check_experts(x, gate_up, gate_up_scale, down, down_scale)
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    block_m = block_m or fp8_block_m(num_assignments, num_experts, group_k)
    config = config or fp8_gemm_config(block_m, group_k)
    blocks = None if num_tokens == 1 else moe_align(topk_ids, num_experts, block_m)
    flat_ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    a, a_scale = quantize_activations(x, group_k)
    act = torch.empty(num_assignments, inter, dtype=x.dtype, device=x.device)
    _fp8_grouped_gemm(a, a_scale, gate_up, gate_up_scale, act, blocks, flat_ids, weights, n=inter, top_k=top_k,
                      rows_per_token=True, gated=True, mul_weight=False, block_m=block_m, config=config)
    a, a_scale = quantize_activations(act, group_k)
    out_k = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
    _fp8_grouped_gemm(a, a_scale, down, down_scale, out_k, blocks, flat_ids, weights, n=hidden, top_k=top_k,
                      rows_per_token=False, gated=False, mul_weight=True, block_m=block_m, config=config)
    out_k = out_k.view(num_tokens, top_k, hidden)
    return out_k.sum(dim=1) if sum_experts else out_k


# ---- torch._scaled_grouped_mm (per-channel experts, prefill sizes) ------------------------------

def scaled_grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor) -> bool:
    """Per-channel experts on an sm90 GPU whose widths suit the grouped kernel (multiples of 16)."""
    if not (x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and gate_up_scale.dim() == 2):
        return False
    _, two_inter, hidden = gate_up.shape
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return device_capability(index) == (9, 0) and two_inter % 32 == 0 and hidden % 16 == 0


def fused_moe_fp8_grouped_mm(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                             down: torch.Tensor, down_scale: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor) -> torch.Tensor:
    """Per-channel fused_moe_fp8 on torch._scaled_grouped_mm, in kernels/moe_grouped_mm.py's sorted
    rows: the assignments' token rows gathered one run per expert (sort_assignments), quantized per
    row, two grouped FP8 GEMMs with row-wise scales (weights read column-major: w.transpose(-2, -1)
    of (E, N, K)) around silu_and_mul, then combine (routing weights, sum over each token's K). No
    host synchronisation."""
    top_k = topk_ids.shape[1]
    dest, order, offs = sort_assignments(topk_ids, gate_up.shape[0], by_sort=True)  # as fused_moe_grouped_mm
    x_q, x_scale = quantize_rows_triton(x)
    tokens = order // top_k
    h = torch._scaled_grouped_mm(x_q[tokens], gate_up.transpose(-2, -1), x_scale[tokens], gate_up_scale, offs=offs,
                                 out_dtype=x.dtype, use_fast_accum=FAST_ACCUM)
    act_q, act_scale = quantize_rows_triton(silu_and_mul(h))
    del h  # the peak stays one step's temporaries (fused_moe_grouped_mm says why)
    y = torch._scaled_grouped_mm(act_q, down.transpose(-2, -1), act_scale, down_scale, offs=offs, out_dtype=x.dtype,
                                 use_fast_accum=FAST_ACCUM)
    return combine(y, dest, topk_ids, topk_weights, None)


# ---- public entry ----------------------------------------------------------------------------

def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                  down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  sum_experts: bool = True) -> torch.Tensor:
    """The routed FP8 experts' output (T, H): on CUDA the Triton kernels (or, per-channel from
    SCALED_GROUPED_MM_MIN_ASSIGNMENTS assignments on sm90, torch._scaled_grouped_mm), else the reference.
    ``sum_experts=False``: the Triton kernels' (T, K, H) unsummed (kernels/fused_moe.py's fused_moe)."""
    if not use_triton(x):
        return fused_moe_fp8_ref(x, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids)
    if topk_ids.numel() >= SCALED_GROUPED_MM_MIN_ASSIGNMENTS and scaled_grouped_mm_supported(x, gate_up, gate_up_scale):
        return fused_moe_fp8_grouped_mm(x, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids)
    return fused_moe_fp8_triton(x, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids,
                                sum_experts=sum_experts)


def moe_forward_fp8(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                    down: torch.Tensor, down_scale: torch.Tensor, top_k: int, renormalize: bool, *,
                    sum_experts: bool = True) -> torch.Tensor:
    """A sparse MLP with FP8 experts after its router: route_tokens then fused_moe_fp8; one token on
    CUDA routes inside the gate_up launch (moe_single_token_fp8_triton). ``sum_experts``: fused_moe_fp8's.
    With TRITONLLM_MOE_DECODE=fused, 1-16 tokens on CUDA take kernels/moe_decode.py's one launch (W8A16); else the
    token counts the load-time choice marked on ``gate_up`` take kernels/moe_gemv.py's two GEMV launches (W8A16)."""
    if use_triton(x) and fused_decode_enabled() and decode_supported(x):  # opt-in, W8A16 (kernels/moe_decode.py)
        return moe_decode_triton(x, gate_up, down, top_k=top_k, router_logits=router_logits, renormalize=renormalize,
                                 gate_up_scale=gate_up_scale, down_scale=down_scale)
    if use_triton(x) and (tiles := gemv_tiles(gate_up, x.shape[0])) is not None:  # chosen at load (moe_gemv_choice)
        return moe_gemv_triton(x, gate_up, down, top_k=top_k, router_logits=router_logits, renormalize=renormalize,
                               gate_up_scale=gate_up_scale, down_scale=down_scale, tiles=tiles, sum_experts=sum_experts)
    if use_triton(x) and x.shape[0] == 1:
        return moe_single_token_fp8_triton(x, router_logits, gate_up, gate_up_scale, down, down_scale, top_k,
                                           renormalize, sum_experts=sum_experts)
    topk_weights, topk_ids = route_tokens(router_logits, top_k, renormalize)
    return fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids, sum_experts=sum_experts)
