"""S3's round trips as a real S3 has them: moto's server behind a proxy that holds each request
`--delay-ms` (25 by default) on its way in (tests/support/slow_proxy.py). Measured side by side in
one run, now and as before this session's changes (emulated: botocore's `Expect: 100-continue` on
every upload, the worker's looks one at a time, its image fetches and result writes four at a time):

- one request of each kind: HEAD, GET, a PUT of a result's 2 KiB;
- a worker's delivery of 16 backlog jobs (records unchecked, as a bulk enqueue leaves them; 16
  distinct photos in S3), through the worker's pipeline on the echo model: its wall time;
- a Batch's lines, each a new photo as a data: URL, made into manifest lines (each photo uploaded):
  lines/s (before: 8 uploads at a time, each a HEAD then a PUT).

    .venv/bin/python tests/bench/bench_s3_latency.py [--delay-ms 25] [--deliveries 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import botocore.handlers  # noqa: E402

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402
from shared.memory_records import MemoryJobRecords  # noqa: E402
from shared.settings import Settings  # noqa: E402
from shared.stores import open_stores  # noqa: E402
from tests.support import imagegen  # noqa: E402
from tests.support.slow_proxy import SlowProxy  # noqa: E402
from workers import admission  # noqa: E402
from workers.backends.echo import EchoBackend  # noqa: E402
from workers.lane_pools import LanePools  # noqa: E402
from workers.pipeline import Pipeline, assemble  # noqa: E402
from workers.slots import Message  # noqa: E402

JOBS = 16


def _as_before(connection: Any) -> None:
    """botocore's own header on every upload again."""
    connection.client.meta.events.register("before-call.s3", botocore.handlers.add_expect_header)


def _each(what: Callable[[], object], times: int = 10) -> float:
    began = time.perf_counter()
    for _ in range(times):
        what()
    return (time.perf_counter() - began) / times * 1000


def round_trips(settings: Settings, before: bool) -> dict[str, float]:
    _source, results = open_stores(settings)
    connection = results.connection  # type: ignore[attr-defined]
    if before:
        _as_before(connection)
    bucket, body = settings.s3_bucket, b"r" * 2048
    connection.put(bucket, "probe/result.json", body, "application/json")
    return {
        "HEAD": _each(lambda: connection.exists(bucket, "probe/result.json")),
        "GET": _each(lambda: connection.get(bucket, "probe/result.json", 1 << 20)),
        "PUT 2 KiB": _each(lambda: connection.put(bucket, "probe/result.json", body, "application/json")),
    }


def _pipeline(settings: Settings, before: bool) -> Pipeline:
    source, results = open_stores(settings)
    admission.LOOKS_AT_ONCE = 1 if before else 16
    records = MemoryJobRecords()
    pipeline = assemble(EchoBackend(), source, results, records, settings, requeue=lambda *_a: None)
    if before:
        _as_before(results.connection)  # type: ignore[attr-defined]  # one connection for both
        pipeline._fetches.shutdown()
        pipeline._writes.shutdown()
        pipeline._fetches = LanePools(settings.fetch_threads, "-fetch", decodes=False)
        pipeline._writes = LanePools(settings.fetch_threads, "-write", decodes=False)
    return pipeline


def deliveries(settings: Settings, before: bool, count: int, photos: list[str], tag: str) -> list[float]:
    pipeline = _pipeline(settings, before)
    records = pipeline.admission.records
    spent = []
    try:
        for d in range(count):
            messages = []
            for n in range(JOBS):
                job_id = f"{tag}-{d}-{n}"
                body = {"job_id": job_id, "image_uri": photos[n], "prompt": "Refund?", "lane": "backlog",
                        "max_new_tokens": 8}  # fmt: skip
                records.records[job_id] = {"state": "queued", "published": "1", "checked": "0"}  # type: ignore[attr-defined]
                messages.append(Message(job_id, body))
            began = time.perf_counter()
            outcomes = pipeline.run(messages)
            spent.append(time.perf_counter() - began)
            assert outcomes == ["succeeded"] * JOBS, outcomes
    finally:
        pipeline.close()
    return spent


def batch_lines(settings: Settings, before: bool, count: int, seed: int) -> float:
    """Lines a second: `count` Batch lines of new 320x240 photos translated, their photos uploaded."""
    import base64
    import json

    from producer.intake.intake import Intake
    from producer.openai import batch_lines as lines_module
    from shared.stores import s3

    source, _results = open_stores(settings)
    if before:
        _as_before(source.connection)  # type: ignore[attr-defined]
    lines_module._UPLOAD_THREADS, s3.INPUT_PUT_AT_ONCE_BYTES = (8, 0) if before else (32, 256 * 1024)
    raw = []
    for n in range(count):
        url = "data:image/jpeg;base64," + base64.b64encode(imagegen.photo(320, 240, seed=seed + n)).decode()
        content = [{"type": "text", "text": "Q?"}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        line = {"custom_id": f"c{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        raw.append((n + 1, json.dumps(line).encode()))
    translator = lines_module.Translator(
        Intake(settings, source), "/v1/chat/completions", None, frozenset({"tiny"}), set(), {}
    )
    began = time.perf_counter()
    out = list(translator.lines(raw))
    spent = time.perf_counter() - began
    assert len(out) == count
    assert all(b"_invalid" not in text for _n, text in out)
    return count / spent


def main() -> None:
    parser = argparse.ArgumentParser(description="S3 round trips at a real S3's latency, now and before")
    parser.add_argument("--delay-ms", type=float, default=25.0)
    parser.add_argument("--deliveries", type=int, default=6)
    parser.add_argument("--batch-lines", type=int, default=256)
    args = parser.parse_args()
    logs.configure("WARNING")
    with services.local_stack("mrc-bench-s3-", "mrc-bench-s3", ROOT / ".cache" / "mrc") as env:
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        direct = services.settings_from_env(env)
        source, _results = open_stores(direct)
        photos = []
        for n in range(JOBS):
            data = imagegen.photo(320, 240, seed=n)
            photos.append(source.put_input(data, f"{direct.s3_prefix}inputs/bench-{n}.jpg", "image/jpeg"))
        proxy = SlowProxy(int(direct.s3_endpoint_url.rsplit(":", 1)[1]), args.delay_ms / 1000).start()
        try:
            slow = services.settings_from_env(
                {**env, "MRC_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
            )
            for name, before in (("before", True), ("now", False)):
                trips = round_trips(slow, before)
                print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in trips.items()), flush=True)
            walls = {}
            for run, (name, before) in enumerate((("before", True), ("now", False)) * 2):
                spent = deliveries(slow, before, args.deliveries, photos, tag=f"r{run}")
                walls.setdefault(name, []).extend(spent)
                p50 = statistics.median(spent)
                worst = max(spent)
                print(f"{name}: a delivery of {JOBS} backlog jobs, p50 {p50 * 1000:.0f} ms, "
                      f"max {worst * 1000:.0f} ms ({args.delay_ms:g} ms a request)", flush=True)  # fmt: skip
            before_p50, now_p50 = (statistics.median(walls[k]) for k in ("before", "now"))
            print(f"delivery p50, before / now: {before_p50 / now_p50:.2f}x", flush=True)
            rates = {}
            for run, (name, before) in enumerate((("before", True), ("now", False))):
                rates[name] = batch_lines(slow, before, args.batch_lines, seed=1000 * (run + 1))
                print(
                    f"{name}: {args.batch_lines} Batch lines of new photos, {rates[name]:.0f} lines/s",
                    flush=True,
                )
            print(f"Batch lines, now / before: {rates['now'] / rates['before']:.2f}x")
        finally:
            proxy.stop()


if __name__ == "__main__":
    main()
