"""`Queue`: what sends checked jobs to Redis and reads them back, for every producer surface.

Sending is once per job id: a claim on the id (atomic in Redis) before the publish, the publish named
by the id (pushed once whoever retries it: shared/pushes.py), the claim confirmed after it. A
resubmission of a published job is the same job (producer/queue/resubmission.py); a different job
under a used id is refused. Backpressure holds backlog jobs while the lane is at its depth limit.
Reading back: a job's status from its record, its result from S3 (the truth), and a wait for it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.queue import resubmission
from producer.queue.room_wait import RoomWait
from producer.queue.templates import Sends
from shared import backlog_share, logs, names, redis_target
from shared.celery_app import make_celery
from shared.errors import NotReplicated, PushUnconfirmed, ServiceUnreachable, StoreUnavailable
from shared.jobs import Job
from shared.records import (
    CLAIM_TTL_S,
    TERMINAL,
    JobRecords,
    RedisJobRecords,
    answer_timeout_s,
    connect,
    unstored_result,
)
from shared.settings import Settings
from shared.stores import ImageSource, ResultStore, open_stores

_CLAIM_TRIES = 3
_LAST_TICK_READ_S = 0.01  # within a wait's last server tick, reads of the stream that do not block
_EVENT_READ_S = 1.0  # one blocking read of the completion events at most this long (inside socket timeouts)


def stopped_send(stop: BaseException) -> tuple[str, bool | None] | None:
    """What an interruption (Ctrl-C, SIGTERM) of a send left: the job's id and whether its message is
    queued (None: it cannot be told, Redis being away), or None where it stopped before any push."""
    told = getattr(stop, "_mrc_stopped_send", None)
    return told if isinstance(told, tuple) else None


def _tell(stop: BaseException, job_id: str, queued: bool | None) -> None:
    stop._mrc_stopped_send = (job_id, queued)  # type: ignore[attr-defined]  # read by stopped_send


@dataclass(frozen=True)
class _Claim:
    """This submission's claim on its job id."""

    token: str
    ahead: bool = False  # on the backlog's ahead list (shared/names.py AHEAD_STEP)


@dataclass(frozen=True)
class _Done:
    """A submission answered by the result stored under its id (its record expired)."""

    result: dict[str, Any]


class Queue:
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
            connect(
                settings,
                settings.connect_timeout_s,
                retries=3,  # a failover's reconnects
                socket_timeout=answer_timeout_s(settings),
                retry_timeouts=False,  # a hung Redis: 503 / exit 5, not a wait as long as the hang
            )
        )
        # The completion events a wait wakes on (a hint): read on a connection of their own that never
        # retries and times out soon after its longest block, so an unreachable Redis costs a wait no
        # more than it did before. Records handed in (in-process ones) serve for both.
        self._hints: JobRecords | None = records
        self._hints_made = threading.Lock()
        self.celery = celery or make_celery(settings, socket_timeout=answer_timeout_s(settings))
        self.sends = Sends(self.celery)
        self.log = logs.get_logger()

    def close(self) -> None:
        """Let go of the S3, Redis and broker connections this client opened."""
        for part in (self.images, self.results, self.records, self._hints):
            connection = getattr(part, "connection", None) or getattr(part, "_redis", None)
            if connection is not None:
                connection.close()
        self.celery.close()

    def lane_depth(self, lane: str) -> int:
        return self.records.list_lengths(names.queue_keys(lane))

    def backlog_room(self, owner: str) -> backlog_share.Room:
        """The room the backlog lane has for `owner`'s jobs now (shared/backlog_share.py)."""
        return self.records.backlog_room(
            owner, self.settings.backlog_max_depth, self.settings.backlog_key_shares
        )

    def enqueue(
        self, job: Job, block: bool = True, timeout: float | None = None, *, minted: bool = False
    ) -> bool:
        """Send the job unless its id was already submitted; True when this call enqueued it.
        `minted`: the caller drew the job's id at random for this submission (no client named it), so
        no result can be stored under it and S3 is not asked (a HEAD a submission, the intake's
        largest cost: docs/benchmarks.md).

        The same job under a used id is a duplicate (False) once the other submission is published and
        its message is in Redis (pushed again where it is not: producer/queue/resubmission.py); a
        different job under a used id is refused (UsageError). On the backlog lane the claim takes the
        job's room in the lane in the same step (a resubmission of a queued id needs none), waiting
        for it (`block`, up to `timeout`) or raising QueueFull. An interruption at any point (Ctrl-C
        included) undoes the claim. The message is sent only while the claim is still this call's:
        a claim that expired during the look for an earlier result is taken again, never sent on."""
        wait = RoomWait.of(block, timeout)
        for _ in range(_CLAIM_TRIES):
            claim = self._claim(job, wait, minted)
            if isinstance(claim, _Done):  # no room, and no need of any: its result is stored
                return self._duplicate(job, claim.result.get("job_fingerprint"))
            if claim is None:  # the same job, once its message is known to be there (or pushed again)
                return resubmission.answer(job, self.records, self.settings, self._send, self.log)
            sent = self._send_claimed(job, claim, minted)
            if sent is not None:
                return sent
            self.log.warning("MRC_CLAIM_LOST", job_id=job.job_id, lane=job.lane)
        raise StoreUnavailable(f"job {job.job_id}: its claim kept expiring before it could be sent")

    def _claim(self, job: Job, wait: RoomWait, minted: bool = False) -> _Claim | _Done | None:
        """This submission's claim token, or None when the id is taken by a published submission.
        Another producer's claim not yet published is waited out (it publishes, or frees the id when
        it fails or expires): answering 'same job' for it could report a job that is never sent. On
        the backlog lane the claim takes its room, or there is none: wait for some, or QueueFull
        (submissions at once each took room only once they had looked: review, helper-103), unless
        the job's result is stored already (_Done: its record expired; it needs no room)."""
        taken_since: float | None = None
        limit = self.settings.backlog_max_depth if job.lane == "backlog" else None
        while True:
            try:
                claim = self._take(job, limit)
            except backlog_share.NoRoom as full:
                if (
                    not wait.looked and not minted
                ):  # once a submission (review, helper-105: a stored job met 503)
                    wait.looked = True
                    _checked, existing = self._earlier_result(job.job_id)
                    if existing is not None:
                        return _Done(existing)
                wait.refuse_or_wait(full.room, backlog_share.owner_of(job.job_id), self.settings, self.log)
                taken_since = None  # a wait for room is no wait on another's claim
                continue
            if claim is not None:
                return claim
            record = self.records.get(job.job_id)
            if record and record.get("published") != "0":
                return None
            taken_since = time.monotonic() if taken_since is None else taken_since
            if time.monotonic() - taken_since >= CLAIM_TTL_S + 5:
                raise ServiceUnreachable(  # Redis: its claim outlives its lease (review, helper-74: "S3")
                    "Redis", f"job {job.job_id}: another submission of it neither ends nor expires"
                )
            time.sleep(0.05)

    def _take(self, job: Job, limit: int | None) -> _Claim | None:
        """The claim on the job's id (None: taken), and on the backlog whether the job goes on the
        lane's ahead list (decided in the claim step: backlog_share.CLAIM_LUA)."""
        if limit is None:
            token = self.records.claim(job.job_id, job.lane, job.fingerprint())
            return None if token is None else _Claim(token)
        taken = self.records.claim_backlog(
            job.job_id,
            job.fingerprint(),
            limit,
            self.settings.backlog_key_shares,
            self.settings.backlog_ahead_jobs,
        )
        if taken is None:
            return None
        token, room = taken
        return _Claim(token, room.bound_ahead)

    def _send_claimed(self, job: Job, claim: _Claim, minted: bool = False) -> bool | None:
        """True: sent and confirmed; False: a duplicate of an earlier result; None: the claim was lost
        before the send (nothing sent)."""
        sending = False
        try:
            checked, existing = (True, None) if minted else self._earlier_result(job.job_id)
            if existing is not None:
                self.records.release(job.job_id, claim.token)
                return self._duplicate(job, existing.get("job_fingerprint"))
            # the look outlasted the claim's lease (none was made for a drawn id: the claim is new)
            if not minted and not self.records.renew(job.job_id, claim.token):
                return None
            sending = True
            self._send(job, ahead=claim.ahead)
        except NotReplicated as exc:  # queued on the master: the claim stands, so a retry is the same job
            self._confirm_sent(job, claim.token, checked)
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
            self._failed_send(job, claim, checked, exc)
        except BaseException as stop:  # Ctrl-C or SIGTERM
            self._stopped_send(job, claim, checked, sending, stop)
            raise
        try:
            self._confirm_sent(job, claim.token, checked)
        except BaseException as stop:  # sent: the job is queued, its record written or not
            _tell(stop, job.job_id, True)
            raise
        self.log.info(
            "MRC_ENQUEUED", job_id=job.job_id, lane=job.lane, ticket_id=job.ticket_id, image=job.image_uri
        )
        return True

    def _failed_send(self, job: Job, claim: _Claim, checked: bool, exc: Exception) -> None:
        """A publish that raised: returns where its push landed (and its reply was lost), else raises
        what the caller must be told (the failure itself, or maybe enqueued, or not replicated)."""
        landed = self._landed(job)
        if landed is False:  # nothing enqueued: the answer (exit 5 / 503) is true
            self.records.release(job.job_id, claim.token)
            raise exc
        if landed is None:  # unknown: the claim lapses by itself (30 s); a resubmission is safe
            raise self._unconfirmed(job, exc) from exc
        self.log.warning("MRC_PUSH_REPLY_LOST", job_id=job.job_id, lane=job.lane, error=repr(exc)[:200])
        if self.settings.redis_wait_replicas:  # landed, replication not confirmed
            error = NotReplicated(0, self.settings.redis_wait_replicas, self.settings.redis_wait_timeout_ms)
            self._confirm_sent(job, claim.token, checked)
            error.job_id = job.job_id
            raise error from exc

    def _stopped_send(
        self, job: Job, claim: _Claim, checked: bool, sending: bool, stop: BaseException
    ) -> None:
        """A send stopped (Ctrl-C, SIGTERM): before its push nothing is queued and the claim is freed;
        once the push began, whether it landed decides, and the stop carries the answer
        (`stopped_send`). Review, helper-119: a stop during the push's WAIT for replicas freed the claim
        of a job that was queued, its record deleted and its id, drawn by the command, printed nowhere."""
        landed = self._landed(job) if sending else False
        if landed is False:
            self.records.release(job.job_id, claim.token)
        elif landed:  # queued, whatever stopped the send: the claim becomes its record
            self._confirm_sent(job, claim.token, checked)
        # (None: it cannot be told; the claim lapses by itself and a resubmission is safe)
        if sending:
            _tell(stop, job.job_id, landed)

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

    def _send(self, job: Job, push_id: str | None = None, ahead: bool = False) -> None:
        """A submission's publish is named by its job id (a resubmission pushes nothing twice);
        a deliberate resend (`mrc dlq requeue`) passes its own `push_id`."""
        push = push_id or names.job_push_id(job.job_id)
        self.sends.send(job, push, ahead)

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

    # ---- read back ----
    def result(self, job_id: str) -> dict[str, Any] | None:
        return self.results.get_result(job_id)

    def settled_result(self, job_id: str) -> dict[str, Any] | None:
        """The stored result; else, for a job that failed without one (S3 refused it: the worker
        dead-lettered it), what its record says, `result_stored: false`, as a wait answers; else None
        (review, helper-63: `mrc result` and a run's report called such a job pending for good)."""
        result = self.result(job_id)
        if result is not None:
            return result
        record = self.records.get(job_id)
        if record.get("state") == "failed" and record.get("error_code"):
            return unstored_result(job_id, record)
        return None

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
        """Block until the job has a result; raise TimeoutError after `timeout` seconds (also when Redis
        or S3 stayed away: the job was queued, and an outage is waited out, never raised).

        The result object is the truth and the record a hint: S3 is read whenever the record says the
        job ended (or has no record), and at least once a second whatever it says, so a result whose
        record update was lost is still found. A job that ended without a stored result (S3 refused
        it to the end) is reported from its record as failed, instead of a wait that times out."""
        deadline = time.monotonic() + timeout
        # Before the first look: no completion after it is missed. A poll shorter than Redis's timer
        # tick is kept by sleeping, not by blocked reads (their timeouts end on the tick).
        woken = self.settings.wait_poll_s >= redis_target.SERVER_TICK_S
        after = self._events_tail() if woken else None
        next_look = time.monotonic() + 1.0  # the record is read first: S3 only if it says "ended"
        next_tail = next_look
        fault: Exception | None = None  # the last outage the wait rode out, named if it times out
        while True:
            if woken and after is None and time.monotonic() >= next_tail:
                # The stream could not be read (Redis away, a failover): find its tail again, at most
                # once a second, before the next look, so no completion after that look is missed.
                next_tail = time.monotonic() + 1.0
                after = self._events_tail()
            try:  # on the hints' connection: short timeouts, no retries (a Redis that hangs held the
                # wait 10 s a read, three times over, past its timeout and its once-a-second S3 look)
                record, answer = self._events().get_with_answer(job_id)
                if answer is not None:  # the result as stored, kept beside the record: no S3 read
                    return answer
                due = record.get("state") in TERMINAL or record.get("state") is None
            except (redis.RedisError, OSError) as exc:  # Redis away: the job is queued all the same,
                record, due, fault = {}, False, exc  # and S3 is still looked at once a second
            if due or time.monotonic() >= next_look:
                next_look = time.monotonic() + 1.0
                try:
                    result = self.result(job_id)
                except StoreUnavailable as exc:  # S3 away: looked at again until the deadline
                    result, fault = None, exc
                if result is not None:
                    return result
                if record.get("state") == "failed" and record.get("error_code"):
                    return unstored_result(job_id, record)
            if time.monotonic() >= deadline:
                why = f" (last fault: {str(fault).splitlines()[0][:200]})" if fault else ""
                raise TimeoutError(f"no result for {job_id} after {timeout:g} s{why}")
            after = self._until_completed(
                job_id, after, time.monotonic() + self.settings.wait_poll_s, deadline
            )

    def _events(self) -> JobRecords:
        with self._hints_made:  # waits on several threads: one connection pool, which close() closes
            if self._hints is None:
                self._hints = RedisJobRecords(
                    redis_target.client(
                        self.settings,
                        decode_responses=True,
                        socket_timeout=_EVENT_READ_S + 1.0,
                        socket_connect_timeout=min(1.0, self.settings.connect_timeout_s),
                        retry=Retry(NoBackoff(), 0),
                    )
                )
            return self._hints

    def _events_tail(self) -> str | None:
        try:
            return self._events().events_tail()
        except Exception:  # the stream is a hint: without it the wait polls
            return None

    def _until_completed(self, job_id: str, after: str | None, until: float, deadline: float) -> str | None:
        """Sleep until `until` (the next look) or the deadline, woken early by the job's completion
        event (workers/finisher.py appends it once the result and the record are written), so the
        caller looks at once instead of up to a poll interval later. A hint, never the truth: an event
        lost or never written costs the poll interval. A blocked read's timeout can end a server tick
        late (redis_target.SERVER_TICK_S): that may delay a look, never the deadline, which no read
        reaches past. Returns where the next read of the stream starts (None: it cannot be read, and
        the wait only polls)."""
        end = min(until, deadline)
        try:
            while after is not None and (left := end - time.monotonic()) > 0:
                block = min(
                    until - time.monotonic(), deadline - redis_target.SERVER_TICK_S - time.monotonic()
                )
                block = min(block, _EVENT_READ_S)
                if block < 0.005:  # the last tick: reads that do not block, so an event still wakes it
                    block = 0.0
                events = self._events().events_after(after, block_s=block)
                if events:
                    after = events[-1]["id"]
                    if any(event.get("job_id") == job_id for event in events):
                        return after
                elif block == 0.0:
                    time.sleep(min(_LAST_TICK_READ_S, max(0.0, left)))
        except Exception:
            after = None
        time.sleep(max(0.0, end - time.monotonic()))
        return after
