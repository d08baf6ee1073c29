"""Tickets beside the nightly backlog on one worker: what a ticket waits while a backlog run with long
answers is being worked through, against the same tickets on an idle worker.

Real redis-server, moto S3 server, one mrc-worker (tiny Fuyu, NF4, CPU). First `--tickets` tickets
(`--ticket-tokens` new tokens) one every `--every` seconds on the idle worker; then a backlog run of
`--backlog` jobs with `--backlog-tokens` new tokens is queued and the same tickets are sent again while
it runs. Reported: ticket submit -> result p50/p99 idle and busy, their ratio (goal: p99 busy <= 1.5 x
p99 idle), how much of the backlog was still queued or running when the last busy ticket finished
(if none was, the busy phase measured nothing), and the backlog's jobs/s.

`--tree PATH` runs the worker from another checkout of mrc (say, the commit before the engine) with
this checkout's virtual environment, so two versions are measured side by side in one run:

    .venv/bin/python tests/bench/bench_mixed_load.py [--tree /tmp/base] [--backlog 160]

`--backlog-photo 4032x3024 --unchunked` is the chunked-prefill check: the backlog's photos are 12 MP
(2,340 positions each on Fuyu), and the same run is made twice side by side, once as configured (prefill
in chunks of MRC_ENGINE_PREFILL_TOKENS) and once with one prefill per row whatever its length; the row
adds each ticket's first token (submit -> first generated token), idle and busy (goal: p99 busy <= 1.5
x p99 idle).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from shared.jobs import parse_rfc3339  # noqa: E402 - after sys.path is set
from tests.bench.workloads import PROMPT, Workload  # noqa: E402 - after sys.path is set

IMAGES = Workload("mixed-load", (("photo", 1024, 768), ("photo", 768, 1024)), (PROMPT,), (32,))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tickets(
    client: Any, paths: list[Path], args: argparse.Namespace, tag: str, parts: dict[str, list[float]]
) -> list[float]:
    from producer.client import Submission

    sent: dict[str, float] = {}
    for i in range(args.tickets):
        job = client.build_job(
            Submission(image=paths[i % len(paths)], prompt=f"{PROMPT} ({tag} {i})",
                       max_new_tokens=args.ticket_tokens, job_id=f"ticket-{tag}-{i}")
        )  # fmt: skip
        sent[job.job_id] = time.time()
        client.enqueue(job)
        time.sleep(args.every)
    latencies = []
    for job_id, at in sent.items():
        result = client.wait(job_id, 900)
        assert result["status"] == "succeeded", result
        latencies.append(parse_rfc3339(result["finished_at"]).timestamp() - at)
        for key, ms in result["timings_ms"].items():
            parts.setdefault(key, []).append(ms / 1000)
        parts.setdefault("first_tokens", []).append(result["timings_ms"]["first_token"] / 1000)
        if latencies[-1] >= max(latencies):
            parts["worst"] = [v / 1000 for v in result["timings_ms"].values()]
    return latencies


def _backlog(client: Any, paths: list[Path], args: argparse.Namespace, tag: str) -> list[str]:
    from producer.client import Submission

    ids = []
    for i in range(args.backlog):
        job = client.build_job(
            Submission(image=paths[i % len(paths)], prompt=f"{PROMPT} (backlog {tag} {i})",
                       max_new_tokens=args.backlog_tokens, job_id=f"backlog-{tag}-{i}", lane="backlog")
        )  # fmt: skip
        client.enqueue(job)
        ids.append(job.job_id)
    return ids


def measure(
    args: argparse.Namespace,
    env: dict[str, str],
    paths: list[Path],
    work: Path,
    name: str,
    backlog_paths: list[Path] | None = None,
) -> dict[str, Any]:
    from producer.client import Client

    worker_env = dict(env)
    if args.tree:
        worker_env["PYTHONPATH"] = str(args.tree)
    backlog_paths = backlog_paths or paths
    worker = services.start_worker(worker_env, work / f"worker-{name}.log")
    try:
        client = Client(services.settings_from_env(env))
        idle_parts: dict[str, list[float]] = {}
        busy_parts: dict[str, list[float]] = {}
        idle = _tickets(client, paths, args, f"{name}-idle", idle_parts)
        began = time.perf_counter()
        queued: list[str] = []
        feeder = threading.Thread(target=lambda: queued.extend(_backlog(client, backlog_paths, args, name)))
        feeder.start()
        time.sleep(1.0)  # the backlog is flowing before the first busy ticket
        busy = _tickets(client, paths, args, f"{name}-busy", busy_parts)
        feeder.join()
        left = sum(1 for job_id in queued if client.status(job_id)["state"] in ("queued", "running"))
        for job_id in queued:
            client.wait(job_id, 1800)
        backlog_s = time.perf_counter() - began
        return {
            "idle_p50": _pct(idle, 0.5), "idle_p99": _pct(idle, 0.99),
            "busy_p50": _pct(busy, 0.5), "busy_p99": _pct(busy, 0.99),
            "backlog_left": left, "backlog_rate": len(queued) / backlog_s, "busy_mean": statistics.mean(busy),
            "idle_parts": {
                k: statistics.median(v) for k, v in idle_parts.items() if k not in ("worst", "first_tokens")
            },
            "idle_first": _pct(idle_parts["first_tokens"], 0.99),
            "busy_first": _pct(busy_parts["first_tokens"], 0.99),
            "idle_first_p50": _pct(idle_parts["first_tokens"], 0.5),
            "busy_first_p50": _pct(busy_parts["first_tokens"], 0.5),
            "busy_parts": {
                k: statistics.median(v) for k, v in busy_parts.items() if k not in ("worst", "first_tokens")
            },
            "busy_worst": busy_parts.get("worst", []),
        }  # fmt: skip
    finally:
        worker.stop()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="ticket latency beside a backlog run, vs an idle worker")
    parser.add_argument("--tickets", type=int, default=12)
    parser.add_argument("--every", type=float, default=1.5)
    parser.add_argument("--ticket-tokens", type=int, default=32)
    parser.add_argument("--backlog", type=int, default=160)
    parser.add_argument("--backlog-tokens", type=int, default=256)
    parser.add_argument("--tree", type=Path, help="run the worker from this checkout (a baseline)")
    parser.add_argument("--backlog-photo", help="the backlog's photos, WxH (default: the tickets' photos)")
    parser.add_argument(
        "--backlog-distinct", type=int, default=4,
        help="how many distinct photos the backlog's jobs ask about, in turn (--backlog-photo)",
    )  # fmt: skip
    parser.add_argument(
        "--unchunked", action="store_true",
        help="also run with one prefill per row (MRC_ENGINE_PREFILL_TOKENS past any prompt), side by side",
    )  # fmt: skip
    parser.add_argument(
        "--also", action="append", default=[], metavar="KEY=VALUE",
        help="also run with this worker setting, side by side (e.g. MRC_BACKLOG_THREAD_NICE=0)",
    )  # fmt: skip
    return parser


def print_row(args: argparse.Namespace, row: dict[str, Any], label: str) -> None:
    ratio = row["busy_p99"] / row["idle_p99"]
    first = row["busy_first"] / row["idle_first"]
    print("\n| worker | ticket p50 / p99 idle s | ticket p50 / p99 busy s | p99 busy / idle "
          "(goal <= 1.5) | first token p50 / p99 idle s | first token p50 / p99 busy s | first token p99 "
          "busy / idle | backlog jobs/s | backlog left when the tickets ended |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {label} | {row['idle_p50']:.2f} / {row['idle_p99']:.2f} | "
          f"{row['busy_p50']:.2f} / {row['busy_p99']:.2f} | {ratio:.2f} | "
          f"{row['idle_first_p50']:.2f} / {row['idle_first']:.2f} | "
          f"{row['busy_first_p50']:.2f} / {row['busy_first']:.2f} | {first:.2f} | "
          f"{row['backlog_rate']:.2f} | "
          f"{row['backlog_left']} of {args.backlog} |")  # fmt: skip
    for phase in ("idle", "busy"):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in row[f"{phase}_parts"].items())
        print(f"ticket median timings, {phase} (s): {parts}")
    print("slowest busy ticket (s): " + ", ".join(f"{v:.3f}" for v in row["busy_worst"]) + " (same order)")
    photos = f"{args.backlog_photo} photos" if args.backlog_photo else "the tickets' photos"
    print(f"({args.tickets} tickets of {args.ticket_tokens} new tokens every {args.every} s; backlog "
          f"{args.backlog} x {args.backlog_tokens} new tokens on {photos}; tiny Fuyu NF4, CPU)")  # fmt: skip


def main() -> None:
    args = parser().parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-mixed-"))
    redis, s3 = services.start_redis(work / "redis"), services.start_s3(work / "s3")
    try:
        env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
        env["MRC_CACHE_TTL_S"] = "0"
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # the in-process client
        paths = IMAGES.make_images(work)
        backlog_paths: list[Path] | None = None
        if args.backlog_photo:
            width, height = (int(v) for v in args.backlog_photo.lower().split("x"))
            photos = Workload(
                "backlog",
                (("photo", width, height),),
                (PROMPT,),
                (32,),
                distinct_images=args.backlog_distinct,
            )
            backlog_paths = photos.make_images(work)
        name = "tree" if args.tree else "this"
        label = str(args.tree or "this checkout")
        rows = [(label + ", prefill in chunks", env)] if args.unchunked else [(label, env)]
        if args.unchunked:  # one prefill per row: a budget no prompt reaches
            rows.append((label + ", one prefill per row", {**env, "MRC_ENGINE_PREFILL_TOKENS": str(1 << 20)}))
        for setting in args.also:
            key, _, value = setting.partition("=")
            rows.append((f"{label}, {key}={value}", {**env, key: value}))
        for index, (row_label, row_env) in enumerate(rows):
            print_row(args, measure(args, row_env, paths, work, f"{name}{index}", backlog_paths), row_label)
    finally:
        redis.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
