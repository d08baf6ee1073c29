"""Strict lanes and backlog backpressure, with a real Redis and real workers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis as redis_lib

from scripts import devservices as services
from shared.errors import QueueFull
from shared.jobs import parse_rfc3339
from shared.lane_metrics import lane_view
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
    # --wait --timeout bounds the whole command: a lane still full when it is spent is exit 4, nothing
    # enqueued (review: the wait for room had no end)
    began = time.monotonic()
    waited = services.run_cli(
        cluster.env, "submit", "--image", str(image), "--prompt", "q", "--lane", "backlog", "--wait",
        "--timeout", "1", "--job-id", "waited-for-room", timeout=60,
    )  # fmt: skip
    assert waited.returncode == 4, waited.stderr
    assert "still full after 1 s; nothing enqueued" in waited.stderr
    assert time.monotonic() - began < 50
    assert cluster.client.records.get("waited-for-room").get("state") is None
    interactive = cluster.jobs(2, image, prefix="it")
    cluster.send(interactive)  # never held back by the backlog
    blocked_done = threading.Event()

    def blocked_submit() -> None:
        cluster.client.enqueue(backlog[6], block=True)
        blocked_done.set()

    thread = threading.Thread(target=blocked_submit, daemon=True)
    thread.start()
    assert not blocked_done.wait(2), "a backlog submission above the limit must wait"
    cluster.echo_worker()  # drains: room appears, the blocked submission goes through
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
    worker = cluster.echo_worker()  # the lanes' order is tested, not the model
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


LEFT_S = 1.5  # a backlog row's answer is 2.56 s (64 tokens x 40 ms); a ticket's 0.16 s


def test_backlog_never_fills_the_worker_and_a_ticket_overtakes_its_running_rows(cluster: Cluster) -> None:
    """With a deep backlog in hand, the worker holds at most (deliveries - 1) x MRC_BATCH_MAX_JOBS
    backlog messages, so a ticket is fetched at once, finds a thread, and is admitted into the running
    batch at the next step: it finishes while every backlog row that was running when it arrived is
    still decoding (answers of known length: the paced echo model, 64 tokens x 40 ms)."""
    import json

    image = cluster.image()
    backlog = [
        j.model_copy(update={"lane": "backlog"})
        for j in cluster.jobs(80, image, prefix="long", max_new_tokens=64)
    ]
    worker = cluster.paced_worker(40, MRC_BATCH_MAX_JOBS="8", MRC_WORKER_DELIVERIES="3")
    cluster.send(backlog)
    services.wait_for(lambda: bool(worker.find("MRC_SUCCESS")), 60, "a first backlog answer", worker.proc)
    # What `mrc queues` shows as in flight, read ten times in the next second, while 64 of the 80 jobs
    # still wait (each `mrc queues` took a second or two on a busy machine: a fresh-clone CI run's fifth
    # look came as the backlog ended, and read 0)
    view = json.loads(services.run_cli(cluster.env, "queues", "--json").stdout)
    assert view["in_flight"]["backlog"] <= (3 - 1) * 8, view
    lanes = redis_lib.Redis.from_url(cluster.env["MRC_REDIS_URL"], decode_responses=True)
    held = []
    for _ in range(10):
        held.append(int(lane_view(lanes)["backlog"]["in_flight"]))
        time.sleep(0.1)
    assert max(held) <= (3 - 1) * 8, f"backlog took the tickets' room: {held}"
    # Backlog work is in hand (the bound means something); not at every look, as rows of one length end
    # together, and between their acks and the next pop a look finds none.
    assert sum(1 for n in held if n > 0) >= 5, held
    # Three tickets a second apart: the backlog's rows run in waves (a delivery's rows, all of one
    # length, end together), and a ticket that arrives between two waves has no running row to
    # overtake; on a slow machine one may. A wave lasts 2.56 s, so one of the three lands in one.
    tickets = []
    for n in range(3):
        (ticket,) = cluster.jobs(1, image, prefix=f"vip{n}", max_new_tokens=4)
        ticket = ticket.model_copy(update={"prompt": f"ticket {n}?"})  # its own answer, not a cached one
        cluster.send([ticket])
        tickets.append(cluster.wait_all([ticket], 60)[ticket.job_id])
        assert tickets[-1]["status"] == "succeeded"
        time.sleep(1.0)

    def admitted(r: dict[str, Any]) -> float:  # submitted -> admitted to the running batch
        return parse_rfc3339(r["submitted_at"]).timestamp() + r["timings_ms"]["queued"] / 1000

    def finished(r: dict[str, Any]) -> float:
        return parse_rfc3339(r["finished_at"]).timestamp()

    results = cluster.wait_all(backlog, 180).values()
    # The rows with more than LEFT_S of their answer still to go when a ticket was admitted: one
    # admitted at the next step finishes first (4 tokens), one that waited for them overtakes none.
    measured = [
        (
            ticket,
            [
                r
                for r in results
                if admitted(r) <= admitted(ticket) and finished(r) - admitted(ticket) > LEFT_S
            ],
        )
        for ticket in tickets
    ]
    measured = [(ticket, running) for ticket, running in measured if running]
    assert measured, "no backlog row had far to go when any of the three tickets was admitted"
    for result, running in measured:
        _overtook(worker, result, running, admitted, finished)


def _overtook(
    worker: Any, result: dict[str, Any], running: list[dict[str, Any]], admitted: Any, finished: Any
) -> None:
    overtaken = [r for r in running if finished(r) > finished(result)]
    origin = admitted(result)
    story = "\n".join(
        f"{r['job_id']}: admitted {admitted(r) - origin:+.3f} s, finished {finished(r) - origin:+.3f} s, "
        f"timings {r['timings_ms']}"
        for r in [result, *sorted(running, key=finished)]
    )
    lines = [line for line in worker.log_path.read_text().splitlines() if result["job_id"] in line]
    assert len(overtaken) == len(running), (
        f"{len(overtaken)} of {len(running)} rows with over {LEFT_S} s to go overtaken (times from the "
        f"ticket's admission):\n{story}\nthe ticket in the worker's log:\n" + "\n".join(lines)
    )
