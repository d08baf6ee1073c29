"""mrc-api's keys (stored hashed) and per-key rate limits; producer/http/front.py applies them."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared import names

SCOPES = ("all-tenants", "ops")  # beside the lanes in an MRC_API_KEYS entry


@dataclass(frozen=True)
class Caller:
    name: str  # the key's hash prefix, or the client address when keys are off: the rate-limit bucket
    lanes: frozenset[str]
    key_id: str | None = None  # the key's hash prefix (12 hex); None when keys are off
    all_tenants: bool = False  # the `all-tenants` scope: reads every key's jobs (ops tools)
    ops: bool = False  # the `ops` scope: the ops page and its state (counts, ids and codes only)

    @property
    def owner(self) -> str:
        """Whose files and batches these are: the key's id, or `none` without keys."""
        return self.key_id or "none"

    @property
    def namespace(self) -> str | None:
        """Whose job ids this caller reads and names (shared/tenants.py): its key's, or None (every
        job, by stored id) without keys or with the `all-tenants` scope."""
        return None if self.all_tenants else self.key_id


class Keys:
    """`MRC_API_KEYS`: comma-separated `SHA256HEX` or `SHA256HEX@scope+scope`, each scope a lane,
    `all-tenants` or `ops`. Keys are never stored: the presented key is hashed and looked up. Empty: no
    authentication (mrc-api warns at start)."""

    def __init__(self, spec: str) -> None:
        self.entries: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        for raw in (part.strip() for part in spec.split(",")):
            if not raw:
                continue
            digest, _, listed = raw.partition("@")
            digest = digest.lower()
            if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
                raise ValueError(f"MRC_API_KEYS: {digest[:12]!r}... is not a hex sha256")
            scopes = frozenset(listed.split("+")) if listed else frozenset(names.LANES)
            unknown = scopes - set(names.LANES) - set(SCOPES)
            if unknown:
                raise ValueError(f"MRC_API_KEYS: unknown lane(s) or scope(s) {sorted(unknown)}")
            # A key's data is kept under its hash's first 12 hex digits: two entries there would share
            # one tenant, and an entry listed twice would keep only its last scopes (review, helper-73).
            same = next((known for known in self.entries if known[:12] == digest[:12]), None)
            if same is not None:
                twice = "is listed twice" if same == digest else f"shares 12 digits with {same[:16]}"
                raise ValueError(f"MRC_API_KEYS: {digest[:16]}... {twice}; each key needs its own")
            self.entries[digest] = (scopes & frozenset(names.LANES), scopes - frozenset(names.LANES))

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def caller(self, authorization: str | None, address: str) -> Caller | None:
        """The caller for this Authorization header, or None (401)."""
        if not self.enabled:
            return Caller(address, frozenset(names.LANES), ops=True)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        found = self.entries.get(digest)
        if found is None:
            return None
        lanes, scopes = found
        return Caller(
            digest[:12], lanes, digest[:12], all_tenants="all-tenants" in scopes, ops="ops" in scopes
        )


_PRUNE_MIN = 1024


class RateLimiter:
    """A token bucket per caller, in this process: `rate` requests a second, bursts of `burst`."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._prune_at = _PRUNE_MIN

    def retry_after(self, name: str) -> float:
        """0 when the request may go now (a token taken), else the seconds until one is free."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        with self._lock:
            self._prune(now)
            tokens, at = self._buckets.get(name, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1:
                self._buckets[name] = (tokens - 1, now)
                return 0.0
            self._buckets[name] = (tokens, now)
            return (1 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        """Forget the buckets that have filled up again (a full bucket is what a new caller gets): one
        per client address without keys would otherwise grow for the life of the process. Amortised:
        done when the table doubles."""
        if len(self._buckets) < self._prune_at:
            return
        self._buckets = {
            name: (tokens, at)
            for name, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * self.rate < self.burst
        }
        self._prune_at = max(_PRUNE_MIN, 2 * len(self._buckets))

    def __len__(self) -> int:
        return len(self._buckets)
