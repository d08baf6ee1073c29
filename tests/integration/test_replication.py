"""MRC_REDIS_WAIT_REPLICAS against a real Redis with no replica: every publish lands on the master
and none is confirmed. The answer says exactly that — enqueued, not replicated (exit 6, 202 with
`"replicated": false`) — never "nothing enqueued"; the claim stands, so the same job id again is the
same job and the queue holds one message; a backlog run stops at its first unconfirmed part and a
resume queues nothing twice; the worker's own retry publish is logged, never raised."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from producer.backlog.run import Backlog
from producer.client import Client, Submission
from producer.server import create_app
from scripts import devservices as services
from scripts.devservices import run_cli
from shared import names
from shared.celery_app import make_celery
from shared.errors import NotReplicated, PushUnconfirmed
from tests.support import imagegen
from workers.tasks import make_requeue

pytestmark = pytest.mark.integration
KEY = "k-replication"


@pytest.fixture
def unreplicated(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """A Redis of this test's own with no replica, the durability knob on, the session's S3."""
    redis = services.start_redis(tmp_path / "redis")
    own = {
        **env,
        "MRC_REDIS_URL": redis.url,
        "MRC_REDIS_WAIT_REPLICAS": "1",
        "MRC_REDIS_WAIT_TIMEOUT_MS": "100",
    }
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    yield own
    redis.stop()


def _queued(env: dict[str, str], lane: str = "interactive") -> list[str]:
    client = redis_lib.Redis.from_url(env["MRC_REDIS_URL"])
    return [
        json.loads(m)["headers"]["id"] for key in names.queue_keys(lane) for m in client.lrange(key, 0, -1)
    ]


def _record(env: dict[str, str], job_id: str) -> dict[bytes, bytes]:
    return dict(redis_lib.Redis.from_url(env["MRC_REDIS_URL"]).hgetall(names.job_key(job_id)))


@pytest.fixture
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "parcel.jpg"
    path.write_bytes(imagegen.photo(64, 48, seed=3))
    return path


def test_submit_says_enqueued_not_replicated_and_a_retry_is_the_same_job(
    unreplicated: dict[str, str], photo: Path
) -> None:
    args = ("submit", "--image", str(photo), "--prompt", "Refund?", "--job-id", "wait-1")
    first = run_cli(unreplicated, *args)
    assert first.returncode == 6, first.stderr
    assert first.stdout.strip() == "wait-1"
    assert "0 of 1 Redis replicas" in first.stderr
    assert _queued(unreplicated) == ["wait-1"]
    assert _record(unreplicated, "wait-1")[b"published"] == b"1"  # the claim stands
    again = run_cli(unreplicated, *args)
    assert again.returncode == 6, again.stderr
    assert "earlier submission of this job" in again.stderr
    assert _queued(unreplicated) == ["wait-1"]  # the same job: never a second message
    other = run_cli(unreplicated, *args[:-2])  # no id given: the generated one is printed
    assert other.returncode == 6, other.stderr
    assert _queued(unreplicated) == [other.stdout.strip(), "wait-1"]
    off = run_cli({**unreplicated, "MRC_REDIS_WAIT_REPLICAS": "0"}, *args)
    assert off.returncode == 0, off.stderr  # without the knob: a duplicate, as always


def test_the_api_answers_202_with_replicated_false(unreplicated: dict[str, str], photo: Path) -> None:
    api_env = {
        **unreplicated,
        "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(),
        **services.shared_inputs(unreplicated),
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with TestClient(create_app(services.settings_from_env(api_env))) as api:
        form = {"prompt": "Refund?", "job_id": "wait-api"}
        files = {"image": ("p.jpg", photo.read_bytes(), "image/jpeg")}
        reply = api.post("/v1/jobs", data=form, files=files, headers=headers)
        assert reply.status_code == 202, reply.text
        assert reply.json() == {"job_id": "wait-api", "status_url": "/v1/jobs/wait-api", "replicated": False}
        assert reply.headers["Mrc-Replicated"] == "false"
        again = api.post("/v1/jobs", data=form, files=files, headers=headers)
        assert again.status_code == 200, again.text
        assert again.json()["replicated"] is False
    owner = hashlib.sha256(KEY.encode()).hexdigest()[:12]
    assert _queued(unreplicated) == [f"{owner}~wait-api"]  # the key's namespace (shared/tenants.py)


def test_a_backlog_run_stops_unconfirmed_and_its_resume_queues_nothing_twice(
    unreplicated: dict[str, str], photo: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "m.jsonl"
    rows = [{"custom_id": f"c{i}", "image": str(photo), "prompt": f"Refund {i}?"} for i in range(600)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_cli(unreplicated, "backlog", str(manifest), "--run-id", "wait-run")
    assert done.returncode == 6, done.stderr
    assert "resume the run" in done.stderr
    assert "Go on with: mrc backlog --resume wait-run" in done.stderr
    every = sorted(f"wait-run.c{i}" for i in range(600))
    assert sorted(_queued(unreplicated, "backlog")) == sorted(f"wait-run.c{i}" for i in range(500))
    # The unconfirmed part is counted: its jobs are queued, never "unknown" or missing from the run.
    status = run_cli(unreplicated, "backlog", "status", "wait-run", "--json")
    assert status.returncode == 0, status.stderr
    counted = json.loads(status.stdout)
    assert (counted["jobs"], counted["queued"]) == (500, 500), counted
    data = redis_lib.Redis.from_url(unreplicated["MRC_REDIS_URL"], decode_responses=True)
    record = data.hgetall(names.run_record_key("wait-run"))
    assert (record["lines"], record["valid"]) == ("500", "500")  # the 100 never queued: not yet
    # A pass that blanks the lines it finds indexed (an OpenAI batch's) keeps the chunk's index
    # (review, helper-77: it was written empty, and the batch ended failed with 500 jobs running).
    backlog = Backlog(Client(services.settings_from_env(unreplicated)))
    backlog.enqueue(iter([(n, b"") for n in range(1, 601)]), "wait-run", str(manifest))
    status = run_cli(unreplicated, "backlog", "status", "wait-run", "--json")
    assert json.loads(status.stdout)["jobs"] == 500
    assert data.hget(names.run_record_key("wait-run"), "unconfirmed_chunk_0") == "1"  # still to go over
    # A failover lost one of the part's jobs (its record and message): the resume queues it again.
    lost = next(m for m in data.lrange(names.queue_name("backlog"), 0, -1) if '"wait-run.c7"' in m)
    data.lrem(names.queue_name("backlog"), 1, lost)
    data.delete(names.job_key("wait-run.c7"))
    resumed = run_cli({**unreplicated, "MRC_REDIS_WAIT_REPLICAS": "0"}, "backlog", "--resume", "wait-run")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(_queued(unreplicated, "backlog")) == every
    record = data.hgetall(names.run_record_key("wait-run"))
    assert (record["lines"], record["valid"]) == ("600", "600"), "valid stayed short for good (helper-77)"
    assert not [field for field in record if field.startswith("unconfirmed_chunk_")]


def test_the_workers_retry_publish_is_queued_and_logged_never_raised(unreplicated: dict[str, str]) -> None:
    from structlog.testing import capture_logs

    app = make_celery(services.settings_from_env(unreplicated))
    job: dict[str, Any] = {
        "job_id": "retry-1",
        "image_uri": "s3://mrc/a.jpg",
        "prompt": "p",
        "max_new_tokens": 1,
    }
    with capture_logs() as logged:
        make_requeue(app)("retry-1", job, 0.5)  # raised NotReplicated before, which ended the worker
    assert _queued(unreplicated) == ["retry-1"]
    assert [e["event"] for e in logged] == ["MRC_NOT_REPLICATED"]


def test_one_publish_is_pushed_once_whoever_retries_it(unreplicated: dict[str, str]) -> None:
    """The push id travels with the message: a second push of it (redis-py re-running a pipeline
    after a lost reply, Celery re-publishing after a lost connection) lands nothing."""
    app = make_celery(services.settings_from_env({**unreplicated, "MRC_REDIS_WAIT_REPLICAS": "0"}))
    for _ in range(3):
        queue = names.queue_name("interactive")
        app.send_task(names.TASK_NAME, kwargs={"job": {}}, task_id="once-1", queue=queue,
                      headers={names.PUSH_HEADER: "push-fixed"})  # fmt: skip
    assert _queued(unreplicated) == ["once-1"]


class _ReplyLost:
    """A publish that lands, then its reply is lost with the connection (and every retry fails)."""

    def __init__(self, client: Client) -> None:
        self.real = client.sends.send
        client.sends.send = self  # type: ignore[method-assign]  # the fault injected

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.real(*args, **kwargs)
        raise ConnectionError("connection reset by peer (the reply to the push)")


@pytest.fixture
def quiet(unreplicated: dict[str, str]) -> dict[str, str]:
    """The same Redis with the durability knob off."""
    return {**unreplicated, "MRC_REDIS_WAIT_REPLICAS": "0"}


def test_a_push_whose_reply_was_lost_is_known_by_its_marker(quiet: dict[str, str], photo: Path) -> None:
    """It used to be answered 'nothing enqueued' (exit 5) with the message in the queue, and queued a
    second time when resubmitted."""
    client = Client(services.settings_from_env(quiet))
    job = client.build_job(Submission(image=photo, prompt="Refund?", job_id="lost-1"))
    lost = _ReplyLost(client)
    assert client.enqueue(job) is True  # it landed: enqueued, whatever the connection did after
    assert _queued(quiet) == ["lost-1"]
    assert _record(quiet, "lost-1")[b"published"] == b"1"
    client.sends.send = lost.real  # type: ignore[method-assign]
    assert client.enqueue(job) is False  # the same job
    assert _queued(quiet) == ["lost-1"]


def test_a_push_nobody_can_confirm_is_unconfirmed_and_its_resubmission_pushes_nothing_twice(
    quiet: dict[str, str], photo: Path
) -> None:
    client = Client(services.settings_from_env(quiet))
    job = client.build_job(Submission(image=photo, prompt="Refund?", job_id="lost-2"))
    lost = _ReplyLost(client)
    real_pushed = client.records.pushed

    def unreachable(push_id: str) -> bool:
        raise redis_lib.ConnectionError("Redis out of reach")

    client.records.pushed = unreachable  # type: ignore[method-assign]
    with pytest.raises(PushUnconfirmed) as unconfirmed:
        client.enqueue(job)
    assert isinstance(unconfirmed.value, NotReplicated)  # exit 6, never 5: it may have been enqueued
    assert unconfirmed.value.job_id == "lost-2"
    assert _record(quiet, "lost-2")[b"published"] == b"0"  # the claim lapses by itself
    redis_lib.Redis.from_url(quiet["MRC_REDIS_URL"]).delete(names.job_key("lost-2"))  # ...as it would
    client.sends.send, client.records.pushed = lost.real, real_pushed  # type: ignore[method-assign]
    assert client.enqueue(job) is True  # resubmitted: claimed and published again...
    assert _queued(quiet) == ["lost-2"]  # ...and the push, already there, is not queued twice


def test_dlq_requeue_stops_at_its_first_unconfirmed_entry_and_an_interrupt_after_a_push_keeps_it_queued(
    unreplicated: dict[str, str], photo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-77: a wait for the replicas per entry (23 s for 20, ~18 min for the default
    1,000), and a Ctrl-C in that wait left the job queued and dead-lettered both: queued twice next."""
    from producer.queue import dlq

    client = Client(services.settings_from_env(unreplicated))
    jobs = [client.build_job(Submission(image=photo, prompt="refund?", job_id=f"dl-{i}")) for i in range(3)]
    for job in jobs:
        client.records.set_state(job.job_id, "failed", dead_letter="1")
        client.records._redis.lpush(names.dead_letter_key(), json.dumps({"job": job.to_message()}))
    assert dlq.requeue(client, 10) == (1, 0, 1)
    assert _queued(unreplicated, "interactive") == ["dl-0"]
    assert client.records.dead_letter_count() == 2

    durable = Client(services.settings_from_env({**unreplicated, "MRC_REDIS_WAIT_REPLICAS": "0"}))
    real = durable.sends.send

    def pushed_then_interrupted(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt  # as a Ctrl-C in the wait for the replicas, after the push

    monkeypatch.setattr(durable.sends, "send", pushed_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        dlq.requeue(durable, 10)
    monkeypatch.setattr(durable.sends, "send", real)
    assert sorted(_queued(unreplicated, "interactive")) == ["dl-0", "dl-1"]
    assert client.records.dead_letter_count() == 1, "the pushed entry is dead-lettered too"
    assert client.records.get("dl-1").get("dead_letter") != "1"
    assert dlq.requeue(durable, 10) == (1, 0, 0)
    assert sorted(_queued(unreplicated, "interactive")) == ["dl-0", "dl-1", "dl-2"]  # each once
