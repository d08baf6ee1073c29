"""`POST /v1/chat/completions` and `GET /v1/models`: a chat request becomes an interactive job through
the same intake as `POST /v1/jobs` (producer/api.py `prepare_job`: the same checks, upload and
claim), then the request waits for its result and answers a `chat.completion`.

The wait is bounded (`MRC_OPENAI_WAIT_S`, and less when the client says it gives up sooner: the
SDK's `x-stainless-read-timeout`); past it the answer is 504 `answer_timeout` naming the job id, and
the job goes on (`GET /v1/jobs/ID/result` has it later). Once the job is queued the answer always
names it: Redis or S3 going away during the wait is waited out, never a 503 (a 503 means nothing was
enqueued). Retries enqueue nothing twice: a request names its job by an `Idempotency-Key` header (the
job id is derived from it and the caller's key) or `metadata.job_id`, and without either, the same
bytes from the same key within MRC_OPENAI_RETRY_WINDOW_S are the same job (an SDK's retry); a retry
waits for the same job again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from producer.api import prepare_job
from producer.api_front import caller_of
from producer.api_guard import Caller
from producer.openai_errors import OpenAIError, from_usage_error, result_status
from producer.openai_requests import ChatJob, parse_chat, read_json
from shared import logs, names, tenants
from shared.errors import NotReplicated, UsageError
from shared.jobs import Job, parse_rfc3339
from shared.settings import Settings

_MODELS_CACHE_S = 5.0
_RETRY_LOOK_S = 0.5  # after an outage (or no record yet), the wait looks again this often
# KEYS[1] a retry-window mapping; ARGV: the job it named, its replacement, ttl. Replace only what the
# caller saw (concurrent retries of a failed job agree on one new job); the job it names now.
_REPLACE_IF = """
local now = redis.call('GET', KEYS[1])
if now == false or now == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
return now
"""
_IMAGE_CODES = ("image_source_forbidden:", "unsupported_image_format:", "image_too_large:")


def chat_completion(result: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    """A result object as OpenAI's `chat.completion` (id = the job id)."""
    usage = result.get("usage") or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    model = result.get("model") or {}
    return {
        "id": result["job_id"],
        "object": "chat.completion",
        "created": epoch(result.get("submitted_at")),
        "model": model.get("id"),
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": result.get("text") or "",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": prompt if result.get("cache_hit") else 0,  # a reused answer: all of it
                "image_tokens": int(usage.get("image_tokens", 0)),
            },
        },
        "system_fingerprint": f"{model.get('id')}/{model.get('quantization')}",
        "service_tier": "default",
    }


def completion(result: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What the endpoint answers for a job's result: 200 and a chat.completion (a constrained answer
    cut at max_tokens too, `finish_reason: length`, as OpenAI answers one), else the error its code
    maps to (producer/openai_errors.py), naming the job."""
    error = result.get("error") or {}
    if result.get("status") == "succeeded":
        return 200, chat_completion(result, str(result.get("finish_reason") or "stop"))
    if error.get("code") == "answer_incomplete":
        return 200, chat_completion(result, "length")
    code = str(error.get("code") or "internal_error")
    job_id = str(result.get("job_id"))
    message = f"job {job_id} failed ({code}): {error.get('message', '')}"
    return result_status(code), OpenAIError(
        result_status(code), message, None, code, extra={"job_id": job_id}
    ).body()


def epoch(stamp: object) -> int:
    try:
        return int(parse_rfc3339(str(stamp)).timestamp())
    except ValueError:
        return int(time.time())


class Models:
    """The models the workers serve, from their heartbeats (read at most every 5 s)."""

    def __init__(self, settings: Settings, redis: Callable[[], Any]) -> None:
        self.settings, self._redis = settings, redis
        self._lock = threading.Lock()
        self._cached: tuple[float, list[dict[str, Any]]] = (-1e18, [])

    def served(self) -> list[dict[str, Any]]:
        with self._lock:
            at, models = self._cached
            if time.monotonic() - at < _MODELS_CACHE_S:
                return models
        client = self._redis()
        found: dict[str, dict[str, Any]] = {}
        for key in sorted(client.scan_iter(match=names.worker_pattern(), count=100)):
            raw = client.get(key)
            beat = json.loads(raw) if raw else {}
            model = beat.get("model")
            if not model:
                continue
            entry = found.setdefault(
                str(model),
                {
                    "id": str(model),
                    "object": "model",
                    "created": 0,
                    "owned_by": "mrc",
                    "workers": 0,
                    "quantization": None,
                },
            )
            entry["workers"] += 1
            entry["quantization"] = beat.get("quantization")
            entry["created"] = max(entry["created"], epoch(beat.get("seen_at")))
        models = sorted(found.values(), key=lambda m: m["id"])
        with self._lock:
            self._cached = (time.monotonic(), models)
        return models

    def listed(self) -> list[dict[str, Any]]:
        """`GET /v1/models`: the models the workers serve, and the deployment's MRC_MODEL under that
        name too when the workers report it by another (a folder, say) or none is up yet: every name
        a request may give `model` is listed, and answers `GET /v1/models/{model}`."""
        served = self.served()
        if any(entry["id"] == self.settings.model for entry in served):
            return served
        workers = sum(entry["workers"] for entry in served)
        alias = {
            "id": self.settings.model,
            "object": "model",
            "created": max((entry["created"] for entry in served), default=0),
            "owned_by": "mrc",
            "workers": workers,
            "quantization": served[0]["quantization"] if len(served) == 1 else None,
        }
        return sorted([*served, alias], key=lambda entry: str(entry["id"]))

    def known(self) -> frozenset[str]:
        """What a request may name: a model a worker serves, or the deployment's MRC_MODEL (its jobs
        wait in the queue while no worker is up)."""
        return frozenset(entry["id"] for entry in self.listed())

    def check(self, model: str) -> None:
        if model not in self.known():
            raise OpenAIError(
                404,
                f"The model `{model[:100]}` does not exist (GET /v1/models lists them)",
                "model",
                "model_not_found",
            )


def idempotent_job_id(caller: Caller, key: str | None) -> str | None:
    """The job id an Idempotency-Key stands for (per caller's key): a retry names the same job."""
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable() or not key.isascii():
        raise OpenAIError(
            400, "Idempotency-Key: 1-255 printable ASCII characters", "Idempotency-Key", "invalid_value"
        )
    return "chat-" + hashlib.sha256(f"{caller.owner}\n{key}".encode()).hexdigest()[:32]


class Chat:
    def __init__(self, intake: Any, models: Models, redis: Callable[[], Any]) -> None:
        self.intake, self.models, self._redis = intake, models, redis
        self.settings: Settings = intake.settings

    async def create(self, request: Request) -> Response:
        caller = caller_of(request.scope)
        if "interactive" not in caller.lanes:
            raise OpenAIError(403, "this key may not use the interactive lane", None, "forbidden")
        raw = bytearray()
        async for piece in request.stream():  # not request.body(): nothing keeps it past the enqueue
            raw += piece
        key = request.headers.get("idempotency-key")
        named, job = await run_in_threadpool(self._take, raw, key, caller)
        del raw
        request.scope["state"]["done_with_body"]()  # the wait holds neither the body nor the image
        # From here on the job is queued: whatever happens, the answer names it (never a 503, which
        # says nothing was enqueued).
        job_id = tenants.client_id(caller.namespace, job.job_id)
        headers = {"x-mrc-job-id": job_id}
        wait = self._wait_s(request.headers.get("x-stainless-read-timeout"))
        found = await self._answer(job.job_id, wait)
        if found is not None:
            status, body = completion({**found, "job_id": job_id})
            if status >= 400:
                headers["x-should-retry"] = "false"  # the job ended: a retry gets the same answer
            return JSONResponse(body, status_code=status, headers=headers)
        again = "; the same request again waits for it" if named else ""
        if not named:
            headers["x-should-retry"] = "false"  # a retry would enqueue a second job
        raise OpenAIError(
            504,
            f"no answer within {wait:g} s; job {job_id} goes on: GET /v1/jobs/{job_id}/result "
            f"has it once it ends{again}",
            None,
            "answer_timeout",
            extra={"job_id": job_id},
            headers=headers,
        )

    async def _answer(self, job_id: str, wait_s: float) -> dict[str, Any] | None:
        """The job's result within `wait_s`, or None. Whatever happens to Redis or S3 meanwhile (gone,
        hung, refusing) is waited out to the deadline, never past it: the job is queued, and its
        result will be in S3 whatever happens to this wait, so the answer names the job."""
        deadline, told = time.monotonic() + wait_s, False
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:  # one look can block for a socket timeout (a hung Redis or S3): bounded by the deadline
                found = await asyncio.wait_for(
                    self.intake.waits.result(job_id, left, self.intake.client.result), left + 0.05
                )
            except TimeoutError:
                return None
            except Exception as exc:  # after the push nothing may answer without the job's id
                if not told:  # once per request: an outage is seen again at every look
                    told = True
                    logs.get_logger().warning(
                        "MRC_ANSWER_WAIT_INTERRUPTED", job_id=job_id, error=repr(exc)[:200]
                    )
                found = "unavailable"
            if isinstance(found, dict):
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # "unknown" (its record lost, or not readable yet) or an outage: the job was pushed; look
            # again until the wait is over.
            await asyncio.sleep(min(_RETRY_LOOK_S, left))

    def _take(self, raw: bytearray, key: str | None, caller: Caller) -> tuple[bool, Job]:
        """The request read, checked and enqueued (off the event loop): (whether a retry of it lands on
        the same job, its job)."""
        chat = parse_chat(read_json(raw), self.settings)
        self.models.check(chat.model)
        job_id = chat.job_id or idempotent_job_id(caller, key)
        if job_id is None and self.settings.openai_retry_window_s > 0:
            job_id = self._retry_job_id(caller, raw)
        return job_id is not None, self._enqueue(chat, job_id, caller)

    def _retry_job_id(self, caller: Caller, raw: bytearray) -> str:
        """The job this exact request (same key, same bytes) names within MRC_OPENAI_RETRY_WINDOW_S:
        an SDK's retry after a 5xx or a lost answer waits for the first attempt's job instead of
        queueing a second. A job that failed is not reused: sending the request again runs it again."""
        digest = hashlib.sha256(raw).hexdigest()[:32]  # the body as it came: no copy of it
        mapping = names.idempotency_key("chat-retry", caller.owner, digest)
        fresh = f"chat-{uuid.uuid4().hex}"
        ttl = max(1, int(self.settings.openai_retry_window_s))
        client = self._redis()
        if client.set(mapping, fresh, nx=True, ex=ttl):
            return fresh
        earlier = str(client.get(mapping) or fresh)
        stored = tenants.job_id(caller.key_id, earlier)
        if self.intake.client.records.get(stored).get("state") != "failed":
            return earlier
        # It failed: a new job, once however many copies of the request come at the same moment.
        return str(client.eval(_REPLACE_IF, 1, mapping, earlier, fresh, ttl))

    def _enqueue(self, chat: ChatJob, job_id: str | None, caller: Caller) -> Job:
        fields = {
            "image": chat.image or "",
            "prompt": chat.prompt,
            "job_id": job_id,
            "lane": "interactive",
            "max_new_tokens": chat.max_new_tokens,
            "ticket_id": chat.ticket_id,
            "deadline": None,
            "response_format": chat.response_format,
            "api_key": caller.key_id,
        }
        try:
            job = prepare_job(self.intake.client, fields, chat.data)
            # Queued on the master but not replicated yet: the wait for its answer goes on (the answer,
            # once in S3, is durable whatever the replicas do; the producer logs MRC_NOT_REPLICATED).
            with contextlib.suppress(NotReplicated):
                self.intake.client.enqueue(job, block=False)
        except UsageError as exc:
            message = tenants.in_words_of(caller.namespace, exc.message)
            param = chat.image_param if message.startswith(_IMAGE_CODES) else None
            raise from_usage_error(message, param) from None
        return job

    def _wait_s(self, client_timeout: str | None) -> float:
        """MRC_OPENAI_WAIT_S, or less: answer (with the job id) before the client gives up."""
        wait = self.settings.openai_wait_s
        try:
            told = float(client_timeout) if client_timeout else 0.0
        except ValueError:
            told = 0.0
        if told == told and told > 2:  # not NaN; keep 2 s for the answer to travel
            wait = min(wait, told - 2)
        return wait

    async def models_list(self, request: Request) -> Response:
        models = await run_in_threadpool(self.models.listed)
        return JSONResponse({"object": "list", "data": models})

    async def model(self, model: str, request: Request) -> Response:
        """Every name a request may give `model` (what `Models.check` accepts) answers here."""
        models = await run_in_threadpool(self.models.listed)
        for entry in models:
            if entry["id"] == model:
                return JSONResponse(entry)
        raise OpenAIError(404, f"The model `{model[:100]}` does not exist", "model", "model_not_found")
