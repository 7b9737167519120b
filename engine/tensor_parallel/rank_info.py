"""Who am I: this process's rank and world size, from the launcher's environment (no torch: the
tensorrt_llm stub reads it at every start, and its executor runs in the engine process)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# (rank, size, local_rank, local_size) variable names, most specific launcher first.
_RANK_ENV_SCHEMES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int   # index among the ranks on this node: picks the GPU
    local_size: int   # ranks on this node: equals world_size on a single node


def rank_info_from_env(environ: Mapping[str, str] = os.environ) -> RankInfo:
    """Read rank and world size from MPI (OpenMPI, PMI/PMIx), torchrun or Slurm variables.

    No MPI library is initialized: ``tritonserver`` (rank 0) never calls MPI_Init and the Python
    backend stub only inherits the launcher's environment, so the variables are the one source
    that works in every process. Without any of them this is a single rank.
    """
    for rank_var, size_var, local_var, local_size_var in _RANK_ENV_SCHEMES:
        if rank_var in environ and size_var in environ:
            rank, size = int(environ[rank_var]), int(environ[size_var])
            local_rank = int(environ.get(local_var, rank))
            local_size = int(environ.get(local_size_var, size))
            if not 0 <= rank < size:
                raise ValueError(f"{rank_var}={rank} is out of range for {size_var}={size}")
            return RankInfo(rank, size, local_rank, local_size)
    return RankInfo(0, 1, 0, 1)
