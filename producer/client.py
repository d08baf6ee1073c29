"""The producer API: submit / submit_many / wait / status / result. Usable from Python and by the CLI."""

from __future__ import annotations

import hashlib
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery

from producer import resubmission
from shared import logs, names, prompts, tenants
from shared import response_format as response_formats
from shared.celery_app import make_celery, send_job
from shared.errors import NotReplicated, PushUnconfirmed, QueueFull, StoreUnavailable, UsageError
from shared.jobs import Job, Lane, limit_problem, local_image_problem
from shared.records import CLAIM_TTL_S, TERMINAL, JobRecords, RedisJobRecords, connect, unstored_result
from shared.response_format import ChoiceFormat, JsonSchemaFormat
from shared.settings import Settings
from shared.sniff import sniff_format
from shared.stores import ImageSource, ResultStore, open_stores

_CLAIM_TRIES = 3
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_CONTENT_TYPES = {"jpg": "image/jpeg", "png": "image/png", "webp": "image/webp", "gif": "image/gif"}


@dataclass(frozen=True)
class Submission:
    """What one job asks for, before it has an image URI."""

    image: str | Path
    prompt: str
    job_id: str | None = None
    lane: Lane = "interactive"
    max_new_tokens: int | None = None
    ticket_id: str | None = None
    deadline: str | None = None
    # Structured answers: {"type": "json_schema", "schema": {...}} or {"type": "choice", "choices": [...]}
    response_format: Mapping[str, Any] | JsonSchemaFormat | ChoiceFormat | None = None
    # The mrc-api key's id (Job.api_key): the job lives in that key's namespace (its id, its upload;
    # shared/tenants.py) and its usage counts to it. None: `mrc submit`, Python callers, no keys.
    api_key: str | None = None


class Client:
    def __init__(
        self,
        settings: Settings,
        *,
        images: ImageSource | None = None,
        results: ResultStore | None = None,
        records: JobRecords | None = None,
        celery: Celery | None = None,
    ) -> None:
        self.settings = settings
        if images is None or results is None:
            images, results = open_stores(settings)
        self.images: ImageSource = images
        self.results: ResultStore = results
        self.records: JobRecords = records or RedisJobRecords(
            connect(settings, settings.connect_timeout_s, retries=3)
        )
        self.celery = celery or make_celery(settings)
        self.log = logs.get_logger()

    def close(self) -> None:
        """Let go of the S3, Redis and broker connections this client opened."""
        for part in (self.images, self.results, self.records):
            connection = getattr(part, "connection", None) or getattr(part, "_redis", None)
            if connection is not None:
                connection.close()
        self.celery.close()

    # ---- validation ----
    def validate(self, sub: Submission) -> None:
        """Every check that needs neither Redis nor S3: a bad submission is refused before either."""
        fmt = self.response_format(sub)
        problem = limit_problem(self.settings, sub.prompt, sub.max_new_tokens, sub.job_id, fmt)
        if problem:
            raise UsageError(problem)
        if sub.lane not in names.LANES:
            raise UsageError(f"lane must be one of {', '.join(names.LANES)}")
        text = str(sub.image)
        if text.startswith("s3://"):
            try:
                names.parse_s3_uri(text)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        elif _URL_RE.match(text):
            raise UsageError("image_source_forbidden: only local files and s3:// URIs are accepted")
        else:
            self._check_local_image(Path(text))

    def response_format(self, sub: Submission) -> JsonSchemaFormat | ChoiceFormat | None:
        try:
            return response_formats.parse(sub.response_format, self.settings.max_response_format_bytes)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def _check_local_image(self, path: Path) -> None:
        problem = local_image_problem(path, self.settings.max_image_bytes)
        if problem:
            raise UsageError(problem)

    # ---- images ----
    def upload_image(self, path: Path, owner: str | None = None) -> tuple[str, str]:
        """Upload a local image to inputs/<sha256>.<ext> (once per content); return (uri, sha256)."""
        self._check_local_image(path)
        return self.upload_bytes(path.read_bytes(), owner)

    def upload_bytes(self, data: bytes, owner: str | None = None) -> tuple[str, str]:
        """Upload image bytes to inputs/<sha256>.<ext> (once per content; an API key's uploads to
        inputs/<owner>/<sha256>.<ext>, which no other key may name); return (uri, sha256)."""
        if len(data) > self.settings.max_image_bytes:
            raise UsageError(f"image is {len(data)} bytes; the limit is {self.settings.max_image_bytes}")
        digest = hashlib.sha256(data).hexdigest()
        ext = sniff_format(data) or "bin"
        key = names.input_key(self.settings.s3_prefix, digest, ext, owner)
        uri = self.images.put_input(data, key, _CONTENT_TYPES.get(ext, "application/octet-stream"))
        return uri, digest

    def _resolve_image(self, image: str | Path, owner: str | None) -> tuple[str, str | None]:
        """The job's image URI (a local file is uploaded first); `validate` has checked the reference."""
        text = str(image)
        return (text, None) if text.startswith("s3://") else self.upload_image(Path(text), owner)

    # ---- submit ----
    def build_job(self, sub: Submission) -> Job:
        self.validate(sub)
        max_new = self.settings.max_new_tokens_default if sub.max_new_tokens is None else sub.max_new_tokens
        uri, digest = self._resolve_image(sub.image, sub.api_key)
        fields: dict[str, Any] = {
            "job_id": tenants.job_id(sub.api_key, sub.job_id or uuid.uuid4().hex),
            "image_uri": uri,
            "image_sha256": digest,
            "prompt": prompts.neutralise(sub.prompt),
            "lane": sub.lane,
            "max_new_tokens": max_new,
            "ticket_id": sub.ticket_id,
            "deadline": sub.deadline,
            "response_format": self.response_format(sub),
            "api_key": sub.api_key,
        }
        try:
            return Job.from_message(fields)
        except Exception as exc:
            raise UsageError(str(exc)) from None

    def lane_depth(self, lane: str) -> int:
        return self.records.list_lengths(names.queue_keys(lane))

    def wait_for_room(self, lane: str, block: bool = True, timeout: float | None = None) -> None:
        """Backpressure on the backlog lane: wait while it is at its depth limit, or raise QueueFull."""
        if lane != "backlog":
            return  # interactive tickets are never held back by the backlog
        limit = self.settings.backlog_max_depth
        deadline = None if timeout is None else time.monotonic() + timeout
        logged = False
        while (depth := self.lane_depth(lane)) >= limit:
            if not block or (deadline is not None and time.monotonic() >= deadline):
                raise QueueFull(depth, limit)
            if not logged:
                self.log.info("MRC_BACKPRESSURE", lane=lane, depth=depth, limit=limit)
                logged = True
            time.sleep(0.5)

    def enqueue(self, job: Job, block: bool = True, timeout: float | None = None) -> bool:
        """Send the job unless its id was already submitted; True when this call enqueued it.

        The same job under a used id is a duplicate (False) once the other submission is published and
        its message is in Redis (pushed again where it is not: producer/resubmission.py); a
        different job under a used id is refused (UsageError). An interruption at any point (Ctrl-C
        included) undoes the claim. The message is sent only while the claim is still this call's:
        a claim that expired during the look for an earlier result is taken again, never sent on."""
        self.wait_for_room(job.lane, block, timeout)
        for _ in range(_CLAIM_TRIES):
            token = self._claim(job)
            if token is None:  # the same job, once its message is known to be there (or pushed again)
                return resubmission.answer(job, self.records, self.settings, self._send, self.log)
            sent = self._send_claimed(job, token)
            if sent is not None:
                return sent
            self.log.warning("MRC_CLAIM_LOST", job_id=job.job_id, lane=job.lane)
        raise StoreUnavailable(f"job {job.job_id}: its claim kept expiring before it could be sent")

    def _claim(self, job: Job) -> str | None:
        """This submission's claim token, or None when the id is taken by a published submission.
        Another producer's claim not yet published is waited out (it publishes, or frees the id when
        it fails or expires): answering 'same job' for it could report a job that is never sent."""
        deadline = time.monotonic() + CLAIM_TTL_S + 5
        while True:
            token = self.records.claim(job.job_id, job.lane, job.fingerprint())
            if token is not None:
                return token
            record = self.records.get(job.job_id)
            if record and record.get("published") != "0":
                return None
            if time.monotonic() >= deadline:
                raise StoreUnavailable(f"job {job.job_id}: another submission of it neither ends nor expires")
            time.sleep(0.05)

    def _send_claimed(self, job: Job, token: str) -> bool | None:
        """True: sent and confirmed; False: a duplicate of an earlier result; None: the claim was lost
        before the send (nothing sent)."""
        try:
            checked, existing = self._earlier_result(job.job_id)
            if existing is not None:
                self.records.release(job.job_id, token)
                return self._duplicate(job, existing.get("job_fingerprint"))
            if not self.records.renew(job.job_id, token):  # the look outlasted the claim's lease
                return None
            self._send(job)
        except NotReplicated as exc:  # queued on the master: the claim stands, so a retry is the same job
            self._confirm_sent(job, token, checked)
            exc.job_id = job.job_id
            self.log.warning(
                "MRC_NOT_REPLICATED",
                job_id=job.job_id,
                lane=job.lane,
                replicas=exc.acknowledged,
                wanted=exc.wanted,
            )
            raise
        except Exception as exc:  # a reply lost with its connection: did the push land?
            landed = self._landed(job)
            if landed is False:  # nothing enqueued: the answer (exit 5 / 503) is true
                self.records.release(job.job_id, token)
                raise
            if landed is None:  # unknown: the claim lapses by itself (30 s); a resubmission is safe
                raise self._unconfirmed(job, exc) from exc
            self.log.warning("MRC_PUSH_REPLY_LOST", job_id=job.job_id, lane=job.lane, error=repr(exc)[:200])
            if self.settings.redis_wait_replicas:  # landed, replication not confirmed
                error = NotReplicated(
                    0, self.settings.redis_wait_replicas, self.settings.redis_wait_timeout_ms
                )
                self._confirm_sent(job, token, checked)
                error.job_id = job.job_id
                raise error from exc
        except BaseException:
            self.records.release(job.job_id, token)
            raise
        self._confirm_sent(job, token, checked)
        self.log.info(
            "MRC_ENQUEUED", job_id=job.job_id, lane=job.lane, ticket_id=job.ticket_id, image=job.image_uri
        )
        return True

    def _confirm_sent(self, job: Job, token: str, checked: bool) -> None:
        """The claim becomes the job's record, after the push. Nothing here may say "not enqueued":
        the message is queued. A record that is gone (flushed, a failover lost it) or that Redis could
        not write now is logged; the worker runs the job once anyway (it looks for a result when the
        record says nothing) and writes the record again, and a resubmission finds the push's marker
        (nothing is pushed twice)."""
        try:
            confirmed = self.records.confirm(job.job_id, token, checked)
        except Exception as exc:
            self.log.warning(
                "MRC_CLAIM_LOST", job_id=job.job_id, lane=job.lane, sent=True, error=repr(exc)[:200]
            )
            return
        if not confirmed:
            self.log.warning("MRC_CLAIM_LOST", job_id=job.job_id, lane=job.lane, sent=True)

    def _earlier_result(self, job_id: str) -> tuple[bool, dict[str, Any] | None]:
        """A result stored under this id before (its record expired; results do not). With S3 out of
        reach, or slower than a third of the claim's lease (retries included), the job is still sent,
        unchecked, and its record tells the worker to look before it runs: the work done inside the
        claim stays well below its lease."""
        found: list[tuple[bool, dict[str, Any] | None]] = []
        look = threading.Thread(target=lambda: found.append(self._look(job_id)), daemon=True)
        look.start()
        look.join(CLAIM_TTL_S / 3)
        return found[0] if found else (False, None)

    def _look(self, job_id: str) -> tuple[bool, dict[str, Any] | None]:
        try:  # a HEAD first: the answer is almost always "none"
            return True, self.results.get_result(job_id) if self.results.has_result(job_id) else None
        except StoreUnavailable:
            return False, None

    def _send(self, job: Job, push_id: str | None = None) -> None:
        """A submission's publish is named by its job id (a resubmission pushes nothing twice);
        a deliberate resend (`mrc dlq requeue`) passes its own `push_id`."""
        send_job(self.celery, job.to_message(), job.lane, push_id=push_id or names.job_push_id(job.job_id))

    def _landed(self, job: Job) -> bool | None:
        """After a failed publish: whether its push landed (the marker the push writes with it), or
        None when Redis cannot be asked either."""
        try:
            return self.records.pushed(names.job_push_id(job.job_id))
        except Exception:
            return None

    def _unconfirmed(self, job: Job, exc: Exception) -> PushUnconfirmed:
        self.log.warning("MRC_NOT_REPLICATED", job_id=job.job_id, lane=job.lane, what="push unconfirmed")
        error = PushUnconfirmed(repr(exc))
        error.job_id = job.job_id
        return error

    def _duplicate(self, job: Job, fingerprint: str | None) -> bool:
        resubmission.same_job(job, fingerprint)
        self.log.info("MRC_DUPLICATE", job_id=job.job_id, lane=job.lane)
        return False

    def submit(self, image: str | Path, prompt: str, block: bool = True, **options: Any) -> str:
        job = self.build_job(Submission(image=image, prompt=prompt, **options))
        self.enqueue(job, block=block)
        return job.job_id

    def submit_many(self, submissions: Iterable[Submission]) -> list[str]:
        """Every job enqueued (one not replicated does not stop the rest); NotReplicated at the end
        names those whose replication was not confirmed (`job_ids`) and all the ids (`submitted`)."""
        jobs = [self.build_job(s) for s in submissions]
        unreplicated: list[str] = []
        for job in jobs:
            try:
                self.enqueue(job)
            except NotReplicated:
                unreplicated.append(job.job_id)
        ids = [job.job_id for job in jobs]
        if unreplicated:
            settings = self.settings
            error = NotReplicated(
                0,
                settings.redis_wait_replicas,
                settings.redis_wait_timeout_ms,
                f"{len(unreplicated)} of the jobs",
            )
            error.job_ids, error.submitted = unreplicated, ids
            raise error
        return ids

    # ---- read back ----
    def result(self, job_id: str) -> dict[str, Any] | None:
        return self.results.get_result(job_id)

    def status(self, job_id: str) -> dict[str, Any]:
        record = self.records.get(job_id)
        state = record.get("state")
        uri = self.results.result_uri(job_id)
        if state is None:
            result = self.result(job_id)
            state = str(result["status"]) if result else "unknown"
        status: dict[str, Any] = {
            "job_id": job_id,
            "state": state,
            "result_uri": uri if state in TERMINAL else None,
        }
        # Beyond the contract's three keys: what a person looking at a job wants next.
        for key, name in (
            ("lane", "lane"), ("attempts", "attempts"), ("submitted_at", "submitted_at"),
            ("started_at", "started_at"), ("updated_at", "updated_at"), ("worker", "worker"),
            ("retry_reason", "last_retry_reason"), ("error_code", "error_code"), ("run_id", "run_id"),
            ("cancelled", "cancelled"),
        ):  # fmt: skip
            if record.get(key):
                status[name] = int(record[key]) if key == "attempts" else record[key]
        return status

    def wait(self, job_id: str, timeout: float) -> dict[str, Any]:
        """Block until the job has a result; raise TimeoutError after `timeout` seconds.

        The result object is the truth and the record a hint: S3 is read whenever the record says the
        job ended (or has no record), and at least once a second whatever it says, so a result whose
        record update was lost is still found. A job that ended without a stored result (S3 refused
        it to the end) is reported from its record as failed, instead of a wait that times out."""
        deadline = time.monotonic() + timeout
        next_look = time.monotonic() + 1.0  # the record is read first: S3 only if it says "ended"
        while True:
            record = self.records.get(job_id)
            state = record.get("state")
            if state in TERMINAL or state is None or time.monotonic() >= next_look:
                next_look = time.monotonic() + 1.0
                result = self.result(job_id)
                if result is not None:
                    return result
                if state == "failed" and record.get("error_code"):
                    return unstored_result(job_id, record)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no result for {job_id} after {timeout:g} s")
            time.sleep(self.settings.wait_poll_s)
