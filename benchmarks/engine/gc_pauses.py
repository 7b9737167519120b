"""Python's garbage collections during a timed run, as the benchmarks report them.

Why: a full (generation 2) collection holds the GIL while it traverses every tracked object, so every
thread of the process (the executor's loop, the vision tower's encode queue) launches nothing meanwhile:
a few hundred milliseconds after a model's load (engine/executor/gc_freeze.py). In a run's per-iteration
figures it looks like one step that took far too long; this names it.

    with GcPauses() as pauses:
        ...  # the run
    pauses.summary()  # {"collections", "by_generation", "total_ms", "longest": [[at_ms, ms, generation], ...]}
"""
from __future__ import annotations

import gc
import time

SHOWN_MS = 5.0  # collections at least this long are listed one by one (with every generation-2 one)


class GcPauses:
    """Each collection's [start ms after ``origin``, ms, generation, objects collected] while entered."""

    def __init__(self, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.collections: list[list] = []
        self._began: float | None = None

    def __call__(self, phase: str, info: dict) -> None:  # gc.callbacks' signature (runs in the collecting thread)
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            self.collections.append([round((self._began - self.origin) * 1e3, 1), round((now - self._began) * 1e3, 2),
                                     info.get("generation"), info.get("collected")])
            self._began = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict:
        by_generation: dict[int, int] = {}
        for _, _, generation, _ in self.collections:
            by_generation[generation] = by_generation.get(generation, 0) + 1
        shown = [c[:3] for c in self.collections if c[1] >= SHOWN_MS or c[2] == 2]
        return {"collections": len(self.collections), "by_generation": by_generation,
                "total_ms": round(sum(c[1] for c in self.collections), 1), "longest": shown,
                "frozen": gc.get_freeze_count()}
