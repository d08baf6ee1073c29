"""`mrc backlog`: the command-line shell over producer/backlog/run.py.

mrc backlog MANIFEST.jsonl|- [--run-id ID] [--wait [--timeout S]] [--rate N] [--strict] [--no-block]
mrc backlog --from-s3 s3://bucket/prefix --prompt TEXT [--run-id ID] [--wait]
mrc backlog --resume RUN_ID [--wait]
mrc backlog status RUN_ID [--json] | report RUN_ID | cancel RUN_ID
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from producer import arg_types, stops
from producer.backlog import outages
from shared.errors import BucketMissing, QueueFull, UsageError
from shared.settings import Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 3
SUBCOMMANDS = ("status", "report", "cancel")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "backlog",
        help="bulk-enqueue a manifest on the backlog lane (resumable); status|report|cancel RUN_ID",
        description="MANIFEST: one JSON object a line: custom_id, image (s3:// URI or local path), prompt, "
        "optional max_new_tokens and ticket_id; '-' reads stdin. Or: status|report|cancel RUN_ID.",
    )
    p.add_argument("target", nargs="*", help="MANIFEST.jsonl, '-', or status|report|cancel RUN_ID")
    p.add_argument("--run-id", help="the run's id (default: generated; printed first)")
    p.add_argument("--resume", metavar="RUN_ID", help="enqueue what a run's manifest still lacks")
    p.add_argument("--from-s3", metavar="S3_URI", help="build the manifest from a bucket listing")
    p.add_argument("--prompt", help="the prompt for every image, with --from-s3")
    p.add_argument("--wait", action="store_true", help="wait for every job, then write the report")
    p.add_argument(
        "--timeout", type=arg_types.seconds, default=24 * 3600.0, help="seconds --wait waits (default 24 h)"
    )
    p.add_argument("--rate", type=_rate, metavar="N[/s]", help="enqueue at most N lines a second")
    p.add_argument("--strict", action="store_true", help="any invalid line: enqueue nothing (exit 2)")
    p.add_argument("--no-block", action="store_true", help="backlog lane full: exit 4 instead of waiting")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    p.add_argument(
        "--interval",
        type=arg_types.seconds_or_zero,
        default=10.0,
        help="seconds between progress lines off a terminal",
    )


def _rate(text: str) -> float:
    try:
        value = float(text.removesuffix("/s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (say 500 or 500/s)") from None
    # NaN passed `<= 0` and was no limit; 1e-300 overflowed the throttle's clock (review, helper-63)
    if not _SLOWEST_RATE <= value <= _FASTEST_RATE:
        raise argparse.ArgumentTypeError(
            f"the rate must be from {_SLOWEST_RATE} to {_FASTEST_RATE:.0e} lines/s"
        )
    return value


_SLOWEST_RATE, _FASTEST_RATE = 0.001, 1e9


def check(args: argparse.Namespace) -> None:
    """Usage errors, before Redis or S3 are reached."""
    from producer.backlog import manifest  # here, not at the top: every other `mrc` command starts faster

    target = args.target
    if target and target[0] in SUBCOMMANDS:
        if len(target) != 2:
            raise UsageError(f"usage: mrc backlog {target[0]} RUN_ID")
        return
    sources = sum([bool(target), bool(args.resume), bool(args.from_s3)])
    if sources != 1 or len(target) > 1:
        raise UsageError("give one of: a MANIFEST (or -), --resume RUN_ID, --from-s3 S3_URI")
    if args.from_s3 and not args.prompt:
        raise UsageError("--from-s3 needs --prompt")
    if args.from_s3:  # before the run starts (review, helper-82: a bucket S3 cannot name was waited
        _check_listing(args.from_s3)  # out as an outage, and none listed our own bucket)
    if target and target[0] != "-" and not Path(target[0]).is_file():
        raise UsageError(f"manifest not found: {target[0]}")
    for run_id in (args.run_id, args.resume):
        if run_id and not manifest.RUN_ID_RE.match(run_id):
            raise UsageError(f"run id {run_id[:70]!r}: {manifest.RUN_ID_RULE}")


def _check_listing(uri: str) -> None:
    from shared import names

    bucket = uri.removeprefix("s3://").partition("/")[0]
    try:
        names.parse_s3_uri(f"s3://{bucket}/key")  # the bucket's name; a prefix may be empty
        if not uri.startswith("s3://"):
            raise ValueError("not an s3:// URI")
    except ValueError as exc:
        raise UsageError(f"--from-s3 {uri[:80]!r}: {exc}") from None


def run(args: argparse.Namespace, settings: Settings) -> int:
    from producer.backlog import manifest
    from producer.backlog.run import Backlog
    from producer.queue.sender import Queue

    backlog = Backlog(Queue(settings))
    target = args.target
    if target and target[0] in SUBCOMMANDS:
        return _subcommand(backlog, target[0], target[1], args)
    run_id = args.resume or args.run_id or manifest.new_run_id()
    with tempfile.TemporaryFile() as spool:
        lines, source, prompt = _source(backlog, args, run_id, spool)
        if args.strict:
            _strict(lines(), run_id, settings)
        print(run_id, flush=True)
        # One --timeout for the whole --wait: waiting for room on a full lane (review, helper-110: it
        # waited 639 s past a --timeout of 3), the results, and a repair's pass.
        passes, deadline = 0, time.monotonic() + args.timeout
        while True:
            progress = _pass(backlog, args, run_id, (lines, source, prompt), settings, deadline)
            passes += 1
            if isinstance(progress, int):
                return progress
            if not args.wait:
                return EXIT_FAILED if progress.invalid else EXIT_OK
            # A pass that queued nothing again cannot mend what a next one would find (review, helper-76).
            repair = passes < _PASSES and (passes == 1 or progress.enqueued > 0)
            code = _wait(backlog, run_id, args, settings, source, repair, deadline)
            if code is not None:
                return code


# A --wait that finds jobs Redis lost (no record, no result, nothing queued) runs a pass of the run again,
# which queues them, this many passes in all at most.
_PASSES = 4


def _pass(backlog: Any, args: argparse.Namespace, run_id: str, given: tuple[Lines, str, str | None],
          settings: Settings, deadline: float) -> Any:  # fmt: skip
    """One pass of the run, under its lease: its Progress, or the exit code of a pass cut short."""
    from producer.backlog import run_lease

    lines, source, prompt = given
    with run_lease.held(backlog.runs.client, run_id) as lease:
        if prompt:  # a listing's: a refused pass changes nothing of the run (review, helper-76)
            _record_prompt(backlog, run_id, source, prompt)
        return _enqueue(backlog, args, run_id, lines, source, settings, lease, deadline)


def _wait(
    backlog: Any, run_id: str, args: argparse.Namespace, settings: Settings, source: str, repair: bool,
    deadline: float,
) -> int | None:  # fmt: skip
    """--wait: the run's exit code once it is done, or None where Redis lost jobs a pass can queue."""
    try:
        return _wait_and_report(
            backlog, run_id, args.timeout, args.interval, settings.backlog_outage_s, repair, deadline
        )
    except outages.Outage as exc:
        return _gave_up(run_id, source, exc)
    except KeyboardInterrupt as stop:  # review, helper-76: a bare "mrc: interrupted"
        print(f"\nmrc: interrupted; run {run_id} is whole in the queue and goes on without this wait: "
              f"mrc backlog status {run_id}, then mrc backlog report {run_id}", file=sys.stderr)  # fmt: skip
        return stops.exit_code(stop)


def _enqueue(
    backlog: Any, args: argparse.Namespace, run_id: str, lines: Lines, source: str, settings: Settings,
    lease: Any, deadline: float,
) -> Any:  # fmt: skip
    """The run's lines queued, with progress shown and outages waited out: its Progress, or the exit
    code of a pass cut short."""
    from producer.backlog.progress import Display
    from shared.runs import PartNotReplicated, RunLost

    display = Display(interval_s=args.interval)
    heard = outages.Heard()

    def shown(progress: Any) -> None:
        lease.check()  # another pass took the run (Redis lost the lease): this one stops
        heard.saw(progress)
        display.show(progress.snapshot())

    def enqueue() -> Any:
        for _ in range(_PASSES):
            try:
                return backlog.enqueue(
                    lines(), run_id, source, block=not args.no_block, rate=args.rate, on_progress=shown,
                    workdir=os.getcwd(),  # a resume reads relative image paths from where the run began
                    until=deadline if args.wait else None,
                )  # fmt: skip
            except RunLost:  # Redis lost the run's record: its counts start again from the index
                if not lease.renew():
                    lease.check()
                print(f"\nmrc: run {run_id}'s record was lost with Redis's data (a restart without "
                      "persistence?): the pass goes over the run again from its index",
                      file=sys.stderr)  # fmt: skip
        raise UsageError(f"run {run_id}'s record in Redis was lost {_PASSES} times over: stopped")

    try:
        return outages.outlast(
            enqueue, settings.backlog_outage_s, f"enqueueing run {run_id} (it resumes where it was)",
            heard=heard.last,
        )  # fmt: skip
    except outages.Outage as exc:
        return _gave_up(run_id, source, exc)
    except PartNotReplicated as exc:  # the command that resumes this run (review, helper-77: "RUN_ID")
        exc.message = f"{exc.message}. Go on with: {_go_on(run_id, source)}"
        raise
    except QueueFull as exc:
        display.close()  # its last progress line before the message, which says how to go on
        return _full(run_id, source, args.timeout, exc)
    except KeyboardInterrupt as stop:
        print(f"\nmrc: interrupted; run {run_id}'s jobs so far stay queued. Go on with: "
              f"{_go_on(run_id, source)}", file=sys.stderr)  # fmt: skip
        return stops.exit_code(stop)
    finally:
        display.close()


def _full(run_id: str, source: str, timeout: float, exc: QueueFull) -> int:
    """A pass stopped short: --wait's --timeout passed while it waited for room or paced at --rate
    (exit 3, as --wait's), or a full lane with --no-block (QueueFull raised again, saying how to go
    on: exit 4). Either way what was queued is indexed (status sees it)."""
    from producer.backlog.run import TimedOut

    if isinstance(exc, TimedOut):
        print(f"mrc: run {run_id} not whole after {timeout:g} s ({exc.then}); its jobs so far stay queued. "
              f"Go on with: {_go_on(run_id, source)} [--wait]", file=sys.stderr)  # fmt: skip
        return EXIT_TIMEOUT
    then = f"run {run_id}'s jobs so far stay queued. Go on with: {_go_on(run_id, source)}"
    raise QueueFull(exc.depth, exc.limit, f"{exc.then}; {then}" if exc.then else then) from None


def _gave_up(run_id: str, source: str, exc: Exception) -> int:
    """Redis or S3 stayed away past MRC_BACKLOG_OUTAGE_S after the run began: not exit 5 (that says
    nothing was enqueued, and a retry without --run-id would enqueue the run again under new ids)."""
    print(
        f"mrc: run {run_id} is not whole: {exc}; its jobs so far stay queued. Go on with: "
        f"{_go_on(run_id, source)} [--wait]",
        file=sys.stderr,
    )
    return EXIT_TIMEOUT


def _go_on(run_id: str, source: str) -> str:
    """The command that queues the rest of a run cut short."""
    return (
        f"mrc backlog - --run-id {run_id} < MANIFEST" if source == "-" else f"mrc backlog --resume {run_id}"
    )


Lines = Callable[[], Iterator[tuple[int, bytes]]]


def _source(
    backlog: Any, args: argparse.Namespace, run_id: str, spool: IO[bytes]
) -> tuple[Lines, str, str | None]:
    """A way to read the manifest's (line number, raw line) stream from the start (twice with
    --strict), its name for the run's record (a file, stdin (spooled to `spool`), a bucket listing,
    or, with --resume, the source the run recorded), and a listing's prompt."""
    from producer.backlog import manifest

    source = args.target[0] if args.target else args.from_s3
    prompt = args.prompt
    _not_a_batch(backlog.runs.get(run_id), run_id)
    if args.resume:
        run = backlog.runs.get(args.resume)
        source, prompt = run.get("manifest"), prompt or run.get("prompt")
        if not source:
            raise UsageError(
                f"no backlog run {args.resume!r} to resume (its record expired, or Redis lost it: run "
                f"its manifest again with --run-id {args.resume}, which queues what is missing)"
            )
        _into_workdir(run.get("workdir"), source)
    if source.startswith("s3://"):
        bucket, _, prefix = source[5:].partition("/")
        if not prompt:
            raise UsageError("--prompt is needed to resume a --from-s3 run")
        _same_prompt(backlog.runs.get(run_id), run_id, prompt)  # recorded under the run's lease (run())
        return functools.partial(_listing, backlog, run_id, bucket, prefix, prompt), source, prompt
    if source == "-":
        if args.resume:
            raise UsageError("a run read from stdin resumes with: mrc backlog - --run-id RUN_ID")
        shutil.copyfileobj(sys.stdin.buffer, spool)
        return lambda: _from(spool), "-", None
    path = Path(source).resolve()
    if not path.is_file():
        raise UsageError(f"manifest not found: {path}")

    def from_file() -> Iterator[tuple[int, bytes]]:
        with path.open("rb") as handle:
            yield from manifest.read_lines(handle)

    return from_file, str(path), None


def _not_a_batch(record: dict[str, str], run_id: str) -> None:
    """An OpenAI batch's run is fed by mrc-api's batch runner, from the key's input file: a resume here
    read its source as a local path ("manifest not found"), and a manifest run under its id would have
    queued other lines into the key's batch (review)."""
    source = record.get("manifest") or ""
    if source.startswith("openai:"):
        raise UsageError(
            f"run {run_id} is an OpenAI batch (input {source.removeprefix('openai:')[:80]}): mrc-api "
            f"queues its lines itself; follow it with: mrc backlog status {run_id}"
        )


def _record_prompt(backlog: Any, run_id: str, source: str, prompt: str) -> None:
    """A listing run's question, kept in its record for `--resume`; checked again under the lease."""
    backlog.runs.start(run_id, source)
    _same_prompt(backlog.runs.get(run_id), run_id, prompt)
    backlog.runs.update(run_id, prompt=prompt)


def _same_prompt(record: dict[str, str], run_id: str, prompt: str) -> None:
    """A listing run asks one question of every object: one asked another way would be another job under
    a line's id, refused as a reused custom_id (review, helper-76: a `--resume --prompt` rewrote the
    run's question, and the lines queued before became invalid)."""
    recorded = record.get("prompt")
    if recorded and recorded != prompt:
        raise UsageError(
            f"run {run_id} asks {recorded[:80]!r} of every object; a pass of it asks the same (leave "
            "--prompt out to resume it), or start a new run id for another question"
        )


def _indexed(backlog: Any, run_id: str) -> Iterator[dict[str, Any]]:
    """The run's index so far; none where our bucket is not there yet (a first run on a deployment: the
    run's pass makes it, before it writes)."""
    try:
        yield from backlog.entries(run_id)
    except BucketMissing:
        return


def _listing(backlog: Any, run_id: str, bucket: str, prefix: str, prompt: str) -> Iterator[tuple[int, bytes]]:
    """A bucket listing's manifest lines, numbered as the run's index knows them."""
    from producer.backlog import manifest

    keys = backlog.files.list_keys(prefix, bucket=bucket)
    known: dict[str, int] = {}
    last = 0  # past every indexed line, one without a custom_id too (a line refused as too long)
    for entry in _indexed(backlog, run_id):
        last = max(last, int(entry["line"]))
        if "custom_id" in entry:
            known[str(entry["custom_id"])] = int(entry["line"])
    if not last:
        return enumerate(manifest.from_listing(keys, bucket, prompt), start=1)
    line = functools.partial(manifest.listing_line, bucket=bucket, prompt=prompt)
    return ((n, line(key)) for n, key in _numbered(manifest.objects(keys), known, last))


def _numbered(keys: Iterator[str], known: dict[str, int], last: int) -> list[tuple[int, str]]:
    """A listing's objects for a run that indexed some of them already: each it knows at its line,
    new ones after them, in listing order. Numbered by position, a new object sorting among the known
    ones took a known one's line and was skipped, and the last one was queued twice (review,
    helper-65). The keys are held, not their lines (about a third of the memory: review, helper-66)."""
    seen: list[tuple[int, str]] = []
    new: list[str] = []
    for key in keys:
        line = known.get(key)
        if line is None:
            new.append(key)
        else:
            seen.append((line, key))
    seen.sort()
    return [*seen, *zip(range(last + 1, last + 1 + len(new)), new, strict=True)]


def _into_workdir(workdir: str | None, source: str) -> None:
    """Resume where the run began: its manifest's relative image paths are relative to that directory
    (review, helper-63: a resume from elsewhere indexed their lines 'image file not found' for good)."""
    if not workdir or workdir == os.getcwd() or source.startswith("s3://"):  # a listing names no file
        return
    try:
        os.chdir(workdir)
    except OSError as exc:  # another host, or a folder since removed: s3:// and absolute paths still do
        print(
            f"mrc: the run began in {workdir}, which cannot be entered here ({exc.strerror}); relative "
            "image paths are read from this directory",
            file=sys.stderr,
        )


def _from(spool: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    from producer.backlog import manifest

    spool.seek(0)
    return manifest.read_lines(spool)


def _strict(lines: Iterator[tuple[int, bytes]], run_id: str, settings: Settings) -> None:
    """Check every line first; any invalid one is a usage error (nothing enqueued)."""
    from producer.backlog import manifest

    bad = 0
    seen: dict[str, bytes] = {}  # job id -> what makes the job (the enqueue refuses a second one)
    images: dict[str, str] = {}  # a local path -> its bytes' sha256 (uploads are by content)
    for number, raw in lines:
        item = manifest.parse(number, raw, run_id, settings)
        if isinstance(item, manifest.Line):
            made = _what_makes(item, settings, images)
            if seen.setdefault(item.job_id, made) != made:  # review, helper-63: it ran, and exit 1
                item = manifest.Invalid(number, f"custom_id {item.custom_id!r} is already another line's job")
        if isinstance(item, manifest.Invalid):
            bad += 1
            if bad <= 20:
                print(f"mrc: line {item.number}: {item.reason}", file=sys.stderr)
    if bad:
        raise UsageError(f"--strict: {bad} invalid line(s); nothing enqueued")


def _what_makes(line: Any, settings: Settings, images: dict[str, str]) -> bytes:
    """A digest of what makes a line's job as Job.fingerprint sees it once queued: a local image by
    its bytes (uploads are content-addressed: ./p.jpg and p.jpg are one image), an absent
    max_new_tokens as the default it becomes (review, helper-65: --strict refused both as two jobs)."""
    import hashlib

    image = line.image
    if not image.startswith("s3://"):
        if image not in images:
            try:
                images[image] = hashlib.sha256(Path(image).read_bytes()).hexdigest()
            except OSError:  # gone since it was checked: the enqueue will say so for its line
                images[image] = image
        image = images[image]
    new = settings.max_new_tokens_default if line.max_new_tokens is None else line.max_new_tokens
    fmt = None if line.response_format is None else line.response_format.model_dump(by_alias=True)
    material = json.dumps([image, line.prompt, new, fmt], sort_keys=True)
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).digest()[:16]


def _subcommand(backlog: Any, command: str, run_id: str, args: argparse.Namespace) -> int:
    if command == "status":
        status = backlog.status(run_id)
        if args.json:
            print(json.dumps(status))
        else:
            from producer.backlog.progress import describe

            print(describe(status))
        return EXIT_OK
    if command == "cancel":
        cancelled = backlog.cancel(run_id)
        if cancelled is None:
            ended = backlog.status(run_id)["state"]
            print(f"run {run_id} is {ended}: nothing to cancel, and nothing was changed", file=sys.stderr)
        print(json.dumps({"run_id": run_id, "cancelled": cancelled or 0}))
        return EXIT_OK
    summary = backlog.report(run_id)
    print(json.dumps(summary))
    return _exit_for(summary)


def _wait_and_report(
    backlog: Any, run_id: str, timeout: float, interval: float, outage_s: float, repair: bool = False,
    deadline: float | None = None,
) -> int | None:  # fmt: skip
    """The run's exit code once no job of it is queued or running; None (with `repair`) where jobs are
    neither, nor have a result, because Redis lost them: a pass of the run queues them again."""
    from producer.backlog.progress import Display

    display = Display(interval_s=interval)
    deadline = time.monotonic() + timeout if deadline is None else deadline
    try:
        while True:
            began = time.monotonic()
            status = outages.outlast(
                lambda: backlog.status(run_id), outage_s, f"waiting for run {run_id}", until=deadline
            )
            display.show(status)
            if status["queued"] + status["running"] == 0:
                if (
                    repair and status.get("lost") and status["state"] != "cancelled"
                ):  # review, helper-76: the wait ended, 140 jobs never ran
                    print(f"\nmrc: {status['lost']} jobs of run {run_id} have no record (Redis lost them: "
                          "a restart without persistence?): a pass of the run queues again those without a "
                          "result", file=sys.stderr)  # fmt: skip
                    return None
                if status.get("lost"):
                    print(f"\nmrc: {status['lost']} jobs of run {run_id} have no record (Redis lost them); "
                          f"those without a result are queued by: mrc backlog --resume {run_id}",
                          file=sys.stderr)  # fmt: skip
                break
            if time.monotonic() >= deadline:
                print(f"mrc: run {run_id} not done after {timeout:g} s", file=sys.stderr)
                return EXIT_TIMEOUT
            # A status reads the whole index: on a big run, poll no more often than it takes.
            time.sleep(max(1.0, 2 * (time.monotonic() - began)))
    finally:
        display.close()
    summary = outages.outlast(lambda: backlog.report(run_id), outage_s, f"writing run {run_id}'s report")
    print(json.dumps(summary))
    return _exit_for(summary)


def _exit_for(summary: dict[str, Any]) -> int:
    counts = summary["counts"]
    if counts.get("failed") or counts.get("invalid"):
        return EXIT_FAILED
    if counts.get("pending"):
        return EXIT_TIMEOUT
    if summary.get("state") == "enqueuing":  # review, helper-76: exit 0 for a run a kill cut short
        print(f"mrc: run {summary['run_id']} is not whole: its enqueue has not ended (a pass is going on, or "
              f"it stopped: mrc backlog --resume {summary['run_id']})", file=sys.stderr)  # fmt: skip
        return EXIT_TIMEOUT
    return EXIT_OK
