"""In-process twin of the Redis result cache, for unit tests (TTL honoured on read)."""

from __future__ import annotations

import threading
import time
from typing import Any


class MemoryResultCache:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any]]] = {}
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            expires, value = self.entries.get(key, (0.0, {}))
            if expires < time.monotonic():
                self.misses += 1
                return None
            self.hits += 1
            return dict(value)

    def get_many(self, keys: list[str]) -> list[dict[str, Any] | None]:
        return [self.get(key) for key in keys]

    def put(self, key: str, value: dict[str, Any], ttl_s: int) -> None:
        with self._lock:
            self.entries[key] = (time.monotonic() + ttl_s, dict(value))
