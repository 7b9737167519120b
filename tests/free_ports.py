"""Listening ports for the servers that tests start, taken below the kernel's ephemeral range.

Binding to port 0 returns a port from the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
32768-60999 by default). Every outgoing connection also takes its local port from that range. So
between the probe and the server's own bind, a client socket (NCCL, gloo, an HTTP client) may take
the port: CI saw tritonserver fail with "Address already in use" on 2026-11-25. Below the range,
only explicit listeners compete. A port is handed out once per test session.

Under pytest-xdist every worker is a session of its own: to keep two workers from choosing the same
port between one's probe and its server's bind, worker i of n takes only ports p with p % n == i.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def _launcher():
    """scripts/launch_triton_server.py, whose free_port chooses leader mode's rendezvous port."""
    if "launch_triton_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "launch_triton_server", Path(__file__).resolve().parents[1] / "scripts" / "launch_triton_server.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["launch_triton_server"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["launch_triton_server"]


_handed_out: set[int] = set()


def _worker_share() -> tuple[int, int]:
    """(this xdist worker's index, the number of workers); (0, 1) without xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, below the ephemeral range, new to this
    session and (under xdist) in this worker's share of the ports."""
    index, count = _worker_share()
    for _ in range(100 * count):
        port = _launcher().free_port("127.0.0.1")
        if port % count == index and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no port left that this session has not handed out")
