"""A resubmission is answered "already queued" only when the job's message is really in Redis.

What tests/faults/test_failover.py lost a job to, made deterministic: the first submission's record
was confirmed on one Redis master while its push went to another, which was demoted with the message
(the record's and the push's connections are separate). Here the push lands nowhere and the record
says published; the resubmission the contract asks for must push it again, once, and the job must run
once. The reverse: a message still waiting past its marker's old lifetime (an hour) is never pushed
a second time, whoever retries or resubmits it; an acked message's marker says so."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from producer.client import Client, Submission
from producer.queue import dlq
from scripts import devservices as services
from shared import names, pushes
from shared.celery_app import send_job
from shared.errors import NotReplicated
from shared.jobs import Job
from tests.support import imagegen

pytestmark = pytest.mark.integration
HOUR_MS = 3_600_000


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "p.jpg"
    path.write_bytes(imagegen.photo(64, 48, seed=7))
    return path


@pytest.fixture
def own_redis(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """A Redis of this test's own (no worker consumes it), no replica; the session's S3."""
    redis = services.start_redis(tmp_path / "redis")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    yield {**env, "MRC_REDIS_URL": redis.url, "MRC_REDIS_WAIT_TIMEOUT_MS": "100"}
    redis.stop()


class _PushedElsewhere:
    """The publish reaches a master that is demoted before any replica has it: the call returns as a
    push does, and neither the message nor its marker is on the master the record is confirmed on."""

    def __init__(self, client: Client) -> None:
        self.real = client.sends.send
        client.sends.send = self  # type: ignore[method-assign]  # the fault injected

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def heal(self, client: Client) -> None:
        client.sends.send = self.real  # type: ignore[method-assign]


def _queued(redis: redis_lib.Redis, job_id: str) -> int:
    """How many messages of this job wait in its lanes or are held unacked."""
    count = 0
    for key in (*names.queue_keys("interactive"), *names.queue_keys("backlog")):
        count += sum(json.loads(m)["headers"]["id"] == job_id for m in redis.lrange(key, 0, -1))
    for raw in redis.hvals(names.UNACKED_KEY):
        count += json.loads(raw)[0]["headers"]["id"] == job_id
    return count


def _an_hour_passes(redis: redis_lib.Redis) -> None:
    """What an hour does to mrc's keys: those with an hour or less to live are gone."""
    for key in redis.scan_iter(f"{names.REDIS_PREFIX}*"):
        if 0 <= int(redis.pttl(key)) <= HOUR_MS:
            redis.delete(key)


def _job(client: Client, image: Path, prefix: str) -> Job:
    job_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return client.build_job(Submission(image=image, prompt="Refund?", job_id=job_id))


def test_a_resubmission_pushes_a_message_that_is_nowhere_again_and_the_job_runs_once(
    client: Client, worker: services.Worker, image: Path
) -> None:
    """Before: answered "already queued" (MRC_DUPLICATE), nothing queued, the job never ran."""
    job = _job(client, image, "rs-lost")
    elsewhere = _PushedElsewhere(client)
    assert client.enqueue(job) is True  # acknowledged: the record says queued and published...
    record = client.records.get(job.job_id)
    assert (record["state"], record["published"]) == ("queued", "1")
    redis = client.records._redis
    assert _queued(redis, job.job_id) == 0  # ...and the message is in no lane, held by no worker
    elsewhere.heal(client)
    assert client.enqueue(job) is False  # the same job, pushed again
    assert client.wait(job.job_id, timeout=120)["status"] == "succeeded"
    # Its message is acked with its delivery's end, after its result (the wait wakes at the result)
    services.wait_for(lambda: _queued(redis, job.job_id) == 0, 60, "the job's message to be acked")
    for _ in range(2):  # resubmitted again once it ran: its marker says acked, nothing is pushed
        assert client.enqueue(job) is False
    assert _queued(redis, job.job_id) == 0
    assert len(worker.logged("MRC_SUCCESS", job_id=job.job_id)) == 1


def test_two_resubmissions_of_a_lost_message_push_it_once(own_redis: dict[str, str], image: Path) -> None:
    client = Client(services.settings_from_env(own_redis))
    job = _job(client, image, "rs-twice")
    elsewhere = _PushedElsewhere(client)
    assert client.enqueue(job) is True
    elsewhere.heal(client)
    redis = client.records._redis
    # Two resubmissions that both found no message push under the one push id: one lands.
    for _ in range(2):
        send_job(client.celery, job.to_message(), job.lane, push_id=names.job_push_id(job.job_id))
    assert _queued(redis, job.job_id) == 1
    assert client.enqueue(job) is False  # and one that finds it there pushes nothing
    assert _queued(redis, job.job_id) == 1


def test_a_message_waiting_past_an_hour_is_never_pushed_twice(own_redis: dict[str, str], image: Path) -> None:
    """Before: the marker lived an hour whatever its message did; a retry of the push after that (and a
    resubmission that took a missing marker for a lost message) queued the job a second time."""
    client = Client(services.settings_from_env(own_redis))
    job = _job(client, image, "rs-deep")
    assert client.enqueue(job) is True
    redis = client.records._redis
    _an_hour_passes(redis)  # a deep backlog: still waiting in its lane
    assert client.records.get(job.job_id)["state"] == "queued"
    assert client.enqueue(job) is False
    send_job(client.celery, job.to_message(), job.lane, push_id=names.job_push_id(job.job_id))  # a late retry
    assert _queued(redis, job.job_id) == 1


def test_with_replica_acks_a_message_pushed_again_is_the_same_job_only_once_replicated(
    own_redis: dict[str, str], image: Path
) -> None:
    client = Client(services.settings_from_env({**own_redis, "MRC_REDIS_WAIT_REPLICAS": "1"}))
    job = _job(client, image, "rs-wait")
    elsewhere = _PushedElsewhere(client)
    assert client.enqueue(job) is True
    elsewhere.heal(client)
    redis = client.records._redis
    for _ in range(2):  # pushed again, then found: both times queued, neither time replicated
        with pytest.raises(NotReplicated) as unreplicated:
            client.enqueue(job)
        assert (unreplicated.value.job_id, unreplicated.value.duplicate) == (job.job_id, True)
        assert _queued(redis, job.job_id) == 1


def test_a_requeued_dead_letter_is_checked_by_its_own_push(own_redis: dict[str, str], image: Path) -> None:
    client = Client(services.settings_from_env(own_redis))
    job = _job(client, image, "rs-dlq")
    assert client.enqueue(job) is True
    redis = client.records._redis
    for key in names.queue_keys(job.lane):
        redis.delete(key)  # ...it ran, failed three times and was dead-lettered
    client.records.set_state(job.job_id, "failed", dead_letter="1", attempts="3")
    redis.lpush(names.dead_letter_key(), json.dumps({"job": job.to_message()}))
    assert dlq.requeue(client, 10) == (1, 0, 0)
    push_id = client.records.get(job.job_id)["push"]
    assert push_id.startswith(names.job_push_id(job.job_id) + ":requeue:")
    _an_hour_passes(redis)
    assert client.enqueue(job) is False  # its message waits: nothing pushed twice
    assert _queued(redis, job.job_id) == 1
    for key in (*names.queue_keys(job.lane), names.push_key(push_id)):
        redis.delete(key)  # lost in a failover, marker and message together
    assert client.enqueue(job) is False  # pushed again, under the requeue's push id
    assert _queued(redis, job.job_id) == 1
    assert redis.get(names.push_key(push_id)) == pushes.HELD
