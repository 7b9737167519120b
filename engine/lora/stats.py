"""The adapter cache's counters (``LoraCacheStats``), in a module of their own without torch.

Why a module of its own: a snapshot rides in every ``IterationStats`` (engine/executor/stats.py)
that the engine process pickles to its clients, and unpickling imports the module that defines
the class. Defined in engine/lora/cache.py, the first LoRA-enabled iteration's stats made a
torch-free client (the tensorrt_llm stub) import cache.py, adapter.py and torch on its reader
thread: 2-5 s of CPU holding the GIL while the stream's responses waited in the socket, which
then went out coalesced (engine/executor/engine_process.py, "What a client unpickles").
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoraCacheStats:
    """Cumulative counts since start (Prometheus counters) and what is resident now."""

    gpu_loads: int = 0  # adapters copied into a device slot
    gpu_evictions: int = 0  # adapters overwritten in a slot to make room for another
    gpu_hits: int = 0  # requests whose adapter was already in a slot
    host_loads: int = 0  # adapters parsed into the host tier
    host_evictions: int = 0
    adapters_in_gpu: int = 0
    adapters_in_host: int = 0
    requests: Counter = field(default_factory=Counter)  # adapter name -> requests that used it
