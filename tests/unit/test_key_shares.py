"""The backlog lane's key shares (shared/backlog_share.py): a job is held from its queuing to its end,
and the room each owner gets, in the in-process records and in the Redis scripts (a redis-server of
its own); through the public routes: tests/integration/test_tenants.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from scripts import devservices as services
from shared import backlog_share
from shared.memory_records import MemoryJobRecords
from shared.records import RedisJobRecords

ALICE, BOB = "a1a1a1a1a1a1", "b2b2b2b2b2b2"


def _queued(records: MemoryJobRecords, job_id: str, lane: str = "backlog") -> None:
    token = records.claim(job_id, lane)
    assert token is not None
    assert records.confirm(job_id, token)


def test_an_owner_alone_has_the_limit_and_several_share_it() -> None:
    records = MemoryJobRecords()
    for n in range(4):
        _queued(records, f"{ALICE}~a{n}")
    _queued(records, f"{ALICE}~ticket", lane="interactive")  # tickets hold nothing
    alone = records.backlog_room(ALICE, 6)
    assert (alone.room, alone.held, alone.keys) == (6, 4, 1)  # the depth decides (none here)
    _queued(records, f"{BOB}~b0")
    assert records.backlog_room(ALICE, 6).room == 3 - 4  # past her share of 3
    bob = records.backlog_room(BOB, 6)
    assert (bob.room, bob.held, bob.keys) == (2, 1, 2)
    assert bob.refusal(6, owner=BOB) == (
        "the lane is shared by the 2 keys with work in it (queued or running): this key holds 1 jobs, "
        "its share is 3"
    )
    assert "the command line (its runs, no key, count as one) holds 1 jobs" in bob.refusal(6, owner="-")
    _queued(records, "nightly-7")  # the command line (no key) is a third owner
    assert records.backlog_room(backlog_share.NO_KEY, 6).room == 1  # ceil(6 / 3) - 1
    for job_id in ("nightly-7", f"{BOB}~b0"):
        records.set_state(job_id, "succeeded" if job_id == "nightly-7" else "failed")
    assert records.backlog_room(ALICE, 6).keys == 1  # the others' ends let go of their holds
    records.set_state(f"{ALICE}~a0", "running")  # running is still held
    assert records.backlog_room(ALICE, 6).held == 4


def test_a_job_that_ended_before_its_confirm_is_not_held() -> None:
    """A worker may take and finish a single submission between its push and its confirm: held then,
    it would count until the 24-hour look let it go."""
    records = MemoryJobRecords()
    token = records.claim(f"{BOB}~fast", "backlog")
    assert token is not None
    records.set_state(f"{BOB}~fast", "succeeded")
    assert records.confirm(f"{BOB}~fast", token)
    assert records.backlog_room(BOB, 6).held == 0


def test_the_owner_of_a_job_is_its_keys_namespace_or_none() -> None:
    assert backlog_share.owner_of(f"{ALICE}~order-1") == ALICE
    assert backlog_share.owner_of("order-1") == backlog_share.NO_KEY
    assert backlog_share.Room(0, 6, 6, 1).refusal(6) == ""  # alone: the depth limit says it all


@pytest.fixture
def redis_records(tmp_path: Path) -> Iterator[RedisJobRecords]:
    server = services.start_redis(tmp_path / "redis")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield RedisJobRecords(client)
    client.close()
    server.stop()


def test_the_redis_steps_hold_each_backlog_job_once_from_its_queuing_to_its_end(
    redis_records: RedisJobRecords,
) -> None:
    """The scripts themselves: a confirm holds, an end lets go (twice: once), a job that ended before its
    confirm is not held, and a dead letter requeued (review, helper-103: it went back to the lane
    unheld, so its key counted as having no work) or a lost message pushed again is held again."""
    records = redis_records
    for n in range(3):
        token = records.claim(f"{ALICE}~a{n}", "backlog")
        assert token is not None
        assert records.confirm(f"{ALICE}~a{n}", token)
    ticket = records.claim(f"{ALICE}~t", "interactive")
    assert ticket is not None
    assert records.confirm(f"{ALICE}~t", ticket)
    assert records.backlog_room(ALICE, 10).held == 3
    records.set_state(f"{ALICE}~a0", "running")
    records.set_state(f"{ALICE}~a0", "failed")
    records.set_state(f"{ALICE}~a0", "failed")  # an end written twice lets go once
    assert records.backlog_room(ALICE, 10).held == 2
    records.reset_attempts(f"{ALICE}~a0", "requeue-push")  # `mrc dlq requeue`
    assert records.backlog_room(ALICE, 10).held == 3
    records.hold_backlog(f"{ALICE}~a0")  # pushed again after a lost message: still held once
    assert records.backlog_room(ALICE, 10).held == 3
    records.set_state(f"{ALICE}~a1", "succeeded")
    records.hold_backlog(f"{ALICE}~a1")  # ended: not held again
    fast = records.claim(f"{BOB}~fast", "backlog")
    assert fast is not None
    records.set_state(f"{BOB}~fast", "succeeded")  # a worker finished it before its confirm
    assert records.confirm(f"{BOB}~fast", fast)
    room = records.backlog_room(BOB, 10)
    assert (room.held, room.keys, room.room) == (0, 2, 5)  # alice holds a0, a2: bob has half of 10
    assert records.backlog_room(ALICE, 10, shares=False).room == 10  # off: the depth alone (empty lane)
