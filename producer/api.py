"""`mrc-api`: the HTTP intake for upstream systems (FastAPI; producer side, no torch).

POST /v1/jobs (JSON with an s3:// image, or multipart with the image bytes) -> 202 {job_id, status_url};
GET /v1/jobs/{id}, /v1/jobs/{id}/result[?wait=S], /v1/events?after=ID[&wait=S] (completion events
from a capped Redis stream), /healthz, /readyz, /metrics, /openapi.json. Every error is JSON
`{"error": {"code", "message"}}` with the contract's codes. All blocking work (Redis, S3) runs in
the thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, Field

from producer.api_guard import BodyLimit, Caller, Keys, RateLimiter
from producer.client import Client, Submission
from shared import frames, logs, names, reach
from shared.dimensions import image_size
from shared.errors import MrcError, QueueFull, ServiceUnreachable, StoreUnavailable, UsageError
from shared.records import EVENT_ID_RE
from shared.settings import Settings
from shared.sniff import SUPPORTED_FORMATS, sniff_format

_IMAGE_CODES = frozenset({"image_source_forbidden", "unsupported_image_format", "image_too_large"})
# ?wait=SECONDS: finite and not negative; held at most MRC_API_RESULT_WAIT_MAX_S whatever is asked
_WAIT = Query(0.0, ge=0, le=86400, allow_inf_nan=False, description="seconds to wait (bounded by the server)")


class JobRequest(BaseModel):
    """A job as JSON (multipart takes the same fields as form fields, and the image as a file part)."""

    image: str = Field(description="s3://bucket/key (multipart: the image file part instead)")
    prompt: str
    job_id: str | None = None
    ticket_id: str | None = None
    lane: str = "interactive"
    max_new_tokens: int | None = None
    deadline: str | None = None


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["image", "prompt"],
    "properties": {
        "image": {"type": "string", "format": "binary"},
        "prompt": {"type": "string"},
        "job_id": {"type": "string"},
        "ticket_id": {"type": "string"},
        "lane": {"type": "string"},
        "max_new_tokens": {"type": "integer"},
        "deadline": {"type": "string"},
    },
}


class Intake:
    """The routes' state: settings, the producer client (made on first use), keys, limits, metrics."""

    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.api_keys)
        self.limiter = RateLimiter(settings.api_rate_per_s, settings.api_rate_burst)
        self._client = client
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mrc_api_requests_total", "Requests", ["route", "method", "status"], registry=self.registry
        )
        self.seconds = Histogram("mrc_api_request_seconds", "Request time", ["route"], registry=self.registry)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.settings)
        return self._client

    async def measure(self, request: Request, call_next: Any) -> Response:
        began = time.perf_counter()
        response: Response = await call_next(request)
        route = getattr(request.scope.get("route"), "path", "unmatched")
        self.requests.labels(route=route, method=request.method, status=str(response.status_code)).inc()
        self.seconds.labels(route=route).observe(time.perf_counter() - began)
        return response

    def authorize(self, request: Request, lane: str | None = None) -> Caller | JSONResponse:
        address = request.client.host if request.client else "unknown"
        caller = self.keys.caller(request.headers.get("authorization"), address)
        if caller is None:
            return _error(401, "unauthorized", "missing or unknown API key (Authorization: Bearer KEY)")
        if lane is not None and lane not in caller.lanes:
            return _error(403, "forbidden", f"this key may not use the {lane} lane")
        wait = self.limiter.retry_after(caller.name)
        if wait > 0:
            return _error(429, "rate_limited", "too many requests", {"Retry-After": str(max(1, round(wait)))})
        return caller

    async def submit(self, request: Request) -> Response:
        fields, data = await _read_job(request)
        if isinstance(fields, JSONResponse):
            return fields
        lane = str(fields.get("lane") or "interactive")
        caller = self.authorize(request, lane if lane in names.LANES else None)
        if isinstance(caller, JSONResponse):
            return caller
        try:
            return await run_in_threadpool(_enqueue, self.client, fields, data)
        except QueueFull as exc:
            return _error(503, exc.code, exc.message, {"Retry-After": "30"})
        except UsageError as exc:
            conflict = "already used by a different job" in exc.message
            prefix = exc.message.split(":", 1)[0]
            code = prefix if prefix in _IMAGE_CODES else "invalid_job"
            return _error(409 if conflict else 422, code, exc.message)

    async def status(self, job_id: str, request: Request) -> Response:
        caller = self.authorize(request)
        if isinstance(caller, JSONResponse):
            return caller
        found = await run_in_threadpool(self.client.status, job_id)
        if found["state"] == "unknown":
            return _error(404, "not_found", f"no job {job_id[:130]!r}")
        return JSONResponse(found)

    async def result(self, job_id: str, request: Request, wait: float = _WAIT) -> Response:
        caller = self.authorize(request)
        if isinstance(caller, JSONResponse):
            return caller
        deadline = time.monotonic() + max(0.0, min(wait, self.settings.api_result_wait_max_s))
        while True:
            found = await run_in_threadpool(self.client.result, job_id)
            if found is not None:
                return JSONResponse(found)
            state = (await run_in_threadpool(self.client.status, job_id))["state"]
            if state == "unknown":
                return _error(404, "not_found", f"no job {job_id[:130]!r}")
            if time.monotonic() >= deadline:
                return JSONResponse({"job_id": job_id, "state": state}, status_code=202)
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    async def events(self, request: Request, after: str = "0", wait: float = _WAIT) -> Response:
        caller = self.authorize(request)
        if isinstance(caller, JSONResponse):
            return caller
        if not EVENT_ID_RE.match(after):
            return _error(400, "invalid_request", "after: an event id (1700000000000-0) or 0")
        block = max(0.0, min(wait, self.settings.api_result_wait_max_s))
        found = await run_in_threadpool(self.client.records.events_after, after, block)
        return JSONResponse({"events": found, "last_id": found[-1]["id"] if found else after})

    async def healthz(self) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(self) -> Response:
        try:
            await run_in_threadpool(reach.check, self.settings)
        except ServiceUnreachable as exc:
            return JSONResponse({"status": "not_ready", "reason": exc.message}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _invalid_job(errors: list[Any], where: str, message: str) -> JSONResponse:
    """422 `invalid_job` naming the first field pydantic or FastAPI refused."""
    first = errors[0] if errors else {}
    where = ".".join(str(part) for part in first.get("loc", ())) or where
    return _error(422, "invalid_job", f"{where}: {first.get('msg', message)}"[:300])


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    errors: list[Any] = list(exc.errors()) if isinstance(exc, RequestValidationError) else []
    return _invalid_job(errors, "", "invalid request")


def create_app(settings: Settings, client: Client | None = None) -> FastAPI:
    intake = Intake(settings, client)
    app = FastAPI(title="mrc intake", version="1", description=__doc__)
    app.middleware("http")(intake.measure)
    app.add_exception_handler(RequestValidationError, _invalid)
    body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": JobRequest.model_json_schema()},
                "multipart/form-data": {"schema": _MULTIPART_SCHEMA},
            },
        }
    }
    app.add_api_route("/v1/jobs", intake.submit, methods=["POST"], status_code=202, openapi_extra=body)
    app.add_api_route("/v1/jobs/{job_id}", intake.status, methods=["GET"])
    app.add_api_route("/v1/jobs/{job_id}/result", intake.result, methods=["GET"])
    app.add_api_route("/v1/events", intake.events, methods=["GET"])
    for path, handler in (
        ("/healthz", intake.healthz),
        ("/readyz", intake.readyz),
        ("/metrics", intake.metrics),
    ):
        app.add_api_route(path, handler, methods=["GET"])
    app.add_middleware(BodyLimit, limit=settings.api_max_body_bytes or settings.max_image_bytes + (1 << 20))
    return app


async def _read_job(request: Request) -> tuple[dict[str, Any] | JSONResponse, bytes | None]:
    """The job's fields, and the image bytes for multipart; or the 4xx to send."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind == "multipart/form-data":
        async with request.form() as form:  # closes the uploaded parts' temporary files
            upload = form.get("image")
            if upload is None or isinstance(upload, str):
                return _error(422, "invalid_job", "image: a multipart request needs a file part"), None
            data = await upload.read()
            fields: dict[str, Any] = {k: v for k, v in form.items() if k != "image" and isinstance(v, str)}
        if "max_new_tokens" in fields:
            text = str(fields["max_new_tokens"])
            if not text.lstrip("-").isdigit():
                return _error(422, "invalid_job", "max_new_tokens must be an integer"), None
            fields["max_new_tokens"] = int(text)
        fields["image"] = ""
        return _checked(fields), data
    if kind != "application/json":
        return _error(415, "invalid_job", "send application/json or multipart/form-data"), None
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "invalid_job", "the body is not JSON"), None
    return _checked(body), None


def _checked(data: object) -> dict[str, Any] | JSONResponse:
    try:
        return JobRequest.model_validate(data).model_dump()
    except ValueError as exc:
        return _invalid_job(list(getattr(exc, "errors", lambda: [])()), "body", str(exc))


def _check_image(data: bytes, settings: Settings) -> None:
    """Refuse, before uploading, what the worker would refuse: not an image it decodes, or more
    pixels (all frames counted) than MRC_MAX_IMAGE_PIXELS, read from the header without decoding."""
    fmt = sniff_format(data)
    if fmt is None or fmt not in SUPPORTED_FORMATS:
        raise UsageError(f"unsupported_image_format: not a supported image ({fmt or 'unknown bytes'})")
    size = image_size(data, fmt)
    if size is not None:
        pixels = size[0] * size[1] * frames.frame_count(data, fmt)
        if pixels > settings.max_image_pixels:
            raise UsageError(
                f"image_too_large: {size[0]}x{size[1]} ({pixels} pixels, frames counted); "
                f"the limit is {settings.max_image_pixels}"
            )


def _enqueue(client: Client, fields: dict[str, Any], data: bytes | None) -> Response:
    if fields["lane"] not in names.LANES:
        raise UsageError(f"lane must be one of {', '.join(names.LANES)}")
    image = fields["image"]
    if data is not None:
        _check_image(data, client.settings)
        image = client.upload_bytes(data)[0]
    elif not str(image).startswith("s3://"):
        raise UsageError("image_source_forbidden: the JSON form takes s3:// URIs; upload bytes as multipart")
    submission = Submission(
        image=image,
        prompt=fields["prompt"],
        job_id=fields["job_id"],
        lane=fields["lane"],
        max_new_tokens=fields["max_new_tokens"],
        ticket_id=fields["ticket_id"],
        deadline=fields["deadline"],
    )
    job = client.build_job(submission)
    created = client.enqueue(job, block=False)
    body = {"job_id": job.job_id, "status_url": f"/v1/jobs/{job.job_id}"}
    return JSONResponse(body, status_code=202 if created else 200)


def app_from_env() -> FastAPI:
    """The app for uvicorn's worker processes (`--factory`): settings from the environment."""
    return create_app(Settings())


def main() -> int:
    import uvicorn
    from pydantic import ValidationError

    from shared.settings import describe_error

    try:
        settings = Settings()
        app = create_app(settings)
    except (ValidationError, ValueError) as exc:
        message = describe_error(exc) if isinstance(exc, ValidationError) else str(exc)
        print(f"mrc-api: bad settings: {message}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, fmt=settings.log_format)
    log = logs.get_logger()
    if not Keys(settings.api_keys).enabled:
        log.warning("MRC_API_NO_AUTH", message="MRC_API_KEYS is empty: every caller may submit")
    try:
        reach.check(settings)
    except (ServiceUnreachable, StoreUnavailable, MrcError) as exc:
        print(f"mrc-api: {exc.message}", file=sys.stderr)
        return 5
    log.info("MRC_HTTP_LISTENING", port=settings.api_port, what="mrc-api")
    options: dict[str, Any] = {"host": settings.api_host, "port": settings.api_port, "log_config": None}
    if settings.api_workers > 1:  # worker processes import the app themselves
        uvicorn.run(
            "producer.api:app_from_env",
            factory=True,
            workers=settings.api_workers,
            access_log=False,
            **options,
        )
    else:
        uvicorn.run(app, access_log=False, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
