"""`mrc dlq requeue`: dead-lettered jobs sent back to their lanes with fresh attempts."""

from __future__ import annotations

import json

from producer.queue.sender import Queue
from shared import names
from shared.errors import MrcError, NotReplicated
from shared.jobs import Job


def requeue(client: Queue, limit: int) -> tuple[int, int, int]:
    """Send dead-lettered jobs back with fresh attempts, oldest first; their old failed result is
    replaced when they finish. Each entry moves to a processing list first and leaves it only once
    sent, so a failed send or a killed requeue loses nothing. An entry that is not a valid job is
    kept (and counted) for a person to look at. Returns (requeued, invalid, requeued but not
    confirmed by MRC_REDIS_WAIT_REPLICAS replicas); it stops at the first such, as `mrc backlog` does."""
    records, log = client.records, client.log
    records.recover_dead_letters()
    requeued = invalid = unreplicated = 0
    for _ in range(min(limit, records.dead_letter_count())):
        raw = records.take_dead_letter()
        if raw is None:
            break
        job = _dead_letter_job(raw)
        if job is None:
            records.return_dead_letter(raw, oldest=False)  # not seen again in this pass
            log.warning("MRC_DLQ_INVALID", entry=raw[:200])
            invalid += 1
            continue
        # A new push: under the submission's push id a requeue within the marker's life would be
        # taken for that submission's retry and silently dropped. The record names it, so that a
        # resubmission of the job checks this message (shared/pushes.py).
        push_id = names.requeue_push_id(job.job_id)
        try:
            records.reset_attempts(job.job_id, push_id)
            client.sends.send(job, push_id)
        except NotReplicated:  # sent: it leaves the dead letters; the caller hears it is not durable yet.
            records.ack_dead_letter(raw)  # Nothing more is sent unconfirmed: one wait for the replicas,
            log.warning("MRC_NOT_REPLICATED", job_id=job.job_id, lane=job.lane, what="dlq requeue")
            return requeued + 1, invalid, unreplicated + 1  # not one each (review, helper-77: 23 s for 20)
        except BaseException:
            _undo(client, raw, job, push_id)
            raise
        records.ack_dead_letter(raw)
        log.info("MRC_DLQ_REQUEUED", job_id=job.job_id, lane=job.lane)
        requeued += 1
    return requeued, invalid, unreplicated


def _undo(client: Queue, raw: str, job: Job, push_id: str) -> None:
    """A send that failed, or was interrupted (Ctrl-C): the entry goes back to the dead letters, unless
    its message was pushed before the interrupt came (in the wait for the replicas): then it is
    requeued, and leaves them (review, helper-77: it was both queued and dead-lettered, and the next
    requeue queued it twice)."""
    records = client.records
    try:
        landed = records.pushed(push_id)
    except Exception:  # Redis away: the entry is kept (in the processing list, recovered next time)
        return
    if landed:
        records.ack_dead_letter(raw)
        return
    records.set_state(job.job_id, "failed", dead_letter="1")
    records.return_dead_letter(raw)


def _dead_letter_job(raw: str) -> Job | None:
    try:
        entry = json.loads(raw)
        return Job.from_message(entry.get("job") if isinstance(entry, dict) else None)
    except (ValueError, MrcError, RecursionError):
        return None
