"""`POST /v1/chat/completions`: a chat request becomes an interactive job through the one intake
(producer/intake/: the same checks and upload as `POST /v1/jobs`) and the same queue (the same claim),
then the request waits for its result and answers a `chat.completion` (producer/openai/completion.py).

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
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from producer.http.front import caller_of
from producer.http.guard import Caller
from producer.http.state import ApiState
from producer.intake.checks import IMAGE_CODES
from producer.intake.request import Submission
from producer.openai import chat_stream
from producer.openai.batch_book import REMAP_SCRIPT
from producer.openai.chat_request import ChatJob, idempotency_key, parse_chat, take_json
from producer.openai.completion import completion
from producer.openai.errors import OpenAIError, from_usage_error
from producer.openai.models import Models
from shared import logs, names, tenants
from shared.errors import NotReplicated, UsageError
from shared.jobs import Job
from shared.settings import Settings

_RETRY_LOOK_S = 0.5  # after an outage (or no record yet), the wait looks again this often
# A chat body this small holds no image of its own (text, an s3:// URI or an image URL): it gives its
# body slot (MRC_API_MAX_BODIES, the bound on request bodies in memory) back before it is read into a job.
# A larger one gives it back before its image URL is fetched, its bytes dropped first (review, helper-83:
# a body padded past this held its slot for the whole fetch, and two keys held every slot).
_SMALL_BODY = 256 * 1024


def idempotent_job_id(caller: Caller, key: str | None) -> str | None:
    """The job id an Idempotency-Key stands for (per caller's key): a retry names the same job."""
    if key is None:
        return None
    return "chat-" + hashlib.sha256(f"{caller.owner}\n{key}".encode()).hexdigest()[:32]


class Chat:
    def __init__(self, state: ApiState, models: Models, redis: Callable[[], Any]) -> None:
        self.state, self.models, self._redis = state, models, redis
        self.settings: Settings = state.settings
        self.stream = chat_stream.ChatStream(state)

    async def create(self, request: Request) -> Response:
        caller = caller_of(request.scope)
        if "interactive" not in caller.lanes:
            raise OpenAIError(403, "this key may not use the interactive lane", None, "forbidden")
        key = idempotency_key(request.headers)
        raw = bytearray()
        async for piece in request.stream():  # not request.body(): nothing keeps it past the enqueue
            raw += piece
        done_with_body = request.scope["state"]["done_with_body"]
        if len(raw) <= _SMALL_BODY:  # text and URLs: an image URL's fetch holds no body slot of others'
            done_with_body()
        loop = asyncio.get_running_loop()

        def let_go() -> None:  # from the request's thread, before a fetch: the slot is the loop's
            loop.call_soon_threadsafe(done_with_body)

        named, job, chat = await run_in_threadpool(self._take, raw, key, caller, let_go)
        del raw
        request.scope["state"]["done_with_body"]()  # the wait holds neither the body nor the image
        # From here on the job is queued: whatever happens, the answer names it (never a 503, which
        # says nothing was enqueued).
        job_id = tenants.client_id(caller.namespace, job.job_id)
        headers = {"x-mrc-job-id": job_id}
        if chat.stream:  # keep-alive comments reset a client's read timeout: the whole wait is ours
            return await self._streamed(
                job, job_id, chat, headers, request.headers.get("x-stainless-read-timeout")
            )
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
        deadline, told, queued_now = time.monotonic() + wait_s, False, True
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:  # one look can block for a socket timeout (a hung Redis or S3): bounded by the deadline
                found = await asyncio.wait_for(
                    self.state.waits.result(job_id, left, self.state.queue.result, queued_now),
                    left + 0.05,
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
            queued_now = False  # looked again after an outage or a lost record: S3 at once
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # "unknown" (its record lost, or not readable yet) or an outage: the job was pushed; look
            # again until the wait is over.
            await asyncio.sleep(min(_RETRY_LOOK_S, left))

    async def _streamed(
        self, job: Job, shown_id: str, chat: ChatJob, headers: dict[str, str], read_timeout: str | None
    ) -> Response:
        try:  # off the event loop (a look at the workers' heartbeats); the job is queued: never a 5xx now
            expected = await run_in_threadpool(self.models.answering, chat.model)
        except Exception:
            expected = chat.model
        streamed = chat_stream.streamed_job(
            job.job_id, shown_id, expected, job.submitted_at, chat.include_usage, self.settings.openai_wait_s,
            read_timeout,
        )  # fmt: skip
        return StreamingResponse(
            self.stream.events(streamed),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    def _take(
        self, raw: bytearray, key: str | None, caller: Caller, let_go: Callable[[], None]
    ) -> tuple[bool, Job, ChatJob]:
        """The request read, checked and enqueued (off the event loop): (whether a retry of it lands on
        the same job, its job, the request read). Before an image URL is fetched the body's bytes are
        dropped and its slot given back (`let_go`): what the request holds then is its checked text."""
        digest = hashlib.sha256(raw).hexdigest()[:32]  # the body as it came: no copy of it

        def before_fetch() -> None:
            raw.clear()
            let_go()

        fetched: list[Callable[[], None]] = []  # a fetch's slot, held until its image is uploaded
        try:
            chat = parse_chat(
                take_json(raw), self.settings, owner=caller.owner, check_model=self.models.check,
                before_fetch=before_fetch, fetch_held=fetched,
            )  # fmt: skip
            job_id = chat.job_id or idempotent_job_id(caller, key)
            minted = job_id is None  # drawn here or by the intake: no earlier job's (S3 not asked)
            if job_id is None and self.settings.openai_retry_window_s > 0:
                job_id, minted = self._retry_job_id(caller, digest)
            job = self._enqueue(chat, job_id, caller, minted)
            # Uploaded: the answer's wait (a minute, under no turn) holds no copy of the image (it held
            # the decoded bytes of every waiting request's data: URL).
            return job_id is not None, job, dataclasses.replace(chat, data=None)
        finally:
            for release in fetched:
                release()

    def _retry_job_id(self, caller: Caller, digest: str) -> tuple[str, bool]:
        """The job this exact request (same key, same bytes: `digest`) names within
        MRC_OPENAI_RETRY_WINDOW_S: an SDK's retry after a 5xx or a lost answer waits for the first
        attempt's job instead of queueing a second. A job that failed is not reused: sending the
        request again runs it again. With it, whether this call drew the id (no earlier job's)."""
        mapping = names.idempotency_key("chat-retry", caller.owner, digest)
        fresh = f"chat-{uuid.uuid4().hex}"
        ttl = max(1, int(self.settings.openai_retry_window_s))
        client = self._redis()
        if client.set(mapping, fresh, nx=True, ex=ttl):
            return fresh, True
        earlier = str(client.get(mapping) or fresh)
        stored = tenants.job_id(caller.key_id, earlier)
        if self.state.queue.records.get(stored).get("state") != "failed":
            return earlier, earlier == fresh
        # It failed: a new job, once however many copies of the request come at the same moment.
        # Replace only what this request saw: concurrent retries of a failed job agree on one new job.
        chosen = str(client.eval(REMAP_SCRIPT, 1, mapping, earlier, fresh, ttl))
        return chosen, chosen == fresh

    def _enqueue(self, chat: ChatJob, job_id: str | None, caller: Caller, minted: bool) -> Job:
        sub = Submission(
            image=chat.image or "",
            prompt=chat.prompt,
            job_id=job_id,
            max_new_tokens=chat.max_new_tokens,
            ticket_id=chat.ticket_id,
            response_format=chat.response_format,
            api_key=caller.key_id,
            stream=chat.stream,
            truncate=chat.truncate,
        )
        try:
            job = self.state.intake.job(sub, chat.data, from_network=True)
            # Queued on the master but not replicated yet: the wait for its answer goes on (the answer,
            # once in S3, is durable whatever the replicas do; the producer logs MRC_NOT_REPLICATED).
            with contextlib.suppress(NotReplicated):
                self.state.queue.enqueue(job, block=False, minted=minted)
        except UsageError as exc:
            message = tenants.in_words_of(caller.namespace, exc.message)
            param = chat.image_param if message.partition(":")[0] in IMAGE_CODES else None
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
