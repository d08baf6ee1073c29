"""A small threaded HTTP server for the health and metrics ports (the worker's /metrics, /healthz,
/readyz; the lane exporter's /metrics), bounded as a port anyone on the network reaches must be: at
most `max_connections` are served at once, and a new connection past that closes the oldest one
(so a probe or a scrape always gets its answer, however many idle or trickling connections others
hold: review, helper-65, 16 of them made /healthz fail and kubelet restart the worker); each read
has a timeout; and a client that leaves before its answer is written is nobody's error.
http.server's default printed a multi-line traceback to stderr for each such client, breaking the
one-line-per-event log, and a connection that sent half a request held a thread forever."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shared import logs

# (status, body, content type) for a path; the query string is stripped before.
Route = Callable[[], tuple[int, bytes, str]]
# Seconds a connection may take to send its request and read the answer: a scrape answers in
# milliseconds, and Prometheus's and kubelet's own timeouts are 10 s and 1 s by default.
CONNECTION_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16
_GONE = (ConnectionError, TimeoutError)  # the client reset, closed or stalled: not the server's fault


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # socketserver's 5 dropped connects in a burst (each then retried 1 s on)

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int
    ) -> None:
        super().__init__(address, handler)
        self._max = max_connections
        self._live: dict[Any, None] = {}  # connections, oldest first (dicts keep their order)
        self._lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            while len(self._live) >= self._max:  # the oldest goes: a fresh request is answered
                oldest = next(iter(self._live))
                del self._live[oldest]
                _cut(oldest)
            self._live[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._live.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, _GONE):
            return
        logs.get_logger().warning("MRC_HTTP_ERROR", error=repr(error)[:300])


def _cut(connection: Any) -> None:
    """End a connection its handler thread is still reading or writing: that read or write ends."""
    with contextlib.suppress(OSError):  # already gone
        connection.shutdown(socket.SHUT_RDWR)


def _handler(routes: dict[str, Route], timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler sets it on the socket

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:  # as prometheus_client's server answered it
            self._answer(with_body=False)

        def _answer(self, with_body: bool) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            status, body, content_type = (
                route() if route is not None else (404, b'{"error": "not found"}', "application/json")
            )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # scrapes every few seconds would drown the job events

    return Handler


def serve(
    host: str,
    port: int,
    routes: dict[str, Route],
    name: str,
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = CONNECTION_TIMEOUT_S,
) -> BoundedHTTPServer:
    """Serve `routes` (GET only) from a daemon thread; port 0 picks a free port (server_address)."""
    server = BoundedHTTPServer((host, port), _handler(routes, timeout_s), max_connections)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
