"""What stands in front of mrc-api's routes: API keys (stored hashed), per-key rate limits, and a
request body limit enforced while the body streams in (a missing or lying Content-Length included)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from shared import names

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Caller:
    name: str  # the key's hash prefix, or the client address when keys are off: the rate-limit bucket
    lanes: frozenset[str]


class Keys:
    """`MRC_API_KEYS`: comma-separated `SHA256HEX` or `SHA256HEX@lane+lane`. Keys are never stored:
    the presented key is hashed and looked up. Empty: no authentication (mrc-api warns at start)."""

    def __init__(self, spec: str) -> None:
        self.entries: dict[str, frozenset[str]] = {}
        for raw in (part.strip() for part in spec.split(",")):
            if not raw:
                continue
            digest, _, lanes = raw.partition("@")
            digest = digest.lower()
            if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
                raise ValueError(f"MRC_API_KEYS: {digest[:12]!r}... is not a hex sha256")
            allowed = frozenset(lanes.split("+")) if lanes else frozenset(names.LANES)
            unknown = allowed - set(names.LANES)
            if unknown:
                raise ValueError(f"MRC_API_KEYS: unknown lane(s) {sorted(unknown)}")
            self.entries[digest] = allowed

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def caller(self, authorization: str | None, address: str) -> Caller | None:
        """The caller for this Authorization header, or None (401)."""
        if not self.enabled:
            return Caller(address, frozenset(names.LANES))
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        lanes = self.entries.get(digest)
        return None if lanes is None else Caller(digest[:12], lanes)


class RateLimiter:
    """A token bucket per caller, in this process: `rate` requests a second, bursts of `burst`."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, name: str) -> float:
        """0 when the request may go now (a token taken), else the seconds until one is free."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(name, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1:
                self._buckets[name] = (tokens - 1, now)
                return 0.0
            self._buckets[name] = (tokens, now)
            return (1 - tokens) / self.rate


class BodyLimit:
    """ASGI middleware: 413 once a request body passes `limit` bytes, whatever Content-Length says."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(send, self.limit)
            return
        seen = 0
        refused = False

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(send, self.limit)
        except Exception:
            if not refused:
                raise
            await _too_large(send, self.limit)


class _TooLarge(Exception):
    pass


async def _too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        {"error": {"code": "invalid_job", "message": f"request body over the limit of {limit} bytes"}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
