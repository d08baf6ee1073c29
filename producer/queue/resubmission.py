"""A resubmission of a job id a published submission holds: the same job, answered so only when it is.

The first submission writes its record through the job records' Redis client and pushes its message
through the broker's connection. In a Redis failover the two can reach different masters: a partitioned
primary, back for a moment before Sentinel demotes it, took the push (and said "not replicated"), while
the record was confirmed on the new master. The message was lost with the old master's data; the record
said queued and published, and the resubmission the contract asks for was answered "already queued"
(tests/faults/test_failover.py lost a job so). So a resubmission reads the record and its push's marker
in one step (shared/pushes.py): a job queued, never begun, whose push left no marker on the master in
use has no message anywhere, and is pushed again under the same push id (two resubmissions at once
push it once). Otherwise its message is in a lane, held by a worker, or the job began: the same job.
With MRC_REDIS_WAIT_REPLICAS either answer waits for the replicas (docs/contract.md, "Enqueued, not
replicated").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared import pushes
from shared.errors import NotReplicated, PushUnconfirmed, UsageError
from shared.jobs import Job
from shared.records import TERMINAL, JobRecords
from shared.settings import Settings


def answer(
    job: Job, records: JobRecords, settings: Settings, send: Callable[[Job, str], None], log: Any
) -> bool:
    """False (the same job, not enqueued by this call), once that is true. Raises UsageError for another
    job under the id, NotReplicated (duplicate) while the replicas do not hold its message, and
    PushUnconfirmed when its message, pushed again, could not be confirmed (resubmit to make sure)."""
    record, marker = records.look(job.job_id)
    same_job(job, record.get("fingerprint"))
    if pushes.message_missing(record, marker):
        push_again(job, pushes.record_push_id(job.job_id, record), records, send, log)
        return False
    log.info("MRC_DUPLICATE", job_id=job.job_id, lane=job.lane)
    if record.get("state") not in TERMINAL:  # a finished job's result is in S3: durable
        confirm_replicated(job, records, settings)
    return False


def push_again(
    job: Job, push_id: str, records: JobRecords, send: Callable[[Job, str], None], log: Any
) -> None:
    """Push a job whose message is nowhere, under the push id its record stands for: the push lands
    at most once however many resubmissions race here. Confirmed by its own WAIT (the transport's,
    with MRC_REDIS_WAIT_REPLICAS) and by its marker, read where the record is: a push that reached
    another master than the record's is not yet the job's message."""
    log.warning("MRC_PUSHED_AGAIN", job_id=job.job_id, lane=job.lane, push_id=push_id)
    try:
        send(job, push_id)
    except NotReplicated as exc:  # queued on the master; durable only once the replicas hold it
        records.hold_backlog(job.job_id)
        exc.job_id, exc.duplicate = job.job_id, True
        raise
    except Exception as exc:  # a reply lost with its connection: maybe pushed
        raise _unconfirmed(job, repr(exc), log) from exc
    if not records.pushed(push_id):
        raise _unconfirmed(job, "the push reached another Redis master than the job's record", log)
    # Queued again: held for its key's share until it ends. Only once the push is known to have landed
    # where the record is: a hold for a push that failed would count a job in no lane for a day.
    records.hold_backlog(job.job_id)


def confirm_replicated(job: Job, records: JobRecords, settings: Settings) -> None:
    """With MRC_REDIS_WAIT_REPLICAS, a resubmission is answered "the same job" only once the replicas
    hold the earlier publish, NotReplicated (duplicate) otherwise: a caller that resubmits after exit 6
    / "replicated": false learns whether its job is durable now."""
    wanted, timeout_ms = settings.redis_wait_replicas, settings.redis_wait_timeout_ms
    if wanted <= 0:
        return
    found = records.replicas(wanted, timeout_ms)
    if found < wanted:
        error = NotReplicated(found, wanted, timeout_ms, "the earlier submission of this job")
        error.job_id, error.duplicate = job.job_id, True
        raise error


def same_job(job: Job, fingerprint: str | None) -> None:
    """Refuse another job (image, prompt, max_new_tokens, response_format) under a used id."""
    if fingerprint and fingerprint != job.fingerprint():
        raise UsageError(
            f"job id {job.job_id} is already used by a different job (another image, prompt, "
            "max_new_tokens or response_format); choose a new id"
        )


def _unconfirmed(job: Job, cause: str, log: Any) -> PushUnconfirmed:
    log.warning("MRC_NOT_REPLICATED", job_id=job.job_id, lane=job.lane, what="push again unconfirmed")
    error = PushUnconfirmed(cause)
    error.job_id, error.duplicate = job.job_id, True
    return error
