"""Each fault test gets its own Redis (AOF on), S3 bucket behind a cuttable proxy, and workers.

The S3 server is the session's (one per test process), each cluster in a bucket of its own: a moto
server costs ~1.6 CPU-s to start, and the suite started one per fault test (~30 of its ~60), on two
cores busy with the rest of make test. No fault test stops the server itself: an outage is the proxy's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client
from scripts import devservices as services
from shared.jobs import Job
from tests.conftest import MODEL_HOME, TEST_CPU_THREADS
from tests.support import imagegen
from tests.support.proxy import Proxy


class Cluster:
    def __init__(self, workdir: Path, s3: services.Service) -> None:
        self.workdir, self.s3 = workdir, s3
        self.redis = services.start_redis(workdir / "redis", appendonly=True)
        try:
            self.proxy = Proxy(self.s3.port, services.free_port())
            self.proxy.start()
        except BaseException:  # nothing left running (a fresh clone's run left this redis-server)
            self.redis.stop()
            raise
        bucket = f"mrc-faults-{uuid.uuid4().hex[:8]}"
        self.env = services.base_env(
            self.redis.url, f"http://127.0.0.1:{self.proxy.port}", bucket, MODEL_HOME, TEST_CPU_THREADS
        )
        self.env.update(
            {
                "MRC_QUANTIZATION": "fp32",  # loads in 0.1 s: these tests start many workers
                # Batch-size calibration costs ~4 s per worker start and no fault test is about it
                # (tests/unit/test_batch_sizes.py and the session worker's /readyz are).
                "MRC_BATCH_CALIBRATE": "false",
                # A killed worker's jobs come back after this (the killer test waits it out three
                # times); a live one's never do: it renews them every 1.25 s (a quarter of it), and
                # test_a_batch_longer_than_the_visibility_timeout holds a delivery past 2 s.
                "MRC_VISIBILITY_TIMEOUT_S": "5",
                "MRC_RESTORE_INTERVAL_S": "1",
                "MRC_RETRY_BASE_S": "0.5",
                "MRC_RETRY_MAX_S": "3",  # below the visibility timeout / 1.5, as settings require
                "MRC_MAX_ATTEMPTS": "10",
            }
        )
        self.workers: list[services.Worker] = []
        self._client: Client | None = None

    def paced_worker(self, token_ms: int = 50, **env: str) -> services.Worker:
        """A worker on the echo model at a known speed (MRC_ECHO_TOKEN_MS per answer token), for tests
        whose point is the broker and the worker's bookkeeping, not the model: it starts in a few
        seconds and its batches last as long as the test needs on a machine of any speed."""
        return self.worker(MRC_MODEL="echo", MRC_ECHO_TOKEN_MS=str(token_ms), **env)

    def echo_worker(self, token_ms: int = 2, **env: str) -> services.Worker:
        """A worker on the echo model (no model: it reads image headers, loads no torch and starts in
        ~2 s), for tests of the broker and the worker's bookkeeping: the pipeline, the engine, the
        transport and the stores are the real ones, only the model is not."""
        return self.paced_worker(token_ms, **env)

    def worker(self, **env: str) -> services.Worker:
        log = self.workdir / f"worker-{len(self.workers)}.log"
        w = services.start_worker({**self.env, **env}, log)
        self.workers.append(w)
        return w

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(services.settings_from_env(self.env))
        return self._client

    def image(self, data: bytes | None = None, name: str = "img.jpg") -> Path:
        path = self.workdir / name
        path.write_bytes(data if data is not None else imagegen.photo(320, 240))
        return path

    def jobs(
        self,
        count: int,
        image: Path | None = None,
        prefix: str = "job",
        max_new_tokens: int = 8,
        lane: str = "interactive",
    ) -> list[Job]:
        """Jobs built (image uploaded once) but not yet sent. Tickets (the interactive lane) start a
        delivery each as they arrive; backlog jobs gather into deliveries (workers/tasks.py)."""
        from producer.client import Submission

        image = image or self.image()
        tag = uuid.uuid4().hex[:6]
        return [
            self.client.build_job(
                Submission(
                    image=image,
                    prompt=f"question {i}?",
                    max_new_tokens=max_new_tokens,
                    job_id=f"{prefix}-{tag}-{i}",
                    lane=lane,
                )
            )
            for i in range(count)
        ]

    def send(self, jobs: list[Job]) -> None:
        for job in jobs:
            assert self.client.enqueue(job)

    def results(self, jobs: list[Job]) -> dict[str, dict[str, Any] | None]:
        return {job.job_id: self.client.result(job.job_id) for job in jobs}

    def wait_all(self, jobs: list[Job], timeout: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        pending = {job.job_id for job in jobs}
        done: dict[str, dict[str, Any]] = {}
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                if self.client.records.get(job_id).get("state") in ("succeeded", "failed"):
                    result = self.client.result(job_id)
                    if result is not None:
                        done[job_id] = result
                        pending.discard(job_id)
            time.sleep(0.2)
        assert not pending, (
            f"{len(pending)} jobs without a result after {timeout} s: {sorted(pending)[:5]}\n{self.state()}"
        )
        return done

    def state(self) -> str:
        """What a failed wait shows (a rare failure explained by its own report, not a rerun): the
        queues, the unacked records with their ages, the restore mutex and each worker's last lines."""
        import redis as redis_lib

        from shared import names

        client = redis_lib.Redis.from_url(self.env["MRC_REDIS_URL"], decode_responses=True)
        try:
            now = time.time()
            index: list[tuple[str, float]] = client.zrange(names.UNACKED_INDEX_KEY, 0, -1, withscores=True)  # type: ignore[assignment]
            ages = {tag: round(now - score, 1) for tag, score in index}
            lines = [
                f"queues: { {k: client.llen(k) for k in client.keys('mrc.*') if client.type(k) == 'list'} }",
                f"unacked: {client.hkeys(names.UNACKED_KEY)} ages (s): {ages}",
                f"restore mutex: {client.get('unacked_mutex')!r} ttl {client.pttl('unacked_mutex')} ms",
            ]
        finally:
            client.close()
        for w in self.workers:
            tail = w.log_path.read_text(errors="replace").splitlines()[-15:]
            lines.append(f"{w.log_path.name} (exit {w.proc.poll()}):\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    def successes(self, job_id: str) -> int:
        """How many times any worker computed this job (MRC_SUCCESS lines across all worker logs)."""
        return sum(len(w.find("MRC_SUCCESS", job_id=job_id)) for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.stop(9)
        self.proxy.close()
        self.redis.stop()


@pytest.fixture
def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_service: services.Service
) -> Iterator[Cluster]:
    c = Cluster(tmp_path, s3_service)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, c.env[name])
    try:
        yield c
    finally:
        c.close()
