"""An S3 outage waited out (shared/store_faults.py): its retries give the attempt back while the job's
first fault is younger than the budget, the same in Redis (the Lua step) and in memory."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from scripts import devservices as services
from shared import names
from shared.records import JobRecords, RedisJobRecords


def test_an_outages_retries_give_their_attempts_back_until_the_budget_is_spent(
    any_records: JobRecords,
) -> None:
    records = any_records
    assert records.begin_many(["j"]) == [1]
    assert records.store_fault("j", 60) == 1  # the first retry: the attempt given back
    assert records.begin_many(["j"]) == [1]
    assert records.store_fault("j", 60) == 2
    assert records.begin_many(["j"]) == [1]
    assert records.store_fault("j", 0) == -1  # past the budget: counted as any fault
    assert records.begin_many(["j"]) == [2]


def test_the_budget_runs_from_the_first_fault_and_a_requeued_dead_letter_starts_again(
    any_records: JobRecords,
) -> None:
    records = any_records
    records.begin_many(["j"])
    assert records.store_fault("j", 0.5) == 1
    time.sleep(0.6)
    assert records.store_fault("j", 0.5) == -1
    records.reset_attempts("j", "push-2")  # `mrc dlq requeue`
    assert not set(records.get("j")) & {"store_fault_since", "store_retries"}
    records.begin_many(["j"])
    assert records.store_fault("j", 0.5) == 1


def test_the_record_of_a_job_waiting_out_an_outage_keeps_its_ttl(tmp_path: Path) -> None:
    server = services.start_redis(tmp_path / "redis")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        RedisJobRecords(client).store_fault("fresh", 60)  # a record made by the fault alone
        assert client.ttl(names.job_key("fresh")) > 0
    finally:
        client.close()
        server.stop()
