"""The executor in a process of its own, behind the Executor's API (``EngineProcess``).

Why: inside Triton's Python-backend stub, the executor loop shares one GIL with the stub's own
threads, which convert and send one response per streamed token. Measured on an H100 (SmolLM2
shape, 64 streams): the loop got about half the interpreter, so the served throughput was half
the engine's. Here the loop runs alone in its process and the stub only relays.

Protocol: one duplex ``multiprocessing.connection.Connection`` over a socketpair carrying tuples
pickled by the standard pickler (``send_bytes``; not ``Connection.send``, whose pickler lets torch
pass tensors as shared file descriptors, which needs a multiprocessing-made peer).

    client -> engine:  ("start", engine_dir, ExecutorConfig, device)   once, first (the owner)
                       ("attach",)                                      once, first (other clients)
                       ("enqueue", [request ids], [Request])           ids chosen by the client
                       ("cancel", request_id)
                       ("peer", message)                                for every other client
                       ("shutdown",)
    engine -> client:  ("ready", client_index) | ("failed", message)    once, after "start"/"attach"
                       ("responses", [packed Response])                 one message per loop step
                       ("stats", IterationStats, failure)               when the iteration moved
                       ("peer", message)                                from another client

What a client unpickles: the tensorrt_llm stub imports no torch, and its reader thread unpickles
every message, importing each class's module on first sight. So every class a message may carry
is defined in a module that imports no torch (engine/lora/stats.py says what happened otherwise:
the reader sat in a torch import for seconds, holding the GIL, and a stream's tokens piled up and
went out as one response). Logits therefore cross as numpy arrays, not torch tensors (a client
gets ``Result.context_logits`` / ``generation_logits`` as numpy). tests/executor/test_engine_process.py
checks this.

Several clients (``listen_path``): the client that starts the process owns it (index 0, the
socketpair); others attach over a Unix socket at ``listen_path`` (``EngineProcess.attach``), one per
Triton model instance, so that each instance's stub sends its own requests' responses with its own
interpreter (a Python-backend send is a synchronous round trip to the server, and a stub must not
send from two threads at once: Triton 2.51 then crashes). Client c's request ids are offset by
c * CLIENT_ID_STRIDE inside the engine, so each client numbers its requests on its own; responses
go back to the client that enqueued them. The engine lives as long as its owner's connection;
an attached client that leaves has its requests cancelled.

Invariants: every request id the client hands out gets a final response, from the engine or, if
the engine process dies, an error made by the client; after a death every call answers with an
error response (``failure`` says why) and nothing waits forever. The engine process exits when
the client's end of the socket closes (the stub died), so it never outlives its stub.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import itertools
import operator
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

from engine.executor.output import ResponseQueue
from engine.executor.request import FinishReason, Request, RequestPerfMetrics, Response, Result
from engine.executor.stats import IterationStats

STATS_PERIOD_S = 0.05
ATTACH_RETRY_S = 0.1  # an attaching client's wait between tries while the owner's engine loads
CLIENT_ID_STRIDE = 1 << 40  # client c's request id i is c * CLIENT_ID_STRIDE + i in the engine
SHUTDOWN_TIMEOUT_S = 30.0  # the engine process's own shutdown, after which it exits regardless
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# While a client has requests open, its reader polls the socket every this many microseconds
# instead of blocking in a read ($TRITONLLM_READ_POLL_US; 0: always block). Why: a reader blocked
# on a Unix socket is woken by each write, as a "sync" wakeup that the kernel may serve on the
# writer's CPU, so the engine loop, which writes each step's responses to every client, can wait
# behind the readers it wakes. With nobody blocked, a write only copies into the socket buffer.
# Measured on the H100 (SmolLM2 shape, 64 streams, 8 clients): the loop's time in those writes fell
# from 0.75 to 0.31 ms a step. Each poll costs the stub a little CPU, so by default only machines
# with cores to spare poll (benchmarks/results/serving.md, "Streaming at 64 streams, this session").
READ_POLL_ENV = "TRITONLLM_READ_POLL_US"
POLL_MIN_CORES = 8


def read_poll_s() -> float:
    """The reader's poll period in seconds (0: block)."""
    default = 300 if (os.cpu_count() or 1) >= POLL_MIN_CORES else 0
    return float(os.environ.get(READ_POLL_ENV, default)) / 1e6


def engine_python() -> str:
    """The interpreter for the engine process: $TRITONLLM_ENGINE_PYTHON, else this process's own
    when it is a Python (not the Triton stub binary that embeds one), else ``python3`` on PATH,
    which is the environment the Python backend's stub runs in."""
    if os.environ.get("TRITONLLM_ENGINE_PYTHON"):
        return os.environ["TRITONLLM_ENGINE_PYTHON"]
    if sys.executable and os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError("no python3 on PATH for the engine process; set TRITONLLM_ENGINE_PYTHON")
    return found


class EngineProcess:
    """``engine.executor.Executor``'s API, served by an executor in a child process."""

    def __init__(self, engine_dir: str, config=None, *, device: str | None = None, python: str | None = None,
                 listen_path: str | None = None):
        """Start the engine process and own it; with ``listen_path`` other clients may attach."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        command = [python or engine_python(), "-m", "engine.executor.engine_process", "--fd", str(theirs.fileno())]
        if listen_path:
            command += ["--listen", listen_path]
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._setup(Connection(ours.detach()), process)
        self._handshake(("start", engine_dir, config, device))

    @classmethod
    def attach(cls, listen_path: str, *, timeout_s: float = 1800.0,
               owner_alive: Callable[[], bool] = lambda: True) -> "EngineProcess":
        """A client of the engine process that another ``EngineProcess`` started with ``listen_path``.

        Waits (up to ``timeout_s``, while ``owner_alive()``) for it to finish loading and listen."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(listen_path)
                break
            except OSError as err:
                sock.close()
                if not owner_alive():
                    raise RuntimeError(f"the engine process at {listen_path} is gone: its owner stopped "
                                       "before it was ready") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no engine process answered at {listen_path} within {timeout_s:.0f} s "
                                       f"({err})") from None
                time.sleep(ATTACH_RETRY_S)
        client = cls.__new__(cls)
        client._setup(Connection(sock.detach()), None)
        client._handshake(("attach",))
        return client

    def _setup(self, conn: Connection, process: subprocess.Popen | None) -> None:
        self._process = process  # None for an attached client: the owner's process
        self._conn = conn
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._open: dict[int, int] = {}  # request id -> final responses still expected
        self._open_lock = threading.Lock()
        self._responses = ResponseQueue()
        self._latest_stats = IterationStats()
        self._failure: str | None = None
        self._stopping = False
        self.client_index = 0
        self.on_peer_message: Callable[[object], None] | None = None  # called on the reader thread

    def _handshake(self, message: tuple) -> None:
        try:
            self._send(message)
            self.client_index = self._await_ready()
        except BaseException:
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="engine-process-reader", daemon=True)
        self._reader.start()

    # ----- Executor API -----
    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        ids = [next(self._ids) for _ in requests]
        with self._open_lock:
            for request_id, request in zip(ids, requests):
                self._open[request_id] = _finals_expected(request)
        try:
            payload = pickle.dumps(("enqueue", ids, list(requests)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # e.g. an object that cannot be pickled inside a request
            with self._open_lock:
                failed = [Response(i, error=f"invalid request: it cannot be passed to the engine process "
                                            f"({type(err).__name__}: {err})") for i in ids if self._open.pop(i, None)]
            self._responses.put(failed)
            return ids
        try:
            with self._send_lock:
                self._conn.send_bytes(payload)
        except (OSError, EOFError, ValueError) as err:  # the engine is gone: the reader fails them all
            self._on_engine_lost(f"the engine process is unreachable ({err})")
        if self._failure is not None or self._stopping:
            self._fail_open(ids)
        return ids

    def cancel_request(self, request_id: int) -> None:
        try:
            self._send(("cancel", request_id))
        except (OSError, EOFError, ValueError):
            pass  # gone: its requests are failed by the reader

    def await_responses(self, timeout: float | None = None) -> list[Response]:
        return self._responses.take(timeout)

    def get_latest_iteration_stats(self) -> IterationStats:
        return self._latest_stats

    def send_peer_message(self, message) -> None:
        """Hand ``message`` (picklable) to every other client of this engine process."""
        try:
            self._send(("peer", message))
        except (OSError, EOFError, ValueError):
            pass  # gone: the reader fails this client's requests

    def can_enqueue_requests(self) -> bool:
        return not self._stopping and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("shutdown",))
            if self._process is not None:
                self._process.wait(timeout_s)
        except (OSError, EOFError, ValueError, subprocess.TimeoutExpired):
            pass
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ----- internals -----
    def _send(self, message) -> None:
        send_message(self._conn, self._send_lock, message)

    def _await_ready(self) -> int:
        """Block while the engine loads (minutes for a big model); fail if the process dies first.
        Returns this client's index (0: the owner)."""
        while not self._conn.poll(0.5):
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self._process.returncode} while "
                                   "loading (its error is in this server's log)")
        try:
            message = receive_message(self._conn)
        except (EOFError, OSError) as err:
            raise RuntimeError(f"the engine process closed the connection before it was ready ({err!r})") from None
        if message[0] == "failed":
            raise RuntimeError(message[1])
        if message[0] != "ready":
            raise RuntimeError(f"unexpected first message from the engine process: {message[0]!r}")
        return message[1] if len(message) > 1 else 0

    def _read_loop(self) -> None:
        reason = "the engine process exited"
        poll_s = read_poll_s()
        while True:
            try:
                if poll_s and self._open and not self._conn.poll(0):
                    time.sleep(poll_s)
                    continue
                payload = self._conn.recv_bytes()
            except Exception:  # EOF, or our own end closed by shutdown()
                break
            try:
                message = pickle.loads(payload)
            except Exception as err:  # an undecodable message: responses may be lost, so stop here
                reason = f"a message from the engine process could not be read ({type(err).__name__}: {err})"
                self._process.kill()
                break
            if message[0] == "responses":
                responses = unpack_responses(message[1])
                self._track_finals(responses)
                self._responses.put(responses)
            elif message[0] == "stats":
                self._latest_stats = message[1]
                if message[2] is not None and self._failure is None:
                    self._failure = message[2]
            elif message[0] == "peer" and self.on_peer_message is not None:
                try:
                    self.on_peer_message(message[1])
                except Exception:  # noqa: BLE001 - the handler's failure must not stop the responses
                    pass
        if not self._stopping:
            if reason.endswith("exited"):
                reason += _exit_description(self._wait_briefly())
            self._on_engine_lost(reason)

    def _wait_briefly(self) -> int | None:
        """The exit code once the process is reaped (its socket closes a moment before)."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def _track_finals(self, responses: list[Response]) -> None:
        with self._open_lock:
            for response in responses:
                remaining = self._open.get(response.request_id)
                if remaining is None:
                    continue
                if response.error is not None or remaining <= 1 and response.is_final:
                    del self._open[response.request_id]
                elif response.is_final:
                    self._open[response.request_id] = remaining - 1

    def _on_engine_lost(self, reason: str) -> None:
        if self._failure is None:
            self._failure = f"{reason}; the requests it was serving failed"
        with self._open_lock:
            ids = list(self._open)
        self._fail_open(ids)

    def _fail_open(self, ids: list[int]) -> None:
        reason = self._failure or "the executor is shut down and accepts no requests"
        with self._open_lock:
            failed = [Response(i, error=reason) for i in ids if self._open.pop(i, None) is not None]
        if failed:
            self._responses.put(failed)

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._conn.close()


# ----- responses on the wire ------------------------------------------------------------------------
# A loop step at batch 64 answers 64 streams; pickling 64 Response dataclasses (with their Result,
# perf record and enum) cost ~250 us of the engine loop's time per step (x86, 2026-11-22), ~10% of
# a small model's step. Plain tuples of builtins pickle ~5x faster; the client rebuilds the objects.

_FINISH_REASONS = {reason.value: reason for reason in FinishReason}
_perf_values = operator.attrgetter(*(f.name for f in dataclasses.fields(RequestPerfMetrics)))


def pack_responses(responses: list[Response], id_base: int = 0) -> list[tuple]:
    """Wire tuples of ``responses``, request ids less ``id_base`` (the client's own numbering)."""
    packed = []
    for response in responses:
        result = response.result
        if result is None:
            packed.append((response.request_id - id_base, response.error))
            continue
        perf = result.perf
        packed.append((
            response.request_id - id_base, response.error, result.output_token_ids, result.is_final,
            [reason.value for reason in result.finish_reasons], result.sequence_index, result.cum_log_probs,
            result.log_probs, _wire_logits(result.context_logits), _wire_logits(result.generation_logits),
            None if perf is None else _perf_values(perf),
            result.top_log_prob_ids, result.top_log_probs,
            getattr(result, "_streaming_delta", False), result.context_phase_params, result.token_timestamps,
        ))
    return packed


def _wire_logits(logits):
    """Host logits as numpy (no torch needed to unpickle them): float32 stays float32 (a view, no
    copy); bfloat16, which numpy lacks, widens to float32 exactly."""
    if logits is None or not hasattr(logits, "detach"):
        return logits
    logits = logits.detach().cpu()
    return (logits.float() if str(logits.dtype) == "torch.bfloat16" else logits).numpy()


def unpack_responses(packed: list[tuple]) -> list[Response]:
    responses = []
    for item in packed:
        if len(item) == 2:
            responses.append(Response(item[0], error=item[1]))
            continue
        (request_id, error, tokens, is_final, reasons, sequence_index, cum_log_probs, log_probs,
         context_logits, generation_logits, perf, top_log_prob_ids, top_log_probs, streaming_delta,
         context_phase_params, token_timestamps) = item
        result = Result(output_token_ids=tokens, is_final=is_final,
                        finish_reasons=[_FINISH_REASONS[r] for r in reasons], cum_log_probs=cum_log_probs,
                        log_probs=log_probs, top_log_prob_ids=top_log_prob_ids, top_log_probs=top_log_probs,
                        context_logits=context_logits, generation_logits=generation_logits,
                        sequence_index=sequence_index, context_phase_params=context_phase_params,
                        token_timestamps=token_timestamps,
                        perf=None if perf is None else RequestPerfMetrics(*perf))
        if streaming_delta:
            result._streaming_delta = True  # lets the client's ResponseQueue merge deltas (output.py)
        responses.append(Response(request_id, error, result))
    return responses


def _exit_description(code: int | None) -> str:
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" with code {code}"


def send_message(conn: Connection, lock: threading.Lock, message) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(payload)


def receive_message(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _finals_expected(request: Request) -> int:
    """Final responses a request gets: one per returned sequence (beam search: one in all)."""
    try:
        if (request.sampling.beam_width or 1) > 1:
            return 1
        return max(1, int(request.sampling.num_return_sequences or 1))
    except (AttributeError, TypeError, ValueError):
        return 1  # a malformed request: the engine answers it with one error


# ----- the engine process --------------------------------------------------------------------------


class _Clients:
    """The engine side's connections: index -> (connection, send lock), and each attached client's
    requests still running (cancelled when that client leaves). Index 0 is the owner."""

    def __init__(self, owner: Connection):
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[Connection, threading.Lock]] = {0: (owner, threading.Lock())}
        self._running: dict[int, set[int]] = {}  # attached client -> engine request ids not yet final
        self._next_index = 1

    def add(self, conn: Connection) -> int:
        """Register an attaching client after telling it its index (so "ready" is its first message)."""
        with self._lock:
            index, self._next_index = self._next_index, self._next_index + 1
            send_lock = threading.Lock()
            send_message(conn, send_lock, ("ready", index))
            self._conns[index] = (conn, send_lock)
            self._running[index] = set()
            return index

    def remove(self, index: int) -> list[int]:
        """Forget a client; returns its engine request ids still running (to cancel)."""
        with self._lock:
            self._conns.pop(index, None)
            return sorted(self._running.pop(index, ()))

    def track(self, index: int, engine_ids: list[int]) -> None:
        if index:
            with self._lock:
                self._running.get(index, set()).update(engine_ids)

    def send(self, index: int, message) -> None:
        entry = self._conns.get(index)
        if entry is None:
            return  # that client left: its late responses go nowhere
        try:
            send_message(entry[0], entry[1], message)
        except OSError:  # gone: its reader sees EOF and cleans up
            pass

    def broadcast(self, message, skip: int | None = None) -> None:
        for index in list(self._conns):
            if index != skip:
                self.send(index, message)

    def send_responses(self, responses: list[Response]) -> None:
        """Each client gets its own responses, under its own request ids, in one message."""
        by_client: dict[int, list[Response]] = {}
        for response in responses:
            by_client.setdefault(response.request_id // CLIENT_ID_STRIDE, []).append(response)
        for index, batch in by_client.items():
            if index:
                with self._lock:
                    running = self._running.get(index)
                    if running is not None:
                        running.difference_update(r.request_id for r in batch if r.error is not None or r.is_final)
            self.send(index, ("responses", pack_responses(batch, id_base=index * CLIENT_ID_STRIDE)))


def serve(conn: Connection, listen_path: str | None = None) -> int:
    from engine.executor.executor import Executor

    clients = _Clients(conn)

    def send(message) -> None:
        clients.send(0, message)

    _, engine_dir, config, device = receive_message(conn)
    try:
        # Results hold host tensors only (the executor moves logits to the CPU), so unpickling them
        # never starts CUDA in a client.
        executor = Executor(engine_dir, config, device=device, response_callback=clients.send_responses)
    except Exception as err:
        send(("failed", f"{type(err).__name__}: {err}"))
        return 1
    from engine.executor.gc_freeze import freeze_after_load

    freeze_after_load(executor.runner.device)  # this process's engine lives as long as it: no full GC scans the load's objects
    send(("ready", 0))
    stopped = threading.Event()

    def publish_stats() -> None:
        last = None
        while True:  # at once (the client's metrics show the KV pool from the start), then periodically
            stats = executor.get_latest_iteration_stats()
            # a new object each iteration, and when an idle executor's pool changed (pins freed: same iter)
            if stats is not last or executor.failure is not None:
                last = stats
                clients.broadcast(("stats", stats, executor.failure))
            if stopped.wait(STATS_PERIOD_S):
                return

    threading.Thread(target=publish_stats, name="engine-process-stats", daemon=True).start()
    listener = _listen(listen_path, clients, executor) if listen_path else None
    try:
        _serve_client(conn, 0, clients, executor)  # the owner: its leaving ends the engine
    finally:
        stopped.set()
        if listener is not None:
            listener.close()
            _unlink_quietly(listen_path)
        # Bounded: a loop stuck in a collective on a lost rank would hold shutdown() forever, and
        # this process (and its GPU memory) must not outlive its client.
        closer = threading.Thread(target=executor.shutdown, name="engine-process-shutdown", daemon=True)
        closer.start()
        closer.join(SHUTDOWN_TIMEOUT_S)
    return 0


def _serve_client(conn: Connection, index: int, clients: _Clients, executor) -> None:
    """One client's messages until it says shutdown or goes away; its ids offset into the engine's."""
    base = index * CLIENT_ID_STRIDE
    while True:
        try:
            message = receive_message(conn)
        except (EOFError, OSError):
            break  # the stub is gone
        if message[0] == "enqueue":
            engine_ids = [base + i for i in message[1]]
            clients.track(index, engine_ids)
            executor.enqueue_requests(message[2], request_ids=engine_ids)
        elif message[0] == "cancel":
            executor.cancel_request(base + message[1])
        elif message[0] == "peer":
            clients.broadcast(message, skip=index)
        elif message[0] == "shutdown":
            break


def _listen(listen_path: str, clients: _Clients, executor) -> socket.socket:
    """Accept attaching clients at ``listen_path`` (a Unix socket only this user can reach)."""
    _unlink_quietly(listen_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen_path)
    os.chmod(listen_path, 0o600)
    listener.listen()

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed at shutdown
            threading.Thread(target=attached_client, args=(Connection(sock.detach()),), daemon=True,
                             name="engine-process-client").start()

    def attached_client(conn: Connection) -> None:
        try:
            if receive_message(conn)[0] != "attach":
                conn.close()
                return
        except (EOFError, OSError, pickle.UnpicklingError):
            conn.close()
            return
        try:
            index = clients.add(conn)
        except OSError:
            conn.close()
            return
        try:
            _serve_client(conn, index, clients, executor)
        finally:
            for engine_id in clients.remove(index):
                executor.cancel_request(engine_id)
            conn.close()

    threading.Thread(target=accept, name="engine-process-listener", daemon=True).start()
    return listener


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the engine process of EngineProcess (started by it)")
    parser.add_argument("--fd", type=int, required=True, help="this end of the client's socketpair")
    parser.add_argument("--listen", default=None, help="a Unix socket path where other clients may attach")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group, and mpirun's SIGTERM every process of the job; this
    # process ends when its client says so or goes away (the server's own shutdown unloads the
    # model, which shuts this down in order). Dying on the signal instead would look like a crash
    # to the model, which would then restart it in the middle of the shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGUSR1: every thread's Python stack to stderr (the server's log), also while the loop is
    # stuck in a device call; benchmarks/serving/serving_bench.py asks for it when a served stream stalls.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = serve(Connection(args.fd), args.listen)
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: a leader's process groups were already left (bounded) by shutdown().
    os._exit(code)


if __name__ == "__main__":
    main()
