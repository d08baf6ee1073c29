"""Runs the naive pipeline (naive_worker.py) over a workload's jobs: its rate and per-job latencies."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from scripts import devservices as services

ROOT = Path(__file__).resolve().parents[2]


def naive(
    env: dict[str, str],
    specs: list[tuple[int, str, int]],
    paths: list[Path],
    work: Path,
    trickle_per_s: float,
) -> tuple[float, list[float], list[str]]:
    """specs: (image index, prompt, max_new_tokens) per job. Latency: send to the result's own
    finish time (written by the task), like the system's submitted_at -> finished_at. Also returns
    each job's answer text, in job order."""
    import boto3
    from celery import Celery

    from producer.client import Client

    client = Client(services.settings_from_env(env))
    keys = [client.upload_image(p)[0].split("/", 3)[3] for p in paths]
    log = work / "naive.log"
    with log.open("wb") as out:
        command = [str(services.BIN / "celery"), "-A", "tests.bench.naive_worker", "worker", "--pool", "solo"]
        command += ["-c", "1", "-Q", "naive", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        proc = subprocess.Popen(
            [*command, "-l", "INFO"],
            env={**env, "NAIVE_PRELOAD": "1", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tag = f"{time.monotonic_ns()}"
    try:
        time.sleep(1)
        services.wait_for(lambda: b"ready" in log.read_bytes(), 180, "naive worker", proc)
        app = Celery("naive", broker=env["MRC_REDIS_URL"])
        app.conf.update(task_serializer="json")
        s3 = boto3.client("s3", endpoint_url=env["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")
        bucket = env["MRC_S3_BUCKET"]
        sent: list[float] = []
        began = time.perf_counter()
        for i, (n, prompt, new) in enumerate(specs):
            sent.append(time.time())
            app.send_task("naive.infer", args=[f"n{tag}-{i}", bucket, keys[n], prompt, new], queue="naive")
            if trickle_per_s:
                time.sleep(1 / trickle_per_s)
        latencies, texts = [], []
        for i in range(len(specs)):
            while True:
                try:
                    body = json.loads(
                        s3.get_object(Bucket=bucket, Key=f"naive/n{tag}-{i}.json")["Body"].read()
                    )
                    latencies.append(body["finished_at"] - sent[i])
                    texts.append(body["text"])
                    break
                except s3.exceptions.NoSuchKey:
                    time.sleep(0.05)
        return len(specs) / (time.perf_counter() - began), latencies, texts
    finally:
        services.stop(proc)


def rounds(
    system: Callable[[str], float],
    naive_rate: Callable[[], float],
    count: int,
    label: str,
) -> dict[str, float]:
    """The system and the naive pipeline `count` times each, alternating, the order swapped every round
    (either one's rate moves from run to run on a shared machine; one run of each is one sample of a
    ratio). Prints each round; returns the geometric means as "system" and "naive", and the rounds'
    median system / naive as "ratio_median" (and the lowest as "ratio_min")."""
    rates: dict[str, list[float]] = {"system": [], "naive": []}
    ratios = []
    for n in range(count):
        order = ("system", "naive") if n % 2 == 0 else ("naive", "system")
        got = {part: system(f"r{n}") if part == "system" else naive_rate() for part in order}
        for part, rate in got.items():
            rates[part].append(rate)
        ratios.append(got["system"] / got["naive"])
        print(f"  [{label}] round {n + 1}: system {got['system']:.2f} jobs/s, naive {got['naive']:.2f}, "
              f"system / naive {ratios[-1]:.2f}", flush=True)  # fmt: skip
    means = {part: math.exp(sum(math.log(r) for r in got) / len(got)) for part, got in rates.items()}
    print(f"  [{label}] system / naive over {count} rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}, "
          f"lowest {min(ratios):.2f}", flush=True)  # fmt: skip
    return {**means, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios)}
