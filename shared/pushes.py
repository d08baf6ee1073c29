"""One publish's marker in Redis (`names.push_key(push_id)`): what lets a publish be pushed once, and
a resubmission tell a job whose message is waiting from one whose message was lost.

The marker is written in the same step as the push (`PUSH_ONCE_SCRIPT`: a second push of the same
push id lands nothing) and lives as long as its message: `HELD` while the message waits in a lane or
is held unacked by a worker (the pop, the restore and `give_back` leave it alone), `ACKED` once a
worker acked it (in the ack's own MULTI, shared/transport.py), and then an hour more, so a late retry
of the same publish (redis-py after a lost reply, Celery after a lost connection) still pushes nothing.
Marker and message are written in one atomic step on one master, so a replica, and a master promoted
from it, holds both or neither: a failover that loses the message loses its marker with it.

So a published job whose record says queued and never begun, with no marker on the master in use,
has no message anywhere (`message_missing`): its producer's push went to a master that was demoted
before a replica had it (docs/contract.md, "Enqueued, not replicated"), and a resubmission pushes it
again under the same push id. Before, the marker lived an hour whatever happened to its message: a
job queued longer than that would have been pushed twice by the same check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared import names

HELD = "1"  # pushed, not yet acked (the value markers always had: those written before keep meaning it)
ACKED = "acked"
# How long a marker stays while its message waits: longer than a queued job's record lives (7 days from
# its last change), so the check is exact for as long as a resubmission can find the record; a bound,
# so a message removed some other way (an operator's purge) does not leave its marker forever.
HELD_TTL_MS = 30 * 24 * 3600 * 1000
# How long a marker stays after the ack: longer than every retry of one publish (seconds) and than the
# claim of a submission whose reply was lost (30 s, then resubmitted).
ACKED_TTL_MS = 3_600_000

# KEYS[1] the list, KEYS[2] the publish's marker; ARGV[1] the message, ARGV[2] the marker's lifetime
# (ms). Returns 1 when pushed now, 0 when an earlier attempt did.
PUSH_ONCE_SCRIPT = """
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then
    redis.call('LPUSH', KEYS[1], ARGV[1])
    return 1
end
return 0
"""

# KEYS[1] the job's hash, KEYS[2] the marker of the job's own push id; ARGV[1] the marker keys' prefix.
# The record and the marker of the push it stands for (a requeued dead letter names its own push id in
# `push`; that marker's key is built here, the one key not declared: mrc's Redis is never a cluster),
# read in one step. Returns {the record as HGETALL gives it, the marker's value or ''}.
LOOK_SCRIPT = """
local push = redis.call('HGET', KEYS[1], 'push')
local marker = KEYS[2]
if push then marker = ARGV[1] .. push end
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', marker) or ''}
"""


def push_id_of(headers: Mapping[str, Any] | None) -> str | None:
    """The push id a message's headers carry (every publish through `send_job` has one)."""
    push_id = (headers or {}).get(names.PUSH_HEADER)
    return None if push_id is None else str(push_id)


def mark_acked(pipe: Any, push_id: str) -> None:
    """Queue the marker's change to ACKED on `pipe` (the ack's MULTI): never creates one (XX)."""
    pipe.set(names.push_key(push_id), ACKED, xx=True, px=ACKED_TTL_MS)


def record_push_id(job_id: str, record: Mapping[str, str]) -> str:
    """The push id of the message a job's record stands for: its own, unless a requeue named one."""
    return record.get("push") or names.job_push_id(job_id)


def message_missing(record: Mapping[str, str], marker: str) -> bool:
    """Whether a job's message is in no lane, held by no worker and was never taken: its record says
    published, queued and never begun (no attempt counted: a job that began is the worker's, which
    retries or dead-letters it), and its push left no marker. A backlog job's record was written in
    the same step as its message (shared/runs.py): it has no marker and is never missing."""
    if record.get("state") != "queued" or record.get("published") != "1":
        return False
    if int(record.get("attempts") or 0) > 0:
        return False
    if record.get("run_id") and not record.get("push"):
        return False
    return marker == ""
