"""Python's cyclic garbage collector in a process that serves from a GPU: what the engine's load made is
moved out of its reach (``gc.freeze``), so a full collection while serving scans only what serving made.

Why: a full (generation 2) collection traverses every tracked object of the process, holding the GIL
throughout, so no thread launches anything meanwhile: the executor's loop, the vision tower's encode queue.
After a load (torch, Triton, transformers, a model's modules, ~100 CUDA graphs) that is several hundred
thousand objects: 388k with the imports alone took 0.24-0.34 s per full collection on a 2-core box
(2026-11-29). Serving allocates enough (per request its Request, Sequence, lists, a prompt table's prefix-cache
keys: one tuple per image row) that a full collection comes every few seconds under load, i.e. a step of a
few milliseconds now and then takes a few hundred. Frozen objects are never scanned again; what serving
allocates later is collected as before.

Cost and care: one ``gc.collect()`` before freezing (a fraction of a second, at load), so that load-time garbage
cycles (a failed capture's CUDA graphs, a model copy) go now instead of being frozen, i.e. kept for the
process's life. Objects frozen here that later become cyclic garbage are never collected either, so this is
for a process whose engine lives as long as it does (engine/executor/engine_process.py's, a benchmark's), not
for one that builds and drops executors (tests; ``unfreeze`` undoes it). CUDA only: off the GPU a step takes
long enough that a pause does not show, and CPU test processes would pay the collection per engine start.
"""
from __future__ import annotations

import gc
import os
import time

import torch

GC_FREEZE_ENV = "TRITONLLM_GC_FREEZE"  # "0": leave the collector as it is; "1": freeze off CUDA too


def freeze_after_load(device) -> dict | None:
    """Collect, then freeze every object the process has (on a CUDA ``device``, unless $TRITONLLM_GC_FREEZE=0):
    {"frozen": objects now out of the collector's reach, "collect_s": the collection's seconds (what a full one
    costs this process unfrozen), "counts_before": gc.get_count() then (generation 2's: generation-1 collections
    since the last full one; a full one comes after threshold 10), "full_collections_before": so far}; None when skipped."""
    setting = os.environ.get(GC_FREEZE_ENV)
    if setting == "0" or (setting != "1" and torch.device(device).type != "cuda"):
        return None
    counts, full = gc.get_count(), gc.get_stats()[2]["collections"]
    began = time.perf_counter()
    gc.collect()
    collected = time.perf_counter() - began
    gc.freeze()
    return {"frozen": gc.get_freeze_count(), "collect_s": round(collected, 3), "counts_before": list(counts),
            "full_collections_before": full}


def unfreeze() -> None:
    """Give the frozen objects back to the collector (their cycles are collectable again)."""
    gc.unfreeze()
