"""The backlog beside a closed loop of ticket clients: backlog jobs/s and the tickets' p50/p99, with the
backlog's share (MRC_ENGINE_BACKLOG_SHARE) at its default and at 0 (strict priority, the behaviour
before the share), for 1, 3 and 8 clients; and the same tickets with no backlog, for reference.

Real redis-server, moto S3 server, one mrc-worker (tiny Fuyu, NF4, CPU: backlog rows held beside
tickets, the CPU's default). Per share and client count: a fresh worker and Redis database,
`--backlog` jobs of `--backlog-tokens` new tokens queued, then N clients, each submitting a ticket of
`--ticket-tokens` new tokens, waiting for its result, and submitting the next, for `--seconds` after
`--warm` seconds. Backlog jobs/s: backlog jobs that succeeded inside the window, per second. Ticket
p50/p99: submit -> result (`finished_at`) of the tickets submitted inside the window.

    .venv/bin/python tests/bench/bench_backlog_share.py [--seconds 40] [--clients 1,3,8] [--shares default,0]
"""

from __future__ import annotations

import argparse
import os
import shutil
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

IMAGES = Workload("backlog-share", (("photo", 1024, 768), ("photo", 768, 1024)), (PROMPT,), (32,))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _templates(client: Any, paths: list[Path], args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """A ticket and a backlog job per image, uploaded once; copies get their own ids."""
    from producer.client import Submission

    def job(path: Path, lane: str, tokens: int) -> Any:
        return client.build_job(Submission(image=path, prompt=PROMPT, lane=lane, max_new_tokens=tokens))

    return (
        [job(p, "interactive", args.ticket_tokens) for p in paths],
        [job(p, "backlog", args.backlog_tokens) for p in paths],
    )


def _clients(
    env: dict[str, str], tickets: list[Any], count: int, tag: str, window: tuple[float, float]
) -> list[float]:
    """`count` closed-loop clients until the window ends; latencies of tickets submitted inside it."""
    from producer.client import Client
    from shared.jobs import now_rfc3339

    latencies: list[float] = []
    lock = threading.Lock()

    def loop(n: int) -> None:
        client = Client(services.settings_from_env(env))
        i = 0
        while time.time() < window[1]:
            job = tickets[(n + i) % len(tickets)].model_copy(
                update={"job_id": f"{tag}-c{n}-{i}", "submitted_at": now_rfc3339()}
            )
            sent = time.time()
            client.enqueue(job)
            result = client.wait(job.job_id, 600)
            assert result["status"] == "succeeded", result
            if sent >= window[0]:
                with lock:
                    latencies.append(parse_rfc3339(result["finished_at"]).timestamp() - sent)
            i += 1

    threads = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def _succeeded(client: Any, ids: list[str]) -> int:
    return sum(record.get("state") == "succeeded" for record in client.records.get_many(ids))


_COUNTERS = ("steps", "paused", "discarded")


def _engine(port: int) -> dict[str, float]:
    """The worker's engine series now (its /metrics): steps, rows paused, tokens thrown away, stall."""
    import urllib.request

    wanted = {
        "mrc_engine_steps_total": "steps", 'mrc_engine_paused_rows_total{reason="ticket"}': "paused",
        "mrc_engine_discarded_tokens_total": "discarded", "mrc_engine_backlog_stalled_steps": "stalled",
        "mrc_engine_rows_held": "held",
    }  # fmt: skip
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


def measure(
    args: argparse.Namespace,
    env: dict[str, str],
    paths: list[Path],
    work: Path,
    share: str | None,
    clients: int,
) -> dict[str, Any]:
    """One worker, one share, one client count (share None: no backlog at all)."""
    import redis

    from producer.client import Client

    redis.Redis.from_url(env["MRC_REDIS_URL"]).flushall()  # a fresh lane, records and engine
    worker_env = dict(env)
    if share is not None and share != "default":
        worker_env["MRC_ENGINE_BACKLOG_SHARE"] = share
    name = f"{share or 'none'}-{clients}"
    worker = services.start_worker(worker_env, work / f"worker-{name}.log")
    try:
        client = Client(services.settings_from_env(env))
        tickets, backlog = _templates(client, paths, args)
        ids: list[str] = []
        if share is not None:
            for i in range(args.backlog):
                job = backlog[i % len(backlog)].model_copy(update={"job_id": f"bl-{name}-{i}"})
                client.enqueue(job)
                ids.append(job.job_id)
        start = time.time() + args.warm
        window = (start, start + args.seconds)
        counted: dict[str, int] = {}
        engine: dict[str, dict[str, float]] = {}

        def count_at(at: float, key: str) -> None:
            time.sleep(max(0.0, at - time.time()))
            counted[key] = _succeeded(client, ids)
            engine[key] = _engine(worker.http_port)

        counters = [
            threading.Thread(target=count_at, args=(at, key)) for at, key in zip(window, "ab", strict=True)
        ]
        for thread in counters:
            thread.start()
        latencies = _clients(env, tickets, clients, f"t-{name}", window)
        for thread in counters:
            thread.join()
        done = counted["b"] - counted["a"]
        delta = {k: engine["b"].get(k, 0.0) - engine["a"].get(k, 0.0) for k in _COUNTERS}
        if share is not None and done + counted["a"] >= len(ids):
            print(f"warning: {name}: the backlog ran out inside the window; raise --backlog")
        return {
            "share": share, "clients": clients, "tickets": len(latencies),
            "p50": _pct(latencies, 0.5), "p99": _pct(latencies, 0.99),
            "backlog_rate": done / args.seconds if share is not None else None, "backlog_done": done,
            "steps_s": delta["steps"] / args.seconds, "paused": delta["paused"],
            "discarded": delta["discarded"],
            "stalled_end": engine["b"].get("stalled", 0.0), "held_end": engine["b"].get("held", 0.0),
        }  # fmt: skip
    finally:
        worker.stop(9)  # SIGKILL: the held backlog would otherwise be worked off before it exits


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="backlog jobs/s and ticket p99 under closed-loop tickets")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window per run")
    parser.add_argument("--warm", type=float, default=8.0, help="seconds of load before the window")
    parser.add_argument("--clients", default="1,3,8")
    parser.add_argument(
        "--shares", default="default,0", help="MRC_ENGINE_BACKLOG_SHARE values; default: the setting's"
    )
    parser.add_argument("--backlog", type=int, default=400)
    parser.add_argument("--backlog-tokens", type=int, default=128)
    parser.add_argument("--ticket-tokens", type=int, default=32)
    parser.add_argument("--no-reference", action="store_true", help="skip the tickets-without-backlog rows")
    return parser


def main() -> None:
    from shared.settings import Settings

    args = parser().parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-share-"))
    redis, s3 = services.start_redis(work / "redis"), services.start_s3(work / "s3")
    rows = []
    try:
        env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
        env["MRC_CACHE_TTL_S"] = "0"  # every job costs model time
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # the in-process clients
        paths = IMAGES.make_images(work)
        counts = [int(c) for c in args.clients.split(",")]
        shares: list[str | None] = [s.strip() for s in args.shares.split(",")]
        if not args.no_reference:
            shares.append(None)
        for share in shares:
            for clients in counts:
                row = measure(args, env, paths, work, share, clients)
                rows.append(row)
                print(row, flush=True)
    finally:
        redis.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    default = Settings().engine_backlog_share
    print(
        "\n| backlog share | ticket clients | backlog jobs/s | ticket p50 / p99 s | tickets | engine steps/s "
        "| backlog rows paused | tokens thrown away |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        share = row["share"]
        label = "no backlog" if share is None else f"{default} (default)" if share == "default" else share
        rate = "—" if row["backlog_rate"] is None else f"{row['backlog_rate']:.2f}"
        latency = f"{row['p50']:.2f} / {row['p99']:.2f}"
        print(
            f"| {label} | {row['clients']} | {rate} | {latency} | {row['tickets']} | {row['steps_s']:.1f} "
            f"| {row['paused']:.0f} | {row['discarded']:.0f} |"
        )
    print(
        f"({args.seconds:g} s windows after {args.warm:g} s of load; backlog {args.backlog} queued x "
        f"{args.backlog_tokens} new tokens, tickets {args.ticket_tokens}; tiny Fuyu on the CPU)"
    )


if __name__ == "__main__":
    main()
