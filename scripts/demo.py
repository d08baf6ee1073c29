"""`make demo`: the whole path on local defaults.

Starts redis-server and moto's S3 server on free loopback ports, one mrc-worker on the `parcels` model
(a tiny Fuyu trained on synthetic parcel photos, committed in workers/models/parcels/), submits sample
tickets (parcel photos drawn here by scripts/parcels.py, with the questions that model was taught,
and one structured answer) with the Python client (`producer.client.Client`, in this process: no
process start is timed with a ticket), prints one line per result with the answer, whether it is
right, and the times the result itself reports (queued / preprocess / inference / total), and stops
everything it started, also on Ctrl-C. `--model tiny` runs the random-weight tiny Fuyu instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client  # noqa: E402
from scripts import devservices as services  # noqa: E402 - after the path is set
from scripts import parcels  # noqa: E402
from shared import logs  # noqa: E402

# (seed, image size, question kind): parcel photos of several sizes and both formats, each question
# kind, and one answer in JSON (SCHEMA, all three at once). Seeds far from the training's.
TICKETS = [
    (7001, (1024, 768), "colour"),
    (7002, (640, 480), "damage"),
    (7003, (480, 800), "colour"),
    (7004, (320, 240), "damage"),
    (7005, (800, 400), "digit"),
    (7006, (560, 420), "json"),
]


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _tickets(work: Path) -> list[dict[str, Any]]:
    """The sample tickets: image files written to `work`, each with its question and right answer."""
    tickets = []
    for seed, size, kind in TICKETS:
        data, truth = parcels.make(seed, size)
        path = work / f"parcel-{seed}.{'png' if truth.fmt == 'PNG' else 'jpg'}"
        path.write_bytes(data)
        if kind == "json":
            prompt, expected, options = parcels.JSON_PROMPT, truth.as_json(), {"max_new_tokens": 32}
            options["response_format"] = {"type": "json_schema", "schema": parcels.SCHEMA}
        else:
            prompt, expected, options = (
                parcels.question(seed, kind),
                truth.answer(kind),
                {"max_new_tokens": 4},
            )
        tickets.append({"path": path, "prompt": prompt, "expected": expected, "options": options})
    return tickets


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="parcels", help="MRC_MODEL for the worker (default: parcels)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C stops everything however the demo was started: a shell that starts it in the background
    # (`make demo &`, nohup, CI runners) hands it SIGINT ignored, and Python then never raises
    # KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="mrc-demo-"))
    started: list[services.Service | services.Worker] = []
    began = time.monotonic()
    try:
        redis = services.start_redis(work / "redis")
        started.append(redis)
        s3 = services.start_s3(work / "s3")
        started.append(s3)
        env = services.base_env(redis.url, s3.url, "mrc-demo", ROOT / ".cache" / "mrc")
        env["MRC_DEVICE"] = "auto"
        env["MRC_MODEL"] = args.model
        print(f"redis {redis.url} | S3 {s3.url} | loading the model ({args.model}) ...", flush=True)
        worker = services.start_worker(env, work / "worker.log")
        started.append(worker)
        pids = " ".join(str(item.proc.pid) for item in started)
        print(f"worker ready (log: {work / 'worker.log'}; pids {pids})\n", flush=True)
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # the client's S3 access
        logs.configure("WARNING")  # the client's own events (MRC_ENQUEUED ...) would clutter the table
        client = Client(services.settings_from_env(env))
        tickets = _tickets(work)
        results = []
        for i, ticket in enumerate(tickets):  # one at a time, as tickets trickle in
            job_id = client.submit(ticket["path"], ticket["prompt"], ticket_id=f"T-{i}", **ticket["options"])
            results.append(client.wait(job_id, timeout=300))
        # The same first ticket again: answered from the result cache, without the model.
        first = tickets[0]
        job_id = client.submit(first["path"], first["prompt"], ticket_id="T-0-again", **first["options"])
        results.append(client.wait(job_id, timeout=300))
        tickets.append(first)
        right = _print_table(results, tickets)
        failures = sum(r.get("status") != "succeeded" for r in results)
        print(
            f"\n{len(results) - failures}/{len(results)} jobs succeeded, {right}/{len(results)} answers "
            f"right, in {time.monotonic() - began:.1f} s (start-up included). One result in full (what "
            "`mrc result JOB_ID` prints, indented here):"
        )
        print(json.dumps(results[0], ensure_ascii=False, indent=1))
        print(
            "The services stop with the demo; to keep a worker up and use `mrc` yourself, see README.md, "
            '"Run it yourself".'
        )
        print(
            "The parcels model is a 4 M-parameter Fuyu taught only these questions about these photos "
            "(docs/benchmarks.md: its accuracy).\n"
            "With Fuyu-8B on a GPU (weights in a local folder; nothing is downloaded):\n"
            "  MRC_MODEL=/models/fuyu-8b MRC_QUANTIZATION=nf4 MRC_DEVICE=cuda .venv/bin/mrc-worker"
        )
        return 0 if failures == 0 else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        for item in reversed(started):
            item.stop()
        shutil.rmtree(work, ignore_errors=True)


def _ms(timings: dict[str, Any], key: str) -> str:
    value = timings.get(key)
    return f"{value:.0f}" if isinstance(value, int | float) else "-"


def _answer(result: dict[str, Any]) -> str:
    if result.get("output") is not None:
        return json.dumps(result["output"])
    text = " ".join(str(result.get("text") or (result.get("error") or {}).get("code", "")).split())
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)


def _print_table(results: list[dict[str, Any]], tickets: list[dict[str, Any]]) -> int:
    """Per ticket: the question, the answer, whether it is right, and the times its result reports
    (what the system spent, not what the demo did). Returns how many answers were right."""
    print(
        f"{'ticket':<10} {'question':<30} {'answer':<50} "
        f"{'queued':>6} {'prep':>5} {'model':>5} {'total':>6}  cache  right   (times in ms)"
    )
    right = 0
    for r, ticket in zip(results, tickets, strict=True):
        timings = r.get("timings_ms") or {}
        expected = ticket["expected"]
        ok = r.get("output") == expected if isinstance(expected, dict) else (r.get("text") or "") == expected
        right += ok
        verdict = "yes" if ok else f"NO, it is {json.dumps(expected)}"
        print(
            f"{r.get('ticket_id') or '-':<10} {ticket['prompt'][:30]:<30} {_answer(r)[:50]:<50} "
            f"{_ms(timings, 'queued'):>6} {_ms(timings, 'preprocess'):>5} {_ms(timings, 'inference'):>5} "
            f"{_ms(timings, 'total'):>6}  {'hit' if r.get('cache_hit') else '-':<5}  {verdict}"
        )
    return right


if __name__ == "__main__":
    sys.exit(main())
