"""Throughput of the whole system against the bare model and against the naive pipeline, one run.

Real redis-server, moto S3 server, worker processes, tiny Fuyu (NF4, CPU). Jobs: N tickets with
camera-like photos of mixed sizes, a prompt, MAX_NEW new tokens.
  bare       the backend looping over the same preprocessed batches in this process (model time only)
  system     mrc-worker: batched task, decode pool, device preprocessing, S3 results
  unbatched  mrc-worker with MRC_BATCH_MAX_JOBS=1 (one job per batch)
  naive      one Celery task per job, PIL + FuyuProcessor, generate at batch 1, result to S3

    .venv/bin/python tests/bench/bench_throughput.py [--jobs 48] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from shared.settings import Settings  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set

MAX_NEW = 64
PROMPT = "The parcel arrived crushed and the label is torn. Can I get a refund?"
SIZES = [(1024, 768), (1024, 1024), (768, 1024), (1280, 720)]


def make_images(work: Path, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        path = work / f"img{i}.jpg"
        path.write_bytes(imagegen.camera_photo(w, h, seed=i))
        paths.append(path)
    return paths


def bare(env: dict[str, str], paths: list[Path], batch: int) -> tuple[float, float, float]:
    """jobs/s of backend.run over prepared batches (model only), jobs/s of the same loop with decoding and
    preprocessing inside it (no queue, no S3), and the mean model batch cost in ms."""
    from workers import images
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import FuyuBackend

    settings = Settings(model="tiny", home=env["MRC_HOME"], quantization="nf4", device="cpu")
    backend = FuyuBackend(settings)
    backend.load()
    backend.warm_up()
    tensors = [images.load(p.read_bytes(), 10**9).tensor for p in paths]
    # The system forms batches by size: do the same, so both run the same compositions.
    order = sorted(range(len(paths)), key=lambda i: (tensors[i].shape[1] * tensors[i].shape[2], i))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    prepared = [backend.prepare([GenerationInput(tensors[i], PROMPT, MAX_NEW) for i in g]) for g in groups]
    began = time.perf_counter()
    for p in prepared:
        backend.run(p)
    seconds = time.perf_counter() - began
    datas = [p.read_bytes() for p in paths]
    began = time.perf_counter()
    for g in groups:
        decoded = [images.load(datas[i], 10**9).tensor for i in g]
        backend.generate([GenerationInput(t, PROMPT, MAX_NEW) for t in decoded])
    with_pre = len(paths) / (time.perf_counter() - began)
    return len(paths) / seconds, with_pre, seconds / len(groups) * 1000


def system(env: dict[str, str], paths: list[Path], work: Path, batch: int, tag: str) -> float:
    from producer.client import Client, Submission

    # Deliveries of two model batches: the pool decodes one while the model runs the other.
    worker_env = {
        **env,
        "MRC_BATCH_MAX_JOBS": str(2 * batch),
        "MRC_MODEL_BATCH_MAX_JOBS": str(batch),
        "MRC_BATCH_WAIT_MS": "50",
    }
    worker = services.start_worker(worker_env, work / f"worker-{tag}.log")
    try:
        client = Client(services.settings_from_env(env))
        jobs = [
            client.build_job(Submission(image=p, prompt=PROMPT, max_new_tokens=MAX_NEW, job_id=f"{tag}-{i}"))
            for i, p in enumerate(paths)
        ]
        began = time.perf_counter()
        for job in jobs:
            client.enqueue(job)
        for job in jobs:
            result = client.wait(job.job_id, 900)
            assert result["status"] == "succeeded", result
            assert not result.get("cache_hit"), "a cached answer is not a measurement"
        return len(jobs) / (time.perf_counter() - began)
    finally:
        worker.stop()


def naive(env: dict[str, str], paths: list[Path], work: Path) -> float:
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
    try:
        time.sleep(1)
        services.wait_for(lambda: b"ready" in log.read_bytes(), 180, "naive worker", proc)
        app = Celery("naive", broker=env["MRC_REDIS_URL"])
        app.conf.update(task_serializer="json")
        s3 = boto3.client("s3", endpoint_url=env["MRC_S3_ENDPOINT_URL"], region_name="us-east-1")
        bucket = env["MRC_S3_BUCKET"]
        began = time.perf_counter()
        for i, key in enumerate(keys):
            app.send_task("naive.infer", args=[f"n{i}", bucket, key, PROMPT, MAX_NEW], queue="naive")
        for i in range(len(keys)):
            while True:
                try:
                    s3.head_object(Bucket=bucket, Key=f"naive/n{i}.json")
                    break
                except Exception:
                    time.sleep(0.05)
        return len(keys) / (time.perf_counter() - began)
    finally:
        services.stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description="mrc throughput: system vs bare model vs naive pipeline")
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--parts", default="bare,system,unbatched,naive", help="which runs (all by default)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (worker logs)")
    parser.add_argument("--worker-env", action="append", default=[], help="KEY=VALUE for the mrc-worker runs")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-"))
    redis = services.start_redis(work / "redis")
    s3 = services.start_s3(work / "s3")
    try:
        env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
        # Every run sees the same images and prompt: with the cache on, later runs would be answered
        # from the earlier ones' results.
        env["MRC_CACHE_TTL_S"] = "0"
        env.update(dict(item.split("=", 1) for item in args.worker_env))
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        paths = make_images(work, args.jobs)
        rates: dict[str, float] = {}
        if "bare" in parts:
            rates["bare"], rates["bare+preprocessing"], batch_ms = bare(env, paths, args.batch)
            print(
                f"bare backend: {rates['bare']:7.2f} jobs/s (model batch of {args.batch}: {batch_ms:.0f} ms)"
            )
            print(
                f"bare + decode + preprocess, one loop: {rates['bare+preprocessing']:7.2f} jobs/s", flush=True
            )
        if "system" in parts:
            rates["system"] = system(env, paths, work, args.batch, "sys")
            print(f"system:       {rates['system']:7.2f} jobs/s", flush=True)
        if "unbatched" in parts:
            rates["unbatched"] = system(env, paths, work, 1, "one")
            print(f"batching off: {rates['unbatched']:7.2f} jobs/s", flush=True)
        if "naive" in parts:
            rates["naive"] = naive(env, paths, work)
            print(f"naive:        {rates['naive']:7.2f} jobs/s", flush=True)
        pairs = (
            ("system", "bare"),
            ("system", "bare+preprocessing"),
            ("system", "unbatched"),
            ("system", "naive"),
        )
        for mine, other in pairs:
            if mine in rates and other in rates:
                print(f"{mine} / {other} = {rates[mine] / rates[other]:.2f}")
        print(
            f"(jobs={args.jobs}, batch={args.batch}, max_new_tokens={MAX_NEW}, sizes={SIZES}, tiny Fuyu NF4)"
        )
    finally:
        redis.stop()
        s3.stop()
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
