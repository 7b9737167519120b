"""kernels/l2_prefetch.py: the L2 prefetch launch requests lines of byte views and changes nothing.
GPU: the PTX prefetches on a side stream, joined; CPU: Triton's interpreter (TRITON_INTERPRET=1), where
the programs load the lines instead (any address past a tensor's end would fail there), else skipped."""
from __future__ import annotations

import pytest
import torch


def test_requests_every_line_and_writes_nothing(device):
    from kernels.l2_prefetch import BLOCK, join_prefetch, prefetch_beside, prefetch_regions

    a = torch.randn(3, 1000, device=device, dtype=torch.bfloat16)  # 6,000 bytes: 47 lines, the last one partial
    b = torch.randn(5, 7, device=device)[1:]  # a contiguous slice (as the shared experts' gate_up)
    before = (a.clone(), b.clone())
    sink = torch.full((BLOCK,), 7, dtype=torch.int32, device=device)
    for regions in (prefetch_regions([a]), prefetch_regions([a, b, a, b])):
        prefetch_beside(regions, sink)
    if device == "cuda":
        join_prefetch(a.device)
        torch.cuda.synchronize()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1]) and bool((sink == 7).all())
    with pytest.raises(AssertionError):
        prefetch_regions([a.t()])
