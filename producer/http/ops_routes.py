"""`GET /ops` (the page), `GET /ops/state` (its data as JSON), `GET /ops/page.js`, `POST /ops/login`
and `GET /ops/logout`, mounted on mrc-api. Read-only: every problem the page shows names the command
that fixes it. A key needs the `ops` scope (`SHA256HEX@ops` in MRC_API_KEYS: the page and nothing
else); a browser gives it once in the page's form and keeps it in an HttpOnly cookie for /ops only.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from producer.http.front import OPS_COOKIE
from producer.http.guard import Caller, Keys
from producer.ops import page, state
from shared.records import connect
from shared.settings import Settings

# The page loads nothing but itself and its script, both from here.
_HEADERS = {
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}
_FORM_MAX = 4096


class OpsRoutes:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.api_keys)
        self._client: Any = None

    def _redis(self) -> Any:
        if self._client is None:
            self._client = connect(self.settings, self.settings.connect_timeout_s, retries=1)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

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
        view = await run_in_threadpool(state.collect, self._redis(), self.settings)
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
        view = await run_in_threadpool(state.collect, self._redis(), self.settings)
        return JSONResponse(view, headers={"cache-control": "no-store"})

    async def script(self) -> Response:
        return Response(page.OPS_JS, media_type="text/javascript", headers=_HEADERS)

    async def login(self, request: Request) -> Response:
        raw = await request.body()
        key = urllib.parse.parse_qs(raw[:_FORM_MAX].decode("utf-8", "replace")).get("key", [""])[0].strip()
        caller = self.keys.caller(f"Bearer {key}", "ops-login") if key else None
        if caller is None:
            return HTMLResponse(page.login("unknown key"), status_code=401, headers=_HEADERS)
        if not caller.ops:
            return HTMLResponse(page.forbidden(), status_code=403, headers=_HEADERS)
        done = RedirectResponse("/ops", status_code=303, headers=_HEADERS)
        done.set_cookie(
            OPS_COOKIE, urllib.parse.quote(key, safe=""), httponly=True, samesite="strict", path="/ops",
            secure=request.url.scheme == "https",
        )  # fmt: skip
        return done

    async def logout(self) -> Response:
        done = RedirectResponse("/ops", status_code=303, headers=_HEADERS)
        done.delete_cookie(OPS_COOKIE, path="/ops")
        return done


def _caller(request: Request) -> Caller | None:
    return request.scope.get("state", {}).get("caller")  # type: ignore[no-any-return]
