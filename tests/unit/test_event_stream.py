"""The in-process records' completion events behave as the Redis stream does for the waits that wake
on them (producer/queue/sender.py `Queue.wait`): ids that only grow, past the cap too, and a read that
blocks until a newer event comes. And how `Client.wait` blocks on them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from producer.client import Client
from producer.http.waits import Waits
from scripts import devservices as services
from shared import names
from shared.memory_records import MemoryJobRecords
from shared.records import RECORD_TTL_S, RedisJobRecords
from shared.redis_target import SERVER_TICK_S
from shared.settings import Settings
from shared.stores.memory import MemoryStore


def test_ids_keep_growing_once_the_stream_is_capped_and_a_read_after_the_tail_sees_what_comes() -> None:
    records = MemoryJobRecords()
    for n in range(5):
        records.add_event({"job_id": f"old-{n}"}, keep=3)
    tail = records.events_tail()
    assert tail == "5-0"
    assert [e["job_id"] for e in records.events_after("0-0")] == ["old-2", "old-3", "old-4"]
    assert records.add_event({"job_id": "mine"}, keep=3) == "6-0"
    assert records.events_tail() == "6-0"
    assert [(e["id"], e["job_id"]) for e in records.events_after(tail)] == [("6-0", "mine")]


def test_a_blocking_read_wakes_as_an_event_comes_past_the_cap() -> None:
    records = MemoryJobRecords()
    for n in range(3):
        records.add_event({"job_id": f"old-{n}"}, keep=3)
    tail = records.events_tail()
    adding = threading.Timer(0.2, lambda: records.add_event({"job_id": "mine"}, keep=3))
    adding.start()
    try:
        found = records.events_after(tail, block_s=30)  # before: the cap kept the count, nothing woke it
    finally:
        adding.join()
    assert [e["job_id"] for e in found] == ["mine"]


class _Recording(MemoryJobRecords):
    """Records each read of the stream: when it began and how long it asked to block."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[float, float]] = []

    def events_after(self, after: str, block_s: float = 0.0, count: int = 1000) -> list[dict[str, str]]:
        self.reads.append((time.monotonic(), block_s))
        return super().events_after(after, block_s, count)


def _waiting(poll_s: float) -> tuple[Client, _Recording]:
    store, records = MemoryStore("mrc"), _Recording()
    return Client(Settings(wait_poll_s=poll_s), images=store, results=store, records=records), records


def test_a_client_waits_reads_of_the_stream_end_a_server_tick_before_its_deadline() -> None:
    """A review finding: Redis ends a blocked read's timeout on its timer tick (every 100 ms), and the
    wait's last read blocked right up to its deadline, so wait(t) returned up to ~0.1 s past t on a
    quiet Redis (measured on redis 7). No read may block past the deadline less a tick."""
    client, records = _waiting(0.25)
    deadline = time.monotonic() + 0.7
    with pytest.raises(TimeoutError):
        client.wait("never-ends", 0.7)
    blocking = [(began, block) for began, block in records.reads if block > 0]
    assert blocking  # it waited on the stream, not only slept
    latest = max(began + block for began, block in blocking)
    assert latest <= deadline - SERVER_TICK_S + 0.05, (latest, deadline)
    # The last tick is read without blocking (an event then still wakes the wait), not slept blind.
    assert any(began > deadline - SERVER_TICK_S for began, block in records.reads if block == 0)


def test_a_client_wait_polling_faster_than_a_server_tick_never_blocks_on_the_stream() -> None:
    """MRC_WAIT_POLL_S below Redis's tick: a blocked read of 20 ms came back after ~100 ms, so the
    record was read every 0.1 s, not as often as asked. Such a wait sleeps between looks."""
    client, records = _waiting(0.02)
    with pytest.raises(TimeoutError):
        client.wait("never-ends", 0.2)
    assert [block for _began, block in records.reads if block > 0] == []


class _Failing(_Recording):
    """A stream whose reads fail for a while (Redis away, a failover), then come back."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def events_after(self, after: str, block_s: float = 0.0, count: int = 1000) -> list[dict[str, str]]:
        if self.failures:
            self.failures -= 1
            self.reads.append((time.monotonic(), -1.0))
            raise ConnectionError("the stream is away")
        return super().events_after(after, block_s, count)


def test_a_client_wait_goes_back_to_the_stream_after_a_failed_read() -> None:
    """After one failed read a wait only polled for the rest of its time (left out in an earlier
    session): it finds the stream's tail again within a second and blocks on it once more."""
    store, records = MemoryStore("mrc"), _Failing(failures=1)
    client = Client(Settings(wait_poll_s=0.25), images=store, results=store, records=records)
    with pytest.raises(TimeoutError):
        client.wait("never-ends", 2.5)
    failed = [began for began, block in records.reads if block < 0]
    assert len(failed) == 1
    assert [block for began, block in records.reads if began > failed[0] and block > 0]  # back on it


class _Away(_Recording):
    """Records Redis cannot answer for (a restart): every read of a job's record fails."""

    def get(self, job_id: str) -> dict[str, str]:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def test_a_client_wait_rides_out_redis_away_and_finds_the_result_in_s3() -> None:
    """Review (helper-48): `mrc submit --wait` exited 5 ("nothing enqueued") with nothing on stdout
    when Redis restarted during the wait, for a job that was queued and then succeeded. The wait
    looks at the result object while the record cannot be read, and a timeout names the fault."""
    store, records = MemoryStore("mrc"), _Away()
    client = Client(Settings(wait_poll_s=0.1), images=store, results=store, records=records)
    with pytest.raises(TimeoutError, match="Connection refused"):
        client.wait("queued-before", 0.5)
    done = {"job_id": "queued-before", "status": "succeeded", "text": "yes"}
    threading.Timer(0.3, lambda: store.put_result("queued-before", done)).start()
    assert client.wait("queued-before", 10)["text"] == "yes"


def test_an_api_events_long_poll_never_blocks_past_its_deadline_less_a_server_tick() -> None:
    """`GET /v1/events?wait=` as `Client.wait`: its last slice blocked up to the deadline, and Redis
    ended it up to a tick later. The reads are recorded here, none sent (nothing listens)."""
    waits = Waits(Settings(), 2)
    reads: list[tuple[float, int | None]] = []

    def read(after: str, block_ms: int | None, count: int, owner: str | None) -> list[dict[str, str]]:
        reads.append((time.monotonic(), block_ms))
        if block_ms:
            time.sleep(block_ms / 1000)  # a quiet stream: the read waits its time out
        return []

    waits._read_events = read  # type: ignore[method-assign]
    deadline = time.monotonic() + 0.6
    try:
        assert asyncio.run(waits.events("0-0", 0.6)) == []
    finally:
        waits.close()
    blocking = [(began, block) for began, block in reads if block]
    assert blocking  # it blocked on the stream
    assert max(began + block / 1000 for began, block in blocking) <= deadline - SERVER_TICK_S + 0.05
    assert reads[-1][1] is None  # the last tick slept, then one read that does not block


def test_an_api_events_long_poll_shorter_than_a_tick_reads_before_it_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review finding: a wait of a tick or less slept out its whole time before its one read, so
    events already in the stream came back up to 0.1 s late. It reads first, and returns them."""
    from producer.http import waits as waits_module

    waits = Waits(Settings(), 2)
    done: list[str] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        done.append("sleep")
        await real_sleep(seconds)

    def read(after: str, block_ms: int | None, count: int, owner: str | None) -> list[dict[str, str]]:
        done.append("read")
        return [{"id": "7-0", "job_id": "there-already"}]

    monkeypatch.setattr(waits_module.asyncio, "sleep", sleep)
    waits._read_events = read  # type: ignore[method-assign]
    try:
        found = asyncio.run(waits.events("0-0", 0.1))
    finally:
        waits.close()
    assert [e["job_id"] for e in found] == ["there-already"]
    assert done == ["read"]


def test_events_older_than_a_record_are_let_go_and_a_keys_stream_ends_with_its_records(
    redis_server: services.Service,
) -> None:
    """Review, helper-115: each key's stream was capped alone at MRC_EVENTS_MAX and never expired, so
    the streams held (keys + 1) times what the sizing said, a rotated key's for good."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    records = RedisJobRecords(client)
    owner = "0123456789ab"
    old = f"{int((time.time() - RECORD_TTL_S - 60) * 1000)}-0"
    for key in (names.events_key(), names.events_key(owner)):
        client.xadd(key, {"job_id": f"{owner}~old"}, id=old)
        client.xadd(key, {"job_id": f"{owner}~recent"})
    records.add_event({"job_id": f"{owner}~new", "status": "succeeded"}, keep=1000)
    for key in (names.events_key(), names.events_key(owner)):
        kept = [fields["job_id"] for _id, fields in client.xrange(key)]
        assert kept == [f"{owner}~recent", f"{owner}~new"], key
    assert 0 < client.ttl(names.events_key(owner)) <= RECORD_TTL_S  # a key's ends after its last event
    assert client.ttl(names.events_key()) == -1  # the fleet's: waits read their tail from it
    records.add_event({"job_id": "no-key", "status": "succeeded"}, keep=1000)
    assert client.xlen(names.events_key(owner)) == 2  # a job without a key: the fleet's stream alone
    client.close()
