"""One failover run, for tests/faults/test_failover_*.py: a primary, two replicas and three Sentinels
(scripts/sentinel_cluster.py), a worker and an in-process producer that find the master through the
Sentinels, a steady stream of submissions (both lanes) and a `mrc backlog` run across the fault.

Counted: submissions acknowledged to the producer (Client.submit returned), the results in S3 of
those jobs, the jobs computed more than once (MRC_SUCCESS lines per job id), the time from the fault
to the first acknowledged submission after it."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.client import Client, Submission
from scripts import devservices as services
from scripts import sentinel_cluster
from shared import logs, names
from shared.stores import open_run_files
from tests.conftest import MODEL_HOME, TEST_CPU_THREADS
from tests.support import imagegen

BACKLOG_LINES = 16
# Submissions acknowledged before the fault comes: the stream is flowing, however slow the machine.
FLOWING = 5
# No result for this long while jobs are still pending: the worker stopped consuming (a failure).
STALLED_S = 120


@dataclass
class Outcome:
    acknowledged: list[str] = field(default_factory=list)
    acknowledged_before_fault: int = 0
    refused: int = 0  # submissions the producer saw fail (retried under the same id)
    lost: list[str] = field(default_factory=list)  # acknowledged, no result object
    computed_twice: list[str] = field(default_factory=list)
    skipped_existing: int = 0  # redeliveries the worker skipped: the result was already in S3
    recovery_s: float | None = None  # the fault -> the first acknowledged submission after it
    old_port: int = 0
    new_port: int = 0
    worker_log: str = ""
    backlog_results: list[dict[str, Any]] = field(default_factory=list)
    backlog_cli: str = ""  # the last `mrc backlog --wait` run's exit code and output
    switches: list[tuple[str, str]] = field(default_factory=list)  # the worker's MRC_REDIS_FAILOVER lines
    final_port: int = 0  # the master at the end (a second failover may follow the first)
    readyz_master: str | None = None
    queues_master: str | None = None
    exporter: str = ""
    lost_records: dict[str, dict[str, str]] = field(default_factory=dict)
    lanes_at_end: dict[str, int] = field(default_factory=dict)
    stalled: bool = False  # jobs were still pending (not lost: in flight) when results stopped coming

    def diagnostics(self) -> str:
        """What a failing run's log must show to find its cause afterwards: the state of what was
        lost, and the worker's own story around the fault (printed by the test on failure: CI keeps
        it)."""
        lines = self.worker_log.splitlines()
        interesting = [line for line in lines if not line.startswith(("MRC_SUCCESS|", "MRC_BATCH|"))]
        return "\n".join(
            [
                f"lost (first 10): {self.lost[:10]}"
                + (
                    f" (no result for {STALLED_S} s while they were queued or in flight)"
                    if self.stalled
                    else ""
                ),
                f"their records at the end: {self.lost_records}",
                f"lanes at the end: {self.lanes_at_end}",
                f"worker log: {len(lines)} lines; the last 150 that are not per-job successes:",
                *interesting[-150:],
            ]
        )

    def report(self, name: str) -> str:
        return (
            f"{name}: acknowledged {len(self.acknowledged)} ({self.acknowledged_before_fault} before the "
            f"fault), lost {len(self.lost)}, computed twice "
            f"{len(self.computed_twice)}, skipped as already done {self.skipped_existing}, refused "
            f"{self.refused}, recovered in {_seconds(self.recovery_s)}"
        )


class Run:
    def __init__(self, workdir: Path, wait_replicas: int, s3: services.Service) -> None:
        self.workdir = workdir
        # Sentinel's down-after time: 2 s, not Redis's default 30 s (a test's patience), not 1 s either
        # (on a busy 2-core machine a new master that misses one beat gets failed over again).
        self.cluster = sentinel_cluster.start(workdir / "redis", down_after_ms=2000)
        self.s3 = s3  # the session's server, a bucket of this run's own
        bucket = f"mrc-failover-{uuid.uuid4().hex[:8]}"
        self.env = services.base_env("redis://127.0.0.1:1/0", s3.url, bucket, MODEL_HOME, TEST_CPU_THREADS)
        self.env.update(self.cluster.env())
        self.env.update(
            {
                "MRC_REDIS_WAIT_REPLICAS": str(wait_replicas),
                "MRC_REDIS_WAIT_TIMEOUT_MS": "500",
                "MRC_VISIBILITY_TIMEOUT_S": "6",
                "MRC_RESTORE_INTERVAL_S": "1",
                "MRC_RETRY_BASE_S": "0.5",
                "MRC_RETRY_MAX_S": "2",
                "MRC_MAX_ATTEMPTS": "20",
                "MRC_CONNECT_TIMEOUT_S": "2",
            }
        )
        self.worker: services.Worker | None = None
        self.exporter: Any = None
        self.stop_producing = threading.Event()
        self.outcome = Outcome()
        self._fault_at: float | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.exporter is not None:
            services.stop(self.exporter, signal.SIGKILL)
        if self.worker is not None:
            self.worker.stop(signal.SIGKILL)
        self.cluster.stop()

    # ------------------------------------------------------------------ the run
    def run(
        self,
        fault: Callable[[sentinel_cluster.SentinelCluster, int], None],
        produce_s: float = 6,
        extras: bool = True,
    ) -> Outcome:
        # At debug level the worker logs each Redis connection it makes and each it notes as the master
        # (shared/redis_target.py): a failover it never noted (seen twice in CI) shows its path then.
        env = {**self.env, "MRC_MODEL": "echo", "MRC_ECHO_TOKEN_MS": "5", "MRC_LOG_LEVEL": "DEBUG"}
        self.worker = services.start_worker(env, self.workdir / "worker.log")
        # The backlog run and the lane exporter in one scenario only: each costs seconds, and the
        # suite runs four scenarios one after another.
        self.exporter = self._start_exporter() if extras else None
        image = self.workdir / "parcel.jpg"
        image.write_bytes(imagegen.photo(160, 120, seed=5))
        client = Client(services.settings_from_env(self.env))
        uri = client.upload_image(image)[0]
        producer = threading.Thread(target=self._produce, args=(client, uri), daemon=True)
        producer.start()
        backlog = self._start_backlog(uri) if extras else None
        time.sleep(produce_s * 0.3)
        services.wait_for(lambda: len(self.outcome.acknowledged) >= FLOWING, 120, "the first submissions")
        old = self.cluster.master_port()
        assert old is not None
        self.outcome.old_port = old
        with self._lock:
            self._fault_at = time.monotonic()
            self.outcome.acknowledged_before_fault = len(self.outcome.acknowledged)
        fault(self.cluster, old)
        self.outcome.new_port = self.cluster.wait_for_new_master(old)
        # On until 4 s past the first submission acknowledged after the fault (however long the
        # cluster takes to have a synced replica again on a slow machine), at most 120 s.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            recovered = self.outcome.recovery_s
            if recovered is not None and time.monotonic() - (self._fault_at + recovered) > produce_s * 0.4:
                break
            time.sleep(0.2)
        self.stop_producing.set()
        producer.join(timeout=60)
        if backlog is not None:
            self._finish_backlog(backlog)
        self._count(client)
        return self.outcome

    def _produce(self, client: Client, uri: str) -> None:
        """A steady caller: a new job every 50 ms, both lanes. A refused submission is retried under
        the same job id (the caller's idempotency key) between new ones, until acknowledged; so the
        recovery time is that of new submissions, and a retried id whose claim outlived the failover
        (it frees itself after 30 s) holds nobody else up."""
        index, tag = 0, uuid.uuid4().hex[:6]
        retries: list[Submission] = []
        while not self.stop_producing.is_set() or retries:
            if self.stop_producing.is_set() or (retries and index % 10 == 0):
                sub, fresh = retries.pop(0), False
            else:
                sub, fresh = self._submission(uri, tag, index), True
                index += 1
            started = time.monotonic()
            try:
                client.enqueue(client.build_job(sub))
            except Exception as exc:  # whatever the failover throws, the caller retries later
                self.outcome.refused += 1
                logs.get_logger().info("TEST_SUBMIT_REFUSED", job_id=sub.job_id, error=repr(exc)[:200])
                retries.append(sub)
                self.stop_producing.wait(0.2)
                continue
            with self._lock:
                self.outcome.acknowledged.append(str(sub.job_id))
                # Recovered: the first new submission begun after the fault is acknowledged.
                fault = self._fault_at
                if fresh and fault is not None and started > fault and self.outcome.recovery_s is None:
                    self.outcome.recovery_s = time.monotonic() - fault
            self.stop_producing.wait(0.05)

    @staticmethod
    def _submission(uri: str, tag: str, index: int) -> Submission:
        lane = "backlog" if index % 3 == 2 else "interactive"
        return Submission(image=uri, prompt=f"Refund for parcel {index}?", job_id=f"fo-{tag}-{index}",
                          lane=lane, max_new_tokens=4)  # fmt: skip

    def _start_backlog(self, uri: str) -> Any:
        lines = [
            {"custom_id": f"b-{i}", "image": uri, "prompt": f"Backlog complaint {i}?", "max_new_tokens": 4}
            for i in range(BACKLOG_LINES)
        ]
        self.manifest = self.workdir / "backlog.jsonl"
        self.manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.run_id = f"failover-{uuid.uuid4().hex[:6]}"
        return services.start_cli(
            self.env, "backlog", str(self.manifest), "--run-id", self.run_id, "--rate", "4"
        )

    def _finish_backlog(self, proc: Any) -> None:
        """The run as an operator finishes it: the same manifest under the same run id again (it
        enqueues what is missing, e.g. after the failover cut the first pass short), then waits."""
        proc.wait(timeout=120)
        for _ in range(3):
            done = services.run_cli(
                self.env, "backlog", str(self.manifest), "--run-id", self.run_id,
                "--wait", "--timeout", "120", "--interval", "1", timeout=200,
            )  # fmt: skip
            self.outcome.backlog_cli = f"exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-1500:]}"
            if done.returncode == 0:
                break
        files = open_run_files(services.settings_from_env(self.env))
        text = files.get_text(names.run_key("", self.run_id, "results.jsonl")) or ""
        self.outcome.backlog_results = [json.loads(line) for line in text.splitlines()]

    def _count(self, client: Client) -> None:
        # Until every acknowledged job has its result, or nothing is left to run (a lost job never
        # comes): the lanes empty and nothing in flight for 3 s in a row. Never a fixed time: on a busy
        # machine the worker may need minutes for what is queued, so the wait goes on while results
        # keep coming, and ends only when none came for STALLED_S (a worker that stopped consuming).
        settled, pending = 0, list(self.outcome.acknowledged)
        progressed = time.monotonic()
        while pending and settled < 6 and time.monotonic() - progressed < STALLED_S:
            still = [job_id for job_id in pending if client.result(job_id) is None]
            if len(still) < len(pending):
                progressed = time.monotonic()
            pending = still
            settled = settled + 1 if self._idle(client) else 0
            time.sleep(0.5)
        self.outcome.lost = pending
        self.outcome.stalled = bool(pending) and settled < 6
        try:
            self.outcome.lost_records = {job_id: client.records.get(job_id) for job_id in pending[:10]}
            self.outcome.lanes_at_end = {lane: client.lane_depth(lane) for lane in names.LANES}
            self.outcome.lanes_at_end["unacked"] = int(client.records._redis.hlen(names.UNACKED_KEY))  # type: ignore[attr-defined]
        except Exception as exc:  # the diagnostics must never hide the outcome
            self.outcome.lanes_at_end = {f"unreadable: {exc!r}"[:200]: -1}
        assert self.worker is not None
        text = self.worker.log_path.read_text(errors="replace")
        self.outcome.worker_log = text
        counts: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("MRC_SUCCESS|"):
                job_id = line.split("job_id=", 1)[1].split("|", 1)[0]
                counts[job_id] = counts.get(job_id, 0) + 1
            if line.startswith("MRC_SKIPPED|") and "reason=result_exists" in line:
                self.outcome.skipped_existing += 1
        self.outcome.computed_twice = [j for j, n in counts.items() if n > 1]
        self.outcome.switches = [
            (fields["old"], fields["new"])
            for event, fields in self.worker.events()
            if event == "MRC_REDIS_FAILOVER"
        ]
        self.outcome.final_port = self.cluster.master_port() or 0
        self.outcome.readyz_master = _readyz(self.worker.http_port).get("redis_master")
        queues = services.run_cli(self.env, "queues", "--json")
        self.outcome.queues_master = json.loads(queues.stdout)["redis"]["redis_master"]
        if self.exporter is not None:
            self.outcome.exporter = _scrape(self.exporter_port)

    def _idle(self, client: Client) -> bool:
        """Nothing waiting on the lanes and nothing taken unacked (read on the master in use now)."""
        try:
            waiting = sum(client.lane_depth(lane) for lane in names.LANES)
            taken = int(client.records._redis.hlen(names.UNACKED_KEY))  # type: ignore[attr-defined]
        except Exception:  # the cluster still settling: not idle yet
            return False
        return waiting == 0 and taken == 0

    def _start_exporter(self) -> Any:
        self.exporter_port = services.free_port()
        proc = services.start_cli(self.env, "queues", "--serve-metrics", str(self.exporter_port))
        services.wait_for(
            lambda: "mrc_queue_metrics_up 1" in _scrape(self.exporter_port), 30, "the exporter", proc
        )
        return proc


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _readyz(port: int) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
        return dict(json.loads(response.read()))


def _scrape(port: int) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""
