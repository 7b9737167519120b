"""Seeing the tritonserver that runs this stub begin to stop, early enough to end requests well.
(No Triton import: the model passes its callbacks in.)

Triton tells a model nothing when its server starts to shut down, and what it does then (2.51,
read in server's src/main.cc and http_server.cc, core's server.cc and dynamic_batch_scheduler.cc)
goes badly for long streamed generations:

1. on SIGINT/SIGTERM the HTTP service stops accepting connections (a new one is reset) and waits,
   up to the exit timeout, for its open connections to close;
2. only then the core stops: every model's scheduler refuses new requests ("Server is
   stopping"), and the server waits, up to what is left of the exit timeout, for the requests in
   flight;
3. the gRPC service stops last.

In step 2 a streamed ensemble request whose generation goes on is lost for good: the next token's
postprocessing step is refused, the ensemble marks itself failed while the generation step is
still running, and from then on ignores that step's responses, so its in-flight count never falls
and the server waits out the whole exit timeout (fixed in core after 2.51).

So the model watches for step 1 and keeps step 2 from starting too early: it holds one idle
keep-alive connection to the HTTP service (a "latch": step 1 waits for it), polls the liveness
endpoint over fresh connections (reset or refused once step 1 began), and once the stop is seen it
admits nothing new, gives running requests the grace period to finish (their streams still flow:
the core has not stopped), ends the rest with an error, and lets go of the latch. The server then
stops with nothing in flight, in seconds. A server without HTTP gives no early sign
(`server_http_endpoint` returns None).
"""
from __future__ import annotations

import http.client
import os
import time
from dataclasses import dataclass
from typing import Callable

LIVENESS_PATH = "/v2/health/live"
POLL_PERIOD_S = 0.1
LATCH_REFRESH_S = 5.0  # re-use the latch now and then, so an idle-connection timeout cannot drop it unseen
STOP_CONFIRMATIONS = 2  # consecutive "not live" answers before acting: one reset could be a fluke
FINAL_RESPONSES_WAIT_S = 2.0  # after ending the requests, time for their final responses to go out


def server_http_endpoint(server_pid: int | None = None) -> tuple[str, int] | None:
    """(host, port) of the HTTP endpoint of tritonserver `server_pid` (default: this process's
    parent), read from its command line (--http-port, --http-address; Triton's defaults are 8000
    on all interfaces), or None when it serves no HTTP."""
    pid = os.getppid() if server_pid is None else server_pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return None
    options = {}
    for index, word in enumerate(words):
        if word.startswith("--") and "=" in word:
            key, value = word[2:].split("=", 1)
            options[key] = value
        elif word.startswith("--") and index + 1 < len(words) and not words[index + 1].startswith("--"):
            options[word[2:]] = words[index + 1]
    if options.get("allow-http", "true").lower() in ("false", "0", "no"):
        return None
    host = options.get("http-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    try:
        port = int(options.get("http-port", "8000"))
    except ValueError:
        return None
    return host, port


def is_live(endpoint: tuple[str, int], timeout_s: float = 1.0,
            connection: http.client.HTTPConnection | None = None) -> bool | None:
    """True while the server is up and not stopping; False when it answers "not live", refuses or
    resets the connection (which, once it was seen live, means it is stopping); None when unknown
    (a timeout under load). With `connection`, asks over it and leaves it open."""
    own = connection is None
    connection = connection or http.client.HTTPConnection(*endpoint, timeout=timeout_s)
    try:
        connection.request("GET", LIVENESS_PATH)
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):  # RemoteDisconnected included
        return False
    except OSError:
        return None
    finally:
        if own:
            connection.close()


@dataclass
class ShutdownHooks:
    """What the watcher calls in the model. `has_requests`: any request still running;
    `end_requests`: end every running request with an error, return how many; `paused`: true while
    the model unloads itself (an engine restart), when a not-live answer means nothing; `log`."""
    has_requests: Callable[[], bool]
    end_requests: Callable[[], int]
    paused: Callable[[], bool]
    log: Callable[[str], None]


class ServerStopWatcher:
    """Run `watch` on a thread of its own; `stopping` turns true once the server's stop is seen."""

    def __init__(self, endpoint: tuple[str, int], grace_s: float, hooks: ShutdownHooks):
        self.endpoint = endpoint
        self.grace_s = grace_s
        self.hooks = hooks
        self.stopping = False
        self._latch: http.client.HTTPConnection | None = None
        self._latch_used_at = 0.0

    def watch(self, running: Callable[[], bool]) -> None:
        seen_live = False
        not_live = 0
        while running():
            time.sleep(POLL_PERIOD_S)
            live = is_live(self.endpoint)
            if live:
                seen_live, not_live = True, 0
                self._hold_latch()
            elif live is False and seen_live and not self.hooks.paused():
                not_live += 1
                if not_live >= STOP_CONFIRMATIONS:
                    self._stop_gracefully(running)
                    break
        self.release()

    def release(self) -> None:
        if self._latch is not None:
            self._latch.close()
            self._latch = None

    def _hold_latch(self) -> None:
        now = time.monotonic()
        if self._latch is not None and now - self._latch_used_at < LATCH_REFRESH_S:
            return
        if self._latch is None:
            self._latch = http.client.HTTPConnection(*self.endpoint, timeout=1.0)
        if not is_live(self.endpoint, connection=self._latch):
            self.release()  # closed by the server; opened again at the next poll
        self._latch_used_at = now

    def _stop_gracefully(self, running: Callable[[], bool]) -> None:
        self.stopping = True
        self.hooks.log(f"the server is stopping; requests in flight get {self.grace_s:g} s to finish "
                       "(graceful_shutdown_timeout_ms)")
        deadline = time.monotonic() + self.grace_s
        while running() and self.hooks.has_requests() and time.monotonic() < deadline:
            time.sleep(POLL_PERIOD_S / 2)
        if self.hooks.has_requests():
            ended = self.hooks.end_requests()
            self.hooks.log(f"ended {ended} unfinished requests for the shutdown")
            deadline = time.monotonic() + FINAL_RESPONSES_WAIT_S
            while running() and self.hooks.has_requests() and time.monotonic() < deadline:
                time.sleep(POLL_PERIOD_S / 2)
