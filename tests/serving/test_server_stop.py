"""serving/server_stop.py against a real local HTTP server that behaves as tritonserver's HTTP
service does when it stops: it keeps serving the connections it has, and drops new ones."""
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.server_stop import ServerStopWatcher, ShutdownHooks, is_live, server_http_endpoint


class FakeTritonHttp(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.stopping = False
        self.open_connections = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self):
        return self.server_address

    def verify_request(self, request, client_address):
        return not self.stopping  # a stopping Triton resets new connections


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Triton's

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.open_connections += 1

    def finish(self):
        super().finish()
        with self.server.lock:
            self.server.open_connections -= 1

    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/live" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_endpoint_is_read_from_the_server_command_line():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--model-repository=/m",
                                "--http-port", "9123", "--http-address=0.0.0.0", "--grpc-port=9124"])
    no_http = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--allow-http=false"])
    for child in (process, no_http):  # until exec, /proc/<pid>/cmdline still shows pytest's
        deadline = time.monotonic() + 10
        while b"time.sleep(30)" not in open(f"/proc/{child.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        assert server_http_endpoint(process.pid) == ("127.0.0.1", 9123)
        assert server_http_endpoint(no_http.pid) is None
        assert server_http_endpoint(2 ** 22 + 12345) is None  # no such process
    finally:
        process.kill()
        no_http.kill()


def test_liveness_is_true_while_serving_and_false_once_new_connections_are_dropped():
    server = FakeTritonHttp()
    try:
        assert is_live(server.endpoint) is True
        server.stopping = True
        assert is_live(server.endpoint) is False
    finally:
        server.shutdown()
    server.server_close()
    assert is_live(server.endpoint) is False  # refused


@pytest.mark.parametrize("requests_finish_in_grace", [True, False])
def test_watcher_holds_the_latch_until_requests_have_ended(requests_finish_in_grace):
    server = FakeTritonHttp()
    events = []
    running_requests = [2]
    hooks = ShutdownHooks(has_requests=lambda: running_requests[0] > 0,
                          end_requests=lambda: (events.append("end"), running_requests.__setitem__(0, 0), 2)[2],
                          paused=lambda: False, log=events.append)
    watcher = ServerStopWatcher(server.endpoint, grace_s=0.6, hooks=hooks)
    running = [True]
    thread = threading.Thread(target=watcher.watch, args=(lambda: running[0],), daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.open_connections >= 1)  # the latch
        time.sleep(0.3)
        assert not watcher.stopping
        server.stopping = True
        started = time.monotonic()
        assert wait_for(lambda: watcher.stopping, timeout=2)
        assert server.open_connections == 1  # still held: requests are running
        if requests_finish_in_grace:
            running_requests[0] = 0
        thread.join(timeout=5)
        took = time.monotonic() - started
        assert not thread.is_alive()
        assert wait_for(lambda: server.open_connections == 0)  # let go: the server may stop its core
        assert "the server is stopping" in events[0]
        if requests_finish_in_grace:
            assert "end" not in events and took < 0.6
        else:
            assert events[1:] == ["end", "ended 2 unfinished requests for the shutdown"] and took >= 0.6
    finally:
        running[0] = False
        server.shutdown()
        server.server_close()


def test_a_not_live_answer_while_paused_is_no_stop():
    server = FakeTritonHttp()
    hooks = ShutdownHooks(has_requests=lambda: False, end_requests=lambda: 0, paused=lambda: True,
                          log=lambda message: None)
    watcher = ServerStopWatcher(server.endpoint, grace_s=0.1, hooks=hooks)
    running = [True]
    thread = threading.Thread(target=watcher.watch, args=(lambda: running[0],), daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.open_connections >= 1)
        server.stopping = True
        time.sleep(0.5)
        assert not watcher.stopping
        running[0] = False
        thread.join(timeout=2)
        assert wait_for(lambda: server.open_connections == 0)  # the latch goes when the model does
    finally:
        server.shutdown()
        server.server_close()
