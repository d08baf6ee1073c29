"""What moves a batch along, in every mrc-api process (a keeper thread, every MRC_OPENAI_BATCH_POLL_S):

- `validating` / `in_progress`: its lines are enqueued as a backlog run (producer/openai/batch_lines.py)
  by whichever process holds its `enqueue` lease; a process that died leaves a lease that expires,
  and the next look resumes the run (chunks already queued are not queued again). `in_progress` once
  its first requests go in.
- A cancel, or the window's end: the run is cancelled (its queued jobs end `cancelled`).
- Every request ended (or, after a cancel or the window's end, every one that was running): the
  `finalize` lease's holder writes the output and error files (producer/openai/batch_output.py), then
  the batch is final.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from producer.backlog import chunk_index, manifest
from producer.backlog.run import Backlog, unconfirmed_chunks
from producer.openai.batch_book import FINAL, RUNNING, BatchBook, now
from producer.openai.batch_lines import Translator, max_line_bytes, read_s3_lines
from producer.openai.batch_output import Output, drop_input_copy
from producer.openai.files import Files
from producer.openai.models import Models
from shared import logs, names
from shared import usage as usage_book
from shared.errors import BucketMissing, UsageError

ENQUEUE_LEASE_S, FINALIZE_LEASE_S = 60, 600


class _InputGone(Exception):
    """The batch's copy of its input is not in S3."""


class _Stopped(Exception):
    """The process is stopping, or the batch was cancelled: leave the work to a later pass."""


@dataclass
class Tally:
    """A batch's requests now, from its run's index and its jobs' records."""

    completed: int = 0
    failed: int = 0
    pending: int = 0  # queued or running, and not marked cancelled
    usage: dict[str, int] = field(default_factory=usage_book.empty_sums)


def input_key(prefix: str, batch_id: str) -> str:
    return names.run_key(prefix, batch_id, "input.jsonl")


class Keeper:
    """The thread that looks after the batches in flight, every MRC_OPENAI_BATCH_POLL_S. Looking needs
    Redis only; the batch machinery (its S3 clients and all) is built when there is a batch."""

    def __init__(self, poll_s: float, active: Callable[[], list[str]], runner: Callable[[], Runner]) -> None:
        self.poll_s, self.active, self.runner = poll_s, active, runner
        self._stop = threading.Event()
        self._quiet_until = 0.0
        self._thread: threading.Thread | None = None
        self.log = logs.get_logger()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name="mrc-batch-keeper", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 5.0) -> None:
        """Ends the looking at the next batch (not after a whole pass over every batch in flight, whose
        S3 reads could outlive the process's services: a shutdown then logged store errors)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _keep(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                batch_ids = self.active()
                if batch_ids:
                    runner = self.runner()
                    for batch_id in batch_ids:
                        if self._stop.is_set():
                            break
                        runner.advance(batch_id)
            except Exception as exc:  # Redis or S3 away: the next pass tries again; logged once a minute
                if time.monotonic() >= self._quiet_until:
                    self._quiet_until = time.monotonic() + 60
                    self.log.warning("MRC_BATCH_KEEPER_ERROR", error=repr(exc)[:300])


class Runner:
    def __init__(self, backlog: Backlog, book: BatchBook, files: Files, models: Models, redis: Any) -> None:
        self.backlog, self.book, self.files, self.models = backlog, book, files, models
        self.settings, self._redis = backlog.settings, redis
        self.log = logs.get_logger()
        self._stop = threading.Event()
        self._work = threading.BoundedSemaphore(4)  # enqueues and finalizes at once in this process

    def stop(self) -> None:
        """Work in progress stops at its next step (its lease lapses; a later pass resumes it)."""
        self._stop.set()

    def advance(self, batch_id: str) -> None:
        record = self.book.get(batch_id)
        status = record.get("status")
        if not record or status in FINAL:
            self.book.settle(batch_id)
            return
        if record.get("ended_by") or status == "cancelling":
            if not self.book.held(batch_id, "enqueue") and self.tally(batch_id).pending == 0:
                self._begin(batch_id, "finalize", self._finalize)
            return
        if status == "finalizing":
            self._begin(batch_id, "finalize", self._finalize)  # a finalize whose process died
            return
        if time.time() >= float(record["expires_at"]):
            self.end(batch_id, "expired")
            return
        run = self.backlog.runs.get(batch_id)
        if run.get("state") == "cancelled":  # `mrc backlog cancel` on the batch's run
            self.book.move(batch_id, RUNNING, ended_by="cancelled", status="cancelling", cancelling_at=now())
            return
        if status == "validating" and int(run.get("lines", 0)) > 0:
            self._started(batch_id)
        if run.get("state") == "enqueuing":
            self._begin(batch_id, "enqueue", self._enqueue)
        elif run.get("state") == "enqueued":
            self._settle(batch_id)

    def _started(self, batch_id: str) -> None:
        """`validating` -> `in_progress`, in one step that a cancel or the window's end wins over (a
        read-then-write could put `in_progress` over a cancel's `cancelling`: review)."""
        self.book.move(batch_id, ("validating",), status="in_progress", in_progress_at=now())

    def _settle(self, batch_id: str) -> None:
        """Every request ended: the files are written now, unless a cancel came first (then the next
        pass finalizes it as cancelled)."""
        if self.tally(batch_id).pending == 0 and self.book.move(
            batch_id, RUNNING, status="finalizing", finalizing_at=now()
        ):
            self._begin(batch_id, "finalize", self._finalize)

    def end(self, batch_id: str, why: str) -> bool:
        """A cancel (`cancelling`) or the window's end (`finalizing`): the run is cancelled (its queued
        jobs end `cancelled`, none is queued after), running ones finish, then the files. False, and
        nothing done, when the batch is already finalizing or final (too late to stop anything)."""
        if self._all_ended(batch_id):  # nothing left to stop: finalized as it is (review: a cancel
            self._settle(batch_id)  # in the poll's gap turned a batch whose lines all ran `cancelled`)
            return False
        status = "cancelling" if why == "cancelled" else "finalizing"
        if not self.book.move(batch_id, RUNNING, ended_by=why, status=status, **{f"{status}_at": now()}):
            return False
        self.backlog.cancel(batch_id)
        self.log.info("MRC_BATCH_ENDING", batch_id=batch_id, reason=why)
        return True

    def _all_ended(self, batch_id: str) -> bool:
        """Every line is queued (the run's enqueue is over) and every request has ended."""
        run = self.backlog.runs.get(batch_id)
        return run.get("state") == "enqueued" and self.tally(batch_id).pending == 0

    def _begin(self, batch_id: str, what: str, work: Callable[[str, Callable[[], None]], None]) -> None:
        """Run `work` on a thread of its own, if this process takes the batch's lease for it."""
        ttl = ENQUEUE_LEASE_S if what == "enqueue" else FINALIZE_LEASE_S
        if not self._work.acquire(blocking=False):
            return  # busy: a later pass
        token = self.book.lease(batch_id, what, ttl)
        if token is None:
            self._work.release()
            return

        def renew() -> None:
            if self._stop.is_set() or not self.book.renew(batch_id, what, token, ttl):
                raise _Stopped(what)

        def run() -> None:
            try:
                work(batch_id, renew)
            except _Stopped:
                pass
            except _InputGone:  # someone deleted runs/<batch_id>/input.jsonl: nothing left to run
                self._fail(batch_id, "input_missing", "the batch's copy of its input file is gone")
            except Exception as exc:  # Redis or S3 failing: the lease lapses and a later pass resumes
                self.log.warning("MRC_BATCH_WORK_FAILED", batch_id=batch_id, work=what, error=repr(exc)[:300])
            finally:
                self._work.release()
                # Redis away, or the process stopping with its connections closed under a batch in
                # flight (CI): the lease lapses by itself, and a later pass resumes the batch.
                with contextlib.suppress(Exception):
                    self.book.release(batch_id, what, token)

        threading.Thread(target=run, name=f"mrc-batch-{what}", daemon=True).start()

    # ------------------------------------------------------------------ enqueue
    def _enqueue(self, batch_id: str, renew: Callable[[], None]) -> None:
        record = self.book.get(batch_id)
        # Whole indexes only: a chunk with a partial one is queued again (what it queued stays, once).
        try:
            done, _partial = chunk_index.listed(self.backlog.files.list_keys(self._key(batch_id, "index/")))
        except BucketMissing as exc:  # the bucket went, and the batch's copy of its input with it
            raise _InputGone from exc
        # A chunk the replicas did not confirm is gone over line by line: a failover may have lost any
        # of its jobs (review, helper-77: its lines were blanked, and its index written empty).
        done -= unconfirmed_chunks(self.backlog.runs.get(batch_id))
        seen = first_lines(self.backlog.entries(batch_id))

        def on_group() -> None:
            renew()
            if self.backlog.runs.cancelled(batch_id):
                raise _Stopped("cancelled")
            self._started(batch_id)  # its first requests go in now

        translator = Translator(
            self.backlog.intake,
            record["endpoint"],
            record.get("api_key") or None,
            self.models.known(),
            done,
            seen,
            on_group,
        )
        lines = translator.lines(self._input(batch_id))
        try:
            self.backlog.enqueue(
                lines,
                batch_id,
                f"openai:{record['input_file_id']}",
                on_progress=lambda _p: renew(),
                parse=translator.parse,
            )
        except UsageError as exc:  # cancelled while it enqueued: what was queued is in the index
            self.log.info("MRC_BATCH_ENQUEUE_STOPPED", batch_id=batch_id, reason=exc.message[:200])

    # ------------------------------------------------------------------ counts
    def tally(self, batch_id: str) -> Tally:
        tally = Tally()
        cancelled = self.backlog.runs.cancelled(batch_id)
        fields = ["state", "error_code", "cancelled", *usage_book.RECORD_FIELDS]
        for group in manifest.batched(self.backlog.entries(batch_id), 1000):
            tally.failed += sum(1 for entry in group if "invalid" in entry)
            ids = [entry["job_id"] for entry in group if "job_id" in entry]
            with self._redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hmget(names.job_key(job_id), fields)
                records = pipe.execute()
            for state, code, marked, *_usage in records:
                if state == "succeeded" or (state == "failed" and code == "answer_incomplete"):
                    tally.completed += 1
                elif state in ("queued", "running") and not (state == "queued" and (cancelled or marked)):
                    tally.pending += 1
                elif state == "failed":
                    tally.failed += 1
            usage_book.add_records(tally.usage, [list(r[3:]) for r in records])
        return tally

    def counts(self, record: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
        """(request_counts, usage) of a batch: kept once final, counted now before."""
        if record.get("status") in FINAL and record.get("request_counts"):
            return json.loads(record["request_counts"]), json.loads(record.get("usage") or "{}")
        tally = self.tally(record["id"])
        total = int(record.get("lines", 0))
        return {"total": total, "completed": tally.completed, "failed": tally.failed}, tally.usage

    # ------------------------------------------------------------------ finalize
    def _finalize(self, batch_id: str, renew: Callable[[], None]) -> None:
        Output(self.backlog, self.book, self.files, self._input).write(batch_id, renew)

    def _input(self, batch_id: str) -> Iterator[tuple[int, bytes]]:
        """The batch's copy of its input file, line by line."""
        try:
            body = self.files.connection.call(
                "get_object", Bucket=self.files.bucket, Key=input_key(self.settings.s3_prefix, batch_id)
            )["Body"]
        except ClientError:
            raise _InputGone from None
        return read_s3_lines(body, max_line_bytes(self.settings))

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        ended = {"status": "failed", "failed_at": now(), "errors": json.dumps(errors)}
        if not self.book.update_unless_final(batch_id, **ended):
            # another process finalized it meanwhile (and dropped its input copy, which is why this
            # one found it gone): its end stands (review, helper-117: `cancelled` became `failed`)
            return
        # Its run ends too: left `enqueuing`, it counted as a batch still going for its record's 30
        # days (mrc_backlog_runs_active, MrcBatchNearItsWindow: review, helper-101); what is still
        # queued of it is stopped first, not run and counted for a batch said failed (helper-102).
        with contextlib.suppress(Exception):
            self.backlog.cancel(batch_id)
        self.backlog.runs.update(batch_id, state="failed")
        self.book.settle(batch_id)
        drop_input_copy(self.backlog, input_key(self.settings.s3_prefix, batch_id))
        self.log.warning("MRC_BATCH_DONE", batch_id=batch_id, status="failed", reason=code)

    def _key(self, batch_id: str, name: str) -> str:
        return names.run_key(self.settings.s3_prefix, batch_id, name)


def first_lines(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Each custom id an earlier pass indexed, and the first line that named it. The first, not the
    last: a resumed pass reads the interrupted chunk again, and a line refused as naming an id a line
    before it had named must be refused again, not taken for the id's own line (review, helper-89:
    kept last, the refused duplicates of a chunk cut short were queued and ran on a resume)."""
    seen: dict[str, int] = {}
    for entry in entries:
        if entry.get("custom_id"):
            custom_id, line = str(entry["custom_id"]), int(entry["line"])
            seen[custom_id] = min(line, seen.get(custom_id, line))
    return seen
