"""OpenAI-style batches in Redis: each batch's record (state, times, file ids, counts once final), the
owner's list of batches by age (paged), the set of batches in flight, per-batch leases (one mrc-api
process enqueues or finalizes a batch at a time), and Idempotency-Key mappings. A batch id is also its
backlog run's id (shared/runs.py keeps the run's own record)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from shared import names
from shared.runs import RUN_TTL_S

FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
IDEMPOTENCY_TTL_S = 24 * 3600
IDEMPOTENT_WAIT_S = 10.0  # a request meeting its twin at work waits this long for what it makes
T = TypeVar("T")
_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

# KEYS[1] a lease; ARGV: token, ttl. Renew only the holder's lease. 1 if renewed.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS[1] a batch; ARGV: the statuses it may move from ("|"-joined), then field, value pairs. The move
# happens only from one of those statuses and only if nothing ended the batch yet: a cancel and the
# start of finalizing cannot both win. 1 if it moved.
_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or redis.call('HGET', KEYS[1], 'ended_by') then return 0 end
if not string.find('|' .. ARGV[1] .. '|', '|' .. status .. '|', 1, true) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""
# KEYS[1] a batch's record; ARGV: its fields. Set unless the batch is final already (or gone).
_UNLESS_FINAL = """
local status = redis.call('HGET', KEYS[1], 'status')
local final = {completed = true, failed = true, expired = true, cancelled = true}
if not status or final[status] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
# KEYS[1] an owner's listing; ARGV: the id to start after ("" for the newest), how many. One step: a
# batch created between finding the id's rank and reading on would shift the page onto the id itself
# (review: 20 of 24 walks with `after` repeated a batch while the key created more). False: no such id.
_PAGE = """
local start = 0
if ARGV[1] ~= '' then
  local rank = redis.call('ZREVRANK', KEYS[1], ARGV[1])
  if not rank then return false end
  start = rank + 1
end
return redis.call('ZREVRANGE', KEYS[1], start, start + tonumber(ARGV[2]) - 1)
"""
RUNNING = ("validating", "in_progress")  # a batch still taking its requests: it may end or finalize


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


# The key names ARGV[2] if it named nothing or ARGV[1]; the id it names now (chat's retries use it too).
REMAP_SCRIPT = """
local now = redis.call('GET', KEYS[1])
if now == false or now == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
return now
"""


class BatchBook:
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._remap = client.register_script(REMAP_SCRIPT)
        self._move = client.register_script(_MOVE)
        self._unless_final = client.register_script(_UNLESS_FINAL)
        self._page = client.register_script(_PAGE)

    def create(self, batch_id: str, owner: str, fields: dict[str, str]) -> None:
        key, listing = names.batch_key(batch_id), names.batches_key(owner)
        with self._redis.pipeline() as pipe:  # MULTI: listed and in flight together, or neither
            record = {**fields, "owner": owner}
            pipe.hset(key, mapping=record)  # type: ignore[arg-type]  # str values
            pipe.expire(key, RUN_TTL_S)
            pipe.zadd(listing, {batch_id: float(fields["created_at"])})
            # the ids whose records have expired (RUN_TTL_S after their creation): only a page that
            # met them let them go before, so a busy key's list grew by a batch a batch (helper-115)
            pipe.zremrangebyscore(listing, "-inf", float(fields["created_at"]) - RUN_TTL_S)
            pipe.expire(listing, RUN_TTL_S)
            pipe.sadd(names.active_batches_key(), batch_id)
            pipe.execute()

    def get(self, batch_id: str) -> dict[str, str]:
        return dict(self._redis.hgetall(names.batch_key(batch_id)))  # type: ignore[arg-type]  # decoded

    def update(self, batch_id: str, **fields: str) -> None:
        self._redis.hset(names.batch_key(batch_id), mapping=fields)  # type: ignore[arg-type]  # str values

    def update_unless_final(self, batch_id: str, **fields: str) -> bool:
        """Set `fields` unless the batch is final already (atomic: another process's finalize that
        won is never overwritten); whether they were set."""
        pairs = [item for pair in fields.items() for item in pair]
        return bool(self._unless_final(keys=[names.batch_key(batch_id)], args=pairs))

    def move(self, batch_id: str, allowed: tuple[str, ...], **fields: str) -> bool:
        """Set `fields` only while the batch is in one of the `allowed` statuses and nothing ended it
        (atomic: of a cancel and the start of finalizing, exactly one wins); whether it moved."""
        pairs = [item for pair in fields.items() for item in pair]
        return bool(self._move(keys=[names.batch_key(batch_id)], args=["|".join(allowed), *pairs]))

    def set_if_absent(self, batch_id: str, field: str, value: str) -> str:
        """The field's value, set to `value` unless it had one."""
        key = names.batch_key(batch_id)
        self._redis.hsetnx(key, field, value)
        return str(self._redis.hget(key, field))

    def page(self, owner: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Up to `limit` of the owner's batch ids, newest first, after the id `after`."""
        found = self._page(keys=[names.batches_key(owner)], args=[after or "", limit + 1])
        if not found:
            return [], False
        ids = [str(i) for i in found]
        return ids[:limit], len(ids) > limit

    def forget(self, owner: str, batch_id: str) -> None:
        """A listed batch whose record expired."""
        self._redis.zrem(names.batches_key(owner), batch_id)

    def active(self) -> list[str]:
        return sorted(str(i) for i in self._redis.smembers(names.active_batches_key()))

    def settle(self, batch_id: str) -> None:
        self._redis.srem(names.active_batches_key(), batch_id)

    # ---- leases: who works on a batch now ----
    def lease(self, batch_id: str, what: str, ttl_s: int) -> str | None:
        token = secrets.token_hex(8)
        taken = self._redis.set(names.batch_lease_key(batch_id, what), token, nx=True, ex=ttl_s)
        return token if taken else None

    def renew(self, batch_id: str, what: str, token: str, ttl_s: int) -> bool:
        return bool(self._renew(keys=[names.batch_lease_key(batch_id, what)], args=[token, ttl_s]))

    def release(self, batch_id: str, what: str, token: str) -> None:
        self._release(keys=[names.batch_lease_key(batch_id, what)], args=[token])

    def held(self, batch_id: str, what: str) -> bool:
        return bool(self._redis.exists(names.batch_lease_key(batch_id, what)))

    # ---- Idempotency-Key ----
    def idempotent(
        self, scope: str, owner: str, key: str, new_id: str, ttl_s: int = IDEMPOTENCY_TTL_S
    ) -> tuple[str, bool]:
        """The object an Idempotency-Key names (`new_id` if it names none yet), and whether it is new."""
        mapping = names.idempotency_key(scope, owner, key_digest(key))
        if self._redis.set(mapping, new_id, nx=True, ex=ttl_s):
            return new_id, True
        return str(self._redis.get(mapping)), False

    def remap(self, scope: str, owner: str, key: str, old_id: str, new_id: str, ttl_s: int) -> str:
        """The key names `new_id` instead of `old_id`, unless it names another already (a copy of the
        same request got there first): the id it names now."""
        mapping = names.idempotency_key(scope, owner, key_digest(key))
        return str(self._remap(keys=[mapping], args=[old_id, new_id, ttl_s]))

    def made(
        self, scope: str, owner: str, key: str, object_id: str, look: Callable[[], T | None]
    ) -> T | None:
        """What a request under the same Idempotency-Key is making at once (`object_id`), once `look`
        finds it: waited for up to IDEMPOTENT_WAIT_S while the key still names it (review: the losers
        were answered 409 while a large input was copied, more than the SDK's two retries wait). None
        when it is not made in time, or could not be made (the key was forgotten: a retry makes it)."""
        mapping = names.idempotency_key(scope, owner, key_digest(key))
        until = time.monotonic() + IDEMPOTENT_WAIT_S
        while (found := look()) is None and time.monotonic() < until:
            if self._redis.get(mapping) != object_id:
                return None
            time.sleep(0.2)  # each look is an S3 or Redis read: 50 in the whole wait, not 200 (review)
        return found

    def unmap(self, scope: str, owner: str, key: str) -> None:
        """Forget a mapping whose object could not be made (a retry then makes it afresh)."""
        self._redis.delete(names.idempotency_key(scope, owner, key_digest(key)))

    def unmap_deleted(self, scope: str, owner: str, digest: str, object_id: str) -> None:
        """Forget the mapping of a key whose object was deleted, if it still names that object: a retry
        under the key then makes a new one (review: it waited 10 s for a file that would never come
        back, then answered 409 "retry shortly", for the mapping's whole day)."""
        self._release(keys=[names.idempotency_key(scope, owner, digest)], args=[object_id])


def key_digest(key: str) -> str:
    """What a mapping (and a file's description) keeps of an Idempotency-Key: never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def batch_object(record: dict[str, str], counts: dict[str, int], usage: dict[str, int]) -> dict[str, Any]:
    """A batch as OpenAI's `batch` object."""
    times = {name: int(float(record[name])) if record.get(name) else None for name in _TIMES}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "id": record["id"],
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": json.loads(record["errors"]) if record.get("errors") else None,
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": record["status"],
        "output_file_id": record.get("output_file_id") or None,
        "error_file_id": record.get("error_file_id") or None,
        **times,
        "request_counts": {
            "total": counts.get("total", 0),
            "completed": counts.get("completed", 0),
            "failed": counts.get("failed", 0),
        },
        "metadata": json.loads(record["metadata"]) if record.get("metadata") else None,
        "model": record.get("model") or None,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": usage.get("cached_prompt_tokens", 0),
                "image_tokens": usage.get("image_tokens", 0),
            },
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def now() -> str:
    return f"{time.time():.3f}"
