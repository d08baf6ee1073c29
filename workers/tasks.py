"""The one batched Celery task: a list of requests in, one outcome per request out.

celery-batches acks the whole batch when the task returns *or raises*, so this task never raises
for one job's fault. A fault that leaves the process unusable ends it without acking, and Redis
delivers the batch again after the visibility timeout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import celery_batches
from celery import Celery
from celery_batches import SimpleRequest

from shared import logs, names
from shared.celery_app import send_job
from shared.errors import NotReplicated
from shared.settings import Settings
from workers.pipeline import Pipeline
from workers.slots import Message

EXIT_UNUSABLE = 70


class Batches(celery_batches.Batches):  # type: ignore[misc]  # celery_batches is untyped
    """celery-batches, with ETA (countdown) requests kept outside the prefetch limit, and tickets
    handed on at once.

    A retry is sent back with a countdown; the worker that receives it holds it unacked until its ETA.
    Celery's own strategy raises the prefetch limit by one for each such message (and lowers it when it
    runs); celery-batches does not, so as many pending retries as the prefetch limit stopped the worker
    from taking any fresh job until the first ETA passed (up to MRC_RETRY_MAX_S).

    A ticket (the interactive lane) waits for no company: the engine admits rows at every step, so
    one that arrives a moment later joins the running batch anyway, and the wait (MRC_BATCH_WAIT_MS,
    all of it on an idle worker) was most of a lone ticket's time to its first token (70 ms, 50 of
    them waiting). Backlog messages still gather into deliveries: their round trips are per delivery."""

    def Strategy(self, task: Any, app: Celery, consumer: Any) -> Any:
        # Made again at every consumer (re)start. After a lost broker connection Celery clears the
        # event loop's timers, celery-batches' flush timer among them, while celery-batches keeps its
        # handle and so never starts another: part-full batches then waited for a full one, forever
        # for the last jobs (found by the Redis failover test). A fresh start, a fresh timer.
        self._tref = None
        handler = super().Strategy(task, app, consumer)
        waiting: set[str] = set()
        self._waiting_for_eta = waiting

        def on_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any) -> None:
            headers = message.headers or {}
            if headers.get("eta") and headers.get("id"):
                waiting.add(str(headers["id"]))
                consumer.qos.increment_eventually()  # read now: QoS is set up after the strategies
            handler(message, body, ack, reject, callbacks, **kw)
            if _fresh_ticket(message, headers):
                self._do_flush()  # with whatever else is buffered: nothing in it waits longer

        self._consumer = consumer
        return on_message

    def flush(self, requests: Any) -> Any:
        waiting: set[str] = getattr(self, "_waiting_for_eta", set())
        for request in requests:
            if request.id in waiting:
                waiting.discard(request.id)
                self._consumer.qos.decrement_eventually()
        return super().flush(requests)


INTERACTIVE_QUEUE = names.queue_name("interactive")


def _fresh_ticket(message: Any, headers: dict[str, Any]) -> bool:
    """A message of the interactive lane (kombu's delivery_info names the queue; every priority step
    of a lane carries the lane's name), neither a retry waiting out its countdown nor a message given
    back or restored after its worker died: those still gather, so that the suspects among them run
    in groups (workers/admission.py), not each alone with the worker to itself."""
    lane = str((getattr(message, "delivery_info", None) or {}).get("routing_key", ""))
    return lane == INTERACTIVE_QUEUE and not headers.get("eta") and not headers.get("redelivered")


def to_messages(requests: Sequence[SimpleRequest]) -> list[Message]:
    messages = []
    for request in requests:
        kwargs = request.kwargs if isinstance(request.kwargs, dict) else {}
        body = kwargs.get("job", request.args[0] if request.args else None)
        messages.append(Message(request_id=str(request.id), body=body))
    return messages


def register(
    app: Celery,
    settings: Settings,
    pipeline: Pipeline,
    give_back: Callable[[], int] | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> Any:
    """Register the batched task on `app`, bound to one pipeline (one model per process).

    `give_back` returns every message the process holds unacked to its queue at once when the
    process must end; `on_fatal` marks the worker not ready before it does."""
    log = logs.get_logger()
    ending = threading.Lock()  # the first delivery thread to fail ends the process; the rest wait

    def infer(requests: Sequence[SimpleRequest]) -> None:
        messages = to_messages(requests)
        try:
            pipeline.run(messages)
        except BaseException as exc:
            log.critical("MRC_FATAL", error=repr(exc)[:500], jobs=len(messages))
            with ending:
                if on_fatal is not None:
                    on_fatal(repr(exc)[:300])
                # Every message held, not only this delivery's: the other deliveries in hand, those
                # buffered for the next and the retries counting down cannot finish here either.
                _give_back(give_back, log)
                # Exit without acking: what was not given back, Redis hands out after the visibility
                # timeout.
                os._exit(EXIT_UNUSABLE)

    return app.task(
        infer,
        name=names.TASK_NAME,
        base=Batches,
        flush_every=settings.batch_max_jobs,
        # kombu's timer never fires an interval of 0: MRC_BATCH_WAIT_MS=0 ("do not wait") is 1 ms
        flush_interval=max(settings.batch_wait_ms, 1) / 1000,
        acks_late=True,
        ignore_result=True,
    )


def buffered(app: Celery) -> int:
    """Jobs the batched task holds and has not handed to the pipeline yet (celery-batches' queues)."""
    task = app.tasks.get(names.TASK_NAME)
    queues = [getattr(task, "_buffer", None), getattr(task, "_pending", None)]
    return sum(q.qsize() for q in queues if q is not None)


def _give_back(give_back: Callable[[], int] | None, log: Any) -> None:
    if give_back is None:
        return
    try:
        returned = give_back()
    except Exception as exc:  # Redis may be what failed: the visibility timeout still returns them
        log.error("MRC_GIVE_BACK_FAILED", error=repr(exc)[:300])
        return
    log.warning("MRC_GIVEN_BACK", jobs=returned)


def make_requeue(app: Celery) -> Callable[[str, object, float], None]:
    """Put a job back on its lane after `delay` seconds (a Celery countdown), same task id. A retry
    that reached the master but not enough replicas (MRC_REDIS_WAIT_REPLICAS) is queued: logged, never
    raised (raising here would end the worker with the retry queued and its delivery given back too)."""
    log = logs.get_logger()

    def requeue(request_id: str, body: object, delay: float) -> None:
        job = dict(body) if isinstance(body, dict) else {}
        job.setdefault("job_id", request_id)
        try:
            send_job(app, job, str(job.get("lane", "interactive")), countdown=delay)
        except NotReplicated as exc:
            log.warning("MRC_NOT_REPLICATED", job_id=job["job_id"], what="retry", replicas=exc.acknowledged,
                        wanted=exc.wanted)  # fmt: skip

    return requeue
