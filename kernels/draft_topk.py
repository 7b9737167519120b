"""A draft head's k best tokens per row, mapped to the target's vocabulary, in one launch.

``draft_top_ids(logits, d2t, k) -> (..., k) int64``: for every row of ``logits`` (..., V) the
indices of its k largest values, largest first, plus ``d2t`` at each (EAGLE-3's draft-to-target
offsets: target id = draft id + d2t[draft id]; ``d2t`` None: the indices themselves). That is
``ids = logits.topk(k).indices; ids + d2t[ids]``, which the reference runs.

Why a kernel: torch.topk on CUDA is a radix select (per call ~4 passes of three kernels, two cub
scans, a gather and a bitonic sort of the k found) and the d2t offsets one more gather: ~17
launches and ~40 us for one row of a 32000-token draft vocabulary on an H200 (the EAGLE-3 drafting
replay's kernel table, 2026-11-29: ~200 us of its 1.47 ms in 5 such calls). Here a program per row
holds the whole row in registers (V <= MAX_VOCAB: EAGLE-3's 32000-token draft vocabularies) and
takes k arg-maxes, each blanking the one it found: one launch, the row read once.

Ties: the lowest index first (Triton's argmax); torch.topk leaves ties' order unspecified, so the
two agree wherever no two of a row's top k + 1 values are equal (the tests use random logits).
NaNs are not ranked as torch.topk ranks them (first): draft logits have none.
Rows past MAX_VOCAB wide (a draft vocabulary as large as the target's 128k) and k > MAX_K run the
reference.
"""
from __future__ import annotations

import torch

from kernels._triton import dense_rows, jit, require_dense, tl, triton, use_triton

MAX_VOCAB = 32768  # a row in registers: 32 fp32 values a thread at 32 warps (an SM's 64k registers, no spills)
MAX_K = 32  # k arg-maxes in sequence: beyond this a sort is the better algorithm


def draft_top_ids_ref(logits: torch.Tensor, d2t: torch.Tensor | None, k: int) -> torch.Tensor:
    ids = logits.topk(k, dim=-1).indices
    return ids if d2t is None else ids + d2t[ids]


@jit
def _top_ids_kernel(logits_ptr, d2t_ptr, out_ptr, V, stride_row, K: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_D2T: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V, other=-float("inf"))
    x = x.to(tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(x, axis=0)  # the first index of the row's largest remaining value
        token = best.to(tl.int64)
        if HAS_D2T:
            token += tl.load(d2t_ptr + best).to(tl.int64)
        tl.store(out_ptr + row * K + j, token)
        x = tl.where(offs == best, -float("inf"), x)


def draft_top_ids_triton(logits: torch.Tensor, d2t: torch.Tensor | None, k: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on ``logits``' device (CUDA, or the CPU under TRITON_INTERPRET=1); ``out``: a
    contiguous (..., k) int64 tensor it writes (a CUDA graph's static buffer), else a new one."""
    V = logits.shape[-1]
    rows, = dense_rows(logits.reshape(-1, V))  # (the kernel takes the row stride)
    if out is None:
        out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=logits.device)
    require_dense(out=out)
    assert out.numel() == rows.shape[0] * k and out.dtype == torch.int64
    if rows.shape[0]:
        block = triton.next_power_of_2(V)
        mapped = d2t is not None
        _top_ids_kernel[(rows.shape[0],)](rows, d2t if mapped else out, out, V, rows.stride(0), K=k, BLOCK=block,
                                          HAS_D2T=mapped, num_warps=max(4, min(32, block // 1024)))
    return out.view(*logits.shape[:-1], k)


def draft_top_ids(logits: torch.Tensor, d2t: torch.Tensor | None, k: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """logits (..., V) float, d2t (V,) int64 or None -> (..., k) int64 (module docstring). ``out``:
    (..., k) int64 to write instead (returned): a contiguous one the kernel writes itself, else a copy."""
    if use_triton(logits) and logits.shape[-1] <= MAX_VOCAB and 0 < k <= min(MAX_K, logits.shape[-1]) and (
            d2t is None or d2t.is_contiguous()):
        if out is not None and out.is_contiguous():
            return draft_top_ids_triton(logits, d2t, k, out)
        ids = draft_top_ids_triton(logits, d2t, k)
    else:
        ids = draft_top_ids_ref(logits, d2t, k)
    return ids if out is None else out.copy_(ids)
