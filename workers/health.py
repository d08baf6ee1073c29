"""/metrics, /healthz and /readyz for one worker, on a small threaded HTTP server."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers.liveness import Liveness
from workers.metrics import Metrics

RedisStatus = Callable[[], dict[str, Any]]


class HealthState:
    """What /readyz reports: empty until the model is loaded and warmed up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[str, Any] | None = None
        self.reason = "starting"

    def set_ready(self, info: dict[str, Any]) -> None:
        with self._lock:
            self._ready = dict(info)

    def set_not_ready(self, reason: str = "starting") -> None:
        with self._lock:
            self._ready = None
            self.reason = reason

    def readiness(self) -> dict[str, Any] | None:
        with self._lock:
            return None if self._ready is None else dict(self._ready)


def _handler(
    state: HealthState, metrics: Metrics, liveness: Liveness | None, redis_status: RedisStatus | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, data: dict[str, Any]) -> None:
            self._send(status, json.dumps(data).encode(), "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                alive, details = liveness.report() if liveness is not None else (True, {"status": "alive"})
                self._json(200 if alive else 503, details)
            elif path == "/readyz":
                ready = state.readiness()
                if ready is None:
                    self._json(503, {"status": "not_ready", "reason": state.reason})
                else:
                    self._json(200, {"status": "ready", **ready, **(redis_status() if redis_status else {})})
            elif path == "/metrics":
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            else:
                self._json(404, {"error": "not found"})

        def log_message(self, format: str, *args: Any) -> None:
            return None  # scrapes every few seconds would drown the job events

    return Handler


def serve(
    port: int,
    state: HealthState,
    metrics: Metrics,
    host: str = "0.0.0.0",
    liveness: Liveness | None = None,
    redis_status: RedisStatus | None = None,
) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; port 0 picks a free port (read it from server_address).
    `redis_status`: the Redis master in use now, read at each /readyz (it changes with a failover)."""
    server = ThreadingHTTPServer((host, port), _handler(state, metrics, liveness, redis_status))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="mrc-health", daemon=True).start()
    return server
