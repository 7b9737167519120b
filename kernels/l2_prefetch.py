"""Weights pulled into the GPU's L2 cache ahead of the kernels that read them, from a side stream.

Why: a batch-1 decode step is a chain of short kernels, each reading its weight from HBM once. A
1280 x 1280 product reads 3.3 MB, about one memory latency's worth of bytes at HBM's rate, so it
spends most of its few microseconds ramping its reads up and draining them, and HBM idles between
kernels (Whisper large-v3's step moved 1.86 GB in 2.2-2.5 ms: ~0.8 TB/s of the H200's 4.2). A prefetch
of the next product's weight, issued while the current one runs, keeps HBM streaming across the kernel
boundaries; the product then reads its weight from L2.

``l2_prefetch(regions)``: programs of SLICE bytes of each region of ``regions`` (an int64 (n, 2) device tensor
of [address, bytes] rows, ``region_table``), each issuing ``cp.async.bulk.prefetch.L2`` (sm_90 and later: the
SM's bulk-copy unit reads, no registers, nothing waits) over its slice in CHUNK-byte pieces, BLOCK at once. A
prefetch changes no value anywhere: at worst it costs bandwidth and evicts lines.
``l2_prefetch_pages``: a paged pool's pages of each row (a decode step's cross K/V), from block tables on the
device. ``L2Prefetcher.issue(regions)`` (``issue_pages(...)``) launches it on a side stream that first waits for the current stream's
work so far (inside a CUDA-graph capture: a branch of the graph beside the next kernels);
``L2Prefetcher.join()`` makes the current stream wait for the prefetches (a capture must end joined).
Off the GPU, on GPUs before Hopper and under Triton's interpreter (no inline PTX) both do nothing.
"""
from __future__ import annotations

import torch

from kernels._triton import bulk_prefetch_l2, hopper_or_later, jit, tl, triton

CHUNK = 16384  # bytes one prefetch instruction asks for (a multiple of 16, as the instruction needs)
BLOCK = 32  # prefetch instructions a program issues at once (one per thread of its one warp)
# Bytes of a region one program covers. Why split: one SM's bulk prefetches went at ~0.25-0.4 TB/s (H200,
# 2026-11-30: one program per 3-13 MB region took 32.7 us a launch, and the side stream's chain of them, not the
# step's kernels, set a fused Whisper step's length: 6.35 ms against 2.30 without), so a region is spread over
# programs of SLICE bytes each (a 13 MB weight: 26 programs).
SLICE = 512 << 10


@jit
def _l2_prefetch_kernel(regions_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr):
    """Program (region, slice): bytes [slice * SLICE, +SLICE) of the region (none past its end)."""
    region = tl.program_id(0)
    base = tl.load(regions_ptr + 2 * region)
    size = tl.load(regions_ptr + 2 * region + 1)
    first = tl.program_id(1).to(tl.int64) * SLICE
    end = tl.minimum(size, first + SLICE)
    lanes = tl.arange(0, BLOCK).to(tl.int64) * CHUNK
    for start in range(first, end, BLOCK * CHUNK):
        offsets = start + lanes
        bulk_prefetch_l2(base + offsets, tl.minimum(end - offsets, CHUNK).to(tl.int32))


@jit
def _l2_prefetch_pages_kernel(k_ptr, v_ptr, tables_ptr, lengths_ptr, stride_table, stride_kb, stride_vb, page_bytes,
                              PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row``: the K and V pages of its first ``lengths[row]`` tokens (pages ``tables[row, :]``, each
    ``page_bytes`` contiguous at ``ptr + page * stride_*b`` elements)."""
    row = tl.program_id(0)
    pages = tl.cdiv(tl.load(lengths_ptr + row), PAGE)
    lanes = tl.arange(0, BLOCK)
    for first in range(0, pages, BLOCK):
        index = first + lanes
        ok = index < pages
        page = tl.load(tables_ptr + row.to(tl.int64) * stride_table + index, mask=ok, other=0).to(tl.int64)
        nbytes = tl.where(ok, page_bytes, 0).to(tl.int32)
        bulk_prefetch_l2((k_ptr + page * stride_kb).to(tl.int64, bitcast=True), nbytes)
        bulk_prefetch_l2((v_ptr + page * stride_vb).to(tl.int64, bitcast=True), nbytes)


def l2_prefetch_pages(k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
                      ) -> None:
    """Prefetch each row's K and V pages into L2, on the current stream: ``k_pool`` / ``v_pool`` (blocks, page,
    heads, head_dim) views whose blocks are each one contiguous span (head-major pools: the runner's);
    ``tables`` (rows, width) int32 block ids; ``lengths`` (rows,) int32 tokens. Device values only (CUDA-graph
    safe)."""
    if not prefetches(k_pool.device):
        return
    page, block_elements = k_pool.shape[1], k_pool[0].numel()
    for pool in (k_pool, v_pool):
        assert pool.stride(0) >= block_elements and _one_span(pool[0]), "a pool block is one contiguous span"
    assert tables.stride(1) == 1 and lengths.is_contiguous()
    _l2_prefetch_pages_kernel[(tables.shape[0],)](
        k_pool, v_pool, tables, lengths, tables.stride(0), k_pool.stride(0), v_pool.stride(0),
        block_elements * k_pool.element_size() // 16 * 16, PAGE=page, BLOCK=64, num_warps=2)


def _one_span(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one contiguous span in some order (strides a permutation of a dense layout)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def region_table(tensors: list[torch.Tensor], device) -> torch.Tensor | None:
    """The [address, bytes] rows of ``tensors`` (each contiguous; its bytes rounded down to 16; tensors
    under 16 bytes left out) as an int64 (n, 2) tensor on ``device``, or None when none is left. The
    table holds addresses: the tensors must outlive it and never move."""
    rows = []
    for t in tensors:
        assert t.is_contiguous(), "a prefetch region is one contiguous span"
        size = t.numel() * t.element_size() // 16 * 16
        if size:
            rows.append([t.data_ptr(), size])
    if not rows:
        return None
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    table.slices = -(-max(size for _, size in rows) // SLICE)  # programs a region (l2_prefetch)
    return table


def prefetches(device) -> bool:
    """Whether ``l2_prefetch`` launches anything on ``device`` (a Hopper or later GPU, Triton compiled)."""
    probe = torch.empty(0, device=device)
    return probe.is_cuda and triton is not None and hopper_or_later(probe)


def l2_prefetch(regions: torch.Tensor) -> None:
    """Prefetch every region of ``regions`` (``region_table``) into L2, on the current stream: SLICE bytes a
    program (the table's ``slices`` attribute: its largest region's count of them)."""
    if regions is None or not prefetches(regions.device):
        return
    _l2_prefetch_kernel[(regions.shape[0], regions.slices)](regions, CHUNK=CHUNK, BLOCK=BLOCK, SLICE=SLICE,
                                                            num_warps=1)


class L2Prefetcher:
    """``l2_prefetch`` on a side stream of ``device`` (module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.on = prefetches(self.device)
        self.stream = torch.cuda.Stream(self.device) if self.on else None
        self.pending = False

    def issue(self, regions: torch.Tensor | None) -> None:
        if not self.on or regions is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            l2_prefetch(regions)
        self.pending = True

    def issue_pages(self, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                    lengths: torch.Tensor) -> None:
        if not self.on:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            l2_prefetch_pages(k_pool, v_pool, tables, lengths)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False
