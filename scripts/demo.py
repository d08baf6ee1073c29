"""`make demo`: the whole path on local defaults.

Starts redis-server and moto's S3 server on free loopback ports, one mrc-worker on the tiny Fuyu,
submits sample tickets (images made here, prompts in English and Chinese) through the `mrc` CLI,
prints one line per result, and stops everything it started, also on Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after the path is set
from scripts.samples import photo  # noqa: E402

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
        ids = []
        for i, (name, (w, h), prompt) in enumerate(TICKETS):
            path = work / name
            fmt = "PNG" if name.endswith(".png") else "JPEG"
            path.write_bytes(photo(w, h, seed=i, fmt=fmt))
            done = services.run_cli(
                env, "submit", "--image", str(path), "--prompt", prompt, "--ticket-id", f"T-{i}"
            )
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            ids.append(done.stdout.strip())
        results = [_wait_result(env, job_id) for job_id in ids]
        # The same first ticket again: answered from the result cache, without the model.
        again = services.run_cli(env, "submit", "--image", str(work / TICKETS[0][0]), "--prompt",
                                 TICKETS[0][2], "--ticket-id", "T-0-again", "--wait")  # fmt: skip
        results.append(json.loads(again.stdout) if again.stdout.strip() else {"status": "failed"})
        _print_table(results)
        failures = sum(r.get("status") != "succeeded" for r in results)
        print(
            f"\n{len(results) - failures}/{len(results)} jobs succeeded in {time.monotonic() - began:.1f} s "
            "(start-up included). One result in full: `.venv/bin/mrc result JOB_ID`."
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


def _print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'ticket':<11} {'lane':<12} {'status':<10} {'latency':>8}  {'cache':<5}  text")
    for r in results:
        timings = r.get("timings_ms") or {}
        latency = f"{timings.get('total', 0) / 1000:.2f} s" if timings else "-"
        text = " ".join(str(r.get("text") or (r.get("error") or {}).get("code", "")).split())
        text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)
        print(
            f"{r.get('ticket_id') or '-':<11} {r.get('lane', '-'):<12} {r.get('status', '?'):<10} "
            f"{latency:>8}  {'hit' if r.get('cache_hit') else '-':<5}  {text[:48]}"
        )


def _wait_result(env: dict[str, str], job_id: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = services.run_cli(env, "result", job_id)
        if done.stdout.strip():
            return dict(json.loads(done.stdout))
        time.sleep(0.2)
    return {"job_id": job_id, "status": "timeout"}


if __name__ == "__main__":
    sys.exit(main())
