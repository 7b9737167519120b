"""Is the process that exported a context phase's KV still alive? (disaggregated serving, same host)

A context process that dies leaves its generation side waiting: for a claim answer (``nixl``) or for a file
still being written (``shm``), up to the transfer timeout (60 s). The blob carries the exporter's identity
(``identity``): the host's boot id, its pid namespace, its pid and that process's start time. A generation
side on the same host and in the same pid namespace can then tell that the process is gone (``gone``): no
such pid, a zombie, or another process under a reused pid (another start time). Across hosts or pid
namespaces nothing is decided here (None): ``nixl`` has its claim acknowledgement for that
(kv_transfer_nixl.ACK_TIMEOUT_S). Linux /proc only; elsewhere ``gone`` is always None.
"""
from __future__ import annotations

import os
import time

CHECK_S = 0.1  # how often a waiting pull looks (a /proc read, ~20 us)

_SELF: dict | None = None


class PeerGone(RuntimeError):
    """The context process that exported the KV is gone; the message names it."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc/<pid>/stat; None when there is no such process."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    rest = text[text.rindex(")") + 2:].split()  # (the command name may hold spaces and parentheses)
    return rest[0], rest[19]


def identity() -> dict:
    """This process, as a peer on the same host can check it: {"boot", "pidns", "pid", "start"}."""
    global _SELF
    if _SELF is None or _SELF["pid"] != os.getpid():  # (a forked child is another process)
        stat = _stat(os.getpid())
        _SELF = {"boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": _pidns(), "pid": os.getpid(),
                 "start": None if stat is None else stat[1]}
    return _SELF


def gone(peer) -> str | None:
    """The error for a pull whose context process ``peer`` (its ``identity``) is known to be dead; None when it is
    alive or cannot be checked from here (another host or pid namespace, an old blob without the field)."""
    here = identity()
    if not isinstance(peer, dict) or here["boot"] is None or here["pidns"] is None or peer.get("start") is None \
            or peer.get("boot") != here["boot"] or peer.get("pidns") != here["pidns"] \
            or not isinstance(peer.get("pid"), int):
        return None
    stat = _stat(peer["pid"])
    if stat is not None and stat[0] not in ("Z", "X") and stat[1] == peer["start"]:
        return None
    return (f"context_phase_params: the context process (pid {peer['pid']}) that holds this KV cache is gone; run "
            f"the context_only request again")


class Watch:
    """A waiter's look at its peer (``peer``: an ``identity``; None: not checkable, or not known yet), at most every
    CHECK_S: the transports' pollers (shm's and cuda_ipc's reader threads, the nixl pull, a cuda_ipc claim, the
    context loop's look at a cuda_ipc claimer) call ``gone`` as often as they poll (0.5-2 ms) and pay the /proc
    read ten times a second."""
    __slots__ = ("peer", "next_check")

    def __init__(self, peer=None):
        self.peer, self.next_check = peer, 0.0  # (the first call looks)

    @property
    def due(self) -> bool:
        """Whether the next ``gone`` looks (a clock read)."""
        return time.monotonic() >= self.next_check

    def gone(self) -> str | None:
        """``gone(peer)``'s error when it is time to look and the peer is known dead, else None."""
        now = time.monotonic()
        if now < self.next_check:
            return None
        self.next_check = now + CHECK_S
        return gone(self.peer)
