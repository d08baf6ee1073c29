"""Strict lanes and backlog backpressure, with a real Redis and real workers."""

from __future__ import annotations

import threading

import pytest

from scripts import devservices as services
from shared.errors import QueueFull
from shared.jobs import parse_rfc3339
from tests.faults.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_backlog_depth_limit_blocks_or_refuses_but_never_interactive(cluster: Cluster) -> None:
    cluster.env["MRC_BACKLOG_MAX_DEPTH"] = "5"
    image = cluster.image()
    backlog = [j.model_copy(update={"lane": "backlog"}) for j in cluster.jobs(7, image, prefix="bl")]
    cluster.send(backlog[:5])
    assert cluster.client.lane_depth("backlog") == 5
    with pytest.raises(QueueFull) as caught:
        cluster.client.enqueue(backlog[5], block=False)
    assert (caught.value.depth, caught.value.limit) == (5, 5)
    assert "5" in caught.value.message
    refused = services.run_cli(
        cluster.env, "submit", "--image", str(image), "--prompt", "q", "--lane", "backlog", "--no-block"
    )
    assert refused.returncode == 4
    assert "queue full" in refused.stderr
    assert refused.stdout == ""
    interactive = cluster.jobs(2, image, prefix="it")
    cluster.send(interactive)  # never held back by the backlog
    blocked_done = threading.Event()

    def blocked_submit() -> None:
        cluster.client.enqueue(backlog[6], block=True)
        blocked_done.set()

    thread = threading.Thread(target=blocked_submit, daemon=True)
    thread.start()
    assert not blocked_done.wait(2), "a backlog submission above the limit must wait"
    cluster.worker()  # drains: room appears, the blocked submission goes through
    assert blocked_done.wait(60)
    results = cluster.wait_all([*backlog[:5], backlog[6], *interactive], 90)
    assert {r["status"] for r in results.values()} == {"succeeded"}
    assert cluster.client.result(backlog[5].job_id) is None  # refused: never enqueued


def test_interactive_jobs_overtake_a_deep_backlog(cluster: Cluster) -> None:
    image = cluster.image()
    backlog = [j.model_copy(update={"lane": "backlog"}) for j in cluster.jobs(200, image, prefix="deep")]
    interactive = cluster.jobs(4, image, prefix="vip")
    cluster.send(backlog)
    cluster.send(interactive)
    worker = cluster.worker()
    done = cluster.wait_all(interactive, 60)
    last_vip = max(parse_rfc3339(r["finished_at"]) for r in done.values())
    before = 0
    for job in backlog:
        result = cluster.client.result(job.job_id)
        if result is not None and parse_rfc3339(result["finished_at"]) < last_vip:
            before += 1
    delivery = int(cluster.env.get("MRC_BATCH_MAX_JOBS", "16"))
    # The first delivery may already hold backlog jobs when the worker starts; no more than that.
    assert before <= delivery, f"{before} backlog jobs finished before the interactive ones"
    assert worker.proc.poll() is None
