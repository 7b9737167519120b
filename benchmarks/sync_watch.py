"""Where a benchmark's threads stall their launches: calls that make the host wait for the GPU (torch's CUDA
sync debug mode, each warning kept with the warning thread's stack) and Triton kernels compiled meanwhile
(a specialization not made at load: hundreds of ms of host time on the launching thread).

Why: a step whose host launch ends when its own device work ends waited for the device somewhere on its
launch path (vlm_bench, 2026-11-30: one executor step of each process's first image run launched in
370 ms; no allocation was counted). torch.cuda.set_sync_debug_mode("warn") makes every synchronizing
call (``.item()``, a pageable copy, ``nonzero``, a stream or device synchronize) warn; this keeps each
warning's thread, time and the stack's frames in this checkout, and counts them by stack.

    with SyncWatch() as watch:
        ...
    watch.summary()   # [{"count", "first_ms", "thread", "stack": ["path:line function", ...]}, ...], most first
    watch.compiles    # [{"at_ms", "ms", "thread", "kernel"}, ...]: each Triton compile in the block, in order

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
        self.compiles: list[dict] = []

    def __enter__(self) -> SyncWatch:
        self.started = time.perf_counter()
        self.compiles: list[dict] = []
        self._compiling: dict[int, list] = {}  # thread id -> [at_ms, kernel, its repr] of its compile under way
        self._hooks = _set_compile_hooks(self._compile_starts, self._compile_ends)
        self._previous_hook = warnings.showwarning
        warnings.showwarning = self._show
        # every occurrence, not once per location (the default filter keeps the first of each)
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
        if torch.cuda.is_available():
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        _set_compile_hooks(*self._hooks)
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
        at_ms = self._now_ms()
        with self._lock:
            entry = self._by_stack.setdefault(stack, {"count": 0, "first_ms": at_ms,
                                                      "thread": threading.current_thread().name})
            entry["count"] += 1

    def _now_ms(self) -> float:
        return round((time.perf_counter() - self.started) * 1e3, 1)

    def _compile_starts(self, *, repr: str = "", **_) -> bool:
        self._compiling[threading.get_ident()] = [self._now_ms(), repr.split("[", 1)[0], repr[:400]]
        return False  # (a true result would tell Triton to skip the compile)

    def _compile_ends(self, **_) -> None:
        begun = self._compiling.pop(threading.get_ident(), None)
        if begun is not None:
            with self._lock:
                self.compiles.append({"at_ms": begun[0], "ms": round(self._now_ms() - begun[0], 1),
                                      "thread": threading.current_thread().name, "kernel": begun[1],
                                      "specialization": begun[2]})

    def summary(self) -> list[dict]:
        with self._lock:
            rows = [{**entry, "stack": list(stack)} for stack, entry in self._by_stack.items()]
        return sorted(rows, key=lambda row: -row["count"])


def _set_compile_hooks(starts, ends) -> tuple:
    """Triton's runtime hooks called before and after a kernel compile (triton.knobs, Triton >= 3.4) -> the ones they
    replace; a Triton without them (or none at all) -> (None, None), nothing set."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = starts, ends
        return previous
    except (ImportError, AttributeError):
        return None, None
