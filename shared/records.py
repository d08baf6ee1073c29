"""Job records in Redis: the state a job is in, for `mrc status` and for running a job id once."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Protocol

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared import backlog_share, encoding, names, ops_counts, pushes, redis_target, store_faults, tenants
from shared import usage as usage_book
from shared.jobs import State, now_rfc3339
from shared.settings import REDIS_SOCKET_TIMEOUT_S, Settings

RECORD_TTL_S = 7 * 24 * 3600
# An interactive job's result is also kept in Redis this long, up to this size, beside its record's
# end: a chat's answer, `mrc submit --wait` and a result wait read it with the record, one S3 round
# trip fewer at the end of a ticket (tens of milliseconds at a real S3). S3 stays the truth: the copy
# is written after the result is stored, and a wait that finds none reads S3.
ANSWER_TTL_S = 120
ANSWER_MAX_BYTES = 16 * 1024
ENDED = frozenset({"succeeded", "failed"})  # a job's last states
# A completion event's stream id ("1700000000000-0"), or "0" for "from the oldest kept". ASCII digits:
# `\d` takes any Unicode digit and int() reads them, but Redis does not (review, helper-89: `after=٣`
# was a 500).
EVENT_ID_RE = re.compile(r"^[0-9]{1,20}(-[0-9]{1,20})?\Z")
_STREAM_ID_MAX = 2**64 - 1  # each part of a Redis stream id is an unsigned 64-bit number


def valid_event_id(text: str) -> bool:
    """Whether Redis accepts `text` as a stream id to read after: the pattern, and each part in range
    (twenty digits can say more than 64 bits hold, and Redis refuses those)."""
    if not EVENT_ID_RE.match(text):
        return False
    return all(int(part) <= _STREAM_ID_MAX for part in text.split("-"))


# A claim lives this long until its message is confirmed published: a producer killed between claim
# and publish leaves a claim that frees its job id by itself, instead of blocking it for a week.
CLAIM_TTL_S = 30

# A claim (backlog_share.CLAIM_LUA) is atomic: whole or absent, and it names its holder, so only the
# holder can confirm or release it. On the backlog lane it takes its room in the same step.
# KEYS[1] the job's hash, KEYS[2] the backlog's claims; ARGV: claim token, ttl, the claim's member.
# The claim is still this holder's (it did not expire and was not taken by another): give it a fresh
# lease, and its room too. 1 if so.
_RENEW_SCRIPT = """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'published') ~= '0' then
  return 0
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')  -- the claims' clock is Redis's (shared/backlog_share.py)
local lease = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], 'XX', lease, ARGV[3])
redis.call('ZADD', KEYS[2], 'XX', lease, ARGV[3] .. 'AHEAD_MARK')  -- a claim bound for the ahead list
return 1
""".replace("AHEAD_MARK", backlog_share.AHEAD_MARK)
# KEYS[1]; ARGV: claim token, record ttl, checked. Only the holder confirms, and only its own claim: a
# record that expired meanwhile is not re-created with half its fields.
# A backlog job is held for its key's share (shared/backlog_share.py: KEYS[2..4], ARGV[4..6] owner, job
# id, now), its claim's room given back, unless it already ended: a worker may take and finish it
# between the push and this step.
_CONFIRM_SCRIPT = (
    backlog_share.ROOM_LUA
    + """
if redis.call('HGET', KEYS[1], 'claim') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'published', '1', 'checked', ARGV[3])
redis.call('HDEL', KEYS[1], 'claim')
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[4] .. ' ' .. ARGV[5], ARGV[4] .. ' ' .. ARGV[5] .. 'AHEAD_MARK')
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'lane') == 'backlog' and state ~= 'succeeded' and state ~= 'failed' then
  backlog_hold(KEYS[2], KEYS[3], ARGV[4], ARGV[5], tonumber(ARGV[6]))
end
return 1
""".replace("AHEAD_MARK", backlog_share.AHEAD_MARK)
)
# KEYS[1], KEYS[2] the backlog's claims; ARGV: claim token, the claim's member. Undo this holder's
# unpublished claim, never another's, and give back the room it took.
_RELEASE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'claim') == ARGV[1] and redis.call('HGET', KEYS[1], 'published') == '0' then
  redis.call('ZREM', KEYS[2], ARGV[2], ARGV[2] .. 'AHEAD_MARK')
  return redis.call('DEL', KEYS[1])
end
return 0
""".replace("AHEAD_MARK", backlog_share.AHEAD_MARK)


def connect(
    settings: Settings,
    connect_timeout: float = 5.0,
    retries: int = 10,
    socket_timeout: float = REDIS_SOCKET_TIMEOUT_S,  # above any WAIT the settings allow
    retry_timeouts: bool = True,
) -> redis.Redis:
    """A client that rides out a Redis restart or a failover: reconnects (to the master Sentinel names
    now, where MRC_REDIS_SENTINELS is set) and retries with exponential backoff (about 30 s in all with
    the default 10 retries: right for a worker, too long for a person at a command line, who gets
    fewer) instead of failing the first command after the connection dropped. `retry_timeouts=False`:
    a command Redis does not answer within `socket_timeout` fails at once (a Redis that hangs is not
    waited out: a producer answers 503 / exit 5 instead)."""
    errors: tuple[type[Exception], ...] = (redis.ConnectionError,)
    if retry_timeouts:
        errors += (redis.TimeoutError, TimeoutError)
    return redis_target.client(
        settings,
        decode_responses=True,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=5.0, base=0.1), retries=retries, supported_errors=errors),
        retry_on_error=list(errors),
    )


SCRAPE_TIMEOUT_S = 2.0


def answer_timeout_s(settings: Settings) -> float:
    """How long a command of a producer waits for Redis's answer: MRC_CONNECT_TIMEOUT_S, and the
    replicas' WAIT on top. A submission waits for Redis as long as the settings say, then answers
    503 / exit 5 (review, helper-74: mrc-api held its requests for as long as Redis hung, 10 s a
    command and each retried, then named S3)."""
    return settings.connect_timeout_s + settings.redis_wait_timeout_ms / 1000


def scrape_client(settings: Settings) -> redis.Redis:
    """A client for reads made while someone waits on an answer that must come anyway: a scrape
    (Prometheus gives up at 10 s), a probe. Each command gives up after SCRAPE_TIMEOUT_S, without
    retries: a Redis that hangs costs a scrape that long and reads as down (review, helper-74: 10 s
    a scrape, at Prometheus's own deadline)."""
    return redis_target.client(
        settings,
        decode_responses=True,
        socket_timeout=SCRAPE_TIMEOUT_S,
        socket_connect_timeout=min(SCRAPE_TIMEOUT_S, settings.connect_timeout_s),
        retry=None,
    )


TERMINAL: frozenset[str] = frozenset({"succeeded", "failed"})


class JobRecords(Protocol):
    """Job state, claims and dead letters: what the producer and the worker keep in Redis."""

    def claim(
        self, job_id: str, lane: str, fingerprint: str = "", limit: int | None = None, shares: bool = True
    ) -> str | None: ...
    def claim_backlog(
        self, job_id: str, fingerprint: str, limit: int, shares: bool = True, ahead_most: int = 0
    ) -> tuple[str, backlog_share.Room] | None: ...
    def renew(self, job_id: str, token: str) -> bool: ...
    def confirm(self, job_id: str, token: str, checked: bool = True) -> bool: ...
    def release(self, job_id: str, token: str) -> None: ...
    def replicas(self, wanted: int, timeout_ms: int) -> int: ...
    def pushed(self, push_id: str) -> bool: ...
    def look(self, job_id: str) -> tuple[dict[str, str], str]: ...
    def set_state(self, job_id: str, state: State, *, answer: str | None = None, **fields: str) -> None: ...
    def get(self, job_id: str) -> dict[str, str]: ...
    def get_with_answer(self, job_id: str) -> tuple[dict[str, str], dict[str, Any] | None]: ...
    def get_many(self, job_ids: list[str]) -> list[dict[str, str]]: ...
    def begin(self, job_id: str) -> int: ...
    def begin_many(self, job_ids: list[str], worker: str = "") -> list[int]: ...
    def solo_run(self, job_id: str) -> int: ...
    def withdraw_solo_run(self, job_id: str) -> None: ...
    def suspect_group(self, job_ids: list[str], size: int) -> None: ...
    def reset_attempts(self, job_id: str, push_id: str) -> None: ...
    def hold_backlog(self, job_id: str) -> None: ...
    def store_fault(self, job_id: str, budget_s: float) -> int: ...
    def count_usage(
        self,
        job_id: str,
        api_key: str | None,
        usage: dict[str, int],
        cache_hit: bool,
        done: ops_counts.Finished | None = None,
    ) -> bool: ...
    def list_lengths(self, keys: list[str]) -> int: ...
    def backlog_room(self, owner: str, limit: int, shares: bool = True) -> backlog_share.Room: ...
    def dead_letter(self, entry: dict[str, object]) -> None: ...
    def dead_letters(self, limit: int = 100) -> list[dict[str, object]]: ...
    def dead_letter_count(self) -> int: ...
    def take_dead_letter(self) -> str | None: ...
    def ack_dead_letter(self, raw: str) -> None: ...
    def return_dead_letter(self, raw: str, oldest: bool = True) -> None: ...
    def recover_dead_letters(self) -> int: ...
    def purge_dead_letters(self) -> int: ...
    def add_event(self, event: dict[str, str], keep: int) -> str: ...
    def events_after(self, after: str, block_s: float = 0.0, count: int = 1000) -> list[dict[str, str]]: ...
    def events_tail(self) -> str: ...


class RedisJobRecords:
    """One Redis hash per job. `claim` is atomic: the first submitter of a job id wins."""

    def __init__(self, client: redis.Redis, claim_ttl_s: int = CLAIM_TTL_S) -> None:
        self._redis = client
        self._claim_ttl_s = claim_ttl_s
        self._claim = client.register_script(backlog_share.CLAIM_LUA)
        self._renew = client.register_script(_RENEW_SCRIPT)
        self._confirm = client.register_script(_CONFIRM_SCRIPT)
        self._release = client.register_script(_RELEASE_SCRIPT)
        self._count_usage = client.register_script(usage_book.COUNT_SCRIPT)
        self._look = client.register_script(pushes.LOOK_SCRIPT)
        self._store_fault = client.register_script(store_faults.SCRIPT)

    @classmethod
    def from_settings(cls, settings: Settings) -> RedisJobRecords:
        return cls(connect(settings))

    def claim(
        self, job_id: str, lane: str, fingerprint: str = "", limit: int | None = None, shares: bool = True
    ) -> str | None:
        """Take the job id for one submission: its claim token, or None when the id is taken. Until
        `confirm`, the claim expires after a short while (a producer that died before publishing frees
        the id); only the token's holder can renew, confirm or release it. On the backlog lane with a
        depth `limit`, the claim takes its room in the same step (claim_backlog)."""
        if lane == "backlog" and limit is not None:
            taken = self.claim_backlog(job_id, fingerprint, limit, shares)
            return None if taken is None else taken[0]
        reply = self._claim_script(job_id, lane, fingerprint, None, shares)
        return reply[1] if reply[0] else None

    def claim_backlog(
        self, job_id: str, fingerprint: str, limit: int, shares: bool = True, ahead_most: int = 0
    ) -> tuple[str, backlog_share.Room] | None:
        """A backlog job's claim that takes its room in the lane in the same step (its owner's share
        with `shares`): its token and the room as it was before it, or None when the id is taken;
        raises backlog_share.NoRoom, and writes nothing, when there is none. `ahead_most`: the ahead
        list's cap (MRC_BACKLOG_AHEAD_JOBS); the room's `bound_ahead` says whether the job goes there."""
        reply = self._claim_script(job_id, "backlog", fingerprint, limit, shares, ahead_most)
        if not reply[0]:
            return None
        # its own claim sent again by redis-py (a reply lost) says no room: taken as one that goes
        # nowhere ahead (review, helper-107: it raised ValueError)
        return reply[1], backlog_share.room_from(reply[2:]) if len(reply) > 2 else backlog_share.Room(
            1, 0, 0, 1
        )

    def _claim_script(
        self, job_id: str, lane: str, fingerprint: str, limit: int | None, shares: bool, ahead_most: int = 0
    ) -> list[Any]:
        """[1, token, room...] claimed, [0] taken; NoRoom raised."""
        token = secrets.token_hex(8)
        room = "" if limit is None else limit  # '': no room taken
        keys = [names.job_key(job_id), *backlog_share.keys(), *(names.queue_keys(lane) if room else [])]
        args: list[str | int | float] = [
            self._claim_ttl_s, lane, now_rfc3339(), fingerprint, token, backlog_share.owner_of(job_id),
            time.time(), backlog_share.HELD_MAX_AGE_S, room, "1" if shares else "0", job_id, ahead_most,
        ]  # fmt: skip
        reply = [int(x) for x in self._claim(keys=keys, args=args)]
        if reply[0] < 0:
            raise backlog_share.NoRoom(backlog_share.room_from(reply[1:]))
        return [reply[0], token, *reply[1:]]

    def renew(self, job_id: str, token: str) -> bool:
        """A fresh lease for a claim still held (False: it expired, and may be another's now)."""
        keys = [names.job_key(job_id), names.backlog_claims_key()]
        args: list[str | int] = [token, self._claim_ttl_s, backlog_share.claim_member(job_id)]
        return bool(self._renew(keys=keys, args=args))

    def confirm(self, job_id: str, token: str, checked: bool = True) -> bool:
        """The message is published: the claim becomes a record that lives as long as any other.
        `checked`: the producer found no earlier result under this id (else the worker looks).
        False when the claim was no longer this holder's."""
        args: list[str | int | float] = [
            token, RECORD_TTL_S, "1" if checked else "0", backlog_share.owner_of(job_id), job_id, time.time()
        ]  # fmt: skip
        return bool(self._confirm(keys=[names.job_key(job_id), *backlog_share.keys()], args=args))

    def backlog_room(self, owner: str, limit: int, shares: bool = True) -> backlog_share.Room:
        """The room the backlog lane has for `owner`'s next jobs (its depth limit, and its share while
        other keys have work in it, unless `shares` is off)."""
        script, keys, args = backlog_share.room_call(owner, limit, shares)
        return backlog_share.room_from(self._redis.eval(script, len(keys), *keys, *args))

    def pushed(self, push_id: str) -> bool:
        """Whether the publish of this push id landed (shared/transport.py marks it in the same step)."""
        return bool(self._redis.exists(names.push_key(push_id)))

    def look(self, job_id: str) -> tuple[dict[str, str], str]:
        """The job's record and the marker of the push it stands for (shared/pushes.py: '' when none),
        read in one step: what a resubmission decides on."""
        keys = [names.job_key(job_id), names.push_key(names.job_push_id(job_id))]
        flat, marker = self._look(keys=keys, args=[names.push_key("")])
        return dict(zip(flat[::2], flat[1::2], strict=True)), str(marker)

    def replicas(self, wanted: int, timeout_ms: int) -> int:
        """How many replicas (waiting for `wanted` at most `timeout_ms`) hold everything the master
        held a moment ago, a resubmitted job's earlier publish included: a write of our own, then a
        WAIT for it. The replication stream is in order: a replica with our write has all before it."""
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(names.replication_probe_key(), now_rfc3339(), px=60_000)
            pipe.execute_command("WAIT", wanted, timeout_ms)
            return int(pipe.execute()[-1])

    def release(self, job_id: str, token: str) -> None:
        """Undo this holder's claim whose message never reached the queue."""
        keys = [names.job_key(job_id), names.backlog_claims_key()]
        self._release(keys=keys, args=[token, backlog_share.claim_member(job_id)])

    def set_state(self, job_id: str, state: State, *, answer: str | None = None, **fields: str) -> None:
        """The job's state; an end (`succeeded`, `failed`) lets go of its hold on the backlog's share in
        the same step. `answer`: its stored result's text, kept ANSWER_TTL_S for its waits; without one
        an earlier run's copy goes (review, helper-126: a requeued job that ended without a copy, its
        result too long or settled after a crash, was answered with its earlier run's result)."""
        key = names.job_key(job_id)
        with self._redis.pipeline() as pipe:
            mapping: dict[str, str] = {"state": state, "updated_at": now_rfc3339(), **fields}
            pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]  # redis-py types mapping values narrowly
            pipe.expire(key, RECORD_TTL_S)
            if answer is not None:
                pipe.set(names.answer_key(job_id), answer, ex=ANSWER_TTL_S)
            else:
                pipe.delete(names.answer_key(job_id))
            if state in ENDED:
                script, keys, args = backlog_share.release_call(job_id)
                pipe.eval(script, len(keys), *keys, *args)
            pipe.execute()

    def get(self, job_id: str) -> dict[str, str]:
        record: dict[str, str] = self._redis.hgetall(names.job_key(job_id))  # type: ignore[assignment]  # sync client
        return dict(record)

    def get_with_answer(self, job_id: str) -> tuple[dict[str, str], dict[str, Any] | None]:
        return record_with_answer(self._redis, job_id)

    def dead_letter(self, entry: dict[str, object]) -> None:
        self._redis.lpush(names.dead_letter_key(), encoding.to_text(entry))

    def dead_letters(self, limit: int = 100) -> list[dict[str, object]]:
        return [_dead_letter(raw) for raw in self._redis.lrange(names.dead_letter_key(), 0, limit - 1)]

    def dead_letter_count(self) -> int:
        return int(self._redis.llen(names.dead_letter_key()))

    def take_dead_letter(self) -> str | None:
        """Move the oldest entry to the processing list and return it as stored. It leaves that list
        only by `ack_dead_letter` (sent) or `return_dead_letter` (not sent): never lost in between."""
        raw = self._redis.lmove(names.dead_letter_key(), names.dead_letter_processing_key(), "RIGHT", "LEFT")
        return None if raw is None else str(raw)

    def ack_dead_letter(self, raw: str) -> None:
        self._redis.lrem(names.dead_letter_processing_key(), 1, raw)

    def return_dead_letter(self, raw: str, oldest: bool = True) -> None:
        """Back to the dead-letter list: as the oldest (where it came from) or as the newest (to skip it
        for the rest of a pass)."""
        with self._redis.pipeline() as pipe:  # MULTI/EXEC: in one list or the other, never neither
            pipe.lrem(names.dead_letter_processing_key(), 1, raw)
            (pipe.rpush if oldest else pipe.lpush)(names.dead_letter_key(), raw)
            pipe.execute()

    def recover_dead_letters(self) -> int:
        """Entries a requeue left in the processing list when it was killed go back, as the oldest."""
        moved = 0
        while self._redis.lmove(names.dead_letter_processing_key(), names.dead_letter_key(), "LEFT", "RIGHT"):
            moved += 1
        return moved

    def purge_dead_letters(self) -> int:
        count = int(self._redis.llen(names.dead_letter_key()))
        self._redis.delete(names.dead_letter_key())
        return count

    def list_lengths(self, keys: list[str]) -> int:
        with self._redis.pipeline() as pipe:
            for key in keys:
                pipe.llen(key)
            return sum(int(n) for n in pipe.execute())

    def reset_attempts(self, job_id: str, push_id: str) -> None:
        """A fresh start for a requeued dead letter: no attempts, no crash history, and the push id of
        its new message (what a resubmission checks its message by)."""
        key = names.job_key(job_id)
        with self._redis.pipeline() as pipe:
            # its run's progress (the ops page) no longer counts it finished
            pipe.eval(usage_book.UNCOUNT_RUN_SCRIPT, 1, key, names.run_record_key(""))
            fresh = {"attempts": "0", "solo_runs": "0", "state": "queued", "published": "1", "push": push_id}
            pipe.hset(key, mapping=fresh)  # type: ignore[arg-type]  # redis-py types mapping values narrowly
            runs_again = ("suspect_group", "dead_letter", "error_code", "error_message", "usage_counted")
            pipe.hdel(key, *runs_again, *store_faults.FIELDS)
            pipe.delete(names.answer_key(job_id))  # its earlier run's result is not its answer
            pipe.expire(key, RECORD_TTL_S)
            script, keys, args = backlog_share.hold_call(job_id)  # queued again: held again (review)
            pipe.eval(script, len(keys), *keys, *args)
            pipe.execute()

    def hold_backlog(self, job_id: str) -> None:
        """Hold a backlog job whose message is pushed again (shared/backlog_share.py), unless it ended;
        a job held already stays held once."""
        script, keys, args = backlog_share.hold_call(job_id)
        self._redis.eval(script, len(keys), *keys, *args)

    def count_usage(
        self,
        job_id: str,
        api_key: str | None,
        usage: dict[str, int],
        cache_hit: bool,
        done: ops_counts.Finished | None = None,
    ) -> bool:
        """Add a finished job's usage to its key's totals and keep it in its record, and `done` to the
        ops counts, once per job (shared/usage.py); True when counted now."""
        keys = [names.job_key(job_id), names.usage_totals_key(), *ops_counts.script_keys(time.time())]
        args = [*usage_book.count_args(api_key, usage, cache_hit), *ops_counts.script_args(done)]
        return bool(self._count_usage(keys=keys, args=args))

    def get_many(self, job_ids: list[str]) -> list[dict[str, str]]:
        """The records of a delivery's jobs in one round trip; a backlog job's record also says
        `run_cancelled: "1"` when its run was cancelled (one more round trip, for the delivery's runs):
        a job queued just before a cancel may not carry the cancel mark itself."""
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(names.job_key(job_id))
            records = [dict(record) for record in pipe.execute()]
        runs = sorted({record["run_id"] for record in records if record.get("run_id")})
        if runs:
            with self._redis.pipeline(transaction=False) as pipe:
                for run_id in runs:
                    pipe.hget(names.run_record_key(run_id), "state")
                cancelled = {
                    run for run, state in zip(runs, pipe.execute(), strict=True) if state == "cancelled"
                }
            for record in records:
                if record.get("run_id") in cancelled:
                    record["run_cancelled"] = "1"
        return records

    def store_fault(self, job_id: str, budget_s: float) -> int:
        """An S3 fault's retry, its attempt given back while the job's faults are under `budget_s`
        seconds old: the retries so far, or -1 past the budget (shared/store_faults.py)."""
        key = names.job_key(job_id)
        return int(self._store_fault(keys=[key], args=[repr(time.time()), budget_s, RECORD_TTL_S]))

    def begin(self, job_id: str) -> int:
        """Mark the job running and count the attempt; returns the attempt number (1 for the first)."""
        return self.begin_many([job_id])[0]

    def begin_many(self, job_ids: list[str], worker: str = "") -> list[int]:
        """`begin` for a delivery's jobs in one round trip (one MULTI/EXEC); `worker` names who runs
        them (shown by `mrc status`)."""
        if not job_ids:
            return []
        stamp = now_rfc3339()
        with self._redis.pipeline() as pipe:
            for job_id in job_ids:
                key = names.job_key(job_id)
                pipe.hincrby(key, "attempts", 1)
                pipe.hset(
                    key,
                    mapping={"state": "running", "updated_at": stamp, "started_at": stamp, "worker": worker},
                )
                pipe.expire(key, RECORD_TTL_S)
            replies = pipe.execute()
        return [int(replies[3 * i]) for i in range(len(job_ids))]

    def solo_run(self, job_id: str) -> int:
        """Count a run of the job alone (its group one, in the same transaction: a worker that dies
        between two writes must not leave a lone run counted under its last group's size); returns how
        many lone runs came before this one."""
        key = names.job_key(job_id)
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, "solo_runs", 1)
            pipe.hset(key, "suspect_group", "1")
            replies = pipe.execute()
        return int(replies[0]) - 1

    def withdraw_solo_run(self, job_id: str) -> None:
        """Take back the lone run `solo_run` counted last: it ended with the worker alive, and
        `solo_runs` counts the lone runs a worker died in (workers/admission.py)."""
        self._redis.hincrby(names.job_key(job_id), "solo_runs", -1)

    def suspect_group(self, job_ids: list[str], size: int) -> None:
        """Record that these suspects start a run together, `size` of them: if their worker dies again,
        each runs next in a group of half that size (workers/admission.py, suspect_groups)."""
        with self._redis.pipeline() as pipe:
            for job_id in job_ids:
                pipe.hset(names.job_key(job_id), "suspect_group", str(size))
            pipe.execute()

    def add_event(self, event: dict[str, str], keep: int) -> str:
        """Append a completion event to the capped stream (about `keep` newest kept), and an API key's
        job's also to that key's own stream (shared/tenants.py), in one round trip; the fleet stream's id.
        Each stream also lets go of events older than a job's record lives (RECORD_TTL_S), and a key's
        stream ends that long after its last event: each key's stream was capped alone and kept for
        good, so a fleet of keys held (keys + 1) times the cap, a rotated key's for ever (review,
        helper-115)."""
        fields = {key: value for key, value in event.items() if value is not None}
        owner = tenants.owner_of(str(event.get("job_id") or ""))
        oldest = f"{int((time.time() - RECORD_TTL_S) * 1000)}-0"  # stream ids begin with their ms time
        with self._redis.pipeline(transaction=False) as pipe:
            for key in (names.events_key(), *([names.events_key(owner)] if owner is not None else [])):
                pipe.xadd(key, fields, maxlen=keep, approximate=True)  # type: ignore[arg-type]
                pipe.xtrim(key, minid=oldest, approximate=False)  # exact: a few at a time
                if key != names.events_key():  # the fleet's stays: a wait's tail is read from it
                    pipe.expire(key, RECORD_TTL_S)
            return str(pipe.execute()[0])

    def events_after(self, after: str, block_s: float = 0.0, count: int = 1000) -> list[dict[str, str]]:
        """Completion events newer than `after` ("0": from the oldest kept), waiting up to `block_s`
        for the first; each with its stream id as `id`."""
        block = int(block_s * 1000) or None
        reply: Any = self._redis.xread({names.events_key(): after}, count=count, block=block)
        out: list[dict[str, str]] = []
        for _stream, entries in reply or []:
            for event_id, fields in entries:
                out.append({"id": str(event_id), **fields})
        return out

    def events_tail(self) -> str:
        """The newest completion event's id ("0-0" when there is none): a wait that reads the events
        after it from here on misses none that come after its first look at the job."""
        reply: Any = self._redis.xrevrange(names.events_key(), count=1)
        return str(reply[0][0]) if reply else "0-0"


def record_with_answer(client: redis.Redis, job_id: str) -> tuple[dict[str, str], dict[str, Any] | None]:
    """The record, and the result kept beside it (ANSWER_TTL_S) once it ended: one round trip."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(names.job_key(job_id))
        pipe.get(names.answer_key(job_id))
        record, answer = pipe.execute()
    return read_answer(dict(record), answer)


def read_answer(record: dict[str, str], answer: Any) -> tuple[dict[str, str], dict[str, Any] | None]:
    """A record and the result kept beside it, read: the result only where the record says the job
    ended (a copy left from an earlier run of the id, requeued since, is not its answer) and it reads
    as a result object (anything else: S3 is asked, as without it)."""
    if answer is None or record.get("state") not in ENDED:
        return record, None
    try:
        result = json.loads(answer)
    except ValueError:
        return record, None
    return record, result if isinstance(result, dict) and "status" in result else None


def unstored_result(job_id: str, record: dict[str, str]) -> dict[str, Any]:
    """What a wait returns for a job whose result could not be stored: failed, from its record
    (`Client.wait` and `GET /v1/jobs/ID/result` alike)."""
    return {
        "schema": "mrc.result/1",
        "job_id": job_id,
        "status": "failed",
        "text": None,
        "error": {
            "code": record.get("error_code", "internal_error"),
            "message": record.get("error_message", "the job ended without a stored result"),
            # as the worker's MRC_ERROR said (an internal error): the job is dead-lettered, and only
            # `mrc dlq requeue` runs it again (review, helper-124: true here, false in the log)
            "retryable": False,
        },
        "lane": record.get("lane", "interactive"),
        "result_stored": False,
        "finished_at": record.get("updated_at"),
    }


def _dead_letter(raw: Any) -> dict[str, object]:
    """An entry as stored; one that is no JSON object (put there by hand, or by another program) as what
    it is, `invalid` beside its first 2,000 characters: the runbook sends a person to look at it
    (review: `mrc dlq list` ended in a traceback, listing none)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    try:
        entry = json.loads(text)
    except (ValueError, RecursionError):
        entry = None
    if isinstance(entry, dict):
        return entry
    return {"invalid": "not a JSON object", "raw": text[:2000]}
