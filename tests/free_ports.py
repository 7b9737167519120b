"""Listening ports for the servers that tests start, taken below the kernel's ephemeral range.

Binding to port 0 returns a port from the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
32768-60999 by default). Every outgoing connection also takes its local port from that range. So
between the probe and the server's own bind, a client socket (NCCL, gloo, an HTTP client) may take
the port: CI saw tritonserver fail with "Address already in use" on 2026-11-25. Below the range,
only explicit listeners compete. A port is handed out once per test session.
"""
from __future__ import annotations

import random
import socket

_LOWEST = 20000
_handed_out: set[int] = set()
_random = random.SystemRandom()  # immune to tests that seed the random module


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, nor is in TIME_WAIT, outside the ephemeral range."""
    highest = min(_ephemeral_low(), 32768) - 1
    for _ in range(500):
        port = _random.randint(_LOWEST, highest)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_LOWEST}-{highest}")
