"""What ops look at exists on a live worker: every series the dashboard queries, and log lines that
all parse."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from producer.client import Client
from scripts import devservices as services
from shared.logs import parse_line
from tests.unit.test_deploy import dashboard_metrics

GPU_ONLY_PREFIX = "mrc_gpu_"  # NVML and torch.cuda series: absent on a machine without a GPU


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


def test_every_series_the_dashboard_queries_exists_on_a_live_worker(worked: services.Worker) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{worked.http_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    exposed = {line.split("{")[0].split()[0] for line in text.splitlines() if line.startswith("mrc_")}
    families = {name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for name in exposed}
    families |= {name.removesuffix("_total") for name in families}
    missing = sorted(
        name
        for name in dashboard_metrics()
        if not name.startswith(GPU_ONLY_PREFIX)
        and name not in families
        and name.removesuffix("_total") not in families
    )
    assert not missing, missing


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
