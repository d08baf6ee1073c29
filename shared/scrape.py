"""Metrics read from Redis at scrape time, read at most once a second: scrapes from several Prometheus
replicas within a second read Redis once, and a scrape never fails for Redis (None: not read)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import redis

T = TypeVar("T")
CACHE_S = 1.0


class ScrapeCache(Generic[T]):
    def __init__(self, read: Callable[[], T], cache_s: float = CACHE_S) -> None:
        self._read, self._cache_s = read, cache_s
        self._lock = threading.Lock()
        self._cached: tuple[float, T | None] = (-1e18, None)

    def get(self) -> T | None:
        with self._lock:
            at, view = self._cached
            if time.monotonic() - at < self._cache_s:
                return view
            try:
                view = self._read()
            except redis.RedisError:
                view = None  # the collector's `..._up` gauge says so
            self._cached = (time.monotonic(), view)
            return view
