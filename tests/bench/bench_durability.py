"""What the durability knob costs: a submission's latency (claim, record and publish through
`Client.enqueue`) with MRC_REDIS_WAIT_REPLICAS=0 and =1, side by side in one run, on a primary with two
replicas and three Sentinels on loopback (scripts/sentinel_cluster.py), and on the plain single Redis
as the baseline. Blocks of each setting alternate, so the machine's drift hits all of them alike.

    .venv/bin/python tests/bench/bench_durability.py [--jobs 300] [--blocks 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.client import Client, Submission  # noqa: E402 - after sys.path is set
from scripts import devservices as services  # noqa: E402 - after sys.path is set
from scripts import sentinel_cluster  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set

HOME = ROOT / ".cache" / "mrc"


def _latencies(client: Client, uri: str, count: int, tag: str) -> list[float]:
    out = []
    for index in range(count):
        sub = Submission(image=uri, prompt=f"Refund {index}?", job_id=f"{tag}-{index}", max_new_tokens=4)
        job = client.build_job(sub)
        began = time.perf_counter()
        client.enqueue(job)
        out.append(time.perf_counter() - began)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300, help="submissions per setting")
    parser.add_argument("--blocks", type=int, default=6, help="alternating blocks the jobs are split into")
    args = parser.parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-durability-"))
    cluster = sentinel_cluster.start(work / "sentinel")
    single = services.start_redis(work / "single")
    s3 = services.start_s3(work / "s3")
    try:
        base = services.base_env(single.url, s3.url, "mrc-durability", HOME)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            os.environ[name] = base[name]
        setups = {
            "single Redis": base,
            "Sentinel, WAIT off": {**base, **cluster.env()},
            "Sentinel, WAIT 1": {**base, **cluster.env(), "MRC_REDIS_WAIT_REPLICAS": "1"},
        }
        clients = {name: Client(services.settings_from_env(env)) for name, env in setups.items()}
        image = work / "p.jpg"
        image.write_bytes(imagegen.photo(160, 120))
        uri = next(iter(clients.values())).upload_image(image)[0]
        per_block = max(1, args.jobs // args.blocks)
        seconds: dict[str, list[float]] = {name: [] for name in setups}
        for name, client in clients.items():  # warm: connections, scripts loaded
            _latencies(client, uri, 5, f"warm-{abs(hash(name))}")
        for block in range(args.blocks):
            for name, client in clients.items():
                seconds[name] += _latencies(client, uri, per_block, f"b{block}-{abs(hash(name))}")
        base_p50 = statistics.median(seconds["single Redis"])
        print(f"{'setting':<20} {'p50 ms':>8} {'p99 ms':>8} {'vs single':>10} {'jobs/s (one producer)':>22}")
        for name, values in seconds.items():
            values.sort()
            p50, p99 = statistics.median(values), values[int(len(values) * 0.99) - 1]
            rate = 1 / statistics.mean(values)
            print(f"{name:<20} {p50 * 1000:8.2f} {p99 * 1000:8.2f} {p50 / base_p50:9.2f}x {rate:22.0f}")
    finally:
        cluster.stop()
        single.stop()
        s3.stop()


if __name__ == "__main__":
    main()
