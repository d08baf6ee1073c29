"""The one batched Celery task: a list of requests in, one outcome per request out.

celery-batches acks the whole batch when the task returns *or raises*, so this task never raises
for one job's fault. A fault that leaves the process unusable ends it without acking, and Redis
delivers the batch again after the visibility timeout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery_batches import Batches, SimpleRequest

from shared import logs, names
from shared.settings import Settings
from workers.pipeline import Message, Pipeline

EXIT_UNUSABLE = 70


def to_messages(requests: Sequence[SimpleRequest]) -> list[Message]:
    messages = []
    for request in requests:
        kwargs = request.kwargs if isinstance(request.kwargs, dict) else {}
        body = kwargs.get("job", request.args[0] if request.args else None)
        messages.append(Message(request_id=str(request.id), body=body))
    return messages


def register(app: Celery, settings: Settings, pipeline: Pipeline) -> Any:
    """Register the batched task on `app`, bound to one pipeline (one model per process)."""
    log = logs.get_logger()

    def infer(requests: Sequence[SimpleRequest]) -> None:
        messages = to_messages(requests)
        try:
            outcomes = pipeline.run(messages)
        except BaseException as exc:
            log.critical("MRC_FATAL", error=repr(exc)[:500], jobs=len(messages))
            # Unacked messages go back to the queue after the visibility timeout.
            os._exit(EXIT_UNUSABLE)
        for message, outcome in zip(messages, outcomes, strict=True):
            if outcome == "unwritten":
                _requeue(app, message, log)

    return app.task(
        infer,
        name=names.TASK_NAME,
        base=Batches,
        flush_every=settings.batch_max_jobs,
        flush_interval=settings.batch_wait_ms / 1000,
        acks_late=True,
        ignore_result=True,
    )


def _requeue(app: Celery, message: Message, log: Any) -> None:
    """The result could not be stored: put the job back so another attempt writes it."""
    body = message.body if isinstance(message.body, dict) else {}
    lane = body.get("lane", "interactive")
    lane = lane if lane in names.LANES else "interactive"
    try:
        app.send_task(
            names.TASK_NAME, kwargs={"job": body}, task_id=message.request_id, queue=names.queue_name(lane)
        )
        log.warning("MRC_REQUEUED", job_id=message.request_id, reason="result_not_stored")
    except Exception as exc:
        log.critical("MRC_FATAL", error=f"cannot requeue {message.request_id}: {exc!r}"[:500])
        os._exit(EXIT_UNUSABLE)
