"""Routed experts for large batches (prefill chunks, decode batches of hundreds): the
assignments sorted into one contiguous run per expert, and each projection as one grouped GEMM
(``torch._grouped_mm``: CUTLASS's grouped kernel on Hopper, offsets read on the device).

Shapes (T tokens, H hidden, E experts, I expert width, K experts per token, A = T * K
assignments, a = t * K + k): x (T, H), gate_up (E, 2I, H) rows [gate | up], down (E, H, I),
topk_ids / topk_weights (T, K) -> out (T, H), the same sum as kernels/fused_moe.py:

1. ``sort_assignments``: dest (A,), the sorted row of assignment a (experts in order, assignments
   of one expert in order of a); order (A,), its inverse; offs (E,) int32, the end row of each
   expert's run. Torch ops only, no host synchronisation (CUDA-graph safe): an assignment's row
   is its expert's start plus how many earlier assignments chose the same expert
   (expert_counts_and_ranks).
2. xs = x[order // K] (A, H); h = grouped_mm(xs, gate_up^T, offs) (A, 2I).
3. act = expert_activation(h) (A, I): bias and gated activation (kernels/moe_epilogue.py).
4. y = grouped_mm(act, down^T, offs) (A, H).
5. ``combine``: out[t] = sum_k round(float(y[dest[a]] (+ down_bias)) * topk_weights[a]), summed in
   float32 and rounded once: the roundings of kernels/fused_moe.fused_moe_ref.

Why: the block-tiled Triton kernel of kernels/fused_moe.py gathers its rows from x inside every
K step and tiles at most 64 rows; at thousands of tokens it reached ~22 TFLOPS (H200, 4,096
tokens of Qwen3-30B-A3B). Sorting the rows once makes every expert's run a plain dense GEMM
operand that TMA can stream, and the grouped kernel tiles it as cuBLAS-class GEMMs do.

``torch._grouped_mm`` takes bf16 only, and needs row strides that are multiples of 16 bytes;
``grouped_mm_supported`` says when this path applies (on CPU torch's reference kernel runs it,
which is what the CPU tests check against fused_moe_ref).
"""
from __future__ import annotations

import torch

from kernels._triton import dense, device_capability, jit, tl, triton, use_triton
from kernels.moe_epilogue import PLAIN_SILU, ExpertEpilogue, expert_activation


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """torch._grouped_mm runs these operands: bf16, 16-byte row strides, and on CUDA a Hopper or
    newer GPU (its CUTLASS kernels are built for sm90+)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16:
        return False
    if any(size % 8 for size in (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1], down.shape[-2])):
        return False
    return not x.is_cuda or device_capability(x.device.index if x.device.index is not None
                                              else torch.cuda.current_device()) >= (9, 0)


def expert_counts_and_ranks(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids (A,) int64 -> (counts (E,): assignments per expert; ranks (A,): how many earlier
    assignments chose the same expert). A cumulative sum along the rows of the (E, A) one-hot:
    the scan runs along contiguous memory (a scan down the columns of the (A, E) one-hot took
    25 ms at 65,536 assignments on an H200, this ~0.1 ms)."""
    experts = torch.arange(num_experts, device=flat_ids.device)
    running = torch.cumsum((experts[:, None] == flat_ids[None, :]).to(torch.int32), dim=1)  # (E, A)
    ranks = running.gather(0, flat_ids[None, :]).squeeze(0) - 1
    return running[:, -1], ranks


def sort_assignments(topk_ids: torch.Tensor, num_experts: int, *, by_sort: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dest, order, offs) of the module docstring, step 1. dest, order int64 (A,); offs int32 (E,).
    ``by_sort``: order from a stable torch.sort of the experts instead of expert_counts_and_ranks
    (the same result; which is faster is measured by benchmarks/kernels/moe_kernel_bench.py --stages)."""
    flat = topk_ids.reshape(-1).long()
    positions = torch.arange(flat.numel(), device=flat.device)
    if by_sort:
        order = torch.sort(flat, stable=True).indices
        dest = torch.empty_like(order).scatter_(0, order, positions)
        ends = torch.cumsum(torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
                            .scatter_add_(0, flat, torch.ones_like(flat)), dim=0)
        return dest, order, ends.to(torch.int32)
    counts, before = expert_counts_and_ranks(flat, num_experts)
    ends = torch.cumsum(counts, dim=0)
    dest = (ends - counts)[flat] + before
    order = torch.empty_like(dest).scatter_(0, dest, positions)
    return dest, order, ends.to(torch.int32)


def combine_ref(y: torch.Tensor, dest: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                down_bias: torch.Tensor | None) -> torch.Tensor:
    """Step 5: y (A, H) in sorted rows -> out (T, H)."""
    num_tokens, top_k = topk_ids.shape
    rows = y[dest]
    if down_bias is not None:
        rows = rows + down_bias[topk_ids.reshape(-1).long()]
    scaled = (rows.float() * topk_weights.reshape(-1, 1).float()).to(y.dtype)
    return scaled.view(num_tokens, top_k, -1).sum(dim=1)


@jit
def _combine_kernel(y_ptr, dest_ptr, ids_ptr, weights_ptr, bias_ptr, out_ptr, hidden, stride_y, stride_b, stride_o,
                    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token, column tile): combine_ref for BLOCK columns of one token."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        a = token * TOP_K + k
        row = tl.load(dest_ptr + a)
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            expert = tl.load(ids_ptr + a).to(tl.int64)
            y = (y.to(tl.float32) + tl.load(bias_ptr + expert * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
                 ).to(y.dtype)
        acc += (y.to(tl.float32) * tl.load(weights_ptr + a)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(y: torch.Tensor, dest: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            down_bias: torch.Tensor | None) -> torch.Tensor:
    """combine_ref: Triton on CUDA (one pass over y), else the reference."""
    if not use_triton(y):
        return combine_ref(y, dest, topk_ids, topk_weights, down_bias)
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    assert y.stride(1) == 1  # (rows at y_ptr + row * stride + column)
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        weights = topk_weights.reshape(-1).float().contiguous()
        dest, down_bias = dense(dest, down_bias)  # read at dest_ptr + assignment, bias_ptr + expert * stride + column
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            y, dest, topk_ids.reshape(-1).contiguous(), weights, down_bias if down_bias is not None else y, out,
            hidden, y.stride(0), down_bias.stride(0) if down_bias is not None else 0, out.stride(0),
            TOP_K=top_k, HAS_BIAS=down_bias is not None, BLOCK=block, num_warps=4)
    return out


def fused_moe_grouped_mm(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """The routed experts' output (T, H) through sorted rows and two grouped GEMMs (module docstring)."""
    num_tokens, top_k = topk_ids.shape
    # torch.sort: 108 us at 8,192 tokens x top-8 of 128 on an H200, the scan 251 us.
    dest, order, offs = sort_assignments(topk_ids, gate_up.shape[0], by_sort=x.is_cuda)
    # Each temporary is dropped as soon as the next exists: at 8,192 tokens x top-8 of Qwen3-30B-A3B
    # rows and y are 256 MiB each, h 192 and act 96, so the peak is rows + h, not all four (the
    # executor sizes its KV pool before any forward runs, from what is free then).
    rows = x.index_select(0, order // top_k)  # (A, H), expert runs back to back
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)  # (A, 2I)
    del rows
    act = expert_activation(h, topk_ids.reshape(-1)[order], epilogue)  # (A, I)
    del h
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)  # (A, H)
    del act
    return combine(y, dest, topk_ids, topk_weights, epilogue.down_bias)
