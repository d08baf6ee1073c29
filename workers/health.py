"""/metrics, /healthz and /readyz for one worker, on the bounded HTTP server of shared/http_serve.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shared import http_serve
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


def _routes(
    state: HealthState, metrics: Metrics, liveness: Liveness | None, redis_status: RedisStatus | None
) -> dict[str, http_serve.Route]:
    def as_json(status: int, data: dict[str, Any]) -> tuple[int, bytes, str]:
        return status, json.dumps(data).encode(), "application/json"

    def healthz() -> tuple[int, bytes, str]:
        alive, details = liveness.report() if liveness is not None else (True, {"status": "alive"})
        return as_json(200 if alive else 503, details)

    def readyz() -> tuple[int, bytes, str]:
        ready = state.readiness()
        if ready is None:
            return as_json(503, {"status": "not_ready", "reason": state.reason})
        return as_json(200, {"status": "ready", **ready, **(redis_status() if redis_status else {})})

    def scrape() -> tuple[int, bytes, str]:
        return 200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST

    return {"/healthz": healthz, "/readyz": readyz, "/metrics": scrape}


def serve(
    port: int,
    state: HealthState,
    metrics: Metrics,
    host: str = "0.0.0.0",
    liveness: Liveness | None = None,
    redis_status: RedisStatus | None = None,
) -> http_serve.BoundedHTTPServer:
    """Start serving in a daemon thread; port 0 picks a free port (read it from server_address).
    `redis_status`: the Redis master in use now, read at each /readyz (it changes with a failover)."""
    return http_serve.serve(host, port, _routes(state, metrics, liveness, redis_status), "mrc-health")
