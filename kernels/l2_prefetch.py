"""Weights a later kernel of the step will read, pulled into L2 while the memory is otherwise idle.

A batch-1 decode layer of a MoE model alternates bandwidth-bound kernels (the products, the expert
GEMMs) with latency-bound ones that move almost no bytes (norms, the attention over a short latent
cache, the combine, the router): DeepSeek-V2-Lite's MLA kernels and router are ~20 us a layer with
HBM idle. Weights are never written by a step, so the ones read next -- the layer's o_proj, and the
shared experts every token goes through -- can be requested during that window: ``l2_prefetch``
launches a small kernel whose programs only issue ``prefetch.global.L2::evict_last`` for every
128-byte line of the given tensors (no registers filled, nothing stored), and the product that reads
them later finds them in L2 (evict_last: kept over the streamed lines of other weights).

``prefetch_beside`` runs it on a side stream forked from the step's stream, so the
step's kernels never wait for it (it must not delay the PDL chain: a kernel waits for every program
of the one before it), and joins that stream back once a step (``join_prefetch``): CUDA-graph capture
takes the fork and the join as a branch of the graph. Whether the step gains is the GPU's to say (the
model's load-time choice, engine/executor/decode_fusions.py, times it). Under TRITON_INTERPRET=1 (no
inline PTX) the programs load the lines instead, which checks the addresses; results never depend on
this kernel.
"""
from __future__ import annotations

import os

import torch

from kernels._triton import jit, tl, triton

LINE = 128  # bytes a prefetch covers (an L2 line)
BLOCK = 1024  # lines a program requests per step of its loop
MAX_REGIONS = 4  # byte ranges one launch takes
PROGRAMS = 32  # programs of the launch, each requesting its share of lines: few, to leave the SMs to the step
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_FORKED: set[torch.device] = set()  # devices whose side stream took a prefetch since the last join


@jit
def _prefetch_lines(base, lines, sink_ptr, BLOCK: tl.constexpr, LINE: tl.constexpr, INTERPRETED: tl.constexpr):
    """This program's share of ``lines`` 128-byte lines from byte pointer ``base``: lines pid * BLOCK + i,
    every programs * BLOCK. Lanes past the end prefetch the last line again (inline PTX takes no mask)."""
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, lines, stride):
        line = tl.minimum(start + tl.arange(0, BLOCK), lines - 1)
        ptrs = base + line.to(tl.int64) * LINE
        if INTERPRETED:
            done = tl.load(ptrs).to(tl.int32)
        else:
            done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                             [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        # (never true: keeps the requests from being dropped as unused values)
        tl.store(sink_ptr + tl.arange(0, BLOCK), done, mask=done < -1000)


@jit
def _l2_prefetch_kernel(a_ptr, a_lines, b_ptr, b_lines, c_ptr, c_lines, d_ptr, d_lines, sink_ptr, BLOCK: tl.constexpr,
                        LINE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Up to MAX_REGIONS byte ranges (an unused one: 0 lines), each spread over every program."""
    _prefetch_lines(a_ptr, a_lines, sink_ptr, BLOCK, LINE, INTERPRETED)
    _prefetch_lines(b_ptr, b_lines, sink_ptr, BLOCK, LINE, INTERPRETED)
    _prefetch_lines(c_ptr, c_lines, sink_ptr, BLOCK, LINE, INTERPRETED)
    _prefetch_lines(d_ptr, d_lines, sink_ptr, BLOCK, LINE, INTERPRETED)


def prefetch_regions(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as byte views, each contiguous (a strided view is refused: its bytes are not one range)."""
    assert all(t.is_contiguous() for t in tensors), [tuple(t.stride()) for t in tensors]
    return [t.view(-1).view(torch.uint8) for t in tensors]


def l2_prefetch(regions: list[torch.Tensor], sink: torch.Tensor) -> None:
    """Request every line of up to MAX_REGIONS byte tensors (prefetch_regions) into L2, on the current
    stream. ``sink``: an int32 tensor of at least BLOCK elements on the device (never written in practice)."""
    assert 1 <= len(regions) <= MAX_REGIONS and sink.dtype == torch.int32 and sink.numel() >= BLOCK
    slots = [arg for region in regions for arg in (region, triton.cdiv(region.numel(), LINE))]
    slots += [regions[0], 0] * (MAX_REGIONS - len(regions))
    _l2_prefetch_kernel[(PROGRAMS,)](*slots, sink, BLOCK=BLOCK, LINE=LINE,
                                     INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4)


def prefetch_beside(regions: list[torch.Tensor], sink: torch.Tensor) -> None:
    """l2_prefetch on the device's side stream, forked from the current stream (the work so far comes
    first); the current stream does not wait for it until join_prefetch. Off CUDA (the interpreter's
    runs on CPU tensors) on the current stream."""
    device = sink.device
    if device.type != "cuda":
        l2_prefetch(regions, sink)
        return
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    stream = _STREAMS[device]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        l2_prefetch(regions, sink)
    _FORKED.add(device)


def begin_prefetch_step(device: torch.device) -> None:
    """A forward's start: a fork no join followed (a forward that raised, perhaps mid-capture) leaves its
    side stream behind -- a new one serves from here -- so this forward's join never waits on another's
    work (in a graph capture, an event from outside the capture is an error)."""
    if device in _FORKED:
        _FORKED.discard(device)
        _STREAMS.pop(device, None)


def join_prefetch(device: torch.device) -> None:
    """The current stream waits for the side stream's prefetches since the last join (once a step: a
    graph capture must join every branch it forked); nothing where none was forked."""
    if device in _FORKED:
        _FORKED.discard(device)
        torch.cuda.current_stream(device).wait_stream(_STREAMS[device])
