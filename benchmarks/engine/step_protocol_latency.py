"""Cost of leader mode's per-step plan broadcast (engine/tensor_parallel/distributed.py StepChannel) on 2 ranks.

    python benchmarks/engine/step_protocol_latency.py [--device cuda]     # starts its 2 ranks itself

The channel is the one the engine would use on that device (shared memory on GPUs, gloo on CPU);
TRITONLLM_SHM_PLANS=1 or 0 forces one.

Times, per iteration, (a) a gloo all-reduce of one int (the heartbeat's reply), and (b) a batch-1
decode plan (header + payload broadcast over the gloo control group, decoded on the worker)
followed by the same all-reduce; (b) - (a) is what sending one plan adds to a step's critical
path, since the worker cannot launch its half of the step before the plan arrives.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import run_two_ranks  # noqa: E402


def run_rank(rank: int, port: int, device: str, iters: int) -> None:
    from engine.tensor_parallel.distributed import DistSettings, RankInfo, init_distributed, resolve_device
    from engine.tensor_parallel.step_protocol import Op, StepChannel
    from engine.executor.runner import ForwardBatch

    info = RankInfo(rank=rank, world_size=2, local_rank=rank, local_size=2)
    env = {"TRITONLLM_DIST_ADDR": "127.0.0.1", "TRITONLLM_DIST_PORT": str(port)}
    ctx = init_distributed(info, resolve_device(device, rank), DistSettings.from_env(info, env))
    channel = StepChannel(ctx, batch_class=ForwardBatch)
    batch = ForwardBatch([123], [300], [1], [301], [list(range(10))], [0])

    def reply_only():
        channel.all_reduce_min(0)

    def plan_and_reply():
        if rank == 0:
            channel.send(Op.FORWARD, batch=batch)
        else:
            channel.recv()
        channel.all_reduce_min(0)

    results = {}
    for name, step in (("all_reduce_min", reply_only), ("plan + all_reduce_min", plan_and_reply)):
        for _ in range(50):
            step()
        started = time.perf_counter()
        for _ in range(iters):
            step()
        results[name] = (time.perf_counter() - started) / iters * 1e6
    channel.close()
    if rank == 0:
        for name, us in results.items():
            print(f"{name}: {us:.1f} us per iteration", flush=True)
        print(f"one plan adds {results['plan + all_reduce_min'] - results['all_reduce_min']:.1f} us", flush=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.port, args.device, args.iters)
        return
    run_two_ranks(__file__, ["--device", args.device, "--iters", str(args.iters)])


if __name__ == "__main__":
    main()
