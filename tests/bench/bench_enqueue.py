"""How fast `mrc backlog` enqueues, and whether its memory stays flat: N manifest lines whose images
are already in S3, enqueued against a local redis-server and moto S3 server, in this process
(producer/backlog/run.py, as the CLI runs it). Prints lines/s and peak RSS at 10 % and at 100 % of the run,
and the old one-by-one `Client.enqueue` on a sample for comparison.

    .venv/bin/python tests/bench/bench_enqueue.py [--lines 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description="mrc backlog enqueue speed and memory")
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--sample", type=int, default=2000, help="jobs for the one-by-one comparison")
    args = parser.parse_args()
    logs.configure("WARNING")
    limit = str(10 * args.lines)
    home = ROOT / ".cache" / "mrc"
    with services.local_stack("mrc-bench-enqueue-", "mrc-bench", home, MRC_BACKLOG_MAX_DEPTH=limit) as env:
        from producer.backlog.run import Backlog
        from producer.client import Client, Submission

        settings = services.settings_from_env(env)
        client = Client(settings)
        client.results.ensure_bucket()

        def lines(count: int):  # type: ignore[no-untyped-def]
            for n in range(1, count + 1):
                row = {
                    "custom_id": f"c{n}",
                    "image": f"s3://mrc-bench/in/{n % 1000}.jpg",
                    "prompt": f"Refund {n}?",
                }
                yield n, json.dumps(row).encode()

        backlog = Backlog(client)
        marks: dict[str, float] = {}
        tenth = max(1, args.lines // 10)

        def on_progress(progress) -> None:  # type: ignore[no-untyped-def]
            if progress.lines >= tenth and "rss_10" not in marks:
                marks["rss_10"] = _rss_mb()

        began = time.perf_counter()
        progress = backlog.enqueue(lines(args.lines), "bench", "bench", on_progress=on_progress)
        seconds = time.perf_counter() - began
        rss_end = _rss_mb()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert progress.enqueued == args.lines, progress
        depth = client.lane_depth("backlog")
        assert depth == args.lines, depth
        rate = args.lines / seconds
        print(f"mrc backlog: {args.lines} lines in {seconds:.1f} s = {rate:,.0f} lines/s")
        print(f"RSS after 10 %: {marks.get('rss_10', float('nan')):.0f} MB, at the end: {rss_end:.0f} MB, "
              f"peak {peak:.0f} MB")  # fmt: skip

        began = time.perf_counter()
        for n in range(args.sample):
            job = client.build_job(
                Submission(image=f"s3://mrc-bench/in/{n}.jpg", prompt="Q?", job_id=f"one-{n}", lane="backlog")
            )
            client.enqueue(job)
        one = args.sample / (time.perf_counter() - began)
        print(f"Client.enqueue one by one: {one:,.0f} jobs/s ({args.sample} jobs); mrc backlog / one by one "
              f"= {rate / one:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
