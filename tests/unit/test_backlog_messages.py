"""A run's job messages made from one Celery built (producer/backlog/messages.py) are Celery's own,
field for field, for jobs of every shape; where a template cannot make them so, Celery makes them all.
Against a redis-server of the test's own (the capture declares the lane's queue there); real workers
run such messages in tests/integration/test_backlog.py."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from producer.backlog import messages as messages_module
from producer.backlog.messages import Messages
from producer.queue import templates
from scripts import devservices as services
from shared import logs, names
from shared.celery_app import make_celery
from shared.jobs import Job

OWNER = "a1a1a1a1a1a1"


@pytest.fixture
def maker(redis_server: services.Service) -> Iterator[Messages]:
    app = make_celery(services.settings_from_env({"MRC_REDIS_URL": redis_server.url}))
    yield Messages(app)
    app.close()


def _jobs() -> list[Job]:
    """Jobs of every shape a run queues: plain, a key's, unicode and escapes in the prompt, a ticket,
    a structured answer, a deadline."""
    shapes: list[dict[str, Any]] = [
        {},
        {"api_key": OWNER},
        {"prompt": 'émoji 📦 "quoted" \\ back\nslash\t{braces} %s {0}'},
        {"ticket_id": "T-1 ¦ ‹x›", "max_new_tokens": 7},
        {"response_format": {"type": "json_schema", "schema": {"properties": {"ok": {"type": "boolean"}}}}},
        {"response_format": {"type": "choice", "choices": ["yes", "no ‹›"]}},
        {"deadline": "2026-12-08T00:00:00.000Z"},
        {"prompt": "x" * 5000},
    ]
    jobs = []
    for n in range(30):
        fields: dict[str, Any] = {
            "job_id": f"{OWNER}~run.c{n}" if n % 3 == 0 else f"run-1.c{n}",
            "image_uri": f"s3://mrc/in/{n}.jpg",
            "prompt": f"Refund {n}?",
            "lane": "backlog",
            "max_new_tokens": 64,
            **shapes[n % len(shapes)],
        }
        if n % 3 == 0:
            fields["api_key"] = OWNER
        jobs.append(Job.model_validate(fields))
    return jobs


def _parsed(text: str) -> dict[str, Any]:
    """A message as its reader sees it, its body decoded, the fields drawn per publish left out."""
    envelope = json.loads(text)
    envelope["body"] = json.loads(base64.b64decode(envelope["body"]))
    del envelope["properties"]["delivery_tag"], envelope["headers"][names.PUSH_HEADER]
    return envelope


def _count_celery(maker: Messages, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many messages each of the maker's calls to Celery builds, from now on."""
    made_by_celery: list[int] = []
    celery = maker._celery

    def counted(jobs: list[Job], ahead: bool, declare: bool) -> list[tuple[str, str]]:
        made_by_celery.append(len(jobs))
        return celery(jobs, ahead, declare)

    monkeypatch.setattr(maker, "_celery", counted)
    return made_by_celery


def _drawn(text: str) -> tuple[str, str]:
    envelope = json.loads(text)
    return envelope["properties"]["delivery_tag"], envelope["headers"][names.PUSH_HEADER]


@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_messages_made_from_a_template_are_celerys_own(maker: Messages, ahead: int) -> None:
    jobs = _jobs()
    made = maker.queued(jobs, ahead)
    assert maker.templates, "the template disagreed with Celery"
    celery = [
        text
        for start, end in ((0, ahead), (ahead, len(jobs)))
        for _, text in maker._celery(jobs[start:end], start < ahead, declare=False)
    ]
    ahead_list = names.priority_list(names.queue_name("backlog"), names.AHEAD_STEP)
    for n, (job, queued, theirs) in enumerate(zip(jobs, made, celery, strict=True)):
        assert (queued.job_id, queued.lane, queued.fingerprint) == (job.job_id, "backlog", job.fingerprint())
        assert queued.list_key == (ahead_list if n < ahead else names.queue_name("backlog"))
        assert _parsed(queued.message) == _parsed(theirs), f"job {n} differs from Celery's"
        assert _parsed(queued.message)["body"][1]["job"] == job.to_message()
    # Drawn afresh for each message: kombu keeps an unacked message under its delivery tag.
    tags, pushes = zip(*(_drawn(queued.message) for queued in made), strict=True)
    assert len(set(tags)) == len(set(pushes)) == len(jobs)


def test_a_template_that_disagrees_with_celery_hands_every_message_to_celery(
    maker: Messages, monkeypatch: pytest.MonkeyPatch
) -> None:
    made_by_celery = _count_celery(maker, monkeypatch)
    monkeypatch.setattr(messages_module, "agrees", lambda *args: False)  # as a new Celery release might
    jobs = _jobs()
    out = io.StringIO()
    logs.configure(stream=out)
    try:
        first = maker.queued(jobs[:10])
        second = maker.queued(jobs[10:])
    finally:
        logs.configure()
    assert not maker.templates
    assert sum(made_by_celery) == len(jobs)
    assert [q.job_id for q in first + second] == [job.job_id for job in jobs]
    assert out.getvalue().count("MRC_BACKLOG_MESSAGES_FROM_CELERY") == 1


def test_a_template_reproduces_a_field_celery_draws_per_message_only_by_disagreeing(maker: Messages) -> None:
    """A field Celery would draw afresh for each message, unknown to the template, fails the check."""
    jobs = _jobs()[:2]
    made = maker._celery(jobs, False, True)
    template = templates.Template.of(jobs[0].job_id, *made[0])
    assert template is not None
    assert templates.agrees(template, jobs[1], *made[1])
    envelope = json.loads(made[1][1])
    envelope["headers"]["drawn_by_a_newer_celery"] = "f00d"
    assert not templates.agrees(template, jobs[1], made[1][0], json.dumps(envelope))
    assert not templates.agrees(template, jobs[1], "another-list", made[1][1])


def test_job_ids_outside_the_plain_alphabet_are_built_by_celery(maker: Messages) -> None:
    jobs = _jobs()[:6]
    odd = jobs[4].model_copy(update={"job_id": "run-1.c4'quote"})  # never made by mrc: checked anyway
    made = maker.queued([*jobs[:4], odd, jobs[5]])
    assert _parsed(made[4].message)["headers"]["id"] == "run-1.c4'quote"
    assert _parsed(made[4].message)["headers"]["kwargsrepr"] == repr({"job": "run-1.c4'quote"})


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("mrc.infer", "mrc.infer"),  # a run `mrc` whose first lines are both `infer`: Celery's task name
        ("backlog", "c1"),  # within the lane's routing key
        ("mrc", "c1"),  # within both
    ],
)
def test_a_job_id_within_a_field_not_its_own_makes_no_template_of_its_part(
    maker: Messages, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    """Review, helper-109: the task name became each later job's id, and workers discarded them."""
    made_by_celery = _count_celery(maker, monkeypatch)
    jobs = _jobs()[1:8]
    odd = [jobs[0].model_copy(update={"job_id": first}), jobs[1].model_copy(update={"job_id": second})]
    made = maker.queued([*odd, *jobs[2:]])
    assert sum(made_by_celery) == 7, "a template was made of a job whose id is within a fixed field"
    for queued in made:
        message = _parsed(queued.message)
        assert message["headers"]["task"] == names.TASK_NAME
        assert message["properties"]["delivery_info"]["routing_key"] == names.queue_name("backlog")
        assert message["headers"]["id"] == message["headers"]["root_id"] == queued.job_id
    # One such part does not turn templates off: the next part is made from its own first job.
    assert maker.templates
    made_by_celery.clear()
    maker.queued(_jobs()[8:20])
    assert made_by_celery == [2]
