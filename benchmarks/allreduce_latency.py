"""All-reduce latency between 2 GPUs through torch.distributed (NCCL), eager and inside a CUDA graph.

    python benchmarks/allreduce_latency.py            # starts its 2 ranks itself; rank 0 prints

Decode under tensor parallelism runs two all-reduces per layer on tiny messages (batch x hidden
values), so their latency, not bandwidth, bounds how much TP saves per step. Sizes are bf16
element counts: 4,096 (batch 1 of an 8B model), 32,768 (batch 8), 131,072 (batch 32).
``NCCL_DEBUG=INFO`` shows the transport NCCL chose (P2P over NVLink, SHM, ...).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

SIZES = (4096, 4096 * 8, 4096 * 32)


def measure(rank: int, port: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for numel in SIZES:
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager_us = (time.perf_counter() - started) / iters * 1e6

        # 64 all-reduces in one graph, as a decode step's graph holds them.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(64):
                dist.all_reduce(x)
        replays = max(1, iters // 64)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        graph_us = (time.perf_counter() - started) / (replays * 64) * 1e6
        del graph
        if rank == 0:
            print(f"bf16 x {numel:>7}: eager {eager_us:6.1f} us, in a CUDA graph {graph_us:6.1f} us per all-reduce",
                  flush=True)
    measure_symmetric(rank, iters)
    torch.cuda.synchronize()
    # No destroy_process_group: with collectives captured in a graph it can block forever
    # (pytorch/pytorch#115388); the process is done.
    os._exit(0)


def measure_symmetric(rank: int, iters: int) -> None:
    """The same sizes through torch's symmetric-memory one-shot all-reduce (peer loads over NVLink,
    no multicast), checked against the exact sum."""
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
        group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(max(SIZES), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group_name)
    except Exception as err:  # noqa: BLE001  (report and go on: this is a probe)
        if rank == 0:
            print(f"symmetric memory unavailable: {type(err).__name__}: {err}", flush=True)
        return
    for numel in SIZES:
        local = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        view = buffer[:numel]

        def all_reduce():
            view.copy_(local)
            return torch.ops.symm_mem.one_shot_all_reduce(view, "sum", group_name)

        ok = bool((all_reduce() == 3.0).all())
        for _ in range(20):
            all_reduce()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iters):
            all_reduce()
        torch.cuda.synchronize()
        eager_us = (time.perf_counter() - started) / iters * 1e6
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            all_reduce()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(64):
                out = all_reduce()
        replays = max(1, iters // 64)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        graph_us = (time.perf_counter() - started) / (replays * 64) * 1e6
        ok = ok and bool((out == 3.0).all())
        if rank == 0:
            print(f"symm one-shot bf16 x {numel:>7}: eager {eager_us:6.1f} us, in a CUDA graph {graph_us:6.1f} us "
                  f"per all-reduce, sums {'right' if ok else 'WRONG'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=640)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        measure(args.rank, args.port, args.iters)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--iters", str(args.iters)])
             for r in (0, 1)]
    codes = [p.wait(timeout=300) for p in ranks]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
