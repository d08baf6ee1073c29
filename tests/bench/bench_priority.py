"""Interactive latency behind a deep backlog: p50/p95/p99 end to end with 2,000 backlog jobs queued and
a worker busy on them, next to the same figures with an empty backlog, in one run.

    .venv/bin/python tests/bench/bench_priority.py [--backlog 2000] [--interactive 40] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.client import Client, Submission  # noqa: E402 - after sys.path is set
from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from shared.jobs import parse_rfc3339  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set


def percentiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[94], q[98]


def interactive_latencies(client: Client, image: Path, count: int, interval: float, tag: str) -> list[float]:
    """Submit at a steady rate; latency = finished_at - submitted_at of each result (seconds)."""
    jobs = [
        client.build_job(
            Submission(image=image, prompt=f"ticket {i}?", job_id=f"{tag}-{i}", max_new_tokens=16)
        )
        for i in range(count)
    ]
    for job in jobs:
        client.enqueue(job.model_copy(update={"submitted_at": _now()}))
        time.sleep(interval)
    out = []
    for job in jobs:
        result = client.wait(job.job_id, 300)
        out.append(
            (parse_rfc3339(result["finished_at"]) - parse_rfc3339(result["submitted_at"])).total_seconds()
        )
    return out


def _now() -> str:
    from shared.jobs import now_rfc3339

    return now_rfc3339()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=2000)
    parser.add_argument("--interactive", type=int, default=40)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-prio-"))
    redis, s3 = services.start_redis(work / "redis"), services.start_s3(work / "s3")
    worker = None
    try:
        env = services.base_env(redis.url, s3.url, "mrc-prio", ROOT / ".cache" / "mrc")
        env["MRC_CACHE_TTL_S"] = "0"  # every job costs model time
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        client = Client(services.settings_from_env(env))
        image = work / "photo.jpg"
        image.write_bytes(imagegen.camera_photo(1024, 768))
        worker = services.start_worker(env, work / "worker.log")

        quiet = interactive_latencies(client, image, args.interactive, args.interval, "quiet")

        template = client.build_job(Submission(image=image, prompt="nightly reprocessing", lane="backlog"))
        began = time.perf_counter()
        filler = threading.Thread(
            target=lambda: [client.enqueue(template.model_copy(update={"job_id": f"bl-{i}"}))
                            for i in range(args.backlog)], daemon=True)  # fmt: skip
        filler.start()
        filler.join()
        depth_before = client.lane_depth("backlog")
        busy = interactive_latencies(client, image, args.interactive, args.interval, "busy")
        depth_after = client.lane_depth("backlog")
        # One batch = the time of a full delivery of backlog work, what an arriving ticket may wait behind.
        full = [float(b["seconds"]) for b in worker.find("MRC_BATCH") if int(b["jobs"]) >= 16]
        batch_s = statistics.median(full)

        p_quiet, p_busy = percentiles(quiet), percentiles(busy)
        print(f"backlog: {args.backlog} queued in {time.perf_counter() - began:.1f} s")
        print(f"backlog depth {depth_before} when the interactive jobs started, {depth_after} when done")
        print(f"interactive: {args.interactive} jobs, one every {args.interval} s; delivery {batch_s:.2f} s")
        print(f"{'':>16} {'p50':>7} {'p95':>7} {'p99':>7}   (seconds, submit to result)")
        print(f"{'empty backlog':>16} {p_quiet[0]:7.3f} {p_quiet[1]:7.3f} {p_quiet[2]:7.3f}")
        print(f"{'deep backlog':>16} {p_busy[0]:7.3f} {p_busy[1]:7.3f} {p_busy[2]:7.3f}")
        bound = 2 * p_quiet[2] + batch_s
        verdict = "met" if p_busy[2] <= bound else "NOT met"
        print(f"p99 busy / quiet = {p_busy[2] / p_quiet[2]:.2f}; goal p99 busy <= 2 x p99 quiet + one batch")
        print(f"  = {bound:.3f} s: {verdict}")
    finally:
        if worker is not None:
            worker.stop()
        redis.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
