"""A job's message is pushed once, whoever retries or resubmits it, however long it waits: a
message still waiting past its marker's old lifetime (an hour) is never pushed a second time."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib

from producer.client import Client, Submission
from scripts import devservices as services
from shared import names
from shared.celery_app import send_job
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
