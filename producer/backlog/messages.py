"""A part's job messages, for `mrc backlog` and OpenAI Batches: Celery builds the first two of a lane and
priority, the rest are made from the first once the second agrees with it (producer/queue/templates.py
says why and how).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from celery import Celery

from producer.queue.templates import SAFE_ID, Template, agrees, drawn_now
from shared import logs
from shared.celery_app import send_job
from shared.jobs import Job
from shared.runs import Queued


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
        template = Template.of(jobs[0].job_id, *made[0]) if jobs[0].job_id != jobs[1].job_id else None
        if template is None or not agrees(template, jobs[1], *made[1]):
            if template is not None:
                self._distrust()
            return made + self._celery(jobs[2:], ahead, False)
        key = template.list_key
        return made + [
            (key, template.message(job.job_id, job.to_message(), drawn_now(self._app))) for job in jobs[2:]
        ]

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
