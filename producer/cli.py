"""`mrc`: the producer and ops command line (works without torch).

Exit codes: 0 ok / job succeeded, 1 job failed, 2 usage or validation error (nothing enqueued),
3 timeout or no result yet, 4 backlog lane full with --no-block (or still full when --wait's --timeout
is spent), 5 Redis or S3 unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis
from kombu.exceptions import OperationalError

from producer import arg_types, pipe_out, stops
from producer.backlog import cli as backlog_cli
from producer.stops import EXIT_INTERRUPTED, EXIT_TERMINATED  # noqa: F401 - every exit code in one table
from shared import encoding, logs, names, reach, redis_target, tenants
from shared.errors import (
    MrcError,
    NotReplicated,
    PushUnconfirmed,
    QueueFull,
    ServiceUnreachable,
    StoreRefused,
    StoreUnavailable,
    UsageError,
)
from shared.jobs import JOB_ID_RULE
from shared.settings import BadSettings, Settings, unknown_variables
from shared.settings import load as load_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_QUEUE_FULL, EXIT_UNREACHABLE = 0, 1, 2, 3, 4, 5
# Enqueued on the Redis master, but fewer replicas than MRC_REDIS_WAIT_REPLICAS confirmed it in time.
EXIT_NOT_REPLICATED = 6


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mrc", description="Submit image+prompt jobs to mrc and read results."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit one job; prints its id (or its result with --wait)")
    p.add_argument("--image", required=True, help="local image path (uploaded to S3) or s3://bucket/key")
    p.add_argument("--prompt", required=True, help="the question about the image")
    p.add_argument("--job-id", help="your id for the job; submitting the same id twice runs it once")
    p.add_argument(
        "--lane", choices=names.LANES, default="interactive", help="interactive (default) or backlog"
    )
    p.add_argument(
        "--max-new-tokens", type=arg_types.integer, help="tokens to generate (1..MRC_MAX_NEW_TOKENS_LIMIT)"
    )
    p.add_argument("--ticket-id", help="upstream ticket id, copied into the result")
    p.add_argument("--deadline", help="RFC 3339 time after which the job is not run (result: expired)")
    answer = p.add_mutually_exclusive_group()
    answer.add_argument(
        "--json-schema",
        metavar="FILE_OR_JSON",
        help="constrain the answer to JSON valid against this JSON Schema (inline JSON or a file)",
    )
    answer.add_argument("--choice", metavar="A,B,C", help="constrain the answer to one of these strings")
    p.add_argument("--wait", action="store_true", help="wait and print the result JSON")
    p.add_argument(
        "--no-block",
        action="store_true",
        help="no room on the backlog lane (at its depth limit, or this key past its share while keys share "
        "it): fail at once (exit 4) instead of waiting for room",
    )
    p.add_argument(
        "--timeout", type=arg_types.seconds, default=300.0,
        help="seconds --wait waits in all: for room in a full backlog lane (then exit 4), then for the "
        "result (then exit 3) (default 300)",
    )  # fmt: skip

    p = sub.add_parser("status", help="print the state of a job as JSON")
    p.add_argument("job_id")

    p = sub.add_parser("result", help="print the result JSON of a job (exit 1 failed, 3 none yet)")
    p.add_argument("job_id")

    backlog_cli.add_parser(sub)

    p = sub.add_parser("queues", help="queue depths per lane")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--watch", type=arg_types.seconds, metavar="SECONDS", help="print again every SECONDS until Ctrl-C"
    )
    p.add_argument(
        "--serve-metrics",
        type=arg_types.port,
        metavar="PORT",
        help="serve the per-lane metrics (depth, in flight, oldest age, dead letters) on PORT at /metrics "
        "until stopped: an exporter for autoscalers that needs no worker",
    )

    p = sub.add_parser("events", help="completion events, one JSON line each (job_id, status, result_uri)")
    p.add_argument("--after", default="0", help="print events after this id (default: the oldest kept)")
    p.add_argument("--follow", action="store_true", help="keep waiting for new events until Ctrl-C")

    p = sub.add_parser("dlq", help="the dead-letter list: jobs that failed after all their attempts")
    dlq = p.add_subparsers(dest="dlq_command", required=True)
    q = dlq.add_parser("list", help="print entries as JSON lines, newest first")
    q.add_argument("--limit", type=arg_types.count, default=100)
    q = dlq.add_parser("requeue", help="send entries back to their lane with fresh attempts (oldest first)")
    q.add_argument("--limit", type=arg_types.count, default=1000)
    dlq.add_parser("purge", help="delete every entry")
    return parser


def _print_json(data: Any) -> None:
    print(encoding.to_display(data))  # a tenant's text may hold terminal controls (review, helper-62)


def _print_result(result: dict[str, Any]) -> int:
    """Print a result; its exit code: 0 succeeded, 1 failed."""
    _print_json(result)
    return EXIT_OK if result.get("status") == "succeeded" else EXIT_FAILED


def _check_job_id(job_id: str) -> None:
    """A job id that no submit could have made is a usage error, never a key looked up in S3 or Redis.
    An operator (no key) names a tenant's job by its stored id, `OWNER~ID`, as `mrc events` shows it."""
    if not tenants.STORED_JOB_ID_RE.match(job_id):
        raise UsageError(f"job_id {job_id[:40]!r}: {JOB_ID_RULE}; a key's job as OWNER~ID (12 hex digits, ~)")


def _submission(args: argparse.Namespace) -> Any:
    from producer.client import Submission

    return Submission(
        image=args.image,
        prompt=args.prompt,
        job_id=args.job_id,
        lane=args.lane,
        max_new_tokens=args.max_new_tokens,
        ticket_id=args.ticket_id,
        deadline=args.deadline,
        response_format=_response_format(args),
    )


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """--json-schema (inline JSON, else a file's) or --choice as the job's response_format."""
    if args.choice is not None:
        from shared.response_format import parse_choice_list

        return {"type": "choice", "choices": parse_choice_list(args.choice)}
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        text = _schema_file(text)
    try:  # a key given twice, or nesting past 64 levels: refused, as mrc-api does
        schema = encoding.loads(text)
    except encoding.DuplicateKey as twice:
        raise UsageError(f"--json-schema: {twice}") from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--json-schema: not JSON ({str(exc)[:120]})") from None
    if not isinstance(schema, dict):
        raise UsageError("--json-schema: a JSON Schema is a JSON object")
    return {"type": "json_schema", "schema": schema}


SCHEMA_FILE_MAX_BYTES = 1 << 20  # a schema file, pretty-printed; the schema itself is held to far less


def _schema_file(path: str) -> str:
    """A --json-schema file's text: a regular file of at most SCHEMA_FILE_MAX_BYTES (review, helper-84:
    /dev/zero was read until the kernel killed `mrc` at 22 GB, a FIFO blocked it for good). Opened
    without blocking, so a FIFO is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(
            f"--json-schema: {path!r} is neither inline JSON nor a readable file ({exc.strerror})"
        ) from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"--json-schema: {path!r} is not a regular file")
        data = handle.read(SCHEMA_FILE_MAX_BYTES + 1)
    if len(data) > SCHEMA_FILE_MAX_BYTES:
        raise UsageError(f"--json-schema: {path!r} is over {SCHEMA_FILE_MAX_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--json-schema: {path!r} is not UTF-8 text") from None


def _validate_submit(args: argparse.Namespace, settings: Settings) -> None:
    """A bad submission is exit 2 whether or not Redis and S3 are up: checked before reaching them."""
    from producer.intake.intake import validate

    # No Client: one costs a boto3 client and a Redis pool (~0.18 CPU-s), and _cmd_submit makes its own
    validate(settings, _submission(args))


def _cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from producer.client import Client
    from producer.queue.sender import stopped_send

    client = Client(settings)
    sub = _submission(args)
    job = client.build_job(sub)
    replicated = True
    # With --wait, --timeout bounds the whole command: a backlog lane that stays full is exit 4 once it
    # is spent (review: the wait for room had no end), and the result gets what is left of it.
    deadline = time.monotonic() + args.timeout
    queued: bool | None = True  # what a stop during the wait says of the job (None: maybe)
    try:
        client.enqueue(
            job,
            block=not args.no_block,
            timeout=args.timeout if args.wait else None,
            minted=sub.job_id is None,  # an id drawn for it: no earlier job's, S3 not asked
        )
    except NotReplicated as exc:  # queued: the id is the caller's to resubmit under; the wait goes on
        print(f"mrc: job {job.job_id}: {exc.message}", file=sys.stderr)  # with --wait, the id's one mention
        replicated = False
        queued = None if isinstance(exc, PushUnconfirmed) else True
    except KeyboardInterrupt as stop:  # stopped once its push began: the job may be queued all the same
        told = stopped_send(stop)
        if told is None or told[1] is False:
            raise
        return _stopped_after_send(stop, job.job_id, told[1])
    job_id = job.job_id
    try:
        if not args.wait:
            print(job_id)
            return EXIT_OK if replicated else EXIT_NOT_REPLICATED
        result = client.wait(job_id, max(0.1, deadline - time.monotonic()))
    except TimeoutError as exc:
        print(f"mrc: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except KeyboardInterrupt as stop:  # the job stays queued: say which one, or a drawn id is lost
        return _stopped_after_send(stop, job_id, queued)
    return _print_result(result)


def _stopped_after_send(stop: KeyboardInterrupt, job_id: str, queued: bool | None) -> int:
    """A submission stopped once its job was sent: which job, and how to go on."""
    if queued:
        said = f"job {job_id} is queued: `mrc result {job_id}` reads its result"
    else:
        said = (
            f"job {job_id} may be queued (Redis could not say): `mrc status {job_id}` tells; "
            f"submitting it again with --job-id {job_id} never queues it twice"
        )
    print(f"\nmrc: interrupted; {said}", file=sys.stderr)
    return stops.exit_code(stop)


def _cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from producer.client import Client

    _print_json(Client(settings).status(args.job_id))
    return EXIT_OK


def _cmd_result(args: argparse.Namespace, settings: Settings) -> int:
    from producer.client import Client

    client = Client(settings)
    result = client.result(args.job_id)
    if result is None:
        # "none yet" only where Redis, which holds the job, answers: with it away that is exit 5
        # (review: exit 3); a stored result is printed whatever Redis does
        reach.check(settings, need_redis=True, need_s3=False)
        result = client.settled_result(args.job_id)  # a failed job whose result S3 refused
    if result is None:
        state = client.records.get(args.job_id).get("state")
        if state is None:  # review, helper-124: "yet" for an id no one submitted
            print(f"mrc: no job {args.job_id} is known: no record and no result (never submitted, or its "
                  "record expired after 7 days)", file=sys.stderr)  # fmt: skip
        elif state in ("succeeded", "failed"):  # its record ended, its result not stored (review, helper-126)
            print(f"mrc: job {args.job_id} ended {state} without a stored result", file=sys.stderr)
        else:
            print(f"mrc: no result for {args.job_id} yet (it is {state})", file=sys.stderr)
        return EXIT_TIMEOUT
    return _print_result(result)


def _cmd_queues(args: argparse.Namespace, settings: Settings) -> int:
    from shared.records import connect, scrape_client

    if args.serve_metrics is not None:
        return _serve_lane_metrics(scrape_client(settings), args.serve_metrics)
    client = connect(settings, settings.connect_timeout_s, retries=2)
    while True:
        _print_queues(client, settings, args.json)
        if not args.watch:
            return EXIT_OK
        time.sleep(args.watch)


def _serve_lane_metrics(client: Any, port: int) -> int:
    import signal
    import threading

    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from shared import http_serve
    from shared.lane_metrics import LaneCollector
    from shared.usage import UsageCollector

    registry = CollectorRegistry()
    registry.register(LaneCollector(client, runs=True))
    registry.register(UsageCollector(client))
    registry.register(redis_target.FailoverCollector())
    try:
        # Bounded (shared/http_serve.py): each scrape reads Redis, so a flood of connections must not
        # become a flood of reads.
        def scrape() -> tuple[int, bytes, str]:
            return 200, generate_latest(registry), CONTENT_TYPE_LATEST

        # "/" as prometheus_client's server answered it before
        server = http_serve.serve("0.0.0.0", port, {"/metrics": scrape, "/": scrape}, "mrc-lanes")
    except OSError as exc:  # the port taken, or not ours to bind (review: a traceback)
        raise UsageError(f"--serve-metrics {port}: cannot listen there: {exc.strerror or exc}") from None
    logs.get_logger().info("MRC_HTTP_LISTENING", port=server.server_address[1], what="lane metrics")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return EXIT_OK


def _print_queues(client: Any, settings: Settings, as_json: bool) -> None:
    from producer.ops import queues as queues_view

    view = queues_view.collect(client, settings)
    if as_json:
        _print_json(view)
    elif sys.stdout.isatty():
        queues_view.render_rich(view)
    else:
        print(queues_view.render_text(view), flush=True)


def _cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    """Print completion events as JSON lines; with --follow, wait for more (long-polls of 5 s)."""
    from shared.records import RedisJobRecords, connect, valid_event_id

    if not valid_event_id(args.after):
        raise UsageError("--after: an event id (1700000000000-0, each part below 2^64) or 0")
    records = RedisJobRecords(connect(settings, settings.connect_timeout_s, retries=3))
    after, page = args.after, 1000
    while True:
        found = records.events_after(after, block_s=5.0 if args.follow else 0.0, count=page)
        for event in found:
            _print_json(event)
            after = event["id"]
        sys.stdout.flush()
        if not args.follow and len(found) < page:  # read in pages until the stream is drained
            return EXIT_OK


def _cmd_dlq(args: argparse.Namespace, settings: Settings) -> int:
    from producer.client import Client
    from producer.queue import dlq

    client = Client(settings)
    if args.dlq_command == "list":
        for entry in client.records.dead_letters(args.limit):
            _print_json(entry)
    elif args.dlq_command == "requeue":
        requeued, invalid, unreplicated = dlq.requeue(client, args.limit)
        print(json.dumps({"requeued": requeued, "invalid": invalid, "not_replicated": unreplicated}))
        if unreplicated:
            print(
                "mrc: the last requeued job was not confirmed by the Redis replicas, and the requeue stopped "
                "there; the rest stay dead-lettered: run it again once the replicas are back",
                file=sys.stderr,
            )
            return EXIT_NOT_REPLICATED
    else:
        print(json.dumps({"purged": client.records.purge_dead_letters()}))
    return EXIT_OK


_COMMANDS = {
    "submit": _cmd_submit,
    "status": _cmd_status,
    "result": _cmd_result,
    "queues": _cmd_queues,
    "backlog": backlog_cli.run,
    "events": _cmd_events,
    "dlq": _cmd_dlq,
}
# Usage checks that need neither Redis nor S3: a bad command is exit 2 whether or not they are up.
_CHECKS: dict[str, Any] = {
    "submit": _validate_submit,
    "status": lambda args, settings: _check_job_id(args.job_id),
    "result": lambda args, settings: _check_job_id(args.job_id),
    "backlog": lambda args, settings: backlog_cli.check(args),
}
# What each command needs to reach: (Redis, S3). Checked first, with a short timeout.
_NEEDS = {
    "submit": (True, True),
    "status": (True, True),
    "result": (False, True),  # Redis too, but only when no result is stored (_cmd_result)
    "queues": (True, False),
    "backlog": (True, True),
    "events": (True, False),
    "dlq": (True, False),
}


# What a refusal exits with (the contract's exit codes).
_EXITS: tuple[tuple[type[MrcError], int], ...] = (
    (UsageError, EXIT_USAGE),
    (QueueFull, EXIT_QUEUE_FULL),
    (NotReplicated, EXIT_NOT_REPLICATED),
    (ServiceUnreachable, EXIT_UNREACHABLE),
)


def _refused_by_redis(exc: redis.ResponseError, settings: Settings) -> int:
    """Redis answered with an error: a refusal for now (out of memory, a replica after a failover, a
    long script) is 'cannot serve now' (exit 5, as mrc-api's 503), anything else a refused command
    (exit 1), never reported as unreachable."""
    text = redis_target.refusal_words(exc)
    where = redis_target.where(settings)
    if redis_target.refused_for_now(exc):
        print(f"mrc: Redis at {where} cannot serve now: {text}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"mrc: Redis at {where} refused the command: {text}", file=sys.stderr)
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    with stops.sigterm_taken():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    pipe_out.guard_stdout()
    args = _parser().parse_args(argv)
    try:
        settings = load_settings()
    except BadSettings as exc:
        print(f"mrc: bad settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, fmt=settings.log_format)
    for name in unknown_variables():
        logs.get_logger().warning("MRC_UNKNOWN_SETTING", name=name)
    need_redis, need_s3 = _NEEDS[args.command]
    try:
        _CHECKS.get(args.command, lambda a, s: None)(args, settings)
        reach.check(settings, need_redis=need_redis, need_s3=need_s3)
        return _COMMANDS[args.command](args, settings)
    except (UsageError, QueueFull, NotReplicated, ServiceUnreachable) as exc:
        print(f"mrc: {exc.message}", file=sys.stderr)
        return next(code for kind, code in _EXITS if isinstance(exc, kind))
    except (StoreUnavailable, StoreRefused) as exc:  # S3 went away after the check, or refused us
        said = "S3 refused" if isinstance(exc, StoreRefused) else "cannot reach S3"
        print(f"mrc: {said}: {exc.message.splitlines()[0][:300]}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except redis.ResponseError as exc:
        return _refused_by_redis(exc, settings)
    except (redis.RedisError, OperationalError) as exc:  # Redis went away after the check
        where = redis_target.where(settings)
        print(f"mrc: cannot reach Redis at {where}: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MrcError as exc:
        print(f"mrc: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as stop:  # one line, not a traceback (mrc backlog says how to go on: its own)
        print("\nmrc: interrupted", file=sys.stderr)
        return stops.exit_code(stop)


if __name__ == "__main__":
    sys.exit(main())
