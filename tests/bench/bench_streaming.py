"""Streamed answers (`stream: true`): how soon a ticket's first text arrives, and what streaming costs.

Real redis-server, moto S3 server, one mrc-worker (tiny Fuyu, NF4, CPU unless MRC_DEVICE says), and
mrc-api's app over real HTTP; the tickets are chat requests read as server-sent events by httpx.

1. First content vs whole answer: `--tickets` tickets of `--ticket-tokens` new tokens, streamed one
   after another, idle and then beside a backlog run of `--backlog` jobs: submit -> first content
   chunk, and submit -> `[DONE]`, p50 and p99 (goal: first <= 0.3 x whole at p50).
2. Streaming's cost to the engine: the same backlog run beside `--concurrent` tickets running the
   whole time, once sent plain and once streamed (the same tickets, so only the streaming differs):
   the backlog's jobs/s (goal: streamed <= 5 % below plain), and Redis commands per streamed token
   (the worker's XADD + EXPIRE, mrc-api's XREAD), from Redis's own INFO commandstats.

    .venv/bin/python tests/bench/bench_streaming.py [--tickets 12] [--backlog 48]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
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
from tests.bench.workloads import PROMPT, Workload  # noqa: E402 - after sys.path is set
from tests.support.api_server import serve  # noqa: E402 - after sys.path is set

KEY = "k-bench-stream"
KEY_ID = hashlib.sha256(KEY.encode()).hexdigest()[:12]
IMAGES = Workload("streaming", (("photo", 640, 480), ("photo", 480, 640)), (PROMPT,), (32,))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Tickets:
    def __init__(self, url: str, model: str, photos: list[bytes], tokens: int) -> None:
        self.url, self.model, self.photos, self.tokens = url, model, photos, tokens
        self.count = 0
        self._lock = threading.Lock()

    def body(self, stream: bool) -> dict[str, Any]:
        with self._lock:
            self.count += 1
            n = self.count
        photo = base64.b64encode(self.photos[n % len(self.photos)]).decode()
        content = [
            {"type": "text", "text": f"{PROMPT} (ticket {n})"},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}},
        ]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.tokens,
        }
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def streamed(self, http: Any) -> tuple[float, float, int, str]:
        """(seconds to the first content chunk, to the end, completion tokens, job id) of one streamed
        ticket."""
        began, first, tokens = time.perf_counter(), None, 0
        headers = {"Authorization": f"Bearer {KEY}"}
        with http.stream(
            "POST", f"{self.url}/v1/chat/completions", json=self.body(True), headers=headers
        ) as r:
            assert r.status_code == 200, r.read()
            job_id = r.headers["x-mrc-job-id"]
            for line in r.iter_lines():  # JSON read only where needed: the client's CPU is the worker's
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                assert not line.startswith('data: {"error"'), line
                if first is None and '"content":' in line and '"content": ""' not in line:
                    first = time.perf_counter() - began
                if '"usage": {' in line:
                    tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
        whole = time.perf_counter() - began
        return (whole if first is None else first), whole, tokens, job_id

    def plain(self, http: Any) -> int:
        headers = {"Authorization": f"Bearer {KEY}"}
        answer = http.post(f"{self.url}/v1/chat/completions", json=self.body(False), headers=headers)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["completion_tokens"])


def _backlog(client: Any, paths: list[Path], count: int, tokens: int, tag: str) -> list[str]:
    from producer.client import Submission

    ids = []
    for i in range(count):
        job = client.build_job(
            Submission(image=paths[i % len(paths)], prompt=f"{PROMPT} (backlog {tag} {i})",
                       max_new_tokens=tokens, job_id=f"backlog-{tag}-{i}", lane="backlog")
        )  # fmt: skip
        client.enqueue(job)
        ids.append(job.job_id)
    return ids


def _commands(redis: Any) -> dict[str, int]:
    stats = redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def first_vs_whole(tickets: Tickets, http: Any, client: Any, count: int) -> dict[str, float]:
    from shared import tenants

    firsts, wholes, engine = [], [], []
    for _ in range(count):
        first, whole, _tokens, job_id = tickets.streamed(http)
        firsts.append(first)
        wholes.append(whole)
        result = client.result(tenants.job_id(KEY_ID, job_id))
        engine.append(result["timings_ms"]["first_token"] / 1000)  # the job's submission -> first token
    return {
        "first_p50": _pct(firsts, 0.5), "first_p99": _pct(firsts, 0.99),
        "whole_p50": _pct(wholes, 0.5), "whole_p99": _pct(wholes, 0.99),
        "token_p50": _pct(engine, 0.5),
    }  # fmt: skip


def backlog_beside(
    args: argparse.Namespace, client: Any, tickets: Tickets, paths: list[Path], tag: str, stream: bool | None
) -> dict[str, float]:
    """The backlog's jobs/s while `args.concurrent` tickets run all along (plain or streamed; None:
    no tickets), and the tickets' completion tokens."""
    import httpx

    done = threading.Event()
    tokens = [0]

    def ticket_loop() -> None:
        with httpx.Client(timeout=600) as http:
            while not done.is_set():
                got = tickets.streamed(http)[2] if stream else tickets.plain(http)
                tokens[0] += got

    loops = [
        threading.Thread(target=ticket_loop) for _ in range(args.concurrent if stream is not None else 0)
    ]
    for loop in loops:
        loop.start()
    time.sleep(1.0 if loops else 0.0)  # the tickets are running before the backlog arrives
    began, cpu = time.perf_counter(), (_cpu_s(args.worker_pid), time.process_time())
    counted = tokens[0]
    ids = _backlog(client, paths, args.backlog, args.backlog_tokens, tag)
    for job_id in ids:
        assert client.wait(job_id, 1800)["status"] == "succeeded"
    seconds = time.perf_counter() - began
    ticket_tokens = tokens[0] - counted  # the tickets that ended while the backlog ran
    worker_cpu, here_cpu = _cpu_s(args.worker_pid) - cpu[0], time.process_time() - cpu[1]
    done.set()
    for loop in loops:
        loop.join()
    # Tokens the engine made per second, backlog and tickets together: how the engine shares its steps
    # between the two lanes moves the backlog's jobs/s by itself, turn to turn; this does not.
    made = len(ids) * args.backlog_tokens + ticket_tokens
    return {
        "rate": len(ids) / seconds, "ticket_tokens": ticket_tokens, "tokens_per_s": made / seconds,
        "worker_cpu": worker_cpu / seconds, "api_cpu": here_cpu / seconds,
    }  # fmt: skip


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_cost(args: argparse.Namespace, redis_url: str) -> list[tuple[float, float]]:
    """The engine alone, in this process (no API, no clients): `args.concurrent` ticket rows of
    `args.ticket_tokens` tokens beside `2 x args.backlog` backlog rows, with the tickets' text published
    to the real Redis (workers/streaming.py, as a worker does) and without: (tokens/s plain, streamed)
    per turn, alternated."""
    from concurrent.futures import wait

    import redis as redis_lib
    import torch

    from shared.settings import Settings
    from workers.backends.base import GenerationInput
    from workers.backends.fuyu import FuyuBackend
    from workers.engine import scheduler
    from workers.engine.sequence import Sequence
    from workers.engine.service import EngineService
    from workers.metrics import Metrics
    from workers.streaming import RedisSink, TextStreams

    device = os.environ.get("MRC_DEVICE", "cpu")
    backend = FuyuBackend(Settings(model="tiny", home=str(ROOT / ".cache" / "mrc"), device=device))
    backend.load()
    rows = args.concurrent + 2 * args.backlog
    image = torch.full((3, 480, 640), 128, dtype=torch.uint8)

    def one_run(streams: TextStreams | None, turn: int) -> float:
        service = EngineService(
            backend.step_model(args.concurrent + 8), scheduler.Limits(args.concurrent + 8, 4), Metrics(),
            streams=streams,
        ).start()  # fmt: skip
        batch = []
        for i in range(rows):
            ticket = i < args.concurrent
            tokens = args.ticket_tokens if ticket else args.backlog_tokens
            inputs, positions = backend.row_inputs(GenerationInput(image, f"{PROMPT} ({turn} {i})", tokens))
            row = Sequence(
                f"{turn}-{i}",
                inputs,
                positions,
                tokens,
                backend.eos_id,
                "interactive" if ticket else "backlog",
            )
            row.exact_steps = True  # every row its full length: the same work in both runs
            if ticket and streams is not None:
                row.stream_to = f"bench-{turn}-{i}"
            batch.append(row)
        began = time.perf_counter()
        futures = service.submit_many(batch)
        wait(futures)
        seconds = time.perf_counter() - began
        service.stop()
        return sum(len(f.result().tokens) for f in futures) / seconds

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    one_run(None, -1)  # warm: the first shapes of each kind are the slowest
    turns = []
    for turn in range(args.repeats):
        plain = one_run(None, 2 * turn)
        streams = TextStreams(
            RedisSink(client, 600), backend.detokenize, 0.05, backend.cleans_spaces, backend.settled
        ).start()
        streamed = one_run(streams, 2 * turn + 1)
        streams.stop()
        turns.append((plain, streamed))
    client.close()
    return turns


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="streamed answers: first text, and the cost of streaming")
    parser.add_argument("--tickets", type=int, default=12)
    parser.add_argument("--ticket-tokens", type=int, default=64)
    parser.add_argument("--backlog", type=int, default=48)
    parser.add_argument("--backlog-tokens", type=int, default=32)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="plain/streamed turns, alternated")
    return parser


def main() -> None:
    import httpx
    import redis as redis_lib

    from producer.client import Client

    args = parser().parse_args()
    logs.configure("WARNING")
    work = Path(tempfile.mkdtemp(prefix="mrc-bench-stream-"))
    redis, s3 = services.start_redis(work / "redis"), services.start_s3(work / "s3")
    worker = None
    try:
        env = services.base_env(redis.url, s3.url, "mrc-bench", ROOT / ".cache" / "mrc")
        env.update(
            MRC_CACHE_TTL_S="0",
            MRC_API_KEYS=hashlib.sha256(KEY.encode()).hexdigest(),
            MRC_API_RATE_PER_S="0",
            MRC_API_KEY_SOURCES="*=s3://mrc-bench/inputs/",
            MRC_OPENAI_WAIT_S="900",
        )
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        paths = IMAGES.make_images(work)
        photos = [p.read_bytes() for p in paths]
        worker = services.start_worker(env, work / "worker.log")
        args.worker_pid = worker.proc.pid
        client = Client(services.settings_from_env(env))
        counter = redis_lib.Redis.from_url(redis.url, decode_responses=True)
        with serve(env) as url, httpx.Client(timeout=900) as http:
            tickets = Tickets(url, env["MRC_MODEL"], photos, args.ticket_tokens)
            tickets.streamed(http)  # warm: the API's first request, the worker's first shapes
            idle = first_vs_whole(tickets, http, client, args.tickets)
            feeder = threading.Thread(
                target=_backlog, args=(client, paths, args.backlog * 2, args.backlog_tokens, "busy")
            )
            feeder.start()
            time.sleep(1.0)
            busy = first_vs_whole(tickets, http, client, args.tickets)
            feeder.join()
            for i in range(args.backlog * 2):
                client.wait(f"backlog-busy-{i}", 1800)
            alone = backlog_beside(args, client, tickets, paths, "alone", None)
            pairs, calls = [], {"xadd": 0, "expire": 0, "xread": 0}
            for turn in range(args.repeats):  # alternated: a drift of the machine hits both alike
                marks = [_commands(counter)]
                plain = backlog_beside(args, client, tickets, paths, f"plain{turn}", False)
                marks.append(_commands(counter))
                streamed = backlog_beside(args, client, tickets, paths, f"streamed{turn}", True)
                marks.append(_commands(counter))
                for name in calls:
                    calls[name] += marks[2].get(name, 0) - marks[1].get(name, 0)
                plain["commands"] = sum(marks[1].values()) - sum(marks[0].values())
                streamed["commands"] = sum(marks[2].values()) - sum(marks[1].values())
                pairs.append((plain, streamed))
        report(args, idle, busy, alone, pairs, calls)
        worker.stop()
        worker = None
        turns = engine_cost(args, redis.url)
        print(
            f"\n| the engine alone: {args.concurrent} ticket rows x {args.ticket_tokens} tokens + "
            f"{2 * args.backlog} backlog rows x {args.backlog_tokens} | tokens/s plain | tokens/s, the "
            "tickets streamed to Redis | streamed vs plain |"
        )
        print("|---|---|---|---|")
        for turn, (plain_rate, streamed_rate) in enumerate(turns, start=1):
            print(
                f"| turn {turn} | {plain_rate:.0f} | {streamed_rate:.0f} | "
                f"{1 - streamed_rate / plain_rate:+.1%} below |"
            )
        plain_mean = sum(t[0] for t in turns) / len(turns)
        streamed_mean = sum(t[1] for t in turns) / len(turns)
        print(
            f"| mean | {plain_mean:.0f} | {streamed_mean:.0f} | "
            f"{1 - streamed_mean / plain_mean:+.1%} below (goal <= 5 %) |"
        )
    finally:
        if worker is not None:
            worker.stop()
        redis.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(
    args: argparse.Namespace,
    idle: dict[str, float],
    busy: dict[str, float],
    alone: dict[str, float],
    pairs: list[tuple[dict[str, float], dict[str, float]]],
    calls: dict[str, int],
) -> None:
    print(
        "\n| phase | first content p50 / p99 s | whole answer p50 / p99 s | first / whole at p50 | "
        "the job's first token p50 s |"
    )
    print("|---|---|---|---|---|")
    for name, row in (("idle", idle), (f"beside a {args.backlog * 2}-job backlog", busy)):
        share = row["first_p50"] / row["whole_p50"]
        print(
            f"| {name} | {row['first_p50']:.3f} / {row['first_p99']:.3f} | "
            f"{row['whole_p50']:.3f} / {row['whole_p99']:.3f} | {share:.2f} (goal <= 0.3) | "
            f"{row['token_p50']:.3f} |"
        )
    print(
        f"\n| backlog of {args.backlog} x {args.backlog_tokens} tokens | backlog jobs/s | "
        "tokens/s, backlog and tickets | CPU cores: worker / mrc-api and clients |"
    )
    print("|---|---|---|---|")
    rows = [("alone", alone)] + [
        (f"turn {turn}: beside {args.concurrent} {name} tickets", row)
        for turn, pair in enumerate(pairs, start=1)
        for name, row in zip(("plain", "streamed"), pair, strict=True)
    ]
    for name, row in rows:
        print(
            f"| {name} | {row['rate']:.2f} | {row['tokens_per_s']:.0f} | "
            f"{row['worker_cpu']:.2f} / {row['api_cpu']:.2f} |"
        )

    def mean(key: str, side: int) -> float:
        return sum(pair[side][key] for pair in pairs) / len(pairs)

    print(
        f"| mean of {len(pairs)} turns, streamed vs plain | {1 - mean('rate', 1) / mean('rate', 0):+.1%} "
        f"below | {1 - mean('tokens_per_s', 1) / mean('tokens_per_s', 0):+.1%} below (goal <= 5 %) |"
    )
    tokens = max(1, int(sum(s["ticket_tokens"] for _p, s in pairs)))
    plain_tokens = max(1, int(sum(p["ticket_tokens"] for p, _s in pairs)))
    plain_commands = sum(p["commands"] for p, _s in pairs)
    streamed_commands = sum(s["commands"] for _p, s in pairs)
    print(
        f"\nRedis commands per streamed token ({tokens} tokens streamed): the worker's XADD "
        f"{calls['xadd'] / tokens:.3f} (and an EXPIRE at a stream's first and last write), mrc-api's "
        f"XREAD {calls['xread'] / tokens:.3f}. Every Redis command of the phase (backlog and tickets "
        f"alike) per ticket token: plain {plain_commands / plain_tokens:.2f}, streamed "
        f"{streamed_commands / tokens:.2f}"
    )
    device = os.environ.get("MRC_DEVICE", "cpu")
    print(
        f"({args.tickets} tickets of {args.ticket_tokens} new tokens per phase; tiny Fuyu NF4, {device}; "
        "MRC_STREAM_INTERVAL_S default)"
    )


if __name__ == "__main__":
    main()
