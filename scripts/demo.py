"""`make demo`: the whole path on local defaults.

Starts redis-server and moto's S3 server on free loopback ports, one mrc-worker on the tiny Fuyu,
submits sample tickets (images made here, prompts in English and Chinese) with the Python client
(`producer.client.Client`, in this process: no process start is timed with a ticket), prints one line
per result with the times the result itself reports (queued / preprocess / inference / total) and one
result in full, and stops everything it started, also on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client  # noqa: E402
from scripts import devservices as services  # noqa: E402 - after the path is set
from scripts.samples import photo  # noqa: E402
from shared import logs  # noqa: E402

TICKETS = [
    ("parcel-front.jpg", (1024, 768), "The box arrived crushed. Can I get a refund?"),
    ("parcel-side.png", (640, 480), "What is written on the parcel?"),
    ("receipt.jpg", (480, 800), "这个包裹坏了，我可以退款吗？"),
    ("phone-photo.jpg", (2016, 1512), "Is the item inside damaged?"),
    ("label.jpg", (1920, 1080), "Which delivery company shipped this?"),
]


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="mrc-demo-"))
    started: list[services.Service | services.Worker] = []
    began = time.monotonic()
    try:
        redis = services.start_redis(work / "redis")
        started.append(redis)
        s3 = services.start_s3(work / "s3")
        started.append(s3)
        env = services.base_env(redis.url, s3.url, "mrc-demo", ROOT / ".cache" / "mrc")
        env["MRC_DEVICE"] = "auto"
        print(f"redis {redis.url} | S3 {s3.url} | building/loading the tiny Fuyu ...", flush=True)
        worker = services.start_worker(env, work / "worker.log")
        started.append(worker)
        pids = " ".join(str(item.proc.pid) for item in started)
        print(f"worker ready (log: {work / 'worker.log'}; pids {pids})\n", flush=True)
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # the client's S3 access
        logs.configure("WARNING")  # the client's own events (MRC_ENQUEUED ...) would clutter the table
        client = Client(services.settings_from_env(env))
        for name, (w, h), _prompt in TICKETS:
            fmt = "PNG" if name.endswith(".png") else "JPEG"
            (work / name).write_bytes(photo(w, h, seed=len(name), fmt=fmt))
        results = []
        for i, (name, _size, prompt) in enumerate(TICKETS):  # one at a time, as tickets trickle in
            job_id = client.submit(work / name, prompt, ticket_id=f"T-{i}")
            results.append(client.wait(job_id, timeout=300))
        # The same first ticket again: answered from the result cache, without the model.
        job_id = client.submit(work / TICKETS[0][0], TICKETS[0][2], ticket_id="T-0-again")
        results.append(client.wait(job_id, timeout=300))
        _print_table(results)
        failures = sum(r.get("status") != "succeeded" for r in results)
        print(
            f"\n{len(results) - failures}/{len(results)} jobs succeeded in {time.monotonic() - began:.1f} s "
            "(start-up included). One result in full (what `mrc result JOB_ID` prints, indented here):"
        )
        print(json.dumps(results[0], ensure_ascii=False, indent=1))
        print(
            "The services stop with the demo; to keep a worker up and use `mrc` yourself, see README.md, "
            '"Run it yourself".'
        )
        print(
            "The tiny Fuyu has random weights: its text is noise; the path it takes is the real one.\n"
            "With Fuyu-8B on a GPU (weights in a local folder; nothing is downloaded):\n"
            "  MRC_MODEL=/models/fuyu-8b MRC_QUANTIZATION=nf4 MRC_DEVICE=cuda .venv/bin/mrc-worker"
        )
        return 0 if failures == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        for item in reversed(started):
            item.stop()
        shutil.rmtree(work, ignore_errors=True)


def _ms(timings: dict[str, Any], key: str) -> str:
    value = timings.get(key)
    return f"{value:.0f}" if isinstance(value, int | float) else "-"


def _print_table(results: list[dict[str, Any]]) -> None:
    """Per ticket, the times its result reports: what the system spent, not what the demo did."""
    print(
        f"{'ticket':<11} {'status':<10} {'queued':>7} {'prep':>6} {'model':>6} {'total':>7} ms  cache  text"
    )
    for r in results:
        timings = r.get("timings_ms") or {}
        text = " ".join(str(r.get("text") or (r.get("error") or {}).get("code", "")).split())
        text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)
        print(
            f"{r.get('ticket_id') or '-':<11} {r.get('status', '?'):<10} {_ms(timings, 'queued'):>7} "
            f"{_ms(timings, 'preprocess'):>6} {_ms(timings, 'inference'):>6} {_ms(timings, 'total'):>7}    "
            f"{'hit' if r.get('cache_hit') else '-':<5}  {text[:40]}"
        )


if __name__ == "__main__":
    sys.exit(main())
