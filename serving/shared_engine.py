"""One engine process for every instance of a `tensorrt_llm` model (no Triton import).

Why several instances: a Python-backend ``send`` is a synchronous round trip to the server process
(the stub waits until a server thread has passed the response on to the ensemble or the client),
so one stub relays at most a few thousand responses a second, fewer than a batch of 64 streams
makes with one response per token. Several sending threads in one stub would overlap the round
trips, but Triton 2.51 crashes when one stub sends from two threads at once (a send's shared-memory
message is freed by the stub while the server still touches it; seen here as std::bad_alloc and
boost lock_exception aborts of tritonserver within seconds at 64 streams). Each model instance is
a stub of its own, with its own interpreter lock and its own round trips in flight, so n
instances relay about n times as many responses; they share one engine (one KV cache, one batch).

Rendezvous: the first instance to take an exclusive lock on a file named for the server process,
the model, its version and its load generation is the owner: it starts the engine process
listening on a Unix socket beside that file and holds the lock while it lives. The others attach
to that socket (EngineProcess.attach), waiting while the owner's engine loads and giving up if
the lock is released first (the owner failed or went away).
"""
from __future__ import annotations

import fcntl
import os
import re
import tempfile
from dataclasses import dataclass
from typing import IO, Any, Callable

# Request keys (serving/inflight.py) of client c start at c * KEY_STRIDE, so the key a
# postprocessing step reports names one request among all instances.
KEY_STRIDE = 1 << 40


@dataclass
class SharedEngine:
    engine: Any  # an EngineProcess, owned or attached
    is_owner: bool
    lock_file: IO | None  # held open by the owner: its lock tells the others it is alive

    def release(self) -> None:
        """The owner's last step (after the engine is shut down): drop the lock and its file."""
        if self.lock_file is not None:
            try:
                os.unlink(self.lock_file.name)
            except OSError:
                pass
            self.lock_file.close()
            self.lock_file = None


def rendezvous_paths(model_name: str, model_version: str, generation: int,
                     server_pid: int | None = None) -> tuple[str, str]:
    """(lock file, Unix socket) for one load of one model in one server (the stubs' parent)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)[:40]
    base = os.path.join(tempfile.gettempdir(),
                        f"tritonllm-{server_pid or os.getppid()}-{name}-{model_version}-{generation}")
    return base + ".lock", base + ".sock"


def open_shared_engine(lock_path: str, socket_path: str, start: Callable[[str], Any],
                       attach: Callable[[str, Callable[[], bool]], Any]) -> SharedEngine:
    """Become the owner (``start(socket_path)``) or attach (``attach(socket_path, owner_alive)``)."""
    lock_file = open(lock_path, "a+")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        return SharedEngine(attach(socket_path, lambda: lock_is_held(lock_path)), is_owner=False, lock_file=None)
    remove_files_of_dead_servers(os.path.dirname(lock_path))
    try:
        return SharedEngine(start(socket_path), is_owner=True, lock_file=lock_file)
    except BaseException:
        lock_file.close()  # releases the lock: waiting instances stop waiting
        raise


def remove_files_of_dead_servers(folder: str) -> None:
    """Rendezvous files left by servers that were killed (a clean unload removes its own)."""
    for name in os.listdir(folder):
        match = re.fullmatch(r"tritonllm-(\d+)-.+\.(lock|sock)", name)
        if match and not _is_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def lock_is_held(lock_path: str) -> bool:
    """Whether some process (the owner) holds the exclusive lock on ``lock_path``."""
    with open(lock_path, "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False
