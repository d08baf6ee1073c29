"""What another key's backlog jobs meet while one run fills the backlog lane: the lane's shares off
(MRC_BACKLOG_KEY_SHARES=false, one depth, first come first in) and on, and on with the ahead list
(MRC_BACKLOG_AHEAD_JOBS, default 8; 0 in the first two modes), side by side in one run.

Per mode: a fresh redis-server and moto S3 server, one echo worker (`MRC_MODEL=echo`: the whole path,
queue -> worker -> S3 result, with no model time) on the backlog lane, MRC_BACKLOG_MAX_DEPTH=--depth.
A command-line run (no key) of --run-lines jobs is fed as the lane drains, as `mrc backlog` feeds
one; once it has filled the lane, a key submits --key-jobs single backlog jobs one after another, as a
client does (`Client.enqueue`, no wait: a `queue_full` refusal is retried after --retry-s, as a 503's
Retry-After asks). Printed: the key's refusals, when its first job ended, when its last job was let
in and when its last job ended (from its first try), and the share of the jobs that ended meanwhile
that were the key's.

    .venv/bin/python tests/bench/bench_key_shares.py [--depth 300] [--run-lines 20000] [--key-jobs 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts import devservices as services  # noqa: E402 - after sys.path is set
from shared import logs  # noqa: E402 - after sys.path is set
from tests.support import imagegen  # noqa: E402 - after sys.path is set

KEY = "b0b0b0b0b0b0"  # the other key's owner (12 hex, as shared/tenants.py names one)
Then = Callable[[Any, Any, Path], dict[str, Any]]  # (client, backlog, photo) -> what the part measured


def _mode(shares: bool, ahead: int, args: argparse.Namespace, work: Path, then: Then) -> dict[str, Any]:
    """Fresh services, a run filling the lane as it drains, then `then` (what the other keys do)."""
    from producer.backlog.run import Backlog
    from producer.client import Client
    from shared.errors import UsageError

    home = ROOT / ".cache" / "mrc"
    settings_env = {
        "MRC_BACKLOG_MAX_DEPTH": str(args.depth),
        "MRC_BACKLOG_KEY_SHARES": str(shares).lower(),
        "MRC_BACKLOG_AHEAD_JOBS": str(ahead),
    }
    with services.local_stack("mrc-bench-share-", "mrc-bench", home, **settings_env) as env:
        client = Client(services.settings_from_env(env))
        client.results.ensure_bucket()
        photo = work / "parcel.jpg"
        photo.write_bytes(imagegen.photo(64, 48, seed=3))
        run_image, _ = client.upload_image(photo)
        worker = services.start_worker({**env, "MRC_MODEL": "echo"}, work / f"worker-{shares}-{ahead}.log")
        backlog = Backlog(client)

        def lines():  # type: ignore[no-untyped-def]
            for n in range(1, args.run_lines + 1):  # the light keys' part runs until it is cancelled
                yield n, json.dumps({"custom_id": f"n{n}", "image": run_image, "prompt": "Torn?"}).encode()

        def feed() -> None:
            with contextlib.suppress(UsageError):  # cancelled once the key's jobs ended: the end
                backlog.enqueue(lines(), "nightly", "bench", block=True)

        feeder = threading.Thread(target=feed, daemon=True)
        try:
            feeder.start()
            deadline = time.monotonic() + 120
            while client.lane_depth("backlog") < args.depth * 0.9:  # the run has filled the lane
                assert time.monotonic() < deadline, "the run never filled the lane"
                time.sleep(0.1)
            return then(client, backlog, photo)
        finally:
            backlog.cancel("nightly")
            feeder.join(30)
            worker.stop()


def _the_key(client: Any, backlog: Any, photo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The key's jobs, submitted one by one with retries; what they met."""
    from producer.client import Submission as submission
    from shared.errors import QueueFull as queue_full

    image, _ = client.upload_image(photo, KEY)
    ended_before = _ended(client, backlog)
    began, refused, let_in = time.monotonic(), 0, 0.0
    ids: list[str] = []
    first_ended: list[float] = []

    def watch_first() -> None:
        while client.records.get(ids[0]).get("state") not in ("succeeded", "failed"):
            time.sleep(0.02)
        first_ended.append(time.monotonic() - began)

    first = threading.Thread(target=watch_first, daemon=True)
    for n in range(args.key_jobs):
        job = client.build_job(
            submission(image=image, prompt="Refund?", job_id=f"k{n}", lane="backlog", api_key=KEY)
        )
        while True:
            try:
                client.enqueue(job, block=False)
                break
            except queue_full:
                refused += 1
                time.sleep(args.retry_s)
            assert time.monotonic() - began < args.limit_s, "the key's jobs were not let in in time"
        ids.append(job.job_id)
        if n == 0:
            first.start()  # when the first job ends, watched beside the key's next submissions
    let_in = time.monotonic() - began
    while True:
        states = [r.get("state") for r in client.records.get_many(ids)]
        if all(s in ("succeeded", "failed") for s in states):
            break
        assert time.monotonic() - began < args.limit_s, "the key's jobs did not end in time"
        time.sleep(0.1)
    ended = time.monotonic() - began
    run_ended = _ended(client, backlog) - ended_before
    first.join(10)
    return {
        "refused": refused,
        "first_ended_s": first_ended[0],
        "let_in_s": let_in,
        "ended_s": ended,
        "run_ended": run_ended,
    }


def _light_keys(client: Any, backlog: Any, photo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The light keys at work for --seconds: how many jobs ended, theirs and the run's."""
    from producer.client import Submission
    from shared.errors import QueueFull

    keys = [f"{n:x}" * 12 for n in range(10, 10 + args.keys)]  # 12 hex each: aaaaaaaaaaaa, ...
    images = {key: client.upload_image(photo, key)[0] for key in keys}
    stop = threading.Event()
    ended = dict.fromkeys(keys, 0)

    def light(key: str) -> None:
        outstanding: list[str] = []
        count = 0
        while not stop.is_set():
            while len(outstanding) < args.held and not stop.is_set():
                job = client.build_job(
                    Submission(
                        image=images[key], prompt="Refund?", job_id=f"k{count}", lane="backlog", api_key=key
                    )
                )
                try:
                    client.enqueue(job, block=False)
                except QueueFull:
                    time.sleep(0.05)
                    continue
                outstanding.append(job.job_id)
                count += 1
            states = [r.get("state") for r in client.records.get_many(outstanding)]
            done = [
                job_id for job_id, s in zip(outstanding, states, strict=True) if s in ("succeeded", "failed")
            ]
            ended[key] += len(done)
            outstanding = [job_id for job_id in outstanding if job_id not in done]
            time.sleep(0.01)

    run_before = _ended(client, backlog)
    threads = [threading.Thread(target=light, args=(key,), daemon=True) for key in keys]
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    return {"run": _ended(client, backlog) - run_before, "keys": sum(ended.values())}


def _ended(client: Any, backlog: Any) -> int:
    """The run's jobs ended so far (its record's counts as the workers keep them)."""
    record = backlog.runs.get("nightly")
    return int(record.get("finished_succeeded", 0)) + int(record.get("finished_failed", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description="another key's backlog jobs beside a run filling the lane")
    parser.add_argument(
        "--part",
        default="shares,ahead",
        help="shares: one key's jobs, shares off and on and the ahead list; ahead: light keys beside the "
        "run, the ahead list off and on",
    )
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--run-lines", type=int, default=20_000)
    parser.add_argument("--key-jobs", type=int, default=60)
    parser.add_argument("--retry-s", type=float, default=1.0)
    parser.add_argument("--limit-s", type=float, default=600.0)
    parser.add_argument("--keys", type=int, default=4, help="ahead: light keys")
    parser.add_argument("--held", type=int, default=8, help="ahead: jobs each light key keeps outstanding")
    parser.add_argument("--seconds", type=float, default=15.0, help="ahead: how long the light keys ask")
    args = parser.parse_args()
    logs.configure("WARNING")
    import tempfile

    parts = args.part.split(",")
    with tempfile.TemporaryDirectory(prefix="mrc-bench-share-") as folder:
        work = Path(folder)
        if "shares" in parts:
            _print_shares(
                args,
                {m: _mode(*m, args, work, _part(_the_key, args)) for m in ((False, 0), (True, 0), (True, 8))},
            )
        if "ahead" in parts:
            args.run_lines = 1_000_000  # the lane kept full for the whole window
            _print_ahead(
                args, {m: _mode(*m, args, work, _part(_light_keys, args)) for m in ((True, 0), (True, 8))}
            )


def _part(
    part: Callable[[Any, Any, Path, argparse.Namespace], dict[str, Any]], args: argparse.Namespace
) -> Then:
    return lambda client, backlog, photo: part(client, backlog, photo, args)


def _print_shares(args: argparse.Namespace, rows: dict[tuple[bool, int], dict[str, Any]]) -> None:
    print(
        f"depth {args.depth}, a run of {args.run_lines} lines feeding the lane, one echo worker; a key's "
        f"{args.key_jobs} single backlog jobs, a refusal retried after {args.retry_s:g} s"
    )
    print(
        "| shares | ahead list | the key's refusals | its first job ended | its last job let in "
        "| its last job ended | jobs ended meanwhile that were the key's |"
    )
    print("|---|---|---|---|---|---|---|")
    for (shares, ahead), row in rows.items():
        part = args.key_jobs / (args.key_jobs + row["run_ended"])
        print(
            f"| {'on' if shares else 'off'} | {ahead or 'off'} | {row['refused']} | "
            f"{row['first_ended_s']:.2f} s | {row['let_in_s']:.1f} s | {row['ended_s']:.1f} s | {part:.0%} |"
        )
    off, on, ahead_on = rows[False, 0], rows[True, 0], rows[True, 8]
    print(f"last job ended: off / on = {off['ended_s'] / on['ended_s']:.1f}x")
    print(
        f"first job ended: no ahead list / with it = {on['first_ended_s'] / ahead_on['first_ended_s']:.1f}x"
    )


def _print_ahead(args: argparse.Namespace, rows: dict[tuple[bool, int], dict[str, Any]]) -> None:
    print(
        f"depth {args.depth}, a run keeping the lane full, one echo worker; {args.keys} keys each keeping "
        f"{args.held} single backlog jobs outstanding, {args.seconds:g} s"
    )
    print("| ahead list | the run's jobs ended | the keys' jobs ended | the run's part |")
    print("|---|---|---|---|")
    for (_shares, ahead), row in rows.items():
        part = row["run"] / max(1, row["run"] + row["keys"])
        print(f"| {ahead or 'off'} | {row['run']} | {row['keys']} | {part:.0%} |")


if __name__ == "__main__":
    main()
