"""One submission's enqueue, in this process, against a local redis-server and moto S3 server: what
mrc-api and `mrc submit` spend on each job once it is checked (the claim, the message, the push, the
confirmation), its id drawn (no S3 look). Side by side in one run, alternated: each message made from
a template of Celery's (producer/queue/templates.py) and each built by Celery (the Sends told to trust
no template, as before 2026-12-08). Prints ms of wall and of CPU an enqueue, and the ratio.

    .venv/bin/python tests/bench/bench_submit.py [--jobs 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set


def one_round(env: dict[str, str], image: str, count: int, templates: bool) -> tuple[float, float]:
    """(ms wall, ms CPU) an enqueue, over `count` drawn-id jobs after 50 to warm up."""
    from producer.client import Client
    from producer.intake.request import Submission

    client = Client(services.settings_from_env(env))
    client.sends._trusting = templates  # False: Celery builds every message, as before
    jobs = [
        client.build_job(Submission(image=image, prompt=f"Refund {n}?", job_id=f"chat-{uuid.uuid4().hex}"))
        for n in range(count + 50)
    ]
    for job in jobs[:50]:
        client.enqueue(job, minted=True)
    cpu, wall = time.process_time(), time.perf_counter()
    for job in jobs[50:]:
        client.enqueue(job, minted=True)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    client.close()
    return wall * 1000 / count, cpu * 1000 / count


def main() -> None:
    parser = argparse.ArgumentParser(description="one submission's enqueue: templates against Celery")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logs.configure("WARNING")
    depth = str(10 * args.jobs * args.rounds)
    with services.local_stack("mrc-bench-submit-", "mrc-bench", ROOT / ".cache" / "mrc",
                              MRC_BACKLOG_MAX_DEPTH=depth) as env:  # fmt: skip
        from producer.client import Client

        with tempfile.TemporaryDirectory() as folder:
            photo = Path(folder) / "p.jpg"
            photo.write_bytes(imagegen.photo(64, 48))
            image, _ = Client(services.settings_from_env(env)).upload_image(photo)
        cpu: dict[str, list[float]] = {"celery": [], "templates": []}
        for turn in range(args.rounds):  # alternated: a drift of the machine hits both alike
            for name in ("celery", "templates"):
                wall_ms, cpu_ms = one_round(env, image, args.jobs, name == "templates")
                cpu[name].append(cpu_ms)
                print(f"round {turn + 1}, messages built by {name}: {wall_ms:.3f} ms wall, "
                      f"{cpu_ms:.3f} ms CPU an enqueue", flush=True)  # fmt: skip
        before, now = statistics.median(cpu["celery"]), statistics.median(cpu["templates"])
        print(f"CPU an enqueue, median: Celery {before:.3f} ms, templates {now:.3f} ms ({now / before:.2f}x)")


if __name__ == "__main__":
    main()
