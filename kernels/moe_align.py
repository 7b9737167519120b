"""Alignment for the grouped expert GEMMs: the assignments (a = t * K + k, A = T * K of them)
sorted by expert, each expert's run padded to a multiple of BLOCK_M with the sentinel A, so every
BLOCK_M-row block of the sorted list belongs to one expert (kernels/fused_moe.py's module docstring
has a worked example). Outputs, whatever the path:

    sorted_ids (max_padded,) int32   assignment ids by expert; padding = A; entries at or past
                                     num_padded are never read (their blocks exit at once)
    block_expert (max_padded // BLOCK_M,) int32   the expert of each block
    num_padded (1,) int32            rows of the padded list actually used

No host synchronisation on any path (the sizes depend on T, K, E only), so CUDA graphs capture it.

Paths: ``moe_align_torch`` (torch ops: the CPU path and the tests' oracle; assignments of one
expert in order of a); ``moe_align_triton``, one program (a decode step's few assignments);
``moe_align_parallel`` (CUDA, larger batches): three launches over chunks of assignments, each
chunk reserving its experts' rows with one atomic add an expert, so the order of assignments
within an expert depends on which chunk got there first. Harmless: a row of a block is computed
from its own token and weights alone, so where in its expert's run it lands changes nothing in
the output. Measured on an H200 at 512 tokens x top-8 of 128 experts (block_m 64): the torch
ops 71 us, the one-program kernel 133 us; the three launches are timed by
benchmarks/kernels/moe_kernel_bench.py --stages.
"""
from __future__ import annotations

import torch

from kernels._triton import jit, pdl_options, pdl_prologue, tl, triton, use_triton
from kernels.moe_grouped_mm import expert_counts_and_ranks

# Assignments up to which the one-program kernel aligns (a few decode tokens); past it the
# parallel kernels on CUDA.
ALIGN_KERNEL_MAX_ASSIGNMENTS = 256
PARALLEL_ALIGN_CHUNK = 128  # assignments a program of the parallel kernels


def max_padded_assignments(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The longest sorted_ids can get: each expert that has any assignment (at most
    min(E, T * K) of them) wastes at most BLOCK_M - 1 padding rows."""
    padded = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-padded // block_m) * block_m


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, num_padded) of the module docstring, in torch ops.

    sorted_ids (max_padded,) int32: assignment ids grouped by expert (ascending within an
    expert), each group padded to a multiple of block_m with T * K; block_expert
    (max_padded // block_m,) int32: the expert of each block (blocks past num_padded: clamped
    to E - 1, never read); num_padded (1,) int32.

    No sort and no host synchronisation, so it is captured in CUDA graphs as it is: an
    assignment's place within its expert is the count of earlier assignments of that expert
    (expert_counts_and_ranks).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_assignments, device = flat.numel(), flat.device
    max_padded = max_padded_assignments(num_assignments, num_experts, block_m)
    counts, before = expert_counts_and_ranks(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, dim=0)
    destination = (padded_ends - padded)[flat] + before
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destination, torch.arange(num_assignments, dtype=torch.int32, device=device))
    block_rows = torch.arange(0, max_padded, block_m, dtype=padded_ends.dtype, device=device)
    block_expert = torch.searchsorted(padded_ends, block_rows, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_ends[-1:].to(torch.int32)


@jit
def _moe_align_kernel(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                      num_assignments, num_experts, max_padded,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program does it all (small T * K: decode steps), in three passes over the assignments'
    experts, CHUNK at a time: count per expert; write the padding and each block's expert; then
    place each assignment at its expert's padded start + how many of that expert came before it
    (a cumulative sum over a (CHUNK, E_PAD) one-hot)."""
    experts = tl.arange(0, E_PAD)
    chunk = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_assignments, CHUNK):
        e = tl.load(topk_ids_ptr + start + chunk, mask=start + chunk < num_assignments, other=E_PAD)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, axis=0)
    padded_starts = padded_ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, max_padded, CHUNK):
        tl.store(sorted_ids_ptr + start + chunk, num_assignments + chunk * 0, mask=start + chunk < max_padded)
    for start in range(0, max_padded // BLOCK_M, CHUNK):
        rows = (start + chunk) * BLOCK_M
        # A block's expert = how many experts end at or before its first row (empty experts included).
        owner = tl.sum((padded_ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + start + chunk, tl.minimum(owner, num_experts - 1),
                 mask=rows < max_padded)
    tl.debug_barrier()  # the padding is written before any assignment lands on it
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_assignments, CHUNK):
        ok = start + chunk < num_assignments
        e = tl.load(topk_ids_ptr + start + chunk, mask=ok, other=E_PAD)
        one_hot = (e[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E_PAD)
        before_in_chunk = tl.cumsum(one_hot, axis=0) - one_hot
        slot = tl.sum(one_hot * (before_in_chunk + (padded_starts + seen)[None, :]), axis=1)
        tl.store(sorted_ids_ptr + slot, start + chunk, mask=ok)
        seen += tl.sum(one_hot, axis=0)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_torch's layout in one kernel launch (one program: for small T * K only)."""
    num_assignments, device = topk_ids.numel(), topk_ids.device
    sorted_ids, block_expert, num_padded = _empty_layout(num_assignments, num_experts, block_m, device)
    max_padded = sorted_ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, block_expert, num_padded,
                            num_assignments, num_experts, max_padded,
                            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, min(256, 8192 // e_pad)), num_warps=4)
    return sorted_ids, block_expert, num_padded


def _empty_layout(num_assignments: int, num_experts: int, block_m: int, device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised (sorted_ids, block_expert, num_padded) of the module docstring's sizes."""
    max_padded = max_padded_assignments(num_assignments, num_experts, block_m)
    return (torch.empty(max_padded, dtype=torch.int32, device=device),
            torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


@jit
def _count_experts_kernel(topk_ids_ptr, counts_ptr, num_assignments, num_experts,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """counts[e] += assignments of expert e among this program's CHUNK (one atomic an expert)."""
    pdl_prologue(PDL)
    start = tl.program_id(0) * CHUNK
    chunk = start + tl.arange(0, CHUNK)
    e = tl.load(topk_ids_ptr + chunk, mask=chunk < num_assignments, other=E_PAD)
    experts = tl.arange(0, E_PAD)
    local = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + experts, local, mask=(experts < num_experts) & (local > 0))


@jit
def _plan_blocks_kernel(counts_ptr, cursor_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_assignments,
                        num_experts, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One program: each expert's padded start (into cursor, where the placing kernel reserves
    rows), num_padded, the sentinel in each run's padding tail, and every block's expert."""
    pdl_prologue(PDL)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, axis=0)
    padded_starts = padded_ends - padded
    tl.store(cursor_ptr + experts, padded_starts, mask=experts < num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tail = tl.arange(0, BLOCK_M)
    tail_rows = (padded_starts + counts)[:, None] + tail[None, :]  # (E_PAD, BLOCK_M)
    tl.store(sorted_ids_ptr + tail_rows, num_assignments + tail_rows * 0,
             mask=(tail[None, :] < (padded - counts)[:, None]) & (experts < num_experts)[:, None])
    blocks = tl.arange(0, BLOCK_CHUNK)
    for start in range(0, max_blocks, BLOCK_CHUNK):
        rows = (start + blocks) * BLOCK_M
        owner = tl.sum((padded_ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + start + blocks, tl.minimum(owner, num_experts - 1), mask=start + blocks < max_blocks)


@jit
def _place_assignments_kernel(topk_ids_ptr, cursor_ptr, sorted_ids_ptr, num_assignments, num_experts,
                              E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """This program's CHUNK assignments into their experts' runs: one atomic add an expert reserves
    the chunk's rows of that expert; within the chunk, assignments keep their order."""
    pdl_prologue(PDL)
    start = tl.program_id(0) * CHUNK
    chunk = start + tl.arange(0, CHUNK)
    ok = chunk < num_assignments
    e = tl.load(topk_ids_ptr + chunk, mask=ok, other=E_PAD)
    experts = tl.arange(0, E_PAD)
    one_hot = (e[:, None] == experts[None, :]).to(tl.int32)  # (CHUNK, E_PAD)
    local = tl.sum(one_hot, axis=0)
    base = tl.atomic_add(cursor_ptr + experts, local, mask=(experts < num_experts) & (local > 0))
    before = tl.cumsum(one_hot, axis=0) - one_hot
    slot = tl.sum(one_hot * (before + base[None, :]), axis=1)
    tl.store(sorted_ids_ptr + slot, chunk, mask=ok)


def moe_align_parallel(topk_ids: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's layout in three launches (plus one memset) over chunks of assignments."""
    num_assignments, device = topk_ids.numel(), topk_ids.device
    sorted_ids, block_expert, num_padded = _empty_layout(num_assignments, num_experts, block_m, device)
    max_padded = sorted_ids.numel()
    counts_and_cursor = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
    flat = topk_ids.reshape(-1).contiguous()
    e_pad = triton.next_power_of_2(num_experts)
    chunk = PARALLEL_ALIGN_CHUNK
    grid = (triton.cdiv(num_assignments, chunk),)
    _count_experts_kernel[grid](flat, counts_and_cursor[0], num_assignments, num_experts, E_PAD=e_pad, CHUNK=chunk,
                                num_warps=4, **pdl_options(flat))
    _plan_blocks_kernel[(1,)](counts_and_cursor[0], counts_and_cursor[1], sorted_ids, block_expert, num_padded,
                              num_assignments, num_experts, max_padded // block_m, BLOCK_M=block_m, E_PAD=e_pad,
                              BLOCK_CHUNK=max(16, 8192 // e_pad), num_warps=4, **pdl_options(flat))
    _place_assignments_kernel[grid](flat, counts_and_cursor[1], sorted_ids, num_assignments, num_experts,
                                    E_PAD=e_pad, CHUNK=chunk, num_warps=4, **pdl_options(flat))
    return sorted_ids, block_expert, num_padded


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, num_padded) of the module docstring: the one-program kernel for
    a few assignments and the parallel kernels for more on CUDA, else the torch ops."""
    if use_triton(topk_ids) and topk_ids.numel() > 0:
        if topk_ids.numel() <= ALIGN_KERNEL_MAX_ASSIGNMENTS:
            return moe_align_triton(topk_ids, num_experts, block_m)
        return moe_align_parallel(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)
