"""A chat's answer at a real S3's latency: redis-server, moto's S3 server behind a proxy that holds each
request `--delay-ms` on its way in (tests/support/slow_proxy.py), an echo worker (no model: what is
left is mrc's own path) and mrc-api in this process, both through the proxy. `--chats` chats, each
with a new 320x240 photo as a data: URL, one after another; p50 latency and S3 requests a chat.

Side by side, alternated: now, and as before 2026-12-08 (emulated: the waits ignore the result the
worker keeps beside the record, so they read it from S3).

    .venv/bin/python tests/bench/bench_chat_s3.py [--delay-ms 25] [--chats 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set
from tests.support.api_server import serve  # noqa: E402 - after sys.path is set
from tests.support.slow_proxy import SlowProxy  # noqa: E402 - after sys.path is set

KEY = "bench-chat-s3"


def chats(http: Any, url: str, count: int, seed: int) -> list[float]:
    spent = []
    for n in range(count):
        photo = base64.b64encode(imagegen.photo(320, 240, seed=seed + n)).decode()
        url_part = {"url": f"data:image/jpeg;base64,{photo}"}
        content = [
            {"type": "text", "text": f"Is it damaged? ({n})"},
            {"type": "image_url", "image_url": url_part},
        ]
        body = {"model": "echo", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        began = time.perf_counter()
        reply = http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        spent.append(time.perf_counter() - began)
        assert reply.status_code == 200, reply.text
    return spent


def main() -> None:
    import httpx

    from producer.http import waits

    parser = argparse.ArgumentParser(description="a chat's answer at a real S3's latency, now and before")
    parser.add_argument("--delay-ms", type=float, default=25.0)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logs.configure("WARNING")
    kept = waits.read_answer
    with services.local_stack("mrc-bench-chat-s3-", "mrc-bench", ROOT / ".cache" / "mrc") as env:
        proxy = SlowProxy(int(env["MRC_S3_ENDPOINT_URL"].rsplit(":", 1)[1]), 0.0).start()
        env = {
            **env,
            "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
            "MRC_MODEL": "echo",
            "MRC_API_KEYS": hashlib.sha256(KEY.encode()).hexdigest(),
            "MRC_API_RATE_PER_S": "0",
        }
        os.environ["MRC_S3_ENDPOINT_URL"] = env["MRC_S3_ENDPOINT_URL"]
        work = Path(tempfile.mkdtemp(prefix="mrc-bench-chat-s3-"))
        worker = services.start_worker(env, work / "worker.log")
        rows: dict[tuple[str, float], list[float]] = {}
        asked: dict[tuple[str, float], list[int]] = {}
        try:
            with serve(env) as url, httpx.Client(timeout=60) as http:
                chats(http, url, 2, seed=0)  # warm: the bucket, the worker's first shapes
                seed = 100
                for _ in range(args.rounds):
                    for name in ("now", "before"):
                        waits.read_answer = (
                            kept if name == "now" else (lambda record, _answer: (record, None))
                        )  # type: ignore[assignment]
                        for delay in (0.0, args.delay_ms):
                            proxy.delay_s = delay / 1000
                            del proxy.requests[:]
                            rows.setdefault((name, delay), []).extend(chats(http, url, args.chats, seed))
                            asked.setdefault((name, delay), []).append(len(proxy.requests))
                            seed += args.chats
        finally:
            waits.read_answer = kept
            worker.stop()
            proxy.stop()
    print("| S3 delay a request | now: p50 ms, S3 requests a chat | before | now / before |")
    print("|---|---|---|---|")
    for delay in (0.0, args.delay_ms):
        now, before = (statistics.median(rows[(n, delay)]) * 1000 for n in ("now", "before"))
        per = {n: sum(asked[(n, delay)]) / (args.chats * args.rounds) for n in ("now", "before")}
        print(f"| {delay:g} ms | {now:.0f} ms, {per['now']:.2f} | {before:.0f} ms, {per['before']:.2f} | "
              f"{now / before:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
