"""Where a benchmark's threads make the host wait for the GPU: torch's CUDA sync debug mode, each warning
kept with the warning thread's stack.

Why: a step whose host launch ends when its own device work ends waited for the device somewhere on its
launch path (vlm_bench, 2026-11-30: one executor step of each process's first image run launched in
370 ms; no allocation was counted). torch.cuda.set_sync_debug_mode("warn") makes every synchronizing
call (``.item()``, a pageable copy, ``nonzero``, a stream or device synchronize) warn; this keeps each
warning's thread, time and the stack's frames in this checkout, and counts them by stack.

    with SyncWatch() as watch:
        ...
    watch.summary()  # [{"count", "first_ms", "thread", "stack": ["path:line function", ...]}, ...], most first

On a machine without CUDA nothing warns and the summary is empty. Event waits (``Event.synchronize``) are
not among torch's synchronizing calls: the executor's token waits do not show.
"""
from __future__ import annotations

import threading
import time
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # (torch's warning text)
FRAMES_KEPT = 8


class SyncWatch:
    def __init__(self, frames: int = FRAMES_KEPT):
        self.frames = frames
        self.started = 0.0
        self._by_stack: OrderedDict[tuple, dict] = OrderedDict()
        self._lock = threading.Lock()
        self._previous_hook = None
        self._previous_mode = 0

    def __enter__(self) -> SyncWatch:
        self.started = time.perf_counter()
        self._previous_hook = warnings.showwarning
        warnings.showwarning = self._show
        # every occurrence, not once per location (the default filter keeps the first of each)
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
        if torch.cuda.is_available():
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "always" and f[1] is not None
                                                                   and SYNC_MESSAGE in f[1].pattern)]
        warnings.showwarning = self._previous_hook

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._previous_hook(message, category, filename, lineno, file, line)
            return
        # The warning thread's frames in this checkout, innermost last (torch's own and warnings' left out)
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(REPO_ROOT)
                and "site-packages" not in f.filename and f.filename != __file__]
        stack = tuple(f"{Path(f.filename).relative_to(REPO_ROOT)}:{f.lineno} {f.name}" for f in ours[-self.frames:])
        at_ms = round((time.perf_counter() - self.started) * 1e3, 1)
        with self._lock:
            entry = self._by_stack.setdefault(stack, {"count": 0, "first_ms": at_ms,
                                                      "thread": threading.current_thread().name})
            entry["count"] += 1

    def summary(self) -> list[dict]:
        with self._lock:
            rows = [{**entry, "stack": list(stack)} for stack, entry in self._by_stack.items()]
        return sorted(rows, key=lambda row: -row["count"])
