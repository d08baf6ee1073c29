"""What every mrc-api request passes before and after its route, as one ASGI layer (outermost):

1. measured: every response is counted, 401s, 413s and 500s included (`mrc_api_requests_total`);
2. authenticated and rate-limited from its headers alone, before one byte of its body is read;
3. a body is read only while fewer than MRC_API_MAX_BODIES are being read (memory = that x the limit;
   one key at most half of them, callers without a key from a pool of their own: body_slots.py), within
   MRC_API_BODY_TIMEOUT_S of its turn (else 408), and only up to its route's limit (an image's worth
   where one comes, a job's JSON, a few KiB for a batch create: `limits` in producer/server.py): past
   it the rest of the body is read and dropped (up to MRC_API_DRAIN_BYTES, nothing kept) and the
   answer is 413, so a client that writes its whole body before reading sees the 413 instead of a
   reset connection. A refused caller's body (401, 429) is never read; a client that leaves mid-body
   is counted 499, not a fault;
4. a fault becomes JSON: Redis or S3 out of reach -> 503 `service_unavailable` with Retry-After; any
   other exception -> 500 `internal_error` (logged with its traceback), never plain text;
5. every answer carries `x-request-id`, the name its fault's log line gives it.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import redis
from kombu.exceptions import OperationalError
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from producer.http.body_slots import BodySlots
from producer.http.guard import Caller, Keys, RateLimiter
from shared import logs, redis_target
from shared.errors import ServiceUnreachable, StoreUnavailable

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# What "Redis or S3 cannot serve now" looks like from the route's side: retry later, not a bug.
UNAVAILABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.ReadOnlyError,
    OperationalError,  # kombu, publishing to an unreachable broker
    StoreUnavailable,
    ServiceUnreachable,
)
RETRY_AFTER_S = "5"
BODY_BYTES_PER_S = 64 * 1024  # what each second past MRC_API_BODY_TIMEOUT_S needs to have brought
BODY_IDLE_S = 30.0  # the longest silence within a body
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc")


@dataclass(frozen=True)
class Limits:
    body_bytes: int  # a request body over this is 413, unless a rule below says otherwise
    bodies: int  # request bodies being read at once
    drain_bytes: int  # past the limit, read and drop at most this much before closing
    body_wait_s: float = 10.0  # wait this long for a turn to read a body, then 503
    body_read_s: float = 120.0  # a body must arrive within this of its turn, or 408 (MRC_API_BODY_TIMEOUT_S)
    # (path prefix, content type or "" for any, limit), the first that matches: each route's bodies
    # bounded by what it carries (an image in a multipart job or a chat request, a batch input file,
    # a few KiB of JSON for a batch create).
    paths: tuple[tuple[str, str, int], ...] = ()
    # Path prefixes whose bodies past `heavy_bytes` (or of no declared length) cost several times their
    # size to read: they also take one of a quarter of the turns (body_slots.py).
    heavy_paths: tuple[str, ...] = ()
    heavy_bytes: int = 1 << 20

    def heavy(self, path: str, declared: int | None) -> bool:
        return path.startswith(self.heavy_paths) and (declared is None or declared > self.heavy_bytes)

    def for_request(self, path: str, content_type: str = "") -> int:
        kind = content_type.split(";", 1)[0].strip().lower()
        for prefix, wanted, limit in self.paths:
            if path.startswith(prefix) and wanted in ("", kind):
                return limit
        return self.body_bytes


def json_body(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return status, head, body


def _slow_down(wait: float) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return json_body(429, "rate_limited", "too many requests", {"Retry-After": str(max(1, round(wait)))})


def _ambiguous(scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
    """400 for a request two parties could read two ways (review, helper-84): two Authorization
    headers (the last one won: a proxy's and the client's), or a body framed both by Content-Length
    and by Transfer-Encoding (RFC 9112 6.1: a request smuggled past a proxy that reads the other)."""
    names = [name.lower() for name, _value in scope.get("headers") or []]
    if names.count(b"authorization") > 1:
        return json_body(400, "invalid_request", "Authorization is given more than once")
    if b"transfer-encoding" in names and b"content-length" in names:
        message = "a body framed by both Content-Length and Transfer-Encoding"
        return json_body(400, "invalid_request", message, {"Connection": "close"})
    return None


def _route_label(scope: Scope) -> str:
    """The route template a request is counted under: the one that answered it, or, for an answer
    given before routing (401, 429, 413, 503 at the door) or by a route that sets none (/openapi.json,
    a 405), the one its path matches; "unmatched" only where none does (review: every refusal at the
    door was counted "unmatched", beside the 404 noise). Templates only: a bounded label."""
    answered = getattr(scope.get("route"), "path", None)
    if answered:
        return str(answered)
    router = getattr(scope.get("app"), "router", None)
    probe = {**scope, "type": "http"}
    partial = None
    for route in getattr(router, "routes", []):
        match, _child = route.matches(probe)
        if match is Match.FULL:
            return str(route.path)
        if match is Match.PARTIAL and partial is None:  # the path with another method: a 405
            partial = str(route.path)
    return partial or "unmatched"


class Front:
    def __init__(
        self,
        app: ASGIApp,
        keys: Keys,
        limiter: RateLimiter,
        limits: Limits,
        count: Callable[[str, str, int, float], None],
        unavailable: Callable[[str], None] = lambda _service: None,
    ) -> None:
        self.app, self.keys, self.limiter, self.limits, self.count = app, keys, limiter, limits, count
        self.unavailable = unavailable  # a 503 because Redis or S3 could not serve: by service
        self._bodies = BodySlots(limits.bodies, limits.body_wait_s)
        self.log = logs.get_logger()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began, status = time.perf_counter(), [0]
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                head = list(message.get("headers") or [])
                if not any(name.lower() == REQUEST_ID_HEADER for name, _value in head):
                    message = {**message, "headers": [*head, (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self._serve(scope, receive, sent, status)
        finally:
            route = _route_label(scope)
            method = str(scope.get("method", ""))
            method = method if method in _METHODS else "other"  # a label per invented method: unbounded
            self.count(route, method, status[0] or 500, time.perf_counter() - began)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, status: list[int]) -> None:
        refused = _ambiguous(scope) or self._gate(scope)
        if refused is not None:
            await _reply(send, refused)
            return
        try:
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                await self._with_body(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        except ClientDisconnect:  # the client left mid-body: nobody to answer, and not our fault
            status[0] = status[0] or 499
        except Exception as exc:  # the route failed: a JSON answer, unless one is already on its way
            if status[0]:
                raise
            await _reply(send, self._fault(exc, scope))

    def _gate(self, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """401 / 429 from the headers alone; the caller is kept for the route (lanes, read scope). The
        ops page (/ops...) also takes its key from its cookie, and a caller without a key gets the
        page's own answer (a form asking for one), not JSON."""
        path = str(scope.get("path", ""))
        ops = path == "/ops" or path.startswith("/ops/")
        if not ops and (not path.startswith("/v1/") or path.startswith(_OPEN_PATHS)):
            return None
        headers = dict(scope.get("headers") or [])
        client = scope.get("client")
        address = client[0] if client else "unknown"
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        if authorization is None and ops:
            authorization = ops_cookie(headers.get(b"cookie", b"").decode("latin-1"))
        caller = self.keys.caller(authorization, address)
        # Unknown keys' requests are limited per address as a key's are (they were not): load shed,
        # never a lockout (a known key is never held back; keys are long random tokens). On the ops
        # page too, for a key in a header or its cookie (review, helper-73: 1,000 guesses there in
        # 0.75 s, never a 429; its sign-in form is limited by its route); without one, it is its form.
        if caller is None and (authorization is not None or not ops):
            wait = self.limiter.retry_after(f"unknown-key {address}")
            if wait > 0:
                return _slow_down(wait)
        if caller is None and ops:
            scope.setdefault("state", {})["caller"] = None
            return None
        if caller is None:
            return json_body(401, "unauthorized", "missing or unknown API key (Authorization: Bearer KEY)")
        wait = self.limiter.retry_after(caller.name)
        if wait > 0:
            return _slow_down(wait)
        scope.setdefault("state", {})["caller"] = caller
        return None

    async def _with_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        kind = headers.get(b"content-type", b"").decode("latin-1")
        limit = self.limits.for_request(str(scope.get("path", "")), kind)
        size = _declared_size(headers.get(b"content-length"))
        if size is not None and size > limit:
            await _drain(receive, self.limits.drain_bytes, size)
            await _reply(send, _too_large(limit))
            return
        caller = (scope.get("state") or {}).get("caller")
        who = caller.key_id if caller is not None else None  # keys off: no one caller to hold back
        heavy = self.limits.heavy(str(scope.get("path", "")), size)
        turn = await self._bodies.take(who, let_in=caller is not None, heavy=heavy)
        if isinstance(turn, str):
            await _drain(receive, self.limits.drain_bytes, None)
            await _reply(send, json_body(503, "busy", turn, {"Retry-After": "2"}))
            return
        # A route that goes on long after it let go of its body (a chat completion waiting for its
        # answer) gives its turn back early by calling this; every other route holds it to its end.
        scope.setdefault("state", {})["done_with_body"] = turn
        try:
            await self._limited(scope, receive, send, limit)
        finally:
            turn()

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen, over, ended, late = 0, False, False, False
        began = time.monotonic()

        async def counted() -> Message:
            nonlocal seen, over, ended, late
            if ended:
                return await receive()  # the body is in: what comes next is the client leaving
            # A body keeps arriving: MRC_API_BODY_TIMEOUT_S, and a second more for every 64 KiB in
            # (review: a total deadline cut a steady 200 MB upload off; a trickle still ends 408), and
            # never a silence past BODY_IDLE_S (bytes sent early buy no idle hour later: review).
            until = began + self.limits.body_read_s + seen / BODY_BYTES_PER_S
            idle = min(BODY_IDLE_S, self.limits.body_read_s)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(until - time.monotonic(), idle)))
            except TimeoutError:
                late = True
                raise _TooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                ended = not message.get("more_body", False)
                if seen > limit:
                    over = True
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except Exception:
            if late:  # no drain: a client this slow is not waited for again
                message = (
                    "the request body stopped arriving (MRC_API_BODY_TIMEOUT_S, a second more per "
                    f"64 KiB, no pause over {min(BODY_IDLE_S, self.limits.body_read_s):g} s)"
                )
                await _reply(send, json_body(408, "request_timeout", message, {"Connection": "close"}))
                return
            if not over:
                raise
            if not ended:  # the last part already came: nothing left to drain
                await _drain(receive, self.limits.drain_bytes, None)
            await _reply(send, _too_large(limit))

    def _fault(self, exc: Exception, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        path = str(scope.get("path", ""))
        rid = str((scope.get("state") or {}).get("request_id", ""))
        if isinstance(exc, UNAVAILABLE):
            which = "Redis" if isinstance(exc, redis.RedisError | OperationalError) else "S3"
            if isinstance(exc, ServiceUnreachable):
                which = exc.service
            self.log.warning(
                "MRC_API_UNAVAILABLE", path=path, service=which, request_id=rid, error=repr(exc)[:300]
            )
            self.unavailable(which)
            message = f"{which} cannot be reached now; retry later"
            return json_body(503, "service_unavailable", message, {"Retry-After": RETRY_AFTER_S})
        if redis_target.refused_for_now(exc):  # out of memory, a failover: there, and refusing for now
            words = redis_target.refusal_words(exc)
            self.log.warning("MRC_API_UNAVAILABLE", path=path, service="Redis", request_id=rid, error=words)
            self.unavailable("Redis")
            message = f"Redis cannot serve now ({words[:120]}); retry later"
            return json_body(503, "service_unavailable", message, {"Retry-After": RETRY_AFTER_S})
        self.log.exception("MRC_API_ERROR", path=path, request_id=rid, error=repr(exc)[:300])
        message = f"the server failed on this request (logged as request {rid})"
        return json_body(500, "internal_error", message)


OPS_COOKIE = "mrc_ops_key"
REQUEST_ID_HEADER = b"x-request-id"
# A client's own id is kept when it is a plain token a log line can carry as it is (a proxy's UUID, a
# trace id); anything else is replaced, never echoed (header and log injection).
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def _request_id(scope: Scope) -> str:
    """The id every answer carries in `x-request-id` (the OpenAI SDKs keep it as `_request_id`) and
    every fault's log line names: the client's `X-Request-Id` when it is a plain token, else a new one."""
    for name, value in scope.get("headers") or []:
        if name.lower() == REQUEST_ID_HEADER:
            given = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(given):
                return str(given)
            break
    return f"req_{secrets.token_hex(12)}"


def ops_cookie(header: str) -> str | None:
    """`Authorization` as the ops page's cookie holds it (the key the operator typed in, /ops/login)."""
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == OPS_COOKIE and value:
            return f"Bearer {urllib.parse.unquote(value)}"
    return None


def caller_of(scope: Scope) -> Caller:
    """The caller the front door let in (every /v1/ route runs after it)."""
    return scope["state"]["caller"]  # type: ignore[no-any-return]


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


def _declared_size(declared: bytes | None) -> int | None:
    """Content-Length as a number, None when absent or not one. Past 4,300 digits int() raises; past 20
    no body could be that large, and the HTTP server below refuses it first (a guard, not a path)."""
    if declared is None or not declared.isdigit():
        return None
    digits = declared.lstrip(b"0") or b"0"
    return int(digits) if len(digits) <= 20 else 1 << 64


def _too_large(limit: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return json_body(413, "invalid_job", f"request body over the limit of {limit} bytes")


async def _reply(send: Send, response: tuple[int, list[tuple[bytes, bytes]], bytes]) -> None:
    status, headers, body = response
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, bound: int, declared: int | None) -> None:
    """Read and drop what is left of the body, up to `bound` bytes (and 30 s), before the answer goes
    out (the server reads nothing more once it has answered), so a client that writes its whole body
    before it reads gets to our answer. A body declared larger than the bound is not waited for."""
    if declared is not None and declared > bound:
        return
    dropped = 0

    async def drop() -> None:
        nonlocal dropped
        while dropped <= bound:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(drop(), 30)
    except Exception:  # timed out, or the client went away: nothing left to answer
        return
