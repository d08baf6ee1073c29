"""`mrc-api`: the HTTP intake for upstream systems (FastAPI; producer side, no torch).

POST /v1/jobs (JSON with an s3:// image, or multipart with the image bytes) -> 202 {job_id, status_url};
GET /v1/jobs/{id}, /v1/jobs/{id}/result[?wait=S], /v1/events?after=ID[&wait=S] (completion events
from a capped Redis stream), /healthz, /readyz, /metrics, /openapi.json. Every error is JSON
`{"error": {"code", "message"}}` with the contract's codes. What every request passes first (keys,
rate limit, body limits, faults as JSON, counting) is producer/api_front.py; the long-polls run on an
asyncio Redis client (producer/api_waits.py); other blocking work (Redis, S3) runs in the thread pool,
never on the event loop.

Read scope: keys are tenants (shared/tenants.py). A key names, reads, waits on and follows only its
own jobs: ids in its own namespace, events from its own stream; another key's job answers 404, as an
unknown one does. A key with the `all-tenants` scope (ops tools), and every caller of an API without
keys, reads any job by its stored id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer.api_forms import JobRequest, error, invalid_job, job_fields, multipart_schema
from producer.api_front import Front, Limits, caller_of
from producer.api_guard import Caller, Keys, RateLimiter
from producer.api_waits import Waits
from producer.client import Client, Submission
from producer.openai_errors import OpenAIErrors
from shared import frames, logs, names, reach, redis_target, tenants
from shared.dimensions import image_size
from shared.errors import MrcError, NotReplicated, QueueFull, ServiceUnreachable, StoreUnavailable, UsageError
from shared.jobs import JOB_ID_RE, Job, limit_problem
from shared.records import connect, valid_event_id
from shared.settings import Settings
from shared.sniff import SUPPORTED_FORMATS, sniff_format
from shared.usage import UsageCollector

_IMAGE_CODES = frozenset({"image_source_forbidden", "unsupported_image_format", "image_too_large"})
# ?wait=SECONDS: finite and not negative; held at most MRC_API_RESULT_WAIT_MAX_S whatever is asked
_WAIT = Query(0.0, ge=0, le=86400, allow_inf_nan=False, description="seconds to wait (bounded by the server)")


def _not_found(job_id: str) -> JSONResponse:
    return error(404, "not_found", f"no job {job_id[:130]!r}")


def _stored_id(caller: Caller, job_id: str) -> str | None:
    """The job a caller means by `job_id` (shared/tenants.py): one of its key's own, or any job by its
    stored id for a caller without a namespace; None when no job of the caller's can have that id (the
    same 404 as an unknown one: another key's ids cannot be spelt in a key's namespace)."""
    namespace = caller.namespace
    if namespace is None:
        return job_id
    return tenants.job_id(namespace, job_id) if JOB_ID_RE.match(job_id) else None


class Intake:
    """The routes' state: settings, the producer client (made on first use), limits, metrics."""

    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self._client = client
        self._own_client = False  # made here (closed at shutdown), or the caller's
        self.waits = Waits(settings, settings.api_wait_threads)
        self._probe: Any = None  # one S3 connection for /readyz (boto3 clients are made once, not per probe)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mrc_api_requests_total", "Requests", ["route", "method", "status"], registry=self.registry
        )
        self.seconds = Histogram("mrc_api_request_seconds", "Request time", ["route"], registry=self.registry)
        self.registry.register(redis_target.FailoverCollector())

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.settings)
            self._own_client = True
        return self._client

    def close(self) -> None:
        self.waits.close()
        if self._client is not None and self._own_client:
            self._client.close()

    def count(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.seconds.labels(route=route).observe(seconds)

    async def submit(self, request: Request) -> Response:
        fields, data = await job_fields(request)
        if isinstance(fields, JSONResponse):
            return fields
        caller = caller_of(request.scope)
        lane = str(fields.get("lane") or "interactive")
        if lane in names.LANES and lane not in caller.lanes:
            return error(403, "forbidden", f"this key may not use the {lane} lane")
        fields["api_key"] = caller.key_id
        try:
            return await run_in_threadpool(_enqueue, self.client, fields, data, caller.namespace)
        except QueueFull as exc:
            return error(503, exc.code, exc.message, {"Retry-After": "30"})
        except UsageError as exc:
            message = tenants.in_words_of(caller.namespace, exc.message)
            conflict = "already used by a different job" in message
            prefix = message.split(":", 1)[0]
            code = prefix if prefix in _IMAGE_CODES else "invalid_job"
            return error(409 if conflict else 422, code, message)

    async def status(self, job_id: str, request: Request) -> Response:
        stored = _stored_id(caller_of(request.scope), job_id)
        if stored is None:
            return _not_found(job_id)
        found = await run_in_threadpool(self.client.status, stored)
        if found["state"] == "unknown":
            return _not_found(job_id)
        return JSONResponse({**found, "job_id": job_id})

    async def result(self, job_id: str, request: Request, wait: float = _WAIT) -> Response:
        stored = _stored_id(caller_of(request.scope), job_id)
        if stored is None:
            return _not_found(job_id)
        bounded = max(0.0, min(wait, self.settings.api_result_wait_max_s))
        found = await self.waits.result(stored, bounded, self.client.result)
        if isinstance(found, dict):
            return JSONResponse({**found, "job_id": job_id})
        if found == "unknown":
            return _not_found(job_id)
        return JSONResponse({"job_id": job_id, "state": found}, status_code=202)

    async def events(self, request: Request, after: str = "0", wait: float = _WAIT) -> Response:
        if not valid_event_id(after):
            return error(
                400, "invalid_request", "after: an event id (1700000000000-0, parts below 2^64) or 0"
            )
        caller = caller_of(request.scope)
        block = max(0.0, min(wait, self.settings.api_result_wait_max_s))
        # A key reads its own stream (its jobs' events only); ops and an API without keys, the fleet's.
        found = await self.waits.events(after, block, owner=caller.namespace)
        last = found[-1]["id"] if found else after
        if caller.namespace is not None:
            found = [{**e, "job_id": tenants.client_id(caller.namespace, e.get("job_id", ""))} for e in found]
        return JSONResponse({"events": found, "last_id": last})

    async def healthz(self) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(self) -> Response:
        """Redis and S3 reachable, each within MRC_CONNECT_TIMEOUT_S; any failure is a 503, never a 500."""
        try:
            await self.waits.ping()
        except Exception as exc:
            return JSONResponse({"status": "not_ready", "reason": f"Redis: {exc!r}"[:300]}, status_code=503)
        try:
            await run_in_threadpool(self._probe_s3)
        except Exception as exc:
            return JSONResponse({"status": "not_ready", "reason": f"S3: {exc!r}"[:300]}, status_code=503)
        return JSONResponse({"status": "ready", **redis_target.status(self.settings)})

    def _probe_s3(self) -> None:
        if self._probe is None:
            from shared.stores.s3 import S3Connection

            self._probe = S3Connection(self.settings, attempts=1)
        self._probe.probe(self.settings.s3_bucket)

    async def metrics(self) -> Response:
        # Off the event loop: the usage totals are read from Redis at scrape time.
        return Response(
            await run_in_threadpool(generate_latest, self.registry), media_type=CONTENT_TYPE_LATEST
        )


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    errors: list[Any] = list(exc.errors()) if isinstance(exc, RequestValidationError) else []
    return invalid_job(errors, "request")


# The framework's own refusals (no such route, a method the route has not, a multipart body the parser
# refuses: no boundary, too many fields, a field over 1 MiB) in the contract's error shape.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "invalid_job", 415: "invalid_job"}


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = getattr(exc, "detail", None) or "refused"
    headers = getattr(exc, "headers", None)
    return error(status, _HTTP_CODES.get(status, "invalid_job" if status < 500 else "internal_error"),
                 str(detail)[:300], headers)  # fmt: skip


SMALL_BODY_BYTES = 64 * 1024  # a batch create, a cancel, any other POST: a few KiB of JSON at most


def job_json_bytes(settings: Settings) -> int:
    """The largest JSON job body: its prompt and response_format at their limits, every character
    written as a 6-byte \\u escape, and 64 KiB for the rest (ids, an s3:// URI, a deadline)."""
    return 6 * (settings.max_prompt_chars + settings.max_response_format_bytes) + SMALL_BODY_BYTES


def limits(settings: Settings) -> Limits:
    """Each route's body limit, by what it carries. MRC_API_MAX_BODY_BYTES, when set, caps them all
    (the file upload has its own, MRC_OPENAI_FILE_MAX_BYTES)."""

    def capped(limit: int) -> int:
        return min(limit, settings.api_max_body_bytes) if settings.api_max_body_bytes else limit

    # A chat request carries its image as base64 (4 characters per 3 bytes); a file is a batch's input.
    chat = (settings.max_image_bytes + 2) // 3 * 4 + (1 << 20)
    paths = (
        ("/v1/chat/", "", capped(chat)),
        ("/v1/files", "", settings.openai_file_max_bytes + (1 << 20)),
        ("/v1/jobs", "multipart/form-data", capped(settings.max_image_bytes + (1 << 20))),
        ("/v1/jobs", "", capped(job_json_bytes(settings))),
    )
    return Limits(capped(SMALL_BODY_BYTES), settings.api_max_bodies, settings.api_drain_bytes, paths=paths)


def create_app(settings: Settings, client: Client | None = None) -> FastAPI:
    from producer.openai_api import OpenAIRoutes  # it builds on this module (prepare_job)

    intake = Intake(settings, client)
    openai = OpenAIRoutes(intake)
    # The usage totals' own connection, no retries: a scrape while Redis is away answers at once (up 0).
    usage_redis = connect(settings, settings.connect_timeout_s, retries=0)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        openai.start()
        yield
        openai.stop()
        intake.close()
        usage_redis.close()

    app = FastAPI(title="mrc intake", version="1", description=__doc__, lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    body = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": JobRequest.model_json_schema()},
                "multipart/form-data": {"schema": multipart_schema()},
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
    openai.mount(app)
    intake.registry.register(UsageCollector(usage_redis))
    keys = Keys(settings.api_keys)
    limiter = RateLimiter(settings.api_rate_per_s, settings.api_rate_burst)
    app.add_middleware(Front, keys=keys, limiter=limiter, limits=limits(settings), count=intake.count)
    app.add_middleware(OpenAIErrors)  # outermost: errors on the OpenAI routes leave in OpenAI's shape
    return app


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


def prepare_job(client: Client, fields: dict[str, Any], data: bytes | None) -> Job:
    """The job a request asks for, its image uploaded, after every check (UsageError otherwise):
    what /v1/jobs and /v1/chat/completions both enqueue."""
    if fields["lane"] not in names.LANES:
        raise UsageError(f"lane must be one of {', '.join(names.LANES)}")
    image = fields["image"]
    submission = Submission(
        image=image,
        prompt=fields["prompt"],
        job_id=fields["job_id"],
        lane=fields["lane"],
        max_new_tokens=fields["max_new_tokens"],
        ticket_id=fields["ticket_id"],
        deadline=fields["deadline"],
        response_format=fields["response_format"],
        api_key=fields.get("api_key"),
    )
    # The limits first: nothing is uploaded for a job that would be refused anyway.
    problem = limit_problem(
        client.settings, submission.prompt, submission.max_new_tokens, submission.job_id,
        client.response_format(submission),
    )  # fmt: skip
    if problem:
        raise UsageError(problem)
    owner = submission.api_key
    if data is not None:
        _check_image(data, client.settings)
        image = client.upload_bytes(data, owner)[0]
    elif not str(image).startswith("s3://"):
        raise UsageError("image_source_forbidden: the JSON form takes s3:// URIs; upload bytes as multipart")
    else:
        problem = _source_problem(client.settings, str(image), owner)
        if problem:
            raise UsageError(problem)
    return client.build_job(dataclasses.replace(submission, image=image))


def _source_problem(settings: Settings, uri: str, owner: str | None) -> str | None:
    """Why a request may not name the image `uri`: a place the workers may not read (refused here, not
    by the worker after the job is queued), or, for a key, a place that is not its own nor allowed
    for it (shared/tenants.py)."""
    try:
        bucket, key = names.parse_s3_uri(uri)
    except ValueError as exc:
        return f"image_source_forbidden: {exc}"
    prefix = settings.image_sources.get(bucket)
    if prefix is None or not names.key_allowed(key, prefix):
        where = f"s3://{bucket}/ (under {prefix or 'any prefix'})"
        return f"image_source_forbidden: {where} is not where the workers may read images"
    if owner is None:
        return None
    return tenants.source_problem(uri, owner, settings.s3_bucket, settings.s3_prefix, settings.key_sources)


def _enqueue(client: Client, fields: dict[str, Any], data: bytes | None, namespace: str | None) -> Response:
    job = prepare_job(client, fields, data)
    job_id = tenants.client_id(namespace, job.job_id)  # as the caller names it
    body: dict[str, Any] = {"job_id": job_id, "status_url": f"/v1/jobs/{job_id}"}
    replicated: bool | None = True if client.settings.redis_wait_replicas else None
    try:
        created = client.enqueue(job, block=False)
    except NotReplicated as exc:  # queued on the master: accepted, not yet durable (docs/contract.md)
        created, replicated = not exc.duplicate, False
    if replicated is not None:  # MRC_REDIS_WAIT_REPLICAS is on: every answer says
        body["replicated"] = replicated
    headers = None if replicated is not False else {"Mrc-Replicated": "false"}
    return JSONResponse(body, status_code=202 if created else 200, headers=headers)


def app_from_env() -> FastAPI:
    """The app for uvicorn's worker processes (`--factory`): each spawned process reads its settings
    and sets up its own logging here (a spawned process starts with none of its parent's)."""
    settings = Settings()
    logs.configure(settings.log_level, fmt=settings.log_format)
    return create_app(settings)


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
    log.info("MRC_HTTP_LISTENING", port=settings.api_port, what="mrc-api", workers=settings.api_workers)
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
