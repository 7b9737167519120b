"""``python -m engine.tensor_parallel.worker --engine_dir DIR``: one non-leader rank of a tensor-parallel job.

Started by ``scripts/launch_triton_server.py --world_size N`` as MPI ranks 1..N-1 next to
``tritonserver`` (rank 0, the leader). It joins the process groups, loads its weight shard, and
runs the leader's plans until the leader says SHUTDOWN (exit 0) or a fault breaks the group
(exit 1, so the job's other ranks see it). It opens no ports and serves no requests.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from engine.tensor_parallel.distributed import run_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine_dir", required=True, help="engine directory built with --tp_size = world size")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:<i>; default: this rank's GPU (local rank) if CUDA is available, else cpu")
    parser.add_argument("--log_level", default="INFO")
    return parser.parse_args(argv)


def _exit_on_signal(signum, _frame) -> None:
    # mpirun forwards SIGTERM/SIGINT to every rank; leave at once (the leader is going too).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s engine.tensor_parallel.worker %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    try:
        run_worker(args.engine_dir, device=args.device)
    except SystemExit:
        raise
    except Exception as err:
        logging.getLogger("engine.tensor_parallel.worker").error("worker failed: %s", err)
        return 1
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: a communicator whose teardown timed out
    (engine.tensor_parallel.distributed._destroy_groups) would block the C++ destructors that run at exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
