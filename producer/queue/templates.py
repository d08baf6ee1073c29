"""Job messages made from one Celery built: for `mrc backlog` and OpenAI Batches a part at a time
(producer/backlog/messages.py), and for each submission of mrc-api and `mrc submit` (Sends, below).

Celery builds each message in about 150 µs (its headers, kombu's envelope and encodings): three quarters
of a bulk enqueue's time was spent there, and a quarter of mrc-api's CPU a submission (docs/benchmarks.md).
Two messages of the same lane and priority differ only in the job: its body, the fields that name its id
(the task id, the root id, the correlation id, the arguments' repr) and two fields drawn at random per
publish (kombu's delivery tag, mrc's push id). So Celery builds the first message of a lane and priority
as the template, and the second to check the template against: the one made from the template, with the
check's random fields, must equal Celery's field for field, its body decoded. Where it does not (a Celery
or kombu release that adds a field or encodes another way), every message from then on is Celery's own,
and the process says so once in its log: never a message Celery would not have sent. A field is the
job's only where it is the job id or the arguments' repr whole: a first job whose id is within any other
field (a run `mrc`'s line `infer` is `mrc.infer`, the task's name), or a second job of the same id (its
check could not tell the job's fields from the others), makes no template.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.utils import json as kombu_json

from shared import logs, names
from shared.celery_app import job_repr, send_job
from shared.jobs import Job

# What the transport puts in each message afresh (kombu's delivery tag: the key its unacked entry is
# kept under; mrc's push id: what makes a retried push land once). Every other field is the template's.
# And one Celery sets per thread: `reply_to`, the sending thread's id (`app.thread_oid`; review,
# helper-125: a template from one thread checked against a message of another disagreed, so under
# concurrent submissions templates were turned off, and a trusted one gave every thread the first's).
_DRAWN_PROPERTIES = ("delivery_tag", "reply_to")
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
class Template:
    """One message Celery built, as text with a place for each of a job's own values: what every job of
    its lane and priority shares."""

    list_key: str
    text: str  # for str.format: the message with {id}, {body} and a drawn field's {name} as places
    body: tuple[str, str]  # the body's JSON before and after the job's message

    @classmethod
    def of(cls, job_id: str, list_key: str, text: str) -> Template | None:
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

    def message(self, job_id: str, job: dict[str, Any], drawn: dict[str, str]) -> str:
        """The message text for another job of the template's lane and priority: its own body and id,
        and the fields drawn per message (`drawn_now`; or Celery's, for the check against it)."""
        before, after = self.body
        values = {key: drawn[key] for key in _DRAWN}
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


def agrees(template: Template, job: Job, list_key: str, text: str) -> bool:
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


def drawn_now(app: Celery, push_id: str | None = None) -> dict[str, str]:
    """The fields of a message drawn as Celery draws them for this publish: kombu's delivery tag (a
    uuid4's text), the push id (`push_id`, else a fresh uuid4's hex), the calling thread's reply-to."""
    return {"delivery_tag": str(uuid.uuid4()), "reply_to": app.thread_oid,
            names.PUSH_HEADER: push_id or uuid.uuid4().hex}  # fmt: skip


_DISAGREEMENTS = 3  # templates checked and found wrong before a process builds every message with Celery


class Sends:
    """Each submission's message pushed as Celery's publish pushes it (shared/transport.py: once per push
    id, then the WAIT for replicas), made from a template once Celery's second message of its lane and
    priority agreed with it; Celery's own until then, and for good once one disagreed. Thread-safe:
    mrc-api's request threads share one."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._trusted: dict[tuple[str, bool], Template] = {}
        self._first: dict[tuple[str, bool], tuple[str, Template]] = {}  # to check against the next
        self._trusting = True
        self._disagreed = 0

    def send(self, job: Job, push_id: str, ahead: bool = False) -> None:
        shape = (job.lane, ahead and job.lane == "backlog")
        template = self._trusted.get(shape)
        queue = names.queue_name(job.lane)
        with self._app.producer_or_acquire() as producer:
            if template is not None and SAFE_ID.match(job.job_id):
                text = template.message(job.job_id, job.to_message(), drawn_now(self._app, push_id))
                producer.channel.push_text(queue, template.list_key, text, push_id)
                return
            with producer.channel.capturing() as captured:
                message = job.to_message()
                send_job(self._app, message, job.lane, producer=producer, push_id=push_id, ahead=ahead)
            ((key, text),) = captured
            producer.channel.push_text(queue, key, text, push_id)
        self._learn(shape, job, key, text)

    def _learn(self, shape: tuple[str, bool], job: Job, key: str, text: str) -> None:
        with self._lock:
            if not self._trusting or shape in self._trusted:
                return
            first = self._first.pop(shape, None)
            if first is None or first[0] == job.job_id:  # the same job twice tells nothing: kept for the next
                made = Template.of(job.job_id, key, text) if first is None else first[1]
                if made is not None:
                    self._first[shape] = (job.job_id, made)
                return
            if agrees(first[1], job, key, text):
                self._trusted[shape] = first[1]
                return
            # A pair of ids can disagree by chance (a first id equal to a fixed field's value): the next
            # pair is tried; a Celery that encodes another way disagrees every time.
            self._disagreed += 1
            if self._disagreed >= _DISAGREEMENTS:
                self._trusting = False
                logs.get_logger().warning(
                    "MRC_MESSAGES_FROM_CELERY",
                    reason="messages made from Celery's template differ from those Celery made",
                )
