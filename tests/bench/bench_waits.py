"""How late a wait learns that its job ended: from the moment the job's end is written (result, record,
then its completion event, as workers/finisher.py writes them) to the moment the wait returns the
result. Three waits, side by side in one run against a local redis-server and moto S3 server:

- `Client.wait` (`mrc submit --wait`), woken by the job's completion event, and polling only (every
  `MRC_WAIT_POLL_S`, 0.1 s: what it was before);
- mrc-api's `Waits.result` (`GET /v1/jobs/ID/result?wait=`, chat completions), woken the same way, and
  polling only (its follower never wakes it: the record every 0.25 s, what it was before).

Each job ends at a random moment after its wait began (0.3-1.3 s), so a poll's phase is not fixed.

    .venv/bin/python tests/bench/bench_waits.py [--jobs 40]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set


class _Asleep:
    """A follower that never wakes anyone: the API wait as it was, polling only."""

    @contextlib.contextmanager
    def watching(self, job_id: str) -> Iterator[asyncio.Event]:
        yield asyncio.Event()

    def close(self) -> None:
        pass


def _finish_later(client: Any, job_id: str, delay: float, ended: dict[str, float]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        ended[job_id] = time.perf_counter()
        client.results.put_result(job_id, {"schema": "mrc.result/1", "job_id": job_id, "status": "succeeded"})
        client.records.set_state(job_id, "succeeded")
        client.records.add_event({"job_id": job_id, "status": "succeeded"}, 100_000)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _lateness(client: Any, jobs: int, wait: Callable[[str], Any], seed: int) -> list[float]:
    """ms from each job's end being written to its wait returning the result."""
    rng = random.Random(seed)
    late: list[float] = []
    ended: dict[str, float] = {}
    for _ in range(jobs):
        job_id = f"bench-wait-{uuid.uuid4().hex[:12]}"
        assert client.records.claim(job_id, "interactive")
        finisher = _finish_later(client, job_id, rng.uniform(0.3, 1.3), ended)
        result = wait(job_id)
        returned = time.perf_counter()
        finisher.join()
        assert isinstance(result, dict), result
        assert result["status"] == "succeeded", result
        late.append((returned - ended[job_id]) * 1000)
    return late


def main() -> None:
    parser = argparse.ArgumentParser(description="how late a wait learns that its job ended")
    parser.add_argument("--jobs", type=int, default=40)
    args = parser.parse_args()
    logs.configure("WARNING")
    with services.local_stack("mrc-bench-waits-", "mrc-bench", ROOT / ".cache" / "mrc") as env:
        from producer.client import Client
        from producer.http import waits as api_waits

        settings = services.settings_from_env(env)

        class Polling(Client):
            def _events_tail(self) -> str | None:
                return None  # no stream: the wait only polls

        client, polls = Client(settings), Polling(settings)
        client.results.ensure_bucket()
        woken = api_waits.Waits(settings, 4)
        polling = api_waits.Waits(settings, 4)
        polling.completions.close()
        polling.completions = _Asleep()  # type: ignore[assignment]

        def api(waits: Any) -> Callable[[str], Any]:
            return lambda job_id: asyncio.run(waits.result(job_id, 30, client.result))

        ways = {
            "Client.wait, woken by the event": lambda job_id: client.wait(job_id, 30),
            "Client.wait, polling only (before)": lambda job_id: polls.wait(job_id, 30),
            "mrc-api result wait, woken by the event": api(woken),
            "mrc-api result wait, polling only (before)": api(polling),
        }
        print(
            f"| wait ({args.jobs} jobs each, ending 0.3-1.3 s after its wait began) "
            "| p50 ms late | p99 ms late | mean ms |"
        )
        print("|---|---|---|---|")
        try:
            for seed, (name, wait) in enumerate(ways.items()):
                late = sorted(_lateness(client, args.jobs, wait, seed))
                p99 = late[min(len(late) - 1, round(0.99 * (len(late) - 1)))]
                print(
                    f"| {name} | {statistics.median(late):.1f} | {p99:.1f} | {statistics.fmean(late):.1f} |"
                )
        finally:
            woken.close()
            client.close()
            polls.close()


if __name__ == "__main__":
    main()
