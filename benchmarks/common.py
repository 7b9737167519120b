"""Timing of GPU work from CUDA-graph replays, shared by the kernel benchmarks.

``graph_call_us(fn, inputs)``: one graph holds one fn(*args) call per entry of ``inputs`` (different
tensors each, so weights picked by different routings or rows come from HBM, not L2), and the
device time of a replay is divided by the number of calls: launch gaps inside the graph count,
host overheads do not.
"""
from __future__ import annotations

import torch

from kernels.linear import replay_time_ms, side_stream


def graph_call_us(fn, inputs, replays: int = 3) -> float:
    """Device microseconds per fn(*args) call (module docstring); one eager call first, on a side
    stream, compiles whatever the call compiles."""
    stream = side_stream()  # one for every call: torch keeps a cuBLAS workspace per stream (kernels/linear.py)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    us = replay_time_ms(graph, replays=replays) / len(inputs) * 1000
    del graph
    return us
