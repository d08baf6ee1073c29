"""A wait for a job's result (`Client.wait`, mrc-api's `GET /v1/jobs/ID/result?wait=` and chat
completions) answers as the job's completion event comes, not at its next poll of the record: the
polls are made a minute long here, three times each wait, so a wait that answers before its own end
was woken by the event (a poll would find the result only at the wait's end, or after it). Real Redis
and S3; the job's end is written as the worker's finisher writes it (result, record, then the event)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

from producer.client import Client
from producer.http import waits as api_waits
from scripts import devservices as services
from shared import redis_target
from shared.records import RedisJobRecords, connect

pytestmark = pytest.mark.integration

WAIT_S = 20.0  # each wait; the polls are 60 s
FINISHED = {"schema": "mrc.result/1", "status": "succeeded", "text": "yes"}


def _finish(client: Client, job_id: str) -> None:
    """What workers/finisher.py does as a job succeeds, an unrelated job's event first."""
    client.records.add_event({"job_id": f"other-{job_id}", "status": "succeeded"}, 1000)
    client.results.put_result(job_id, {**FINISHED, "job_id": job_id})
    client.records.set_state(job_id, "succeeded")
    client.records.add_event({"job_id": job_id, "status": "succeeded"}, 1000)


def _after(first_look: threading.Event, then: Any) -> threading.Thread:
    def run() -> None:
        assert first_look.wait(WAIT_S)
        then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_client_wait_answers_at_its_jobs_completion_event(env: dict[str, str], client: Client) -> None:
    client.results.ensure_bucket()
    settings = services.settings_from_env({**env, "MRC_WAIT_POLL_S": "60"})
    job_id = f"wake-{uuid.uuid4().hex[:10]}"
    assert client.records.claim(job_id, "interactive")  # queued
    first_look = threading.Event()

    class Looking(RedisJobRecords):
        def get_with_answer(self, key: str) -> tuple[dict[str, str], dict[str, Any] | None]:
            found = super().get_with_answer(key)
            first_look.set()  # the job is finished only after the wait's first look found it queued
            return found

    waiting = Client(settings)
    waiting._hints = Looking(connect(settings))  # a wait reads the record on the hints' connection
    finisher = _after(first_look, lambda: _finish(client, job_id))
    began = time.monotonic()
    try:
        result = waiting.wait(job_id, WAIT_S)
    finally:
        waiting.close()
    finisher.join()
    assert (result["job_id"], result["status"]) == (job_id, "succeeded")
    assert time.monotonic() - began < WAIT_S / 2  # well before the wait's end: not a poll's doing


def test_an_api_result_wait_answers_at_its_jobs_completion_event(
    env: dict[str, str], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.results.ensure_bucket()
    monkeypatch.setattr(api_waits, "RECORD_POLL_S", 60.0)
    monkeypatch.setattr(api_waits, "S3_EVERY_S", 60.0)
    waits = api_waits.Waits(services.settings_from_env(env), 4)
    job_id = f"wake-{uuid.uuid4().hex[:10]}"
    assert client.records.claim(job_id, "interactive")
    first_look = threading.Event()

    def read_result(key: str) -> dict[str, Any] | None:
        found = client.result(key)
        if waits.completions.following.wait(WAIT_S):  # the follower reads the stream from here on
            first_look.set()
        return found

    finisher = _after(first_look, lambda: _finish(client, job_id))
    began = time.monotonic()
    try:
        found = asyncio.run(waits.result(job_id, WAIT_S, read_result))
    finally:
        waits.close()
    finisher.join()
    assert isinstance(found, dict), found  # "queued": woken by nothing, the wait ran out
    assert (found["job_id"], found["status"]) == (job_id, "succeeded")
    assert time.monotonic() - began < WAIT_S / 2  # well before the wait's end: not a poll's doing


def test_the_follower_wakes_only_the_waits_for_the_job_that_ended(
    env: dict[str, str], client: Client
) -> None:
    waits = api_waits.Waits(services.settings_from_env(env), 4)
    mine, other = f"wake-{uuid.uuid4().hex[:10]}", f"wake-{uuid.uuid4().hex[:10]}"

    async def watch() -> tuple[bool, bool]:
        with waits.completions.watching(mine) as completed:
            assert await asyncio.to_thread(waits.completions.following.wait, WAIT_S)
            client.records.add_event({"job_id": other, "status": "succeeded"}, 1000)
            client.records.add_event({"job_id": f"{mine}-not", "status": "failed"}, 1000)
            early = await _set_within(completed, 1.0)
            client.records.add_event({"job_id": mine, "status": "failed"}, 1000)
            return early, await _set_within(completed, WAIT_S)

    try:
        early, woken = asyncio.run(watch())
    finally:
        waits.close()
    assert not early  # other jobs' events (a longer id beginning with this one's too) woke nothing
    assert woken
    assert waits.completions._waiting == {}  # every wait's entry is gone with it


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


def test_closing_the_follower_never_blocks(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A review finding: close() joined the follower, whose read blocks up to READ_MS, on the API's event
    loop at shutdown (and behind a frozen Redis, left it blocked). Now close() returns at once: it drops
    the follower's connection, which ends a read in progress (a read just starting runs its READ_MS out,
    the follower a daemon thread that ends there)."""
    from producer.http import completions

    monkeypatch.setattr(completions, "READ_MS", 60_000)  # a read past the socket timeout (10 s)
    waits = api_waits.Waits(services.settings_from_env(env), 4)

    async def start() -> None:
        with waits.completions.watching("nobody"):
            assert await asyncio.to_thread(waits.completions.following.wait, WAIT_S)

    asyncio.run(start())
    # A read ended by the dropped connection is not made again (redis-py retries a command 10 times by
    # default, reconnecting).
    assert waits.completions._client.get_retry()._retries == 0
    closing = threading.Thread(target=waits.close, daemon=True)
    closing.start()
    closing.join(5)  # joined, the follower would hold it 10 s at least
    assert not closing.is_alive()


def test_a_follower_that_loses_the_stream_says_so_once_and_the_waits_poll(
    env: dict[str, str], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs

    from producer.http import completions

    monkeypatch.setattr(completions, "RETRY_S", 0.05)
    client.results.ensure_bucket()
    refused = completions.Completions(lambda: (_ for _ in ()).throw(ConnectionError("Redis refused")))
    waits = api_waits.Waits(services.settings_from_env(env), 4)
    waits.completions.close()
    waits.completions = refused
    job_id = f"wake-{uuid.uuid4().hex[:10]}"
    assert client.records.claim(job_id, "interactive")
    finisher = threading.Timer(0.5, lambda: _finish(client, job_id))
    with capture_logs() as logged:
        finisher.start()
        try:
            found = asyncio.run(waits.result(job_id, WAIT_S, client.result))  # polls every 0.25 s
        finally:
            finisher.join()
            refused.close()
            waits.close()
    assert isinstance(found, dict), found
    assert found["status"] == "succeeded"
    told = [entry for entry in logged if entry["event"] == "MRC_COMPLETIONS_UNFOLLOWED"]
    assert len(told) == 1, told  # once for the outage, not once a retry
    assert "Redis refused" in told[0]["error"]


def test_a_client_waits_stream_reads_never_retry_and_time_out_soon(env: dict[str, str]) -> None:
    """A review finding: the hint reads went through the records' connection (10 s socket timeout, 3
    retries): a frozen Redis made each read of the stream cost ~40 s more than the wait before it."""
    waiting = Client(services.settings_from_env(env))
    try:
        hints = waiting._events()
        kwargs = hints._redis.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        assert kwargs["socket_timeout"] <= 3
        assert kwargs["retry"]._retries == 0
        assert hints.events_tail()  # and it reads the stream
    finally:
        waiting.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the one made to end
def test_a_follower_that_ended_or_never_started_is_started_by_the_next_wait(
    env: dict[str, str], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review finding: the follower was started once; a thread that could not start (its error went
    to the request) or that ended (a log call failing in its error path) left every later wait to poll
    for the life of the process. Now the next wait starts it, and its log failing does not end it."""
    from producer.http import completions

    monkeypatch.setattr(completions, "RETRY_S", 0.05)
    settings = services.settings_from_env(env)
    connects = iter(["no thread", "refused", "exits"])

    def connect() -> Any:
        trouble = next(connects, None)
        if trouble == "refused":
            raise ConnectionError("Redis refused")  # logged by a logger that fails: the thread goes on
        if trouble == "exits":
            raise SystemExit  # the thread ends (not an Exception: nothing in it catches it)
        return redis_target.client(settings, decode_responses=True)

    thread = threading.Thread

    class Unstartable(thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    class Failing:
        def warning(self, *_args: Any, **_kwargs: Any) -> None:
            raise OSError("stdout is gone")

    follower = completions.Completions(connect)
    mine = f"wake-{uuid.uuid4().hex[:10]}"

    async def waits() -> bool:
        monkeypatch.setattr(completions.threading, "Thread", Unstartable)
        with follower.watching(mine):  # the thread cannot start: the wait goes on, polling
            assert follower._thread is None
        next(connects)  # that start never connected
        monkeypatch.setattr(completions.threading, "Thread", thread)
        monkeypatch.setattr(completions.logs, "get_logger", lambda: Failing())
        with follower.watching(mine):  # starts it: refused (its log fails), then it ends
            ended = follower._thread
            assert ended is not None
            await asyncio.to_thread(ended.join, WAIT_S)
            assert not ended.is_alive()
        with follower.watching(mine) as completed:  # starts it again: it follows
            assert follower._thread is not ended
            assert await asyncio.to_thread(follower.following.wait, WAIT_S)
            client.records.add_event({"job_id": mine, "status": "succeeded"}, 1000)
            return await _set_within(completed, WAIT_S)

    try:
        assert asyncio.run(waits())
    finally:
        follower.close()
    assert follower._waiting == {}
