"""The deliveries a worker has in hand, for /healthz (workers/liveness.py) and the heartbeat: when each
began, when it last moved (a stage ended, or, while it waits on the engine, an engine step), on the
monotonic clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Delivery:
    since: float
    at: float
    on_engine: bool = False


class InHand:
    def __init__(self, engine_at: Callable[[], float]) -> None:
        self._engine_at = engine_at  # when the engine last stepped
        self._lock = threading.Lock()
        self._idle_since = time.monotonic()
        self._deliveries: dict[int, _Delivery] = {}

    def begin(self) -> None:
        """This thread's delivery starts (each delivery runs on one thread)."""
        now = time.monotonic()
        with self._lock:
            self._deliveries[threading.get_ident()] = _Delivery(now, now)

    def end(self) -> None:
        with self._lock:
            self._deliveries.pop(threading.get_ident(), None)
        self._idle_since = time.monotonic()

    def moved(self, on_engine: bool | None = None) -> None:
        delivery = self._deliveries.get(threading.get_ident())
        if delivery is not None:
            delivery.at = time.monotonic()
            if on_engine is not None:
                delivery.on_engine = on_engine

    @property
    def since(self) -> float | None:
        """When the oldest delivery in hand began; None when none is in hand."""
        with self._lock:
            return min((d.since for d in self._deliveries.values()), default=None)

    @property
    def progress_at(self) -> float:
        """When the delivery that has moved least recently last moved (a stage, or an engine step
        while it waits on the engine); between deliveries, when the last one ended."""
        with self._lock:
            deliveries = list(self._deliveries.values())
        if not deliveries:
            return self._idle_since
        engine_at = self._engine_at()
        return min(max(d.at, engine_at) if d.on_engine else d.at for d in deliveries)
