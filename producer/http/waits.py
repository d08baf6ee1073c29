"""mrc-api's long-polls, on threads and Redis connections of their own (a bounded pool each): a
waiting request never holds a thread of the request pool, so a hundred idle followers do not stall
submissions, status reads or /readyz.

Every blocking Redis call is cut into slices shorter than the connection's socket timeout (a read never
outlives the client's own timeout, however long the caller may wait), and S3 is read at a bounded rate
while a result is awaited: the job record is followed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.http.completions import Completions
from shared import names, redis_target
from shared.records import TERMINAL, record_with_answer, unstored_result
from shared.settings import Settings

SOCKET_TIMEOUT_S = 10.0
SLICE_S = 5.0  # one XREAD BLOCK at most this long: well inside SOCKET_TIMEOUT_S
RECORD_POLL_S = 0.25
S3_EVERY_S = 1.0  # at most one S3 read a second per waiting request
LAST_TICK_READ_S = 0.01  # within a long-poll's last server tick, reads that do not block this often

T = TypeVar("T")
ReadResult = Callable[[str], dict[str, Any] | None]


class Waits:
    """The long-polls' own threads and Redis pool, and the waits built on them."""

    def __init__(self, settings: Settings, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mrc-wait")
        self.share = max(1, threads // 2)  # the most event waits one caller blocks in at once
        self._waiting: dict[str, int] = {}  # event waits in progress per caller (the event loop's only)
        timeout = settings.connect_timeout_s
        self._probe = redis_target.client(settings, socket_timeout=timeout, socket_connect_timeout=timeout)
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_connect_timeout": settings.connect_timeout_s,
        }
        if redis_target.uses_sentinel(settings):
            # One connection per thread at most (each wait holds one): a plain pool of that size never
            # runs out, and it follows the master Sentinel names.
            self._redis = redis_target.client(settings, max_connections=threads, **options)
        else:
            connections = redis.BlockingConnectionPool.from_url(
                settings.redis_url,
                max_connections=threads,
                timeout=SOCKET_TIMEOUT_S,  # a free connection, else ConnectionError (a 503)
                **options,
            )
            self._redis = redis.Redis(connection_pool=connections)
        # The result waits' wake-ups: one follower of the completion events, on its own connection.
        # It retries nothing itself (it starts again from the newest event), and its connection, dropped
        # by close(), must not be made again under a read in progress (redis-py retries by default).
        follower = {**options, "retry": Retry(NoBackoff(), 0)}
        self.completions = Completions(lambda: redis_target.client(settings, **follower))

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self.completions.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._redis.close()
        self._probe.close()

    async def record(self, job_id: str) -> dict[str, str]:
        record: dict[str, str] = await self._run(partial(self._redis.hgetall, names.job_key(job_id)))  # type: ignore[arg-type]  # decode_responses
        return dict(record)

    async def ping(self) -> None:
        """Redis answers: on a connection and a thread of its own (the probe must not queue behind
        long-polls holding every wait thread and connection: review)."""
        await asyncio.get_running_loop().run_in_executor(None, self._probe.ping)

    def _read_events(
        self, after: str, block_ms: int | None, count: int, owner: str | None
    ) -> list[dict[str, str]]:
        reply: Any = self._redis.xread({names.events_key(owner): after}, count=count, block=block_ms)
        return [
            {"id": str(event_id), **fields} for _s, entries in reply or [] for event_id, fields in entries
        ]

    def _read_stream(self, key: str, after: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        reply: Any = self._redis.xread({key: after}, count=1000, block=block_ms)
        return [(str(entry_id), fields) for _s, entries in reply or [] for entry_id, fields in entries]

    async def stream(self, key: str, after: str, wait_s: float) -> list[tuple[str, dict[str, str]]]:
        """A streamed job's entries after `after` (producer/openai/chat_stream.py), waiting up to
        `wait_s` (one slice: callers ask for less than SLICE_S) for the first."""
        block_ms = max(1, int(min(SLICE_S, wait_s) * 1000))
        return await self._run(partial(self._read_stream, key, after, block_ms))

    async def events(
        self, after: str, wait_s: float, count: int = 1000, owner: str | None = None, who: str | None = None
    ) -> list[dict[str, str]]:
        """Completion events after `after` (of the fleet, or of one key's jobs), waiting up to `wait_s`
        for the first, in slices. A key (`who`) holding half the threads in such waits
        already is answered at once with what there is (review: one key's 360 waits held every
        thread, and other keys' waits and /readyz queued behind them): it polls, it does not block."""
        if who is None:  # keys off: callers are one (behind a proxy, one address), no share
            return await self._events(after, wait_s, count, owner)
        if self._waiting.get(who, 0) >= self.share:
            wait_s = 0.0
        self._waiting[who] = self._waiting.get(who, 0) + 1
        try:
            return await self._events(after, wait_s, count, owner)
        finally:
            left = self._waiting.pop(who) - 1
            if left:
                self._waiting[who] = left

    async def _events(self, after: str, wait_s: float, count: int, owner: str | None) -> list[dict[str, str]]:
        deadline = time.monotonic() + wait_s
        while True:
            # A blocked read's timeout can end a server tick late (redis_target.SERVER_TICK_S): no
            # slice reaches past the deadline; within the last tick the stream is read without
            # blocking every LAST_TICK_READ_S, so what comes then is still returned as it comes.
            left = deadline - time.monotonic()
            room = min(SLICE_S, left - redis_target.SERVER_TICK_S)
            block = int(room * 1000) if room >= 0.005 else None
            found = await self._run(partial(self._read_events, after, block, count, owner))
            left = deadline - time.monotonic()
            if found or left <= 0:
                return found
            if block is None:
                await asyncio.sleep(min(LAST_TICK_READ_S, left))

    async def result(
        self, job_id: str, wait_s: float, read_result: ReadResult, queued_now: bool = False
    ) -> dict[str, Any] | str:
        """The result (or, for a job that ended without a stored one, the failed result its record
        describes, `result_stored: false`), else the job's state when the wait ends ("unknown": no
        such job).

        The record is read as the job's completion event comes (producer/http/completions.py), and
        every RECORD_POLL_S whatever comes; S3 as soon as the record says the job ended, and at most
        every S3_EVERY_S otherwise, whatever it says (an update of the record may have been lost).
        No record and no result: no such job. `queued_now`: the caller has just queued the job, so S3
        is not read first unless the record says it ended or has none (a chat's answer: its first
        read found nothing, every time, and cost a request to S3)."""
        if wait_s <= 0:  # one look: nothing to wake (and no follower started for it)
            return await self._result(job_id, wait_s, read_result, asyncio.Event(), queued_now)
        with self.completions.watching(job_id) as completed:
            return await self._result(job_id, wait_s, read_result, completed, queued_now)

    async def _result(
        self,
        job_id: str,
        wait_s: float,
        read_result: ReadResult,
        completed: asyncio.Event,
        queued_now: bool,
    ) -> dict[str, Any] | str:
        deadline = time.monotonic() + wait_s
        # the first pass reads S3, unless the job was queued just now
        next_look = time.monotonic() + S3_EVERY_S if queued_now else 0.0
        ended_seen = False
        while True:
            completed.clear()  # a completion from here on wakes the pause below
            record, answer = await self._run(partial(record_with_answer, self._redis, job_id))
            if answer is not None:  # the result as stored, kept beside the record: no S3 read
                return answer
            state = record.get("state")
            now = time.monotonic()
            ended_now = state in TERMINAL and not ended_seen
            if ended_now or state is None or now >= next_look:
                next_look, ended_seen = now + S3_EVERY_S, state in TERMINAL
                found = await self._run(partial(read_result, job_id))
                if found is not None:
                    return found
                if state is None:
                    return "unknown"
                if state == "failed" and record.get("error_code"):
                    return unstored_result(job_id, record)
            if time.monotonic() >= deadline:
                return str(state)
            pause = min(RECORD_POLL_S, max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(completed.wait(), pause)
