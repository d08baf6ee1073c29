"""`make demo`: the whole path on local defaults.

Starts redis-server and moto's S3 server on free loopback ports, one mrc-worker on the tiny Fuyu,
submits sample tickets (images made here, prompts in English and Chinese) through the `mrc` CLI,
prints each result, and stops everything it started, also on Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import imagegen, services  # noqa: E402 - after the path is set

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
            path.write_bytes(imagegen.photo(w, h, seed=i, fmt=fmt))
            done = services.run_cli(
                env, "submit", "--image", str(path), "--prompt", prompt, "--ticket-id", f"T-{i}"
            )
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            ids.append(done.stdout.strip())
        failures = 0
        for job_id in ids:
            shown = _wait_result(env, job_id)
            failures += shown.get("status") != "succeeded"
            print(json.dumps(shown, ensure_ascii=False, indent=2))
        print(
            f"\n{len(ids) - failures}/{len(ids)} jobs succeeded in {time.monotonic() - began:.1f} s "
            "(start-up included)"
        )
        return 0 if failures == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        for item in reversed(started):
            item.stop()
        shutil.rmtree(work, ignore_errors=True)


def _wait_result(env: dict[str, str], job_id: str, timeout: float = 300) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = services.run_cli(env, "result", job_id)
        if done.stdout.strip():
            return dict(json.loads(done.stdout))
        time.sleep(0.2)
    return {"job_id": job_id, "status": "timeout"}


if __name__ == "__main__":
    sys.exit(main())
