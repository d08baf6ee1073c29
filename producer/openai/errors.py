"""OpenAI-shaped errors on mrc-api's OpenAI-compatible routes, decided in one place.

Every error on those routes reaches the client as `{"error": {"message", "type", "param", "code"}}`
(what the official SDKs parse into their exception classes): the routes' own errors (`OpenAIError`)
and everything answered before or around them in mrc's shape, `{"error": {"code", "message"}}` (the
front door's 401 / 413 / 429 / 503, a fault's 500, FastAPI's 404 / 405), rewritten on the way out by
`OpenAIErrors`, the outermost ASGI layer. A new mrc error code needs a line in `_CODES` only if
OpenAI has its own name for it; its type follows from the status.

`x-should-retry` (read by the official SDKs before their own rules): `false` where a retry cannot
help or could enqueue a job twice (a conflict, an answer about a job that ended, a wait that ran out
for a request without an Idempotency-Key).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from producer.http.forms import ErrorResponse
from producer.intake.checks import IMAGE_CODES

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]

PATHS = ("/v1/chat/", "/v1/models", "/v1/files", "/v1/batches")
# mrc's own routes under /v1/, whose errors keep mrc's shape (`{"error": {"code", "message"}}`); every
# other /v1/ path, an unknown one included (/v1/embeddings, /v1/responses...), answers in OpenAI's.
MRC_PATHS = ("/v1/jobs", "/v1/events")
# mrc code -> OpenAI's name for the same thing, where clients are known to look for it.
_CODES = {"unauthorized": "invalid_api_key", "rate_limited": "rate_limit_exceeded"}
# A failed job's result code -> the status its answer gets (default 500: the server's fault). What
# was wrong with the request is 400 `invalid_request_error`, as OpenAI answers it (the SDKs raise
# BadRequestError), with mrc's code kept.
_RESULT_STATUS = {
    "invalid_job": 400,
    "image_not_found": 400,
    "image_source_forbidden": 400,
    "unsupported_image_format": 400,
    "image_decode_error": 400,
    "image_too_large": 400,
    "prompt_too_long": 400,
    "expired": 504,
    "cancelled": 409,
}
_MAX_ERROR_BODY = 64 * 1024


def from_usage_error(message: str, param: str | None = None) -> OpenAIError:
    """What mrc's job checks refused (a UsageError's message), as /v1/jobs answers it: 409 for a job
    id held by a different job, 400 otherwise (with the image's own code where it names one), as
    OpenAI answers a request it refuses."""
    if "already used by a different job" in message:
        return OpenAIError(409, message, param, "conflict")
    prefix, _, rest = message.partition(": ")
    if prefix in IMAGE_CODES:
        return OpenAIError(400, rest, param, prefix)
    return OpenAIError(400, message, param, "invalid_job")


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 504:
        return "timeout_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def result_status(code: str) -> int:
    """The status of the answer about a job that failed with `code`."""
    return _RESULT_STATUS.get(code, 500)


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: status, message, the parameter at fault, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        *,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.extra, self.headers = extra or {}, headers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": error_type(self.status), "param": self.param}
        return {"error": {**error, "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers or None)


def openai_body(status: int, raw: bytes) -> dict[str, Any]:
    """Any error body (mrc's shape, FastAPI's `{"detail": ...}`, text) in OpenAI's shape; fields it
    already has are kept."""
    try:
        data: Any = json.loads(raw) if raw else {}
    except ValueError:
        data = {"detail": raw[:500].decode("utf-8", "replace")}
    found = data.get("error") if isinstance(data, dict) else None
    error: dict[str, Any] = dict(found) if isinstance(found, dict) else {}
    if not error:
        detail = data.get("detail") if isinstance(data, dict) else data
        error["message"] = detail if isinstance(detail, str) else json.dumps(detail)[:500]
    code = error.get("code")
    if status == 413 and code == "invalid_job":  # the front door's body limit: no job was ever read
        code = "request_too_large"
    return {
        "error": {
            **error,
            "message": str(error.get("message", "")),
            "type": error.get("type") or error_type(status),
            "param": error.get("param"),
            "code": _CODES.get(code, code) if isinstance(code, str) else code,
        }
    }


class OpenAIErrors:
    """The outermost layer: error answers on the OpenAI routes, and on any /v1/ path that is not one of
    mrc's own, leave in OpenAI's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not path.startswith("/v1/") or path.startswith(MRC_PATHS):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []
        body = bytearray()

        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start" and int(message["status"]) >= 400:
                held.append(message)
                return
            if not held or message["type"] != "http.response.body":
                await send(message)
                return
            if len(body) <= _MAX_ERROR_BODY:
                body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held[0]
            status = int(start["status"])
            shaped = openai_body(status, bytes(body))
            if status == 404 and scope.get("route") is None:  # no such route: as OpenAI answers one
                method = str(scope.get("method", ""))
                shaped["error"].update(
                    message=f"Invalid URL ({method} {path[:200]}): GET /openapi.json lists mrc-api's routes",
                    code="unknown_url",
                )
            payload = json.dumps(shaped).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in _REPLACED]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ]
            if status == 409 and not any(k.lower() == b"x-should-retry" for k, _ in headers):
                headers.append((b"x-should-retry", b"false"))  # the SDKs retry a 409 unless told not to
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

        await self.app(scope, receive, rewrite)


_REPLACED = (b"content-type", b"content-length")
