"""A timestamped line per phase of an executor's start, on stderr, with $TRITONLLM_LOAD_LOG=1 (the
benchmarks set it): where a 7-8B engine's load goes on a leased GPU, whose cold Triton cache compiles
every load-time candidate tiling, and whose benchmark guards ended inside the load with nothing printed.

    [load 14:05:31] weights: 12.4 s (total 12.4 s)
    [load 14:05:40] load-time kernel choices: 8.9 s (total 21.3 s)
    [load 14:05:52] decode graphs (8 buckets): 11.6 s (total 32.9 s)

Each phase ends with a device synchronize (on CUDA), so the work a phase queued counts in its own time.
Off (the default), a phase costs one environment lookup and no synchronize.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

LOAD_LOG_ENV = "TRITONLLM_LOAD_LOG"

_started: list[float] = []  # the first phase's start in this process (the "total" of each line)


def enabled() -> bool:
    return os.environ.get(LOAD_LOG_ENV, "0") == "1"


@contextmanager
def load_phase(name: str, device=None):
    """Times the block as phase ``name``; ``device``: synchronize it (a CUDA device) before the clock stops.
    ``name`` may be a function of no arguments, called at the end (a count known only then)."""
    if not enabled():
        yield
        return
    started = time.perf_counter()
    if not _started:
        _started.append(started)
    yield
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.synchronize(device)
    now = time.perf_counter()
    label = name() if callable(name) else name
    print(f"[load {time.strftime('%H:%M:%S', time.gmtime())}] {label}: {now - started:.1f} s "
          f"(total {now - _started[0]:.1f} s)", file=sys.stderr, flush=True)
