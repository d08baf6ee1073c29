"""What one job costs the broker, and how far one Redis carries the fleet (docs/scaling.md).

Real redis-server and moto S3 server; workers with the echo backend (MRC_MODEL=echo: no model, a
32x32 image), so the broker path is what is measured: submit -> delivery -> claim -> result record
-> ack -> cache. Prints:
  1. Redis commands and bytes per job, producer side and worker side, by command (INFO deltas);
  2. Redis memory per queued job (message in the lane list + job record) at 10,000 and 100,000 jobs,
     for a minimal job and for a typical ticket (long prompt, long image key);
  3. jobs/s of the whole path with 1 and 2 worker processes, and CPU seconds per job in the workers
     and in redis-server; then the same with the producer submitting at full speed beside them.

    .venv/bin/python tests/bench/bench_broker.py [--jobs 600]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis as redis_lib  # noqa: E402 - after sys.path is set

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs, names  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set

TYPICAL_PROMPT = (
    "Hello, my parcel arrived yesterday and the box was completely crushed on one side. The item "
    "inside looks scratched. Order 4471-2209-XK. Can I get a full refund or a replacement please?"
)
TYPICAL_KEY = "tickets/2026/12/01/eu-west/customer-uploads/5f0c3a1e-9b2d-4c7e-8a61-2f4d9e0b7c55.jpg"


def _commandstats(client: redis_lib.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _net(client: redis_lib.Redis) -> tuple[int, int]:
    info = client.info("stats")
    return int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 10 ms


class Measure:
    """Deltas of Redis command counts, bytes and process CPU over one phase."""

    def __init__(self, client: redis_lib.Redis, pids: dict[str, int]) -> None:
        self.client, self.pids = client, pids
        self.calls, self.net = _commandstats(client), _net(client)
        self.cpu = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        self.began = time.perf_counter()

    def done(self, jobs: int) -> dict[str, Any]:
        seconds = time.perf_counter() - self.began
        calls = _commandstats(self.client)
        # INFO itself (and this benchmark's own polling) is not the system's: left out.
        ours = {"info", "scan", "llen", "ping", "client|setinfo", "client|setname", "rename"}
        delta = {k: v - self.calls.get(k, 0) for k, v in calls.items() if k not in ours}
        delta = {k: v for k, v in delta.items() if v > 0}
        net_in, net_out = _net(self.client)
        return {
            "jobs": jobs,
            "seconds": seconds,
            "jobs_per_s": jobs / seconds,
            "commands_per_job": sum(delta.values()) / jobs,
            "by_command": {k: round(v / jobs, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])},
            "bytes_in_per_job": (net_in - self.net[0]) / jobs,
            "bytes_out_per_job": (net_out - self.net[1]) / jobs,
            "cpu_s_per_job": {
                name: (_cpu_seconds(pid) - self.cpu[name]) / jobs for name, pid in self.pids.items()
            },
        }


def _jobs(client: Any, image: Path, count: int, tag: str) -> list[Any]:
    from producer.client import Submission

    return [
        client.build_job(Submission(image=image, prompt=f"{tag} question {i}?", job_id=f"{tag}-{i}",
                                    max_new_tokens=8))
        for i in range(count)
    ]  # fmt: skip


def _wait_results(s3: Any, bucket: str, count: int, prefix: str, timeout: float = 600) -> None:
    """Poll S3 (not Redis: its commands would count) until `count` results with `prefix` exist."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"results/{prefix}-")
        if sum(page.get("KeyCount", 0) for page in pages) >= count:
            return
        time.sleep(0.25)
    raise TimeoutError(f"fewer than {count} results for {prefix}")


def end_to_end(env: dict[str, str], work: Path, jobs: int, workers: int, alongside: bool) -> dict[str, Any]:
    """Jobs/s and per-job costs of the whole path; the producer runs first, or beside the workers."""
    import boto3

    from producer.client import Client

    client = Client(services.settings_from_env(env))
    image = work / "tiny.png"
    image.write_bytes(imagegen.photo(32, 32, fmt="PNG"))
    tag = f"w{workers}{'a' if alongside else 'f'}{uuid.uuid4().hex[:4]}"
    batch = _jobs(client, image, jobs, tag)
    redis = redis_lib.Redis.from_url(env["MRC_REDIS_URL"])
    s3 = boto3.client("s3", endpoint_url=env["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")
    redis_pid = int(redis.info("server")["process_id"])
    producer: dict[str, Any] = {}
    lane, held = names.queue_name("interactive"), "bench:held"
    if not alongside:  # submit first, no worker running: the producer's own costs
        before = Measure(redis, {"redis": redis_pid})
        for job in batch:
            client.enqueue(job)
        producer = before.done(jobs)
        redis.rename(lane, held)  # held back while the workers start, so their start is not measured
    started = [services.start_worker(env, work / f"{tag}-{n}.log") for n in range(workers)]
    pids = {"redis": redis_pid, **{f"worker{n}": w.proc.pid for n, w in enumerate(started)}}
    try:
        measure = Measure(redis, pids)
        if alongside:
            sender = threading.Thread(target=lambda: [client.enqueue(job) for job in batch])
            sender.start()
        else:
            redis.rename(held, lane)  # one command: every job is queued at once
        _wait_results(s3, env["MRC_S3_BUCKET"], jobs, tag)
        if alongside:
            sender.join()
        system = measure.done(jobs)
    finally:
        for w in started:
            w.stop()
    return {"producer": producer, "system": system}


def _fill(client: redis_lib.Redis, message: bytes, record: dict[str, str], count: int) -> None:
    """`count` copies of one real message in the lane list and of its job record, pipelined."""
    queue = names.queue_name("backlog")
    for start in range(0, count, 5000):
        with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(count, start + 5000)):
                pipe.lpush(queue, message)  # copies: Redis stores each list element on its own
                pipe.hset(names.job_key(f"mem-{i:012d}"), mapping=record)
                pipe.expire(names.job_key(f"mem-{i:012d}"), 7 * 24 * 3600)
            pipe.execute()


def memory_per_job(env: dict[str, str], counts: list[int]) -> dict[str, dict[int, float]]:
    """Bytes of Redis memory per queued job: a real message from the producer, copied."""
    from producer.client import Client, Submission

    client = Client(services.settings_from_env(env))
    redis = redis_lib.Redis.from_url(env["MRC_REDIS_URL"])
    out: dict[str, dict[int, float]] = {}
    for label, prompt, key in (
        ("minimal", "refund?", "i.jpg"),
        ("typical ticket", TYPICAL_PROMPT, TYPICAL_KEY),
    ):
        job = client.build_job(
            Submission(image=f"s3://{env['MRC_S3_BUCKET']}/{key}", prompt=prompt, lane="backlog",
                       job_id="JOBID", ticket_id="T-2026-0001234")
        )  # fmt: skip
        redis.flushdb()
        client.enqueue(job)
        message = redis.lpop(names.queue_name("backlog"))
        record = {k.decode(): v.decode() for k, v in redis.hgetall(names.job_key("JOBID")).items()}
        out[label] = {}
        for count in counts:
            redis.flushdb()
            time.sleep(0.2)
            base = int(redis.info("memory")["used_memory"])
            _fill(redis, message, record, count)
            out[label][count] = (int(redis.info("memory")["used_memory"]) - base) / count
        out[label]["message_bytes"] = float(len(message))
    redis.flushdb()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="mrc broker costs per job, and Redis memory per queued job")
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--memory-counts", default="10000,100000")
    args = parser.parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-broker-"))
    redis = services.start_redis(work / "redis")
    s3 = services.start_s3(work / "s3")
    env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
    env.update({"MRC_MODEL": "echo"})
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        __import__("os").environ[name] = env[name]
    report: dict[str, Any] = {}
    try:
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("1 worker", lambda: end_to_end(env, work, args.jobs, 1, alongside=False)),
            ("2 workers", lambda: end_to_end(env, work, args.jobs, 2, alongside=False)),
            ("1 worker, producer alongside", lambda: end_to_end(env, work, args.jobs, 1, alongside=True)),
            ("2 workers, producer alongside", lambda: end_to_end(env, work, args.jobs, 2, alongside=True)),
        ]
        for label, run in runs:
            report[label] = run()
            system = report[label]["system"]
            rate, commands = system["jobs_per_s"], system["commands_per_job"]
            line = f"{label:<30} {rate:7.1f} jobs/s  {commands:5.1f} Redis cmds/job"
            cpu = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in system["cpu_s_per_job"].items())
            print(f"{line}  CPU/job: {cpu}", flush=True)
        producer = report["1 worker"]["producer"]
        print(f"\nproducer (submit, one by one): {producer['jobs_per_s']:.0f} jobs/s, "
              f"{producer['commands_per_job']:.1f} Redis cmds/job: {producer['by_command']}")  # fmt: skip
        system = report["1 worker"]["system"]
        print(f"worker side per job: {system['by_command']}")
        sides = [("worker side", system), ("producer side", producer)]
        print("Redis bytes per job: " + "; ".join(
            f"{side}: in {d['bytes_in_per_job']:.0f}, out {d['bytes_out_per_job']:.0f}" for side, d in sides
        ))  # fmt: skip
        counts = [int(c) for c in args.memory_counts.split(",")]
        report["memory"] = memory_per_job(env, counts)
        for label, figures in report["memory"].items():
            per = ", ".join(f"{c:,} queued: {figures[c]:.0f} B/job" for c in counts)
            print(f"Redis memory, {label} (message {figures['message_bytes']:.0f} B): {per}")
        (work / "report.json").write_text(json.dumps(report, indent=2, default=str))
        print(json.dumps(report, default=str))
    finally:
        s3.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
