"""What ops look at exists on a live worker: every series the dashboard queries, and log lines that
all parse."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from producer.client import Client
from scripts import devservices as services
from shared.logs import parse_line
from tests.unit.test_deploy import dashboard_metrics

GPU_ONLY_PREFIX = "mrc_gpu_"  # NVML and torch.cuda series: absent on a machine without a GPU
API_PREFIX = "mrc_api_"  # mrc-api's own series, on its /metrics


@pytest.fixture
def worked(worker: services.Worker, client: Client, tmp_path: Path) -> services.Worker:
    """The session worker, after at least one job of this test's (labelled series exist once observed)."""
    from tests.support import imagegen

    photo = tmp_path / "obs.jpg"
    photo.write_bytes(imagegen.photo(320, 240, seed=21))
    job_id = client.submit(photo, "Is it damaged?", job_id=f"obs-{tmp_path.name}")
    assert client.wait(job_id, 120)["status"] == "succeeded"
    # The result is written first, then the job's metrics and its MRC_SUCCESS line (workers/outcomes.py):
    # a scrape right after the result could come before the series existed (a fresh-clone CI run whose
    # worker had no job before this one). The line says the metrics are in.
    assert worker.logged("MRC_SUCCESS", job_id=job_id)
    return worker


def _missing(text: str, wanted: set[str]) -> list[str]:
    """The metric families in `wanted` that the scraped `text` does not expose."""
    exposed = {line.split("{")[0].split()[0] for line in text.splitlines() if line.startswith("mrc_")}
    families = {name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for name in exposed}
    families |= {name.removesuffix("_total") for name in families}
    return sorted(
        name for name in wanted if name not in families and name.removesuffix("_total") not in families
    )


def test_every_series_the_dashboard_queries_exists_on_a_live_worker(worked: services.Worker) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{worked.http_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = {name for name in dashboard_metrics() if not name.startswith((GPU_ONLY_PREFIX, API_PREFIX))}
    assert not _missing(text, wanted)


def test_every_api_series_the_dashboard_queries_exists_on_mrc_api(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's mrc-api panels (review, helper-99: there were none) read what mrc-api serves."""
    from fastapi.testclient import TestClient

    from producer.server import create_app

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, env[name])
    with TestClient(create_app(services.settings_from_env(env))) as api:
        assert api.get("/healthz").status_code == 200
        text = api.get("/metrics").text
    wanted = {name for name in dashboard_metrics() if name.startswith(API_PREFIX)}
    assert wanted >= {"mrc_api_requests_total", "mrc_api_unavailable_total"}
    assert not _missing(text, wanted)


def test_every_worker_log_line_parses_and_job_events_carry_the_job(worked: services.Worker) -> None:
    lines = [line for line in worked.log_path.read_text().splitlines() if line.strip()]
    assert len(lines) > 5
    job_events = {"MRC_SUCCESS", "MRC_ERROR", "MRC_RETRY", "MRC_DEAD_LETTER", "MRC_SKIPPED"}
    seen = set()
    for line in lines:
        event, fields = parse_line(line)
        assert event.isupper(), line[:120]
        assert "ts" in fields, line[:120]
        if event in job_events:
            seen.add(event)
            assert fields.get("job_id"), line[:120]
    assert "MRC_SUCCESS" in seen


def test_the_runs_still_going_the_oldest_ones_age_and_entries_set_aside_are_exported(
    env: dict[str, str],
) -> None:
    """Review, helper-99: MrcBacklogOldestJobTooOld claimed the nightly run's 6-hour SLO, but a run
    bigger than the lane's depth limit is fed as the lane drains: its jobs never wait long, however
    long it runs. The runs' own records are read now: the runs still going, and the oldest's age."""
    import redis as redis_lib

    from shared import names
    from shared.lane_metrics import LaneCollector
    from shared.runs import RunRecords

    client = redis_lib.Redis.from_url(env["MRC_REDIS_URL"].rsplit("/", 1)[0] + "/10", decode_responses=True)
    client.flushdb()
    try:
        runs = RunRecords(client)
        runs.start("nightly-old", "complaints.jsonl")
        runs.update("nightly-old", created_at="2026-12-06T01:15:00Z", state="enqueued", valid="10",
                    finished_succeeded="4")  # fmt: skip
        runs.start("nightly-done", "complaints.jsonl")
        runs.update("nightly-done", created_at="2026-12-05T01:15:00Z", state="enqueued", valid="3",
                    finished_succeeded="2", finished_failed="1")  # fmt: skip
        runs.start("batch_1", "openai:file-1")  # being queued now
        client.set(names.rejected_count_key(), 1003)  # the list keeps 1,000; the count goes on
        gauges = {
            (family.name, sample.labels.get("kind")): sample.value
            for family in LaneCollector(client, runs=True).collect()
            for sample in family.samples
        }
    finally:
        client.flushdb()
        client.close()
    assert gauges[("mrc_backlog_runs_active", "backlog")] == 1  # the finished one is not going
    assert gauges[("mrc_backlog_runs_active", "batch")] == 1
    assert gauges[("mrc_backlog_run_oldest_age_seconds", "backlog")] > 24 * 3600
    assert 0 <= gauges[("mrc_backlog_run_oldest_age_seconds", "batch")] < 3600
    assert gauges[("mrc_rejected", None)] == 1003  # review, helper-99: in no metric before


def test_a_batch_that_failed_before_its_lines_ran_is_no_batch_still_going(env: dict[str, str]) -> None:
    """Review, helper-101: a batch whose input copy was gone was marked failed, and its run stayed
    `enqueuing`: counted as a batch going (and MrcBatchNearItsWindow firing) for its record's 30 days."""
    from types import SimpleNamespace

    import redis as redis_lib

    from producer.openai.batch_book import BatchBook
    from producer.openai.batch_run import Runner
    from shared import run_progress
    from shared.runs import RunRecords
    from shared.settings import Settings

    client = redis_lib.Redis.from_url(env["MRC_REDIS_URL"].rsplit("/", 1)[0] + "/11", decode_responses=True)
    client.flushdb()
    try:
        runs = RunRecords(client)
        book = BatchBook(client)
        runs.start("batch_gone", "openai:file-1")
        book.create("batch_gone", "k", {"created_at": str(int(time.time())), "status": "in_progress"})
        backlog = SimpleNamespace(settings=Settings(), runs=runs)
        runner = Runner(backlog, book, None, None, client)  # type: ignore[arg-type]
        assert run_progress.oldest_active(client)["batch"]["active"] == 1
        runner._fail("batch_gone", "input_missing", "the batch's copy of its input file is gone")
        assert run_progress.oldest_active(client)["batch"]["active"] == 0
        assert runs.get("batch_gone")["state"] == "failed"
        assert book.get("batch_gone")["status"] == "failed"
        # Another process's finalize won (and dropped the input copy, which is why this one found it
        # gone): its end stands (review, helper-117: `cancelled` became `failed`)
        runs.start("batch_ended", "openai:file-2")
        book.create("batch_ended", "k", {"created_at": str(int(time.time())), "status": "cancelled"})
        runs.update("batch_ended", state="cancelled")
        runner._fail("batch_ended", "input_missing", "the batch's copy of its input file is gone")
        assert book.get("batch_ended")["status"] == "cancelled"
        assert runs.get("batch_ended")["state"] == "cancelled"
    finally:
        client.flushdb()
        client.close()
