"""A worker's admission of a delivery of backlog jobs: each record says it was not checked (a bulk
enqueue asks S3 nothing per line), so the worker looks for an earlier result of each before it runs
it. The looks asked of S3 at once (now) against one after another (before: `LOOKS_AT_ONCE = 1`), in
one run, side by side.

S3's round trip is what the look waits for, and moto on loopback is no model of one: the store here is
the in-process one with `--latency-ms` slept per look (20 ms: the order of a real S3 GET that finds
nothing). The records are the in-process ones too: the looks are the measure.

    .venv/bin/python tests/bench/bench_admission.py [--deliveries 20] [--jobs 16] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared import logs  # noqa: E402 - after sys.path is set
from shared.memory_records import MemoryJobRecords  # noqa: E402
from shared.settings import Settings  # noqa: E402
from shared.stores.memory import MemoryStore  # noqa: E402
from workers import admission  # noqa: E402
from workers.metrics import Metrics  # noqa: E402
from workers.slots import Slot  # noqa: E402


class FarStore(MemoryStore):
    """The in-process store, each look for a result a round trip away."""

    def __init__(self, latency_s: float) -> None:
        super().__init__("mrc")
        self.latency_s = latency_s

    def get_result(self, job_id: str) -> dict[str, Any] | None:
        time.sleep(self.latency_s)
        return super().get_result(job_id)


def _delivery(tag: str, jobs: int) -> list[Slot]:
    from shared.jobs import Job

    slots = []
    for n in range(jobs):
        body = {"job_id": f"{tag}-{n}", "image_uri": "s3://mrc/inputs/p.jpg", "prompt": "Refund?",
                "lane": "backlog", "max_new_tokens": 16}  # fmt: skip
        slot = Slot(body["job_id"], body, time.time())
        slot.job = Job.from_message(body)
        slots.append(slot)
    return slots


def run(at_once: int, deliveries: int, jobs: int, latency_s: float) -> list[float]:
    """Seconds each delivery's admission took."""
    admission.LOOKS_AT_ONCE = at_once
    records, store = MemoryJobRecords(), FarStore(latency_s)
    admit = admission.Admission(records, store, Settings(), Metrics(), logs.get_logger())
    spent = []
    try:
        for d in range(deliveries):
            slots = _delivery(f"d{at_once}-{d}", jobs)
            for slot in slots:  # as a bulk enqueue leaves them: queued, published, not checked
                records.records[slot.job_id] = {"state": "queued", "published": "1", "checked": "0"}
            began = time.perf_counter()
            admit.admit(slots)
            spent.append(time.perf_counter() - began)
            assert all(slot.error is None and slot.outcome is None for slot in slots)
    finally:
        admit.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description="a delivery's looks for earlier results, at once vs in turn")
    parser.add_argument("--deliveries", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=16, help="jobs a delivery (MRC_BATCH_MAX_JOBS)")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    logs.configure("WARNING")
    at_once = admission.LOOKS_AT_ONCE
    rows = {}
    for name, threads in (("one after another (before)", 1), ("at once (now)", at_once)):
        spent = run(threads, args.deliveries, args.jobs, args.latency_ms / 1000)
        rows[name] = p50 = statistics.median(spent)
        print(f"{name}: admission of a delivery of {args.jobs}, p50 {p50 * 1000:.1f} ms, "
              f"max {max(spent) * 1000:.1f} ms ({args.latency_ms:g} ms a look)", flush=True)  # fmt: skip
    before, now = rows.values()
    print(f"before / now: {before / now:.1f}x")


if __name__ == "__main__":
    main()
