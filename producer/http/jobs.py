"""mrc-api's own routes: POST /v1/jobs (JSON with an s3:// image, or multipart with the image bytes)
-> 202 {job_id, status_url}; GET /v1/jobs/{id}, /v1/jobs/{id}/result[?wait=S], /v1/events?after=ID
[&wait=S] (completion events from capped Redis streams), /healthz, /readyz, /metrics. Every error is
JSON `{"error": {"code", "message"}}` with the contract's codes. A request's fields become a job
through the one intake (producer/intake/); blocking work (Redis, S3) runs in the thread pool or on
the long-polls' own threads (producer/http/waits.py), never on the event loop.

Read scope: keys are tenants (shared/tenants.py). A key names, reads, waits on and follows only its
own jobs: ids in its own namespace, events from its own stream; another key's job answers 404, as an
unknown one does. A key with the `all-tenants` scope (ops tools), and every caller of an API without
keys, reads any job by its stored id.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer.http.forms import JobRequest, error, job_fields, multipart_schema
from producer.http.front import RETRY_AFTER_S, caller_of
from producer.http.guard import Caller, Keys
from producer.http.state import ApiState
from producer.intake.checks import IMAGE_CODES
from producer.intake.request import Submission
from shared import names, redis_target, tenants
from shared.errors import NotReplicated, QueueFull, UsageError
from shared.jobs import JOB_ID_RE
from shared.records import valid_event_id

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


class JobRoutes:
    def __init__(self, state: ApiState) -> None:
        self.state = state
        self.keys = Keys(state.settings.api_keys)
        self._probe: Any = None  # one S3 connection for /readyz (boto3 clients are made once, not per probe)

    def mount(self, app: FastAPI) -> None:
        body = {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": JobRequest.model_json_schema()},
                    "multipart/form-data": {"schema": multipart_schema()},
                },
            }
        }
        app.add_api_route("/v1/jobs", self.submit, methods=["POST"], status_code=202, openapi_extra=body)
        app.add_api_route("/v1/jobs/{job_id}", self.status, methods=["GET"])
        app.add_api_route("/v1/jobs/{job_id}/result", self.result, methods=["GET"])
        app.add_api_route("/v1/events", self.events, methods=["GET"])
        for path, handler in (
            ("/healthz", self.healthz),
            ("/readyz", self.readyz),
            ("/metrics", self.metrics),
        ):
            app.add_api_route(path, handler, methods=["GET"])

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
            return await run_in_threadpool(self._enqueue, fields, data, caller.namespace)
        except QueueFull as exc:
            return error(503, exc.code, exc.message, {"Retry-After": "30"})
        except UsageError as exc:
            message = tenants.in_words_of(caller.namespace, exc.message)
            conflict = "already used by a different job" in message
            prefix = message.split(":", 1)[0]
            code = prefix if prefix in IMAGE_CODES else "invalid_job"
            return error(409 if conflict else 422, code, message)

    async def status(self, job_id: str, request: Request) -> Response:
        stored = _stored_id(caller_of(request.scope), job_id)
        if stored is None:
            return _not_found(job_id)
        found = await run_in_threadpool(self.state.queue.status, stored)
        if found["state"] == "unknown":
            return _not_found(job_id)
        return JSONResponse({**found, "job_id": job_id})

    async def result(self, job_id: str, request: Request, wait: float = _WAIT) -> Response:
        stored = _stored_id(caller_of(request.scope), job_id)
        if stored is None:
            return _not_found(job_id)
        bounded = max(0.0, min(wait, self.state.settings.api_result_wait_max_s))
        found = await self.state.waits.result(stored, bounded, self.state.queue.result)
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
        block = max(0.0, min(wait, self.state.settings.api_result_wait_max_s))
        # A key reads its own stream (its jobs' events only); ops and an API without keys, the fleet's.
        found = await self.state.waits.events(after, block, owner=caller.namespace, who=caller.key_id)
        last = found[-1]["id"] if found else after
        if caller.namespace is not None:
            found = [{**e, "job_id": tenants.client_id(caller.namespace, e.get("job_id", ""))} for e in found]
        return JSONResponse({"events": found, "last_id": last})

    async def healthz(self) -> Response:
        return JSONResponse({"status": "alive"})

    async def readyz(self) -> Response:
        """Redis and S3 reachable, each within MRC_CONNECT_TIMEOUT_S; any failure is a 503, never a 500."""
        try:
            await self.state.waits.ping()
        except Exception as exc:
            return _not_ready(f"Redis: {exc!r}"[:300])
        try:
            await run_in_threadpool(self._probe_s3)
        except Exception as exc:
            return _not_ready(f"S3: {exc!r}"[:300])
        return JSONResponse({"status": "ready", **redis_target.status(self.state.settings)})

    def _probe_s3(self) -> None:
        if self._probe is None:
            from shared.stores.s3 import S3Connection

            self._probe = S3Connection(self.state.settings, attempts=1)
        self._probe.probe(self.state.settings.s3_bucket)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text. /metrics needs no key, so every key's usage totals (mrc_usage_*) come only
        to a scrape whose key may see every tenant's (`ops` or `all-tenants`), or when keys are off:
        a tenant never reads another's volume (review)."""
        registries = [self.state.scrape]
        caller = self.keys.caller(request.headers.get("authorization"), "metrics")
        if caller is not None and (caller.ops or caller.all_tenants):
            registries.append(self.state.usage_registry)
        # Off the event loop: the usage totals are read from Redis at scrape time.
        text = await run_in_threadpool(lambda: b"".join(generate_latest(r) for r in registries))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    def _enqueue(self, fields: dict[str, Any], data: bytes | None, namespace: str | None) -> Response:
        """The request's job through the intake (its checks, its upload), then queued: 202, or 200
        for the same job again; UsageError for a request the intake refuses."""
        sub = Submission(
            image=fields["image"],
            prompt=fields["prompt"],
            job_id=fields["job_id"],
            lane=fields["lane"],
            max_new_tokens=fields["max_new_tokens"],
            ticket_id=fields["ticket_id"],
            deadline=fields["deadline"],
            response_format=fields["response_format"],
            api_key=fields.get("api_key"),
        )
        job = self.state.intake.job(sub, data, from_network=True)
        job_id = tenants.client_id(namespace, job.job_id)  # as the caller names it
        body: dict[str, Any] = {"job_id": job_id, "status_url": f"/v1/jobs/{job_id}"}
        replicated: bool | None = True if self.state.settings.redis_wait_replicas else None
        try:
            # an id the intake drew (the request named none) is no earlier job's: S3 is not asked
            created = self.state.queue.enqueue(job, block=False, minted=sub.job_id is None)
        except NotReplicated as exc:  # queued on the master: accepted, not yet durable (docs/contract.md)
            created, replicated = not exc.duplicate, False
        if replicated is not None:  # MRC_REDIS_WAIT_REPLICAS is on: every answer says
            body["replicated"] = replicated
        headers = None if replicated is not False else {"Mrc-Replicated": "false"}
        return JSONResponse(body, status_code=202 if created else 200, headers=headers)


def _not_ready(reason: str) -> Response:
    """503 as every route answers one (the error object and Retry-After: review), with the probe's own
    `status` and `reason` beside it."""
    body = {
        "status": "not_ready",
        "reason": reason,
        "error": {"code": "service_unavailable", "message": reason},
    }
    return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
