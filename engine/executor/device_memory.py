"""The device memory this process may still take, the base of every "fraction of the free memory".

``torch.cuda.mem_get_info`` reports the whole device. A process that shares the GPU with others
(several model instances, or test workers) may be capped by
``torch.cuda.set_per_process_memory_fraction``: the caching allocator then refuses allocations
past ``fraction * total``, so the KV pool and the LoRA slots, sized from the free memory, must be
sized from what is left under that cap too, or the pool's own allocation fails.

Under such a cap the operator has divided the device: the cap bounds what the caching allocator
holds, and the memory the driver takes beside it (kernel code, cuBLAS handles) comes from what the
caps leave. Device-wide free memory then moves with the neighbours' allocations, so a measurement of
this process's memory outside the allocator from it (engine/executor/memory_profile.py) is noise and
is not charged against the cap (``is_capped``).
"""
from __future__ import annotations

import os

import torch

# Several engines on one GPU (model instances, test workers): each process's share of the device,
# applied through torch.cuda.set_per_process_memory_fraction when a runner is made on it.
MEMORY_FRACTION_ENV = "TRITONLLM_GPU_MEMORY_FRACTION"


def apply_memory_fraction_from_env(device: torch.device) -> None:
    """Cap this process's caching allocator at $TRITONLLM_GPU_MEMORY_FRACTION of ``device``
    (a number in (0, 1]; unset: no cap)."""
    value = os.environ.get(MEMORY_FRACTION_ENV, "").strip()
    if not value:
        return
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ValueError(f"${MEMORY_FRACTION_ENV} must be a number in (0, 1], got {value!r}")
    torch.cuda.set_per_process_memory_fraction(fraction, _index(device))


def free_device_bytes(device: torch.device | str | int) -> int:
    """Free bytes on a CUDA ``device`` that this process can allocate: the device's free memory, and
    under a per-process cap at most the cap less what this process's tensors hold (the allocator
    releases its cached, unused blocks before it refuses an allocation, so they count as free)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = _per_process_fraction(device)
    if fraction >= 1.0:
        return free
    allocated, cached = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return max(0, min(free + cached - allocated, int(fraction * total) - allocated))


def is_capped(device: torch.device | str | int) -> bool:
    """Whether this process's caching allocator is capped below the whole device."""
    return _per_process_fraction(device) < 1.0


def _per_process_fraction(device) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    return 1.0 if getter is None else float(getter(_index(device)))


def _index(device) -> int:
    """The device's index ("cuda" alone: the current device), which torch's fraction calls require."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return device.index if device.index is not None else torch.cuda.current_device()
