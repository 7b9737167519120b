"""The ``shm`` transport of disaggregated serving: a context_only request's KV as one file in host
shared memory, for a generation executor in another process of the same host (two Triton models,
each with its own engine process). engine/executor/disaggregated.py decides when it is used.

Life of one file (``<dir>/tritonllm-kv-<exporter>-<handle>.pt``, dir = TRITONLLM_KV_TRANSFER_DIR,
else /dev/shm, else the temp dir):
- the context loop writes it under a temporary name and renames it into place (readers never see a
  partial file); the GPU blocks are freed as usual right after (the bytes now live in the file);
- a generation loop claims it by renaming it to a name of its own (atomic: one fetch per blob),
  loads it, deletes it and scatters the blocks into its pool;
- the context loop deletes it at the timeout if nobody claimed it (``expire``).
Content: the blocks as (num_blocks, L, 2, T, H, D) integers of the pool's element width (bytes
unchanged, float8 included), written by torch.save and read back with weights_only.
"""
from __future__ import annotations

import os
import tempfile

import torch

from engine.executor.kv_host_tier import _SAME_WIDTH_INT


def transfer_dir() -> str:
    configured = os.environ.get("TRITONLLM_KV_TRANSFER_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def block_major(pool: torch.Tensor) -> torch.Tensor:
    """(num_blocks, L, 2, T, H, D) integer view of a (L, 2, num_blocks, T, H, D) pool: a view, no copy."""
    return pool.view(_SAME_WIDTH_INT[pool.element_size()]).permute(2, 0, 1, 3, 4, 5)


def write_blocks(pool: torch.Tensor, block_ids: list[int], exporter: str, handle: int) -> str:
    """Copy the blocks to a new file; returns its path."""
    by_block = block_major(pool)
    host = by_block.index_select(0, torch.tensor(block_ids, device=by_block.device)).cpu()
    path = os.path.join(transfer_dir(), f"tritonllm-kv-{exporter}-{handle}.pt")
    partial = f"{path}.partial"
    torch.save(host, partial)
    os.replace(partial, path)
    return path


def claim_blocks(path: str) -> torch.Tensor | None:
    """Take the file (None: fetched already or expired) and return its blocks; the file is deleted."""
    mine = f"{path}.claimed-{os.getpid()}"
    try:
        os.rename(path, mine)
    except FileNotFoundError:
        return None
    try:
        return torch.load(mine, weights_only=True)
    finally:
        os.remove(mine)


def scatter_blocks(blocks: torch.Tensor, pool: torch.Tensor, block_ids: list[int]) -> None:
    """pool[:, :, block_ids[i]] = blocks[i]."""
    by_block = block_major(pool)
    by_block.index_copy_(0, torch.tensor(block_ids, device=by_block.device), blocks.to(by_block.device))
    if by_block.device.type == "cuda":
        torch.cuda.synchronize(by_block.device)


def expire(path: str) -> bool:
    """Delete an unclaimed file; True if it was still there (nobody fetched it in time)."""
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False
