"""A run's part recorded and queued in one Lua step (shared/runs.py ENQUEUE_SCRIPT): each job's room is
decided inside the step, job by job, against the lane's depth and the owner's share as the part's own
jobs fill them; against a redis-server of the test's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from scripts import devservices as services
from shared import backlog_share, names
from shared.runs import CALL_JOBS, CANCELLED, FULL, Queued, RunRecords

ALICE, BOB = "a1a1a1a1a1a1", "b2b2b2b2b2b2"
BACKLOG = names.queue_name("backlog")


@pytest.fixture
def runs(redis_server: services.Service) -> Iterator[RunRecords]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    records = RunRecords(client)
    records.start("r", "manifest.jsonl")
    yield records
    client.close()


def _part(prefix: str, count: int, lane: str = "backlog", start: int = 0) -> list[Queued]:
    key = BACKLOG if lane == "backlog" else names.queue_name(lane)
    return [
        Queued(f"{prefix}j{n}", lane, f"fp{n}", key, f"message {prefix}j{n}")
        for n in range(start, start + count)
    ]


def _depth(client: redis.Redis, lane: str = "backlog") -> int:
    return sum(int(client.llen(key)) for key in names.queue_keys(lane))


def test_a_part_past_the_lanes_depth_queues_exactly_what_fits(runs: RunRecords) -> None:
    replies = runs.enqueue_many("r", _part("", 15), depth_limit=10)
    assert replies == [1] * 10 + [FULL] * 5
    assert _depth(runs.client) == 10
    assert backlog_share.held(runs.client) == {backlog_share.NO_KEY: 10}
    # The jobs refused have no record: a resume queues them once there is room.
    assert [bool(runs.client.exists(names.job_key(f"j{n}"))) for n in (9, 10)] == [True, False]


def test_a_part_stops_at_its_owners_share_beside_another_key(runs: RunRecords) -> None:
    assert runs.enqueue_many("r", _part(f"{BOB}~", 3), depth_limit=10) == [1, 1, 1]
    # Two keys hold work: ALICE's share is ceil(10 / 2) = 5, whatever room the depth leaves.
    replies = runs.enqueue_many("r", _part(f"{ALICE}~", 8), depth_limit=10)
    assert replies == [1] * 5 + [FULL] * 3
    assert backlog_share.held(runs.client) == {BOB: 3, ALICE: 5}
    # Shares off: the depth alone decides (10 - 8 held).
    assert runs.enqueue_many("r", _part(f"{ALICE}~", 4, start=8), depth_limit=10, shares=False) == [
        1,
        1,
        FULL,
        FULL,
    ]


def test_a_part_of_two_owners_gives_each_its_own_room(runs: RunRecords) -> None:
    assert runs.enqueue_many("r", _part(f"{BOB}~", 2), depth_limit=8) == [1, 1]
    mixed = _part(f"{ALICE}~", 3) + _part(f"{BOB}~", 4, start=2) + _part(f"{ALICE}~", 3, start=3)
    replies = runs.enqueue_many("r", mixed, depth_limit=8)
    # Shares of 4 each: ALICE 3 then 1 more; BOB holds 2, so 2 more.
    assert replies == [1, 1, 1, 1, 1, FULL, FULL, 1, FULL, FULL]  # ALICE, BOB, ALICE
    assert backlog_share.held(runs.client) == {ALICE: 4, BOB: 4}


def test_a_job_id_recorded_already_answers_its_fingerprint_and_takes_no_room(runs: RunRecords) -> None:
    assert runs.enqueue_many("r", _part("", 2), depth_limit=3) == [1, 1]
    again = [*_part("", 2), *_part("", 2, start=2)]
    assert runs.enqueue_many("r", again, depth_limit=3) == ["fp0", "fp1", 1, FULL]
    assert _depth(runs.client) == 3


def test_a_cancelled_run_queues_nothing_of_its_part(runs: RunRecords) -> None:
    runs.update("r", state="cancelled")
    assert runs.enqueue_many("r", _part("", 4), depth_limit=10) == [CANCELLED] * 4
    assert _depth(runs.client) == 0


def test_a_part_of_another_lane_counts_that_lanes_depth(runs: RunRecords) -> None:
    assert runs.enqueue_many("r", _part("", 3), depth_limit=10) == [1, 1, 1]
    assert runs.enqueue_many("r", _part("t", 4, lane="interactive"), depth_limit=2) == [1, 1, FULL, FULL]
    assert (_depth(runs.client), _depth(runs.client, "interactive")) == (3, 2)


def test_a_part_longer_than_one_call_is_decided_alike_across_its_calls(runs: RunRecords) -> None:
    size = CALL_JOBS * 2 + 50
    replies = runs.enqueue_many("r", _part(f"{ALICE}~", size), depth_limit=CALL_JOBS * 2 + 30)
    assert replies == [1] * (CALL_JOBS * 2 + 30) + [FULL] * 20
    assert backlog_share.held(runs.client) == {ALICE: CALL_JOBS * 2 + 30}
