"""`GET /ops` (the page), `GET /ops/state` (its data as JSON), `GET /ops/page.js`, `POST /ops/login`
and `GET /ops/logout`, mounted on mrc-api. Read-only: every problem the page shows names the command
that fixes it. A key needs the `ops` scope (`SHA256HEX@ops` in MRC_API_KEYS: the page and nothing
else); a browser gives it once in the page's form and keeps it in an HttpOnly cookie for /ops only.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from producer.http.front import OPS_COOKIE
from producer.http.guard import Caller, Keys, RateLimiter
from producer.ops import page, state
from shared import redis_target
from shared.settings import Settings

# The page loads nothing but itself and its script, both from here.
_HEADERS = {
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}
_FORM_MAX = 4096
# The page's Redis reads: a short timeout and no retries (a Redis that hangs costs a refresh 2 s, then
# a 503), and one collection at a time per process, shared by every page open meanwhile, on a thread
# of its own: however many tabs are open, the ops page never holds the request threads other routes use.
_REDIS_TIMEOUT_S = 2.0
_FRESH_S = 0.5  # a collection this recent answers a refresh as it is


class OpsRoutes:
    def __init__(self, settings: Settings, limiter: RateLimiter) -> None:
        self.settings = settings
        self.keys = Keys(settings.api_keys)
        self.limiter = limiter  # the API's: a wrong key in the form counts as one in a header does
        self._client: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrc-ops")
        self._inflight: asyncio.Future[dict[str, Any]] | None = None
        self._last: tuple[float, dict[str, Any]] | None = None

    def _redis(self) -> Any:
        if self._client is None:
            self._client = redis_target.client(
                self.settings, decode_responses=True, socket_timeout=_REDIS_TIMEOUT_S,
                socket_connect_timeout=min(_REDIS_TIMEOUT_S, self.settings.connect_timeout_s), retry=None,
            )  # fmt: skip
        return self._client

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()

    async def _view(self) -> dict[str, Any]:
        """The state: a fresh collection's, shared by every request that arrives while it runs."""
        if self._last is not None and time.monotonic() - self._last[0] < _FRESH_S:
            return self._last[1]
        if self._inflight is None:
            loop = asyncio.get_running_loop()
            self._inflight = loop.run_in_executor(self._pool, state.collect, self._redis(), self.settings)
        inflight = self._inflight
        try:
            view = await asyncio.shield(inflight)
        finally:
            if self._inflight is inflight and inflight.done():
                self._inflight = None
        self._last = (time.monotonic(), view)
        return view

    def mount(self, app: FastAPI) -> None:
        app.add_api_route("/ops", self.page, methods=["GET"], include_in_schema=False)
        app.add_api_route("/ops/state", self.state, methods=["GET"], summary="The ops page's data")
        app.add_api_route("/ops/page.js", self.script, methods=["GET"], include_in_schema=False)
        app.add_api_route("/ops/login", self.login, methods=["POST"], include_in_schema=False)
        app.add_api_route("/ops/logout", self.logout, methods=["GET"], include_in_schema=False)

    async def page(self, request: Request, part: str | None = None) -> Response:
        caller = _caller(request)
        if caller is None:
            return HTMLResponse(page.login(), status_code=401, headers=_HEADERS)
        if not caller.ops:
            return HTMLResponse(page.forbidden(), status_code=403, headers=_HEADERS)
        view = await self._view()
        body = page.main(view) if part == "main" else page.page(view, self.settings.ops_refresh_s)
        return HTMLResponse(body, headers=_HEADERS)

    async def state(self, request: Request) -> Response:
        caller = _caller(request)
        if caller is None:
            return JSONResponse(
                {"error": {"code": "unauthorized", "message": "missing or unknown API key"}}, 401
            )
        if not caller.ops:
            return JSONResponse({"error": {"code": "forbidden", "message": "this key has no ops scope"}}, 403)
        view = await self._view()
        return JSONResponse(view, headers={"cache-control": "no-store", "x-content-type-options": "nosniff"})

    async def script(self) -> Response:
        return Response(page.OPS_JS, media_type="text/javascript", headers=_HEADERS)

    async def login(self, request: Request) -> Response:
        if _cross_site(request):  # another site's form would plant its own key in an operator's browser
            return HTMLResponse(page.login("sign in from this page"), status_code=403, headers=_HEADERS)
        raw = await request.body()
        key = urllib.parse.parse_qs(raw[:_FORM_MAX].decode("utf-8", "replace")).get("key", [""])[0].strip()
        caller = self.keys.caller(f"Bearer {key}", "ops-login") if key else None
        if caller is None:
            address = request.client.host if request.client else "unknown"
            wait = self.limiter.retry_after(f"unknown-key {address}")  # a known key is never held back
            if wait > 0:
                retry = {**_HEADERS, "Retry-After": str(max(1, round(wait)))}
                return HTMLResponse(page.login("too many unknown keys: wait"), status_code=429, headers=retry)
            return HTMLResponse(page.login("unknown key"), status_code=401, headers=_HEADERS)
        if not caller.ops:
            return HTMLResponse(page.forbidden(), status_code=403, headers=_HEADERS)
        done = RedirectResponse("/ops", status_code=303, headers=_HEADERS)
        done.set_cookie(
            OPS_COOKIE, urllib.parse.quote(key, safe=""), httponly=True, samesite="strict", path="/ops",
            secure=_https(request),
        )  # fmt: skip
        return done

    async def logout(self, request: Request) -> Response:
        done = RedirectResponse("/ops", status_code=303, headers=_HEADERS)
        if not _cross_site(request):  # a link on another site signs nobody out
            done.delete_cookie(OPS_COOKIE, path="/ops")
        return done


def _cross_site(request: Request) -> bool:
    """Whether a browser says the request comes from another site: Sec-Fetch-Site (every current
    browser), else an Origin naming another host than the request's (or "null": an origin hidden on
    purpose). A client that sends neither (curl, a script) is no browser to protect."""
    fetched_from = request.headers.get("sec-fetch-site")
    if fetched_from is not None:
        return fetched_from not in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return False
    if origin == "null":
        return True
    hosts = [request.headers.get("host", ""), *request.headers.get("x-forwarded-host", "").split(",")]
    return _site(origin) not in {_bare(host) for host in hosts if host.strip()}


def _site(origin: str) -> str:
    """An origin's host[:port] as a Host header names it, its scheme's default port left out. From
    the netloc, never .port (urlsplit raises on a port like ':abc': a 500 for anyone; review,
    helper-66) nor .hostname (it drops an IPv6 literal's brackets, which Host keeps)."""
    try:
        parts = urllib.parse.urlsplit(origin)
    except ValueError:  # brackets that are no IPv6 literal: no site of ours (review, helper-67: a 500)
        return "\x00"
    netloc = parts.netloc.rpartition("@")[2].lower()
    default = {"http": ":80", "https": ":443"}.get(parts.scheme, "")
    return netloc.removesuffix(default) if default else netloc


def _bare(host: str) -> str:
    """A Host header as _site writes an origin: a default port left out (either scheme's: a proxy's
    X-Forwarded-Host may name :443 while the request reached us over plain HTTP)."""
    return host.strip().lower().removesuffix(":443").removesuffix(":80")


def _https(request: Request) -> bool:
    """Whether the browser reached us over HTTPS, here or at a TLS proxy in front: the Secure flag
    follows X-Forwarded-Proto from any proxy (uvicorn trusts it only from 127.0.0.1 for the scheme;
    a forged one only keeps the cookie off plain HTTP, which costs its sender alone)."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def _caller(request: Request) -> Caller | None:
    return request.scope.get("state", {}).get("caller")  # type: ignore[no-any-return]
