"""Stopping a model's loop threads at unload within one deadline (no Triton import).

A Python model's `finalize` runs while Triton unloads it, and the server's exit waits for it (Ctrl-C
included). The tensorrt_llm model's loops each see its running flag within their own period; one still
alive past the longest period and a margin is blocked in a call (into the backend's IPC, the engine
process's socket, a liveness request) that waiting longer does not end. Joined one after another with
a timeout each, the timeouts add up (four loops at 5 s each: up to 20 s before the engine is even told
to stop); joined by one deadline, the unload waits at most that deadline, and the threads left are
named with where they are blocked, so the server's log says which call held the unload.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback


def join_by_deadline(threads: list[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Join every thread of ``threads`` by one deadline ``timeout_s`` from now (not ``timeout_s`` each);
    returns those still alive then, in the given order."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [thread for thread in threads if thread.is_alive()]


def where_blocked(threads: list[threading.Thread], frames: int = 3) -> str:
    """'name (file:line in function <- ...)' of each thread, its innermost ``frames`` frames first;
    for a log line saying which calls a stop did not wait for."""
    current = sys._current_frames()
    described = []
    for thread in threads:
        frame = current.get(thread.ident)
        if frame is None:  # it ended meanwhile
            described.append(f"{thread.name} (ended)")
            continue
        stack = traceback.extract_stack(frame)[-frames:][::-1]
        described.append(f"{thread.name} (" + " <- ".join(
            f"{entry.filename.rsplit('/', 1)[-1]}:{entry.lineno} in {entry.name}" for entry in stack) + ")")
    return "; ".join(described)
