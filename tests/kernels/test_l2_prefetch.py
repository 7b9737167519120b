"""kernels/l2_prefetch.py: the region tables (CPU), and on a Hopper GPU the prefetch kernels run over weights
and over a head-major paged pool's pages, eagerly and as a side-stream branch of a CUDA graph, changing nothing."""
from __future__ import annotations

import pytest
import torch

from kernels.l2_prefetch import L2Prefetcher, l2_prefetch, prefetches, region_table


def test_region_table_rows():
    """[address, bytes] per tensor, bytes rounded down to 16, tensors under 16 bytes left out, None for none."""
    a, b, tiny = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(7, 3), torch.zeros(3, dtype=torch.bfloat16)
    table = region_table([a, tiny, b], "cpu")
    assert table.dtype == torch.int64 and table.tolist() == [[a.data_ptr(), 2000], [b.data_ptr(), 80]]
    assert region_table([tiny], "cpu") is None
    assert not prefetches("cpu") and not L2Prefetcher("cpu").on
    l2_prefetch(table)  # off the GPU: nothing


@pytest.mark.gpu
def test_prefetches_change_nothing_in_a_graph():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper (or later) GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, 1280, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (3840, 1280, 5121)]
    odd = torch.randn(1001, device="cuda", dtype=torch.bfloat16, generator=gen)  # 2,002 bytes: rounded to 2,000
    table = region_table(weights + [odd], "cuda")
    # a head-major pool (blocks, page, heads, dim) as the runner's, two rows' pages (one of no tokens)
    pool = torch.randn(2, 12, 20, 32, 64, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(2, 3)
    tables = torch.tensor([[5, 3, 11, 0], [0, 0, 0, 0]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([100, 0], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 1280, device="cuda", dtype=torch.bfloat16, generator=gen)
    before = [w.clone() for w in weights] + [pool.clone()]
    prefetcher = L2Prefetcher("cuda")
    assert prefetcher.on

    def step():
        prefetcher.issue(table)
        prefetcher.issue_pages(pool[0], pool[1], tables, lengths)
        out = x @ weights[0].T
        prefetcher.join()
        return out

    expected = x @ weights[0].T
    torch.testing.assert_close(step(), expected, rtol=0, atol=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for kept, now in zip(before, weights + [pool]):
        assert torch.equal(kept, now)
