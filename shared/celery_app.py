"""The Celery app and its reliability settings, shared by producer and worker."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery

from shared import names, redis_target, transport_qos
from shared.settings import Settings


def make_celery(settings: Settings, socket_timeout: float = 30) -> Celery:
    """`socket_timeout`: how long a broker command waits for Redis (a producer's publish waits as long
    as its other commands do: shared/records.answer_timeout_s)."""
    app = Celery("mrc", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        # Redis, with queue entries that are not message envelopes set aside instead of fatal.
        # (over a master found through Sentinel when MRC_REDIS_SENTINELS is set)
        broker_transport="shared.transport:SentinelTransport"
        if redis_target.uses_sentinel(settings)
        else "shared.transport:Transport",
        # JSON only: a pickled message is refused by the worker's consumer, never executed.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # Results go to S3 as objects of our own schema; Celery's result backend is not used.
        result_backend=None,
        task_ignore_result=True,
        # Ack only after the batch wrote its results; a worker that dies leaves its messages unacked,
        # and Redis hands them out again after the visibility timeout.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Prefetch = one message per thread: the worker runs MRC_WORKER_DELIVERIES x MRC_BATCH_MAX_JOBS
        # threads (a delivery may be one message), so it never hoards the queue; backlog messages
        # never take the last batch's worth (shared/transport.py, lane_limits), so a ticket is always
        # fetched, and finds a thread, at once.
        worker_prefetch_multiplier=1,
        # After a lost broker connection Celery cuts the prefetch to what the tasks in progress leave
        # and gives it back as tasks complete; batched requests (celery-batches) never report that, so
        # a worker could stay at one message at a time (or stall) after a Redis failover.
        worker_enable_prefetch_count_reduction=False,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "queue_order_strategy": "priority",
            "unacked_restore_interval": settings.restore_interval_s,
            "unacked_restore_throttle": 1,
            "unacked_key": names.UNACKED_KEY,
            "unacked_index_key": names.UNACKED_INDEX_KEY,
            # The restore mutex outlives a worker killed while holding it: then nobody restores for
            # this long (kombu's default, 300 s; 60 s let a killed worker's jobs wait 12 visibility
            # timeouts of 5 s in a fault test run).
            "unacked_mutex_expire": transport_qos.restore_mutex_expiry(settings.visibility_timeout_s),
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": 10,
            "retry_on_timeout": True,
            "health_check_interval": 30,
            **redis_target.transport_options(settings),
        },
        # TLS for a rediss:// MRC_REDIS_URL (verified certificates unless the URL says otherwise).
        broker_use_ssl=redis_target.broker_tls(settings) or False,
        broker_connection_timeout=settings.connect_timeout_s,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=names.queue_name("interactive"),
        task_create_missing_queues=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_enable_remote_control=False,
    )
    return app


def send_job(
    app: Celery,
    job: dict[str, object],
    lane: str,
    countdown: float | None = None,
    producer: Any = None,
    declare: list[Any] | None = None,
    push_id: str | None = None,
    ahead: bool = False,
) -> None:
    """Put a job message on its lane's queue, its job id as the task id (how a job id is sent once).
    `producer`: publish through this kombu producer (`mrc backlog` captures the messages instead);
    `declare=[]`: the queue is known to exist (a bulk send declares it once, not per message);
    `push_id`: what makes two publishes the same push (shared/transport.py pushes each once): the
    producer names its job's first publish by the job id, so no resubmission of it pushes twice; by
    default each call is its own push (a retry the worker sends is a new message). `ahead`: on the
    backlog's ahead list (shared/names.py AHEAD_STEP), taken before the rest of the lane."""
    lane = lane if lane in names.LANES else "interactive"
    job_id = str(job.get("job_id"))
    app.send_task(
        names.TASK_NAME,
        kwargs={"job": job},
        task_id=job_id,
        queue=names.queue_name(lane),
        countdown=countdown,
        producer=producer,
        declare=declare,
        # Celery would repr the whole job (prompt included) into the headers, at two thirds of a
        # bulk enqueue's time; the job id says which job it is.
        argsrepr="()",
        kwargsrepr=job_repr(job_id),
        # One id for this publish, the same through Celery's and redis-py's retries of it: the transport
        # pushes a message once per id (shared/transport.py), so a retried push never queues it twice.
        headers={names.PUSH_HEADER: push_id or uuid.uuid4().hex},
        priority=names.AHEAD_STEP if ahead and lane == "backlog" else None,
    )


def job_repr(job_id: str) -> str:
    """What a job message's headers show of its arguments (Celery's `kwargsrepr`)."""
    return f"{{'job': {job_id!r}}}"
