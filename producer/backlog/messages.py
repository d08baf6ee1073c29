"""A part's job messages, for `mrc backlog` and OpenAI Batches: Celery builds a few of them, the rest are
made from one it built.

Celery builds each message in about 150 µs (its headers, kombu's envelope and encodings): three quarters
of a bulk enqueue's time was spent there (docs/benchmarks.md, bulk enqueue). Two messages of the same
lane and priority differ only in the job: its body, the fields that name its id (the task id, the root
id, the correlation id, the arguments' repr) and two fields drawn at random per publish (kombu's delivery
tag, mrc's push id). So per part, Celery builds the first message of a priority as the template, and
the second to check the template against: the one made from the template, with the check's random
fields, must equal Celery's field for field, its body decoded. Where it does not (a Celery or kombu
release that adds a field or encodes another way), every message from then on is Celery's own, and the
run says so once in its log: never a message Celery would not have sent. A field is the job's only
where it is the job id or the arguments' repr whole: a first job whose id is within any other field
(a run `mrc`'s line `infer` is `mrc.infer`, the task's name), or a second job of the same id (its
check could not tell the job's fields from the others), makes no template: Celery builds that part.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.utils import json as kombu_json

from shared import logs, names
from shared.celery_app import job_repr, send_job
from shared.jobs import Job
from shared.runs import Queued

# What the transport puts in each message afresh (kombu's delivery tag: the key its unacked entry is
# kept under; mrc's push id: what makes a retried push land once). Every other field is the template's.
_DRAWN_PROPERTIES = ("delivery_tag",)
_DRAWN_HEADERS = (names.PUSH_HEADER,)


# Where a job's own values go in the template's text: a name in marks JSON writes as they are, which no
# template made from a text that held them already. None of the values needs escaping in JSON or in a
# repr: a job id is of SAFE_ID's characters (others are made by Celery), the rest are uuids and base64.
def _place(name: str) -> str:
    return f"@@mrc:{name}@@"


_ID, _BODY, _JOB = _place("id"), _place("body"), _place("job")
_DRAWN = (*_DRAWN_PROPERTIES, *_DRAWN_HEADERS)
# Each place as str.format writes it: the values go in with one call, at C speed.
_FIELDS = {_ID: "{id}", _BODY: "{body}", **{_place(key): f"{{{key}}}" for key in _DRAWN}}
_PLACES = re.compile("|".join(re.escape(place) for place in _FIELDS))
SAFE_ID = re.compile(r"[A-Za-z0-9._:~-]+\Z")


@dataclass(frozen=True)
class _Template:
    """One message Celery built, as text with a place for each of a job's own values: what every job of
    its lane and priority shares."""

    list_key: str
    text: str  # for str.format: the message with {id}, {body} and a drawn field's {name} as places
    body: tuple[str, str]  # the body's JSON before and after the job's message

    @classmethod
    def of(cls, job_id: str, list_key: str, text: str) -> _Template | None:
        """The template in Celery's message for `job_id`; None where it is not the shape this module
        makes (then Celery builds every message)."""
        try:
            envelope = json.loads(text)
            properties, headers = envelope["properties"], envelope["headers"]
            shape = (properties.get("body_encoding"), envelope.get("content-type"))
            drawn = all(key in headers for key in _DRAWN_HEADERS) and all(
                key in properties for key in _DRAWN_PROPERTIES
            )
            body = _body(envelope)
        except (AttributeError, KeyError, TypeError, ValueError, binascii.Error):
            return None
        usable = isinstance(body, list) and len(body) == 3 and isinstance(body[1], dict) and "job" in body[1]
        if (
            shape != ("base64", "application/json")
            or not usable
            or not drawn
            or not SAFE_ID.match(job_id)
            or "@@mrc:" in text
        ):
            return None
        before, _, after = str(kombu_json.dumps([body[0], {**body[1], "job": _JOB}, body[2]])).partition(
            json.dumps(_JOB)
        )
        try:
            marked = {key: _marked(key, value, job_id) for key, value in envelope.items()}
        except _Unplaceable:
            return None
        text = str(kombu_json.dumps(marked)).replace("{", "{{").replace("}", "}}")
        return cls(list_key, _PLACES.sub(lambda place: _FIELDS[place.group(0)], text), (before, after))

    def message(self, job_id: str, job: dict[str, Any], drawn: dict[str, str] | None = None) -> str:
        """The message text for another job of the template's lane and priority: its own body and id,
        and fresh random fields (or `drawn`'s, for the check against Celery's)."""
        before, after = self.body
        values = {key: (drawn[key] if drawn else _fresh(key)) for key in _DRAWN}
        body = base64.b64encode((before + json.dumps(job) + after).encode("utf-8")).decode("ascii")
        return self.text.format_map({**values, "id": job_id, "body": body})


class _Unplaceable(ValueError):
    """The job id is within a field that is not its own (a run named `mrc` whose line is `infer` has
    the id `mrc.infer`, Celery's task name): marking it there would write each job's id into it."""


def _marked(key: str, value: Any, job_id: str) -> Any:
    """An envelope's field with the job's places marked: the body, the fields drawn per message, and
    those that name the job (its id, or the repr of its arguments)."""
    if key == "body":
        return _BODY
    if key in ("headers", "properties") and isinstance(value, dict):
        drawn = _DRAWN_HEADERS if key == "headers" else _DRAWN_PROPERTIES
        return {
            name: _place(name) if name in drawn else _mark(inner, job_id) for name, inner in value.items()
        }
    return _mark(value, job_id)


def _mark(value: Any, job_id: str) -> Any:
    if value == job_id:
        return _ID
    if value == job_repr(job_id):
        return job_repr(_ID)
    if isinstance(value, str) and job_id in value:
        raise _Unplaceable(value)
    if isinstance(value, dict):
        return {key: _mark(inner, job_id) for key, inner in value.items()}
    if isinstance(value, list):
        return [_mark(inner, job_id) for inner in value]
    return value


class Messages:
    """Job messages for the backlog lane, exactly as Celery and kombu would publish them, captured
    instead of sent (the caller pushes each in one Lua step with its job's record)."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._lock = threading.Lock()  # one capture at a time on the one channel
        self._producer: Any = None
        self.templates = True  # False once a template disagreed with Celery: Celery builds every message

    def queued(self, jobs: list[Job], ahead: int = 0) -> list[Queued]:
        """Each job's message, the first `ahead` on the backlog's ahead list."""
        with self._lock:
            texts: list[tuple[str, str]] = []
            for start, end, first in _groups(len(jobs), ahead):
                texts += self._group(jobs[start:end], ahead=start < ahead, declare=first)
        return [
            Queued(job.job_id, job.lane, job.fingerprint(), key, text)
            for job, (key, text) in zip(jobs, texts, strict=True)
        ]

    def _group(self, jobs: list[Job], ahead: bool, declare: bool) -> list[tuple[str, str]]:
        """(list key, text) for jobs of one lane and priority: Celery's own for the first two, and the
        rest from the first once the second agrees with it."""
        if not self.templates or len(jobs) <= 2 or not all(SAFE_ID.match(job.job_id) for job in jobs):
            return self._celery(jobs, ahead, declare)
        made = self._celery(jobs[:2], ahead, declare)
        # No template from this part where its first job cannot be one (its id within a field not its
        # own, or the check would be the same job: it could not tell a field that names the job from
        # one that does not; review, helper-109: the task name became each job's id, and workers
        # discarded them). Where a template and Celery disagree, none from then on.
        template = _Template.of(jobs[0].job_id, *made[0]) if jobs[0].job_id != jobs[1].job_id else None
        if template is None or not _agrees(template, jobs[1], *made[1]):
            if template is not None:
                self._distrust()
            return made + self._celery(jobs[2:], ahead, False)
        key = template.list_key
        return made + [(key, template.message(job.job_id, job.to_message())) for job in jobs[2:]]

    def _celery(self, jobs: list[Job], ahead: bool, declare: bool) -> list[tuple[str, str]]:
        if not jobs:
            return []
        app = self._app
        if self._producer is None:  # one connection for every part: nothing is sent through it
            self._producer = app.amqp.Producer(app.connection_for_write().default_channel)
        producer = self._producer
        with producer.channel.capturing() as captured:
            for n, job in enumerate(jobs):
                send_job(app, job.to_message(), job.lane, producer=producer,
                         declare=None if declare and n == 0 else [], ahead=ahead)  # fmt: skip
        return list(captured)

    def _distrust(self) -> None:
        if self.templates:
            self.templates = False
            logs.get_logger().warning(
                "MRC_BACKLOG_MESSAGES_FROM_CELERY",
                reason="a message made from Celery's template differs from the one Celery made",
            )


def _groups(count: int, ahead: int) -> Iterable[tuple[int, int, bool]]:
    """(start, end, declares) of the runs of one priority: the ahead jobs, then the others."""
    ahead = max(0, min(ahead, count))
    if ahead:
        yield 0, ahead, True
    if ahead < count:
        yield ahead, count, ahead == 0


def _agrees(template: _Template, job: Job, list_key: str, text: str) -> bool:
    """Whether the template makes `job`'s message as Celery made it (`text`), field for field."""
    try:
        celery = json.loads(text)
        drawn = {key: celery["properties"][key] for key in _DRAWN_PROPERTIES}
        drawn.update((key, celery["headers"][key]) for key in _DRAWN_HEADERS)
        ours = json.loads(template.message(job.job_id, job.to_message(), drawn))
        return list_key == template.list_key and _decoded(ours) == _decoded(celery)
    except (KeyError, TypeError, ValueError, binascii.Error):
        return False


def _decoded(envelope: dict[str, Any]) -> dict[str, Any]:
    return {**envelope, "body": _body(envelope)}


def _body(envelope: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(envelope["body"], validate=True).decode("utf-8"))


def _fresh(key: str) -> str:
    """A random field's new value, drawn as its maker draws it (kombu: a uuid4's text; mrc: its hex)."""
    return uuid.uuid4().hex if key == names.PUSH_HEADER else str(uuid.uuid4())
