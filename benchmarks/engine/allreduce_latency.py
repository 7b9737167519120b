"""All-reduce latency between 2 GPUs through torch.distributed (NCCL), eager and inside a CUDA graph.

    python benchmarks/engine/allreduce_latency.py            # starts its 2 ranks itself; rank 0 prints

Decode under tensor parallelism runs two all-reduces per layer on tiny messages (batch x hidden
values), so their latency, not bandwidth, bounds how much TP saves per step. Sizes are bf16
element counts: 4,096 (batch 1 of an 8B model), 32,768 (batch 8), 131,072 (batch 32).
``NCCL_DEBUG=INFO`` shows the transport NCCL chose (P2P over NVLink, SHM, ...).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import run_two_ranks  # noqa: E402

SIZES = (4096, 4096 * 8, 4096 * 32)


def eager_and_graph_us(all_reduce, iters: int) -> tuple[float, float]:
    """Microseconds per call of ``all_reduce()``: launched one by one, and replayed from a CUDA
    graph that holds 64 of them (as a decode step's graph holds 65)."""
    import torch

    from kernels.linear import graph_time_ms

    for _ in range(20):
        all_reduce()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        all_reduce()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - started) / iters * 1e6
    return eager_us, graph_time_ms(all_reduce, repeat=64) * 1e3


def measure(rank: int, port: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for numel in SIZES:
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        eager_us, graph_us = eager_and_graph_us(lambda: dist.all_reduce(x), iters)
        if rank == 0:
            print(f"NCCL bf16 x {numel:>7}: eager {eager_us:6.1f} us, in a CUDA graph {graph_us:6.1f} us per all-reduce",
                  flush=True)
    measure_symmetric(rank, iters)
    torch.cuda.synchronize()
    # No destroy_process_group: with collectives captured in a graph it can block forever
    # (pytorch/pytorch#115388); the process is done.
    os._exit(0)


def measure_symmetric(rank: int, iters: int) -> None:
    """The same sizes through the engine's one-shot all-reduce (engine.models.layers: torch's
    symmetric memory, peer loads over NVLink, no multicast), checked against the exact sum."""
    import torch
    import torch.distributed as dist

    from engine.models.layers import SymmetricAllReduce

    try:
        one_shot = SymmetricAllReduce(dist.group.WORLD, torch.device("cuda", rank))
    except Exception as err:  # noqa: BLE001  (report and go on: this is a probe)
        if rank == 0:
            print(f"symmetric memory unavailable: {type(err).__name__}: {err}", flush=True)
        return
    for numel in SIZES:
        local = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        eager_us, graph_us = eager_and_graph_us(lambda: one_shot(local), iters)
        torch.cuda.synchronize()
        right = bool((one_shot(local) == 3.0).all())
        if rank == 0:
            print(f"one-shot bf16 x {numel:>7}: eager {eager_us:6.1f} us, in a CUDA graph {graph_us:6.1f} us "
                  f"per all-reduce, sums {'right' if right else 'WRONG'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=640)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        measure(args.rank, args.port, args.iters)
        return
    run_two_ranks(__file__, ["--iters", str(args.iters)])


if __name__ == "__main__":
    main()
