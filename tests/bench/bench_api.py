"""mrc-api intake throughput: POST /v1/jobs (JSON, s3:// images) from 20 concurrent clients against a
local redis-server and moto S3 server, mrc-api with 1 and with 2 uvicorn worker processes, the job ids
named by the clients (each looked up in S3 once: a HEAD) and drawn by mrc-api (no look: no earlier job
can have one). Prints requests/s and latency p50 / p99 (the first response a client sees).

    .venv/bin/python tests/bench/bench_api.py [--requests 2000] [--clients 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def run(
    env: dict[str, str], image: str, workers: int, total: int, clients: int, tag: str | None
) -> dict[str, float]:
    """`tag`: the clients name their job ids `tag-N`; None: they name none (mrc-api draws them)."""
    import httpx

    port = services.free_port()
    api_env = {**env, "MRC_API_PORT": str(port), "MRC_API_WORKERS": str(workers), "MRC_API_RATE_PER_S": "0"}
    proc = subprocess.Popen([str(services.BIN / "mrc-api")], env=api_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        services.wait_for(lambda: _up(port), 60, "mrc-api", proc)
        latencies: list[float] = []
        lock = threading.Lock()
        counter = iter(range(total))

        def client() -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for n in counter:
                    body = {"image": image, "prompt": f"Refund {n}?", "lane": "backlog"}
                    if tag is not None:
                        body["job_id"] = f"{tag}-{n}"
                    began = time.perf_counter()
                    reply = http.post("/v1/jobs", json=body)
                    spent = time.perf_counter() - began
                    assert reply.status_code == 202, reply.text
                    with lock:
                        latencies.append(spent)

        threads = [threading.Thread(target=client) for _ in range(clients)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
    finally:
        services.stop(proc)
    latencies.sort()
    return {
        "rps": total / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="mrc-api POST /v1/jobs throughput")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=20)
    args = parser.parse_args()
    logs.configure("WARNING")
    with services.local_stack(
        "mrc-bench-api-", "mrc-bench", ROOT / ".cache" / "mrc", MRC_BACKLOG_MAX_DEPTH=str(10 * args.requests)
    ) as env:
        from producer.client import Client

        with tempfile.TemporaryDirectory() as folder:
            photo = Path(folder) / "p.jpg"
            photo.write_bytes(imagegen.photo(320, 240))
            image, _ = Client(services.settings_from_env(env)).upload_image(photo)
        rows = {}
        for workers in (1, 2):
            for ids in ("named", "drawn"):
                tag = f"w{workers}" if ids == "named" else None
                r = rows[f"{workers}-{ids}"] = run(env, image, workers, args.requests, args.clients, tag)
                print(f"mrc-api, {workers} uvicorn worker(s), {args.clients} clients, ids {ids}: "
                      f"{r['rps']:.0f} requests/s, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms",
                      flush=True)  # fmt: skip
            named, drawn = rows[f"{workers}-named"]["rps"], rows[f"{workers}-drawn"]["rps"]
            print(f"  {workers} worker(s): drawn ids / named ids = {drawn / named:.2f}x", flush=True)
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
