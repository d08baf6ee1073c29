"""Backlog runs in Redis: the run's own record, and its jobs queued, cancelled and counted in bulk.

A backlog job is recorded and queued in one Lua step (`ENQUEUE_SCRIPT`): a producer killed at any
moment leaves each job either recorded and queued, or neither. That is what lets `mrc backlog
--resume` enqueue exactly what is missing: a job id with a record is never sent again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from shared import backlog_share, names
from shared import usage as usage_book
from shared.errors import NotReplicated
from shared.jobs import now_rfc3339
from shared.records import RECORD_TTL_S

RUN_TTL_S = 30 * 24 * 3600  # a run's record outlives its jobs' (7 days): status still says what it was

# A part of a run's jobs, all of one lane, each recorded and queued in one atomic step, up to CALL_JOBS
# in one call (a call per job packed 25 arguments and read a reply each: a third of a bulk enqueue's
# time).
# KEYS[1] the run's hash, KEYS[2..4] the backlog's held jobs and claims (shared/backlog_share.py),
# KEYS[5..4+L] every list of the lane (its depth), then per job its hash and its queue's list.
# ARGV[1] L, then record ttl, lane, submitted_at, run id, depth limit, now, held max age, shares on
# ('1'), then per job: fingerprint, message, owner, job id.
# Returns per job: 1 when queued here; CANCELLED when the run was cancelled (the whole part: nothing
# queued, in the same atomic step as the cancel could be, so no job slips in after it); FULL when the
# lane has no room for it (at its depth limit, or, on the backlog lane while several keys have work in
# it, past the owner's share: exact, the depth and the shares are read and the job pushed and held in
# one step; an owner's room is read once for its jobs in a row, and each job it queues takes one place
# of it, of its share and of the lane's depth alike); else the fingerprint the id already holds ('' if
# none). The record is `checked = 0`: the worker looks for an earlier result before it runs the job, so
# a bulk enqueue needs no S3 request per line.
CANCELLED, FULL = -1, -2
# Jobs one call takes at most: Redis runs nothing else while a script runs, and 100 jobs take it about
# 1.1 ms here (a part of 500 in one call would hold a worker's pop or a ticket's push up to 6 ms).
CALL_JOBS = 100
_COMMON_ARGS = 9  # L and the eight values every job of the part shares
_JOB_ARGS = 4
ENQUEUE_SCRIPT = (
    backlog_share.ROOM_LUA
    + f"""
local lists = tonumber(ARGV[1])
local jobs = (#ARGV - {_COMMON_ARGS}) / {_JOB_ARGS}
local out = {{}}
if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then
  for j = 1, jobs do out[j] = -1 end
  return out
end
local depth = 0
for i = 5, 4 + lists do depth = depth + redis.call('LLEN', KEYS[i]) end
local ttl, lane, stamp, run_id = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local limit, now, max_age, shared = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9] == '1'
local backlog = lane == 'backlog'
local room, last_owner = 0, nil
for j = 1, jobs do
  local hash, list = KEYS[3 + lists + 2 * j], KEYS[4 + lists + 2 * j]
  local a = {_COMMON_ARGS} + {_JOB_ARGS} * (j - 1)
  local owner = ARGV[a + 3]
  if redis.call('EXISTS', hash) == 1 then
    out[j] = redis.call('HGET', hash, 'fingerprint') or ''
  else
    if backlog and owner ~= last_owner then
      room = backlog_room(KEYS[2], KEYS[3], KEYS[4], owner, now, max_age, limit, depth, shared)[1]
      last_owner = owner
    elseif not backlog then
      room = limit - depth
    end
    if room <= 0 then
      out[j] = -2
    else
      redis.call('HSET', hash, 'state', 'queued', 'lane', lane, 'submitted_at', stamp,
                 'fingerprint', ARGV[a + 1], 'published', '1', 'checked', '0', 'run_id', run_id)
      redis.call('EXPIRE', hash, ttl)
      redis.call('LPUSH', list, ARGV[a + 2])
      depth, room = depth + 1, room - 1
      if backlog then backlog_hold(KEYS[2], KEYS[3], owner, ARGV[a + 4], now) end
      out[j] = 1
    end
  end
end
return out
"""
)

# KEYS[1] the run's hash; ARGV[1] the pass. `enqueued` once every chunk is queued, unless it was
# cancelled meanwhile (0); -1 when the record is not this pass's (LOST: below).
FINISH_SCRIPT = """
if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'pass') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'state', 'enqueued')
return 1
"""

# KEYS[1] the run's hash; ARGV[1] the pass ('' for none: a cancel), then field, amount pairs. The counts
# go into the record only while it is the pass's: a record Redis lost and a pass (or a worker) made anew
# holds other counts, and a newer pass counts from the index (0: LOST).
COUNT_SCRIPT = """
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'pass') ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS[1] the job's hash. A job still queued is marked cancelled (the worker fails it with `cancelled`
# instead of running it); one running or ended is left alone. Returns 1 when marked.
CANCEL_SCRIPT = """
if redis.call('HGET', KEYS[1], 'state') == 'queued' then
  redis.call('HSET', KEYS[1], 'cancelled', '1')
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Queued:
    """One job ready to go: its record fields and the message text the transport captured."""

    job_id: str
    lane: str
    fingerprint: str
    list_key: str
    message: str


run_key = names.run_record_key


class RunLost(Exception):
    """The run's record is not the pass's any more: Redis lost it (restarted without its data, or a
    failover to a replica that had not got it), or a newer pass of the run began. The pass's counts went
    with it (review, helper-76: a second pass started after the loss, and both counted every line)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id}'s record in Redis is gone or another pass's")
        self.run_id = run_id


class PartNotReplicated(NotReplicated):
    """A part of a run was recorded and queued, and fewer replicas than asked confirmed it: `replies`
    says what each of its jobs became, as enqueue_many would have returned."""

    def __init__(self, replies: list[int | str], acknowledged: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(acknowledged, wanted, timeout_ms, "this part of the run")
        self.message = (
            f"the run stopped: its last part was queued, but only {acknowledged} of {wanted} Redis replicas "
            f"confirmed it within {timeout_ms} ms; once they are back, resume the run: what is queued stays "
            "queued, and what a failover lost is queued again"
        )
        self.args = (self.message,)  # as logged (review, helper-77: a batch's log said "submit again")
        self.replies = replies


def _by_lane(jobs: Sequence[Queued]) -> list[tuple[str, list[Queued]]]:
    """The jobs in runs of one lane of at most CALL_JOBS, in order (one enqueue call each)."""
    parts: list[tuple[str, list[Queued]]] = []
    for job in jobs:
        if not parts or parts[-1][0] != job.lane or len(parts[-1][1]) >= CALL_JOBS:
            parts.append((job.lane, []))
        parts[-1][1].append(job)
    return parts


class RunRecords:
    def __init__(self, client: redis.Redis, wait_replicas: int = 0, wait_timeout_ms: int = 1000) -> None:
        self._redis = client
        # MRC_REDIS_WAIT_REPLICAS: a chunk is acknowledged only once that many replicas hold it.
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._cancel = client.register_script(CANCEL_SCRIPT)
        self._finish = client.register_script(FINISH_SCRIPT)
        self._count = client.register_script(COUNT_SCRIPT)

    @property
    def client(self) -> redis.Redis:
        return self._redis

    def close(self) -> None:
        self._redis.close()

    # ---- the run ----
    def get(self, run_id: str) -> dict[str, str]:
        return dict(self._redis.hgetall(run_key(run_id)))  # type: ignore[arg-type]  # decode_responses

    def start(
        self, run_id: str, manifest: str, workdir: str | None = None, pass_id: str | None = None
    ) -> dict[str, str]:
        """Create the run's record unless it exists (a resume keeps the first one); returns it.
        `workdir`: where the first pass ran (a manifest's relative image paths are relative to it);
        `pass_id`: the pass that counts into it from now on (`count`)."""
        key = run_key(run_id)
        with self._redis.pipeline() as pipe:
            if pass_id:
                pipe.hset(key, "pass", pass_id)
            pipe.hsetnx(key, "created_at", now_rfc3339())
            pipe.hsetnx(key, "manifest", manifest)
            if workdir:
                pipe.hsetnx(key, "workdir", workdir)
            pipe.hsetnx(key, "state", "enqueuing")
            pipe.expire(key, RUN_TTL_S)
            pipe.zadd(names.runs_recent_key(), {run_id: time.time()}, nx=True)  # the ops page's list
            pipe.zremrangebyrank(names.runs_recent_key(), 0, -1001)
            pipe.execute()
        return self.get(run_id)

    def forget(self, run_id: str, *fields: str) -> None:
        self._redis.hdel(run_key(run_id), *fields)

    def update(self, run_id: str, **fields: str) -> None:
        self._redis.hset(run_key(run_id), mapping=fields)  # type: ignore[arg-type]  # str values

    def finish_enqueue(self, run_id: str, pass_id: str = "") -> bool:
        """The run is `enqueued`, unless a cancel came first (which then stays); False if it did.
        RunLost when the record is not `pass_id`'s."""
        done = int(self._finish(keys=[run_key(run_id)], args=[pass_id]))
        if done < 0:
            raise RunLost(run_id)
        return bool(done)

    def cancelled(self, run_id: str) -> bool:
        return self._redis.hget(run_key(run_id), "state") == "cancelled"

    def count(self, run_id: str, pass_id: str = "", **increments: int) -> None:
        """Add to the run's counts in one step; with `pass_id`, only into that pass's record (else
        RunLost, nothing added)."""
        pairs = [str(part) for field, amount in increments.items() if amount for part in (field, amount)]
        if pairs and not self._count(keys=[run_key(run_id)], args=[pass_id, *pairs]):
            raise RunLost(run_id)

    # ---- its jobs ----
    def enqueue_many(
        self, run_id: str, jobs: Sequence[Queued], depth_limit: int, shares: bool = True
    ) -> list[int | str]:
        """Record and queue each job in one step, in one round trip, while the lane has room for it
        (`depth_limit`, and on the backlog its owner's share: shared/backlog_share.py); per job 1 where
        queued here, CANCELLED, FULL, or the fingerprint its id holds."""
        if not jobs:
            return []
        stamp, now = now_rfc3339(), time.time()
        with self._redis.pipeline(transaction=False) as pipe:
            for lane, part in _by_lane(jobs):
                lists = names.queue_keys(lane)
                keys = [run_key(run_id), *backlog_share.keys(), *lists]
                args: list[str | int | float] = [
                    len(lists), RECORD_TTL_S, lane, stamp, run_id, depth_limit, now,
                    backlog_share.HELD_MAX_AGE_S,
                    "1" if shares else "0",
                ]  # fmt: skip
                for job in part:
                    keys += (names.job_key(job.job_id), job.list_key)
                    args += (job.fingerprint, job.message, backlog_share.owner_of(job.job_id), job.job_id)
                self._enqueue(keys=keys, args=args, client=pipe)
            if self.wait_replicas > 0:  # on the same connection as the writes: WAIT covers them
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            replies = pipe.execute()
        replicas = int(replies.pop()) if self.wait_replicas > 0 else None
        queued = [reply if isinstance(reply, str) else int(reply) for part in replies for reply in part]
        if replicas is not None and replicas < self.wait_replicas:
            raise PartNotReplicated(queued, replicas, self.wait_replicas, self.wait_timeout_ms)
        return queued

    def cancel_many(self, job_ids: Sequence[str]) -> int:
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                self._cancel(keys=[names.job_key(job_id)], client=pipe)
            return sum(int(r) for r in pipe.execute())

    def recorded(self, job_ids: Sequence[str]) -> list[bool]:
        """Whether each job has a record, in one round trip."""
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(names.job_key(job_id))
            return [bool(found) for found in pipe.execute()]

    def states(self, job_ids: Sequence[str]) -> list[tuple[str | None, str | None, str | None, bool]]:
        """(state, error_code, updated_at, marked cancelled) per job, in one round trip."""
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(names.job_key(job_id), ["state", "error_code", "updated_at", "cancelled"])
            return [(r[0], r[1], r[2], r[3] in ("1", b"1")) for r in pipe.execute()]

    def usage(self, job_ids: Sequence[str]) -> list[list[str | None]]:
        """The usage fields each finished job's record keeps (shared/usage.py), in one round trip."""
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(names.job_key(job_id), list(usage_book.RECORD_FIELDS))
            return [list(r) for r in pipe.execute()]
