"""Each submission's message (mrc-api, `mrc submit`) made from a template of Celery's once Celery's second
message of its lane and priority agreed with it (producer/queue/templates.py): pushed as Celery's own,
field for field, once per push id. Against a redis-server of the test's own; real workers run such
messages in every test that submits through mrc-api or the Python client."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib

from producer.backlog.messages import Messages
from producer.queue import templates
from producer.queue.templates import Sends
from scripts import devservices as services
from shared import logs, names
from shared.celery_app import make_celery
from shared.jobs import Job
from tests.unit.test_backlog_messages import _jobs


@pytest.fixture
def app(redis_server: services.Service) -> Iterator[Any]:
    app = make_celery(services.settings_from_env({"MRC_REDIS_URL": redis_server.url}))
    yield app
    app.close()


@pytest.fixture
def redis(redis_server: services.Service) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


def _built_by_celery(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The job ids whose message Celery builds from now on."""
    built: list[str] = []
    send_job = templates.send_job

    def counted(app: Any, job: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        built.append(str(job["job_id"]))
        send_job(app, job, *args, **kwargs)

    monkeypatch.setattr(templates, "send_job", counted)
    return built


def _parsed(text: str) -> dict[str, Any]:
    envelope = json.loads(text)
    envelope["body"] = json.loads(base64.b64decode(envelope["body"]))
    del envelope["properties"]["delivery_tag"]
    return envelope


def _pushed(redis: redis_lib.Redis, key: str) -> list[str]:
    return list(reversed(redis.lrange(key, 0, -1)))  # LPUSH: the newest first


@pytest.mark.parametrize(("lane", "ahead"), [("interactive", False), ("backlog", False), ("backlog", True)])
def test_each_submission_is_pushed_as_celerys_own_message(
    app: Any, redis: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch, lane: str, ahead: bool
) -> None:
    built = _built_by_celery(monkeypatch)
    sends = Sends(app)
    jobs = [job.model_copy(update={"lane": lane}) for job in _jobs()[:12]]
    for job in jobs:
        sends.send(job, names.job_push_id(job.job_id), ahead)
    assert built == [jobs[0].job_id, jobs[1].job_id], "the template was not used once it agreed"
    queue = names.queue_name(lane)
    key = names.priority_list(queue, names.AHEAD_STEP) if ahead else queue
    pushed = _pushed(redis, key)
    assert len(pushed) == len(jobs)
    celery = Messages(app)
    for job, text in zip(jobs, pushed, strict=True):
        [(theirs_key, theirs)] = celery._celery([job], ahead, declare=False)
        assert theirs_key == key
        ours = _parsed(text)
        assert ours == {**_parsed(theirs), "headers": ours["headers"]}, f"{job.job_id} differs from Celery's"
        assert ours["headers"] == {
            **_parsed(theirs)["headers"],
            names.PUSH_HEADER: names.job_push_id(job.job_id),
        }
        assert ours["body"][1]["job"] == job.to_message()
    tags = {json.loads(text)["properties"]["delivery_tag"] for text in pushed}
    assert len(tags) == len(jobs), "a delivery tag is drawn afresh for each message"


def test_a_push_from_a_template_lands_once_per_push_id(
    app: Any, redis: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _built_by_celery(monkeypatch)
    sends = Sends(app)
    jobs = _jobs()[:3]
    for job in jobs:
        sends.send(job, names.job_push_id(job.job_id))
    again = jobs[2]  # made from the template: a retried publish of it pushes nothing twice
    sends.send(again, names.job_push_id(again.job_id))
    assert len(built) == 2
    assert len(_pushed(redis, names.queue_name("backlog"))) == 3


def test_templates_that_keep_disagreeing_with_celery_hand_every_message_to_celery(
    app: Any, redis: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _built_by_celery(monkeypatch)
    monkeypatch.setattr(templates, "agrees", lambda *args: False)  # as a new Celery release might
    sends = Sends(app)
    jobs: list[Job] = _jobs()[:20]
    out = io.StringIO()
    logs.configure(stream=out)
    try:
        for job in jobs:
            sends.send(job, names.job_push_id(job.job_id))
    finally:
        logs.configure()
    assert built == [job.job_id for job in jobs]
    assert out.getvalue().count("MRC_MESSAGES_FROM_CELERY") == 1
    assert [json.loads(t)["headers"]["id"] for t in _pushed(redis, names.queue_name("backlog"))] == [
        job.job_id for job in jobs
    ]


def test_submissions_from_many_threads_keep_their_templates_and_each_its_threads_reply_to(
    app: Any, redis: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-125: Celery's reply-to is the sending thread's id, which the template held fixed:
    a template checked against another thread's message disagreed, so mrc-api's request threads
    turned templates off within a few submissions; a trusted one gave every thread the first's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    built = _built_by_celery(monkeypatch)
    sends = Sends(app)
    jobs = [job.model_copy(update={"lane": "interactive"}) for job in _jobs()[:24]]
    threads: dict[str, str] = {}
    ready = threading.Barrier(4)

    def send(jobs_of_one_thread: list[Job]) -> None:
        ready.wait(10)  # all four threads alive: each job is sent by the thread it names
        for job in jobs_of_one_thread:
            threads[job.job_id] = app.thread_oid
            sends.send(job, names.job_push_id(job.job_id))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(send, [jobs[n::4] for n in range(4)]))
    assert sends._trusting, "templates were turned off"
    assert len(built) <= 2 * 3, built  # at most a first and a check for each of its three tries
    pushed = [json.loads(text) for text in _pushed(redis, names.queue_name("interactive"))]
    assert len(pushed) == len(jobs)
    assert len(set(threads.values())) == 4
    for message in pushed:
        assert message["properties"]["reply_to"] == threads[message["headers"]["id"]]
