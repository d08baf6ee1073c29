"""A ticket's result kept beside its record (shared/records.py ANSWER_TTL_S): read with the record
only once the record says the job ended, for a short while, alike in Redis and in the in-process
records; anything that is not a result object is not taken for one."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from scripts import devservices as services
from shared import names
from shared.memory_records import MemoryJobRecords
from shared.records import ANSWER_TTL_S, JobRecords, RedisJobRecords

RESULT = {"schema": "mrc.result/1", "job_id": "t-1", "status": "succeeded", "text": "yes"}


@pytest.fixture(params=["redis", "memory"])
def records(request: pytest.FixtureRequest, redis_server: services.Service) -> Iterator[JobRecords]:
    if request.param == "memory":
        yield MemoryJobRecords()
        return
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    yield RedisJobRecords(client)
    client.close()


def test_the_answer_is_read_with_the_record_once_it_ended(records: JobRecords) -> None:
    assert records.claim("t-1", "interactive") is not None
    assert records.get_with_answer("t-1") == (records.get("t-1"), None)
    records.set_state("t-1", "succeeded", answer=json.dumps(RESULT))
    record, answer = records.get_with_answer("t-1")
    assert (record["state"], answer) == ("succeeded", RESULT)
    # run again (`mrc dlq requeue`, a requeue after a crash): the earlier copy is not its answer
    records.set_state("t-1", "queued")
    assert records.get_with_answer("t-1")[1] is None


@pytest.mark.parametrize("kept", ["not json {", json.dumps(["a list"]), json.dumps({"text": "no status"})])
def test_what_is_no_result_object_is_not_taken_for_one(records: JobRecords, kept: str) -> None:
    records.set_state("t-2", "succeeded", answer=kept)
    assert records.get_with_answer("t-2")[1] is None


def test_redis_keeps_the_answer_a_short_while(redis_server: services.Service) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    RedisJobRecords(client).set_state("t-3", "succeeded", answer=json.dumps(RESULT))
    assert 0 < int(client.ttl(names.answer_key("t-3"))) <= ANSWER_TTL_S
    client.close()


def test_the_worker_keeps_a_tickets_answer_and_not_a_backlog_jobs_nor_a_long_one() -> None:
    from workers.finisher import _answer

    ticket = {**RESULT, "lane": "interactive"}
    assert json.loads(_answer(ticket) or "") == ticket
    assert _answer({**ticket, "lane": "backlog"}) is None
    assert _answer({**ticket, "text": "x" * 20_000}) is None
    assert _answer({**ticket, "text": "😀" * 5_000}) is None  # 20,000 bytes: the limit counts bytes


def test_a_requeued_run_never_reads_its_earlier_runs_answer(records: JobRecords) -> None:
    """Review, helper-126: run 2 of a requeued job that ended without a copy of its own (its result over
    the size kept, or settled after its worker died between its S3 write and its record) was answered
    with run 1's result for 2 minutes, while S3 held run 2's."""
    failed = {**RESULT, "status": "failed", "text": None}
    records.set_state("t-4", "failed", answer=json.dumps(failed))
    records.reset_attempts("t-4", "push-2")  # mrc dlq requeue
    records.set_state("t-4", "running")
    records.set_state("t-4", "succeeded")  # run 2's end, no copy: its waits read S3
    assert records.get_with_answer("t-4") == (records.get("t-4"), None)
    records.set_state("t-5", "failed", answer=json.dumps(failed))
    records.set_state("t-5", "succeeded")  # settled from the stored result, without a copy
    assert records.get_with_answer("t-5")[1] is None
