"""What mrc-api's routes share, its own routes and the OpenAI-compatible ones alike: the settings, the
producer's queue and intake (made on first use, so an API whose Redis is away still starts and
answers 503), the long-polls' waits, and the metrics registry."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.metrics_core import Metric

from producer.http.waits import Waits
from producer.intake.intake import Intake
from producer.queue.sender import Queue
from shared import redis_target
from shared.settings import Settings

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's, read when it is imported


class SizedFilesCollector(multiprocess.MultiProcessCollector):
    """prometheus_client's multiprocess collector, leaving out a process's file not yet sized: a
    process creates its file and sizes it after (prometheus/client_python#1199, open), and a scrape
    that read it then failed whole, 500 (a CI run, MRC_API_WORKERS=2); a process killed then leaves it
    so for good. Such a file holds nothing yet."""

    def collect(self) -> Iterable[Metric]:
        files = [path for path in glob.glob(os.path.join(self._path, "*.db")) if _sized(path)]
        return self.merge(files, accumulate=True)  # type: ignore[no-any-return]


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the header: bytes used, and padding
    except OSError:  # gone since the listing (a process's files removed as it ends)
        return False


class ApiState:
    def __init__(self, settings: Settings, queue: Queue | None = None) -> None:
        self.settings = settings
        self._queue = queue
        self._own_queue = False  # made here (closed at shutdown), or the caller's
        self._intake: Intake | None = None
        self.waits = Waits(settings, settings.api_wait_threads)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mrc_api_requests_total", "Requests", ["route", "method", "status"], registry=self.registry
        )
        self.seconds = Histogram("mrc_api_request_seconds", "Request time", ["route"], registry=self.registry)
        # 503s because Redis or S3 could not serve (not the backlog's backpressure, not a body turn):
        # the alert's signal for an outage that leaves Redis answering reads (out of memory) or S3 away.
        self.unavailable = Counter(
            "mrc_api_unavailable_total",
            "Requests answered 503 because Redis or S3 could not serve them",
            ["service"],
            registry=self.registry,
        )
        for service in ("redis", "s3"):  # series from 0, not absent
            self.unavailable.labels(service=service)
        self.registry.register(redis_target.FailoverCollector())
        # What /metrics serves: this registry, or with several API processes (mrc-api sets
        # prometheus_client's own switch for them: server.py) every process's counters summed.
        self.scrape = self.registry
        if os.environ.get(MULTIPROCESS_DIR):
            self.scrape = CollectorRegistry()
            SizedFilesCollector(self.scrape)
            self.scrape.register(redis_target.FailoverCollector())
        # Every key's usage (mrc_usage_*): served on /metrics only to a scrape with an `ops` or
        # `all-tenants` key when keys are on, since /metrics needs no key (producer/http/jobs.py).
        self.usage_registry = CollectorRegistry()

    @property
    def queue(self) -> Queue:
        if self._queue is None:
            from shared.stores import open_stores
            from shared.stores.s3 import REQUEST_ATTEMPTS, REQUEST_READ_TIMEOUT_S

            images, results = open_stores(self.settings, REQUEST_ATTEMPTS, REQUEST_READ_TIMEOUT_S)
            self._queue = Queue(self.settings, images=images, results=results)
            self._own_queue = True
        return self._queue

    @property
    def intake(self) -> Intake:
        if self._intake is None:
            self._intake = Intake(self.settings, self.queue.images)
        return self._intake

    def close(self) -> None:
        self.waits.close()
        if self._queue is not None and self._own_queue:
            self._queue.close()

    def count_unavailable(self, service: str) -> None:
        self.unavailable.labels(service="redis" if service.lower() == "redis" else "s3").inc()

    def count(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.seconds.labels(route=route).observe(seconds)
