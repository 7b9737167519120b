"""A rank other than 0 started as ``tritonserver`` (NVIDIA's recipes: ``srun --mpi=pmix`` or
``mpirun`` running one tritonserver per GPU, each with ``shm-region-prefix-name=prefix{rank}_``;
Kubernetes LeaderWorkerSet pods; ``scripts/launch_triton_server.py --worker_ranks tritonserver``).

Its ``tensorrt_llm`` model's ``initialize`` runs this rank's engine worker and never returns while
the job lives (leader mode: rank 0 serves, every other rank follows its plans), so the rank's
server never finishes loading and never binds its ports. The worker is the same program the
launcher starts for such ranks by default (``python -m engine.tensor_parallel.worker``), a child of
the Python-backend stub that dies with it (PR_SET_PDEATHSIG); it reads its rank, the world and the
rendezvous address from the environment MPI / Slurm gave this server (engine/tensor_parallel/distributed.py).
When it ends (the leader shut the job down, or a fault broke it) this raises, the model fails to
load, and the rank's tritonserver exits: ranks fail together.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys

from serving.child_python import child_environment

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the worker still ends when the leader's group breaks
        pass


def worker_command(engine_dir: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "engine.tensor_parallel.worker", f"--engine_dir={engine_dir}"]


def run_worker_rank(engine_dir: str, rank: int, python: str) -> None:
    """Block while this rank's engine worker runs; raise RuntimeError (naming the rank) once it ends."""
    process = subprocess.Popen(worker_command(engine_dir, python), env=child_environment(),
                               preexec_fn=_die_with_parent)
    code = process.wait()
    if code == 0:
        raise RuntimeError(f"rank {rank}: the leader (rank 0) shut the job down; this rank's tritonserver stops "
                           "with it (a worker rank never serves)")
    raise RuntimeError(f"rank {rank}: its engine worker failed (exit code {code}; its log is above): a rank of the "
                       "job was lost or could not load, so the job stops")
