"""A small threaded HTTP server for the health and metrics ports (the worker's /metrics, /healthz,
/readyz; the lane exporter's /metrics), bounded as a port anyone on the network reaches must be: each
connection has a socket timeout, at most `max_connections` are served at once (past that a
connection is closed unanswered, as a scrape or probe past its own timeout would be), and a client
that leaves before its answer is written is nobody's error. http.server's default printed a
multi-line traceback to stderr for each such client, breaking the one-line-per-event log, and a
connection that sent half a request held a thread forever."""

from __future__ import annotations

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
        self._room = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._room.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, holding no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._room.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._room.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, _GONE):
            return
        logs.get_logger().warning("MRC_HTTP_ERROR", error=repr(error)[:300])


def _handler(routes: dict[str, Route], timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler sets it on the socket

        def do_GET(self) -> None:
            route = routes.get(self.path.split("?", 1)[0])
            status, body, content_type = (
                route() if route is not None else (404, b'{"error": "not found"}', "application/json")
            )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
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
