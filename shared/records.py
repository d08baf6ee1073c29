"""Job records in Redis: the state a job is in, for `mrc status` and for running a job id once."""

from __future__ import annotations

import json
import threading
from typing import Protocol

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared import names
from shared.jobs import State, now_rfc3339

RECORD_TTL_S = 7 * 24 * 3600


def connect(url: str, connect_timeout: float = 5.0, retries: int = 10) -> redis.Redis:
    """A client that rides out a Redis restart: reconnects and retries with exponential backoff
    (about 30 s in all with the default 10 retries: right for a worker, too long for a person at a
    command line, who gets fewer) instead of failing the first command after the connection dropped."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=10,
        socket_connect_timeout=connect_timeout,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=5.0, base=0.1), retries=retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


TERMINAL: frozenset[str] = frozenset({"succeeded", "failed"})


class JobRecords(Protocol):
    def claim(self, job_id: str, lane: str) -> bool: ...
    def release(self, job_id: str) -> None: ...
    def set_state(self, job_id: str, state: State, **fields: str) -> None: ...
    def get(self, job_id: str) -> dict[str, str]: ...
    def begin(self, job_id: str) -> int: ...
    def dead_letter(self, entry: dict[str, object]) -> None: ...


class RedisJobRecords:
    """One Redis hash per job. `claim` is atomic: the first submitter of a job id wins."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    @classmethod
    def from_url(cls, url: str) -> RedisJobRecords:
        return cls(connect(url))

    def claim(self, job_id: str, lane: str) -> bool:
        key = names.job_key(job_id)
        if not self._redis.hsetnx(key, "state", "queued"):
            return False
        self._redis.hset(key, mapping={"lane": lane, "submitted_at": now_rfc3339()})
        self._redis.expire(key, RECORD_TTL_S)
        return True

    def release(self, job_id: str) -> None:
        """Undo a claim whose message never reached the queue."""
        self._redis.delete(names.job_key(job_id))

    def set_state(self, job_id: str, state: State, **fields: str) -> None:
        key = names.job_key(job_id)
        with self._redis.pipeline() as pipe:
            mapping: dict[str, str] = {"state": state, "updated_at": now_rfc3339(), **fields}
            pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
            pipe.expire(key, RECORD_TTL_S)
            pipe.execute()

    def get(self, job_id: str) -> dict[str, str]:
        record: dict[str, str] = self._redis.hgetall(names.job_key(job_id))  # type: ignore[assignment]
        return dict(record)

    def dead_letter(self, entry: dict[str, object]) -> None:
        self._redis.lpush(names.dead_letter_key(), json.dumps(entry, ensure_ascii=False))

    def dead_letters(self, limit: int = 100) -> list[dict[str, object]]:
        return [json.loads(raw) for raw in self._redis.lrange(names.dead_letter_key(), 0, limit - 1)]

    def pop_dead_letter(self) -> dict[str, object] | None:
        raw = self._redis.rpop(names.dead_letter_key())
        return None if raw is None else dict(json.loads(raw))  # type: ignore[arg-type]

    def purge_dead_letters(self) -> int:
        count = int(self._redis.llen(names.dead_letter_key()))  # type: ignore[arg-type]
        self._redis.delete(names.dead_letter_key())
        return count

    def list_lengths(self, keys: list[str]) -> int:
        with self._redis.pipeline() as pipe:
            for key in keys:
                pipe.llen(key)
            return sum(int(n) for n in pipe.execute())

    def reset_attempts(self, job_id: str) -> None:
        self._redis.hset(names.job_key(job_id), mapping={"attempts": "0", "state": "queued"})

    def begin(self, job_id: str) -> int:
        """Mark the job running and count the attempt; returns the attempt number (1 for the first)."""
        key = names.job_key(job_id)
        with self._redis.pipeline() as pipe:
            pipe.hincrby(key, "attempts", 1)
            pipe.hset(key, mapping={"state": "running", "updated_at": now_rfc3339()})
            pipe.expire(key, RECORD_TTL_S)
            attempts = pipe.execute()[0]
        return int(attempts)


class MemoryJobRecords:
    """In-process twin of RedisJobRecords for unit tests."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, str]] = {}
        self.dlq: list[dict[str, object]] = []
        self._lock = threading.Lock()

    def claim(self, job_id: str, lane: str) -> bool:
        with self._lock:
            if job_id in self.records:
                return False
            self.records[job_id] = {"state": "queued", "lane": lane}
            return True

    def release(self, job_id: str) -> None:
        with self._lock:
            self.records.pop(job_id, None)

    def set_state(self, job_id: str, state: State, **fields: str) -> None:
        with self._lock:
            self.records.setdefault(job_id, {}).update({"state": state, **fields})

    def get(self, job_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self.records.get(job_id, {}))

    def dead_letter(self, entry: dict[str, object]) -> None:
        with self._lock:
            self.dlq.append(dict(entry))

    def begin(self, job_id: str) -> int:
        with self._lock:
            record = self.records.setdefault(job_id, {})
            attempts = int(record.get("attempts", "0")) + 1
            record.update({"state": "running", "attempts": str(attempts)})
            return attempts
