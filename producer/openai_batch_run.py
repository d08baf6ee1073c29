"""What moves a batch along, in every mrc-api process (a keeper thread, every MRC_OPENAI_BATCH_POLL_S):

- `validating` / `in_progress`: its lines are enqueued as a backlog run (producer/openai_batch_lines.py)
  by whichever process holds its `enqueue` lease; a process that died leaves a lease that expires,
  and the next look resumes the run (chunks already queued are not queued again). `in_progress` once
  a chunk is queued.
- Every request ended (or, after a cancel or the window's end, every one that was running): the
  `finalize` lease's holder writes the output and error files, then the batch is final.

The files: every non-blank input line ends in exactly one of them, in input order: the output file
holds the requests answered 200 (`response.body` = the chat.completion), the error file the rest, each
with what `POST /v1/chat/completions` would have answered (`response.status_code`, `response.body` =
the error), or, for a request the batch never ran, `response: null` and `error.code`
`batch_cancelled` / `batch_expired`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from producer import manifest
from producer.backlog import Backlog
from producer.openai_batch_book import FINAL, BatchBook, now
from producer.openai_batch_lines import Translator, max_line_bytes, read_s3_lines
from producer.openai_chat import Models, completion
from producer.openai_files import Files, new_file_id
from shared import logs, names
from shared import usage as usage_book
from shared.errors import UsageError
from shared.records import unstored_result

ENQUEUE_LEASE_S, FINALIZE_LEASE_S = 60, 600
_GROUP = 500
_READ_THREADS = 16
_ENDED = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


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


class Runner:
    def __init__(self, backlog: Backlog, book: BatchBook, files: Files, models: Models, redis: Any) -> None:
        self.backlog, self.book, self.files, self.models = backlog, book, files, models
        self.client, self.settings, self._redis = backlog.client, backlog.settings, redis
        self.log = logs.get_logger()
        self._stop = threading.Event()
        self._work = threading.BoundedSemaphore(4)  # enqueues and finalizes at once in this process
        self._thread: threading.Thread | None = None
        self._quiet_until = 0.0

    # ------------------------------------------------------------------ the keeper
    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name="mrc-batch-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _keep(self) -> None:
        while not self._stop.wait(self.settings.openai_batch_poll_s):
            try:
                for batch_id in self.book.active():
                    self.advance(batch_id)
            except Exception as exc:  # Redis or S3 away: the next pass tries again; logged once a minute
                if time.monotonic() >= self._quiet_until:
                    self._quiet_until = time.monotonic() + 60
                    self.log.warning("MRC_BATCH_KEEPER_ERROR", error=repr(exc)[:300])

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
            self.book.update(batch_id, ended_by="cancelled", status="cancelling", cancelling_at=now())
            return
        if status == "validating" and int(run.get("lines", 0)) > 0:
            self.book.update(batch_id, status="in_progress", in_progress_at=now())
        if run.get("state") == "enqueuing":
            self._begin(batch_id, "enqueue", self._enqueue)
        elif run.get("state") == "enqueued" and self.tally(batch_id).pending == 0:
            self.book.update(batch_id, status="finalizing", finalizing_at=now())
            self._begin(batch_id, "finalize", self._finalize)

    def end(self, batch_id: str, why: str) -> None:
        """A cancel (`cancelling`) or the window's end (`finalizing`): the run is cancelled (its queued
        jobs end `cancelled`, none is queued after), running ones finish, then the files."""
        status = "cancelling" if why == "cancelled" else "finalizing"
        self.book.update(batch_id, ended_by=why, status=status, **{f"{status}_at": now()})
        self.backlog.cancel(batch_id)
        self.log.info("MRC_BATCH_ENDING", batch_id=batch_id, reason=why)

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
            except Exception as exc:  # Redis or S3 failing: the lease lapses and a later pass resumes
                self.log.warning("MRC_BATCH_WORK_FAILED", batch_id=batch_id, work=what, error=repr(exc)[:300])
            finally:
                self.book.release(batch_id, what, token)
                self._work.release()

        threading.Thread(target=run, name=f"mrc-batch-{what}", daemon=True).start()

    # ------------------------------------------------------------------ enqueue
    def _enqueue(self, batch_id: str, renew: Callable[[], None]) -> None:
        record = self.book.get(batch_id)
        done = {manifest.chunk_number(k) for k in self.backlog.files.list_keys(self._key(batch_id, "index/"))}
        seen = {
            str(e["custom_id"]): int(e["line"]) for e in self.backlog.entries(batch_id) if e.get("custom_id")
        }

        def on_group() -> None:
            renew()
            if self.backlog.runs.cancelled(batch_id):
                raise _Stopped("cancelled")
            if self.book.get(batch_id).get("status") == "validating":  # its first requests go in now
                self.book.update(batch_id, status="in_progress", in_progress_at=now())

        translator = Translator(
            self.client,
            record["endpoint"],
            record.get("api_key") or None,
            self.models.known(),
            done,
            seen,
            on_group,
        )
        body = self.files.connection.call(
            "get_object", Bucket=self.files.bucket, Key=input_key(self.settings.s3_prefix, batch_id)
        )["Body"]
        lines = translator.lines(read_s3_lines(body, max_line_bytes(self.settings)))
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
        record = self.book.get(batch_id)
        if record.get("status") in FINAL:
            return
        began = time.monotonic()
        ended_by = record.get("ended_by", "")
        counts: Counter[str] = Counter()
        usage = usage_book.empty_sums()
        sizes = {"output": 0, "errors": 0}
        models: list[str] = []
        with tempfile.SpooledTemporaryFile(8 << 20, mode="w+", encoding="utf-8") as errors:

            def output_lines() -> Iterator[str]:
                for kind, line, result in self._outcomes(batch_id, ended_by, renew):
                    text = json.dumps(line, ensure_ascii=False) + "\n"
                    counts[kind] += 1
                    counts["jobs"] += 1 if (line.get("response") or {}).get("request_id") else 0
                    sizes[kind] += len(text.encode())
                    if result is not None:
                        _add_usage(usage, result)
                        models[:] = models or [str((result.get("model") or {}).get("id") or "")]
                    if kind == "output":
                        yield text
                    else:
                        errors.write(text)

            output_key = self._key(batch_id, "openai_output.jsonl")
            errors_key = self._key(batch_id, "openai_errors.jsonl")
            self.backlog.files.write_lines(output_key, output_lines())
            errors.seek(0)
            self.backlog.files.write_lines(errors_key, errors)
        owner = record["owner"]
        done = {"output_file_id": "", "error_file_id": ""}
        for kind, key, name in (("output", output_key, "output"), ("errors", errors_key, "error")):
            if counts[kind]:
                file_id = self.book.set_if_absent(batch_id, f"{name}_file_planned", new_file_id())
                self.files.add_output(owner, file_id, key, sizes[kind], f"{batch_id}_{name}.jsonl")
                done[f"{name}_file_id"] = file_id
        final = {"cancelled": "cancelled", "expired": "expired"}.get(ended_by) or (
            "completed" if counts["jobs"] else self._all_refused(batch_id)
        )
        result_counts = {
            "total": counts["output"] + counts["errors"],
            "completed": counts["output"],
            "failed": counts["errors"],
        }
        self.book.update(
            batch_id,
            **done,
            status=final,
            **{f"{final}_at": now()},
            request_counts=json.dumps(result_counts),
            usage=json.dumps(usage),
            model=models[0] if models else "",
        )
        self.book.settle(batch_id)
        self.log.info(
            "MRC_BATCH_DONE",
            batch_id=batch_id,
            status=final,
            completed=counts["output"],
            failed=counts["errors"],
            seconds=round(time.monotonic() - began, 3),
        )

    def _all_refused(self, batch_id: str) -> str:
        errors = {
            "object": "list",
            "data": [
                {
                    "code": "no_valid_requests",
                    "line": None,
                    "param": None,
                    "message": "no line of the input file is a request mrc runs; the error file says why",
                }
            ],
        }
        self.book.update(batch_id, errors=json.dumps(errors))
        return "failed"

    def _outcomes(
        self, batch_id: str, ended_by: str, renew: Callable[[], None]
    ) -> Iterator[tuple[str, dict[str, Any], dict[str, Any] | None]]:
        """(output | errors, the file's line, the job's result) for every non-blank input line, in order."""
        body = self.files.connection.call(
            "get_object", Bucket=self.files.bucket, Key=input_key(self.settings.s3_prefix, batch_id)
        )["Body"]
        lines = ((n, raw) for n, raw in read_s3_lines(body, max_line_bytes(self.settings)) if raw.strip())
        entries = iter(self.backlog.entries(batch_id))
        entry = next(entries, None)
        with ThreadPoolExecutor(_READ_THREADS) as pool:
            for group in manifest.batched(lines, _GROUP):
                renew()
                items = []
                for number, raw in group:
                    while entry is not None and int(entry["line"]) < number:
                        entry = next(entries, None)
                    items.append(
                        (number, raw, entry if entry is not None and entry["line"] == number else None)
                    )
                for (number, raw, mine), result in zip(items, pool.map(self._result_of, items), strict=True):
                    yield (*_line(batch_id, number, raw, mine, result, ended_by), result)

    def _result_of(self, item: tuple[int, bytes, dict[str, Any] | None]) -> dict[str, Any] | None:
        entry = item[2]
        if entry is None or "job_id" not in entry:
            return None
        job_id = str(entry["job_id"])
        result = self.client.result(job_id)
        if result is None:  # ended without a stored result: its record says how
            record = self.client.records.get(job_id)
            if record.get("state") == "failed" and record.get("error_code"):
                return unstored_result(job_id, record)
        return result

    def _key(self, batch_id: str, name: str) -> str:
        return names.run_key(self.settings.s3_prefix, batch_id, name)


def _add_usage(sums: dict[str, int], result: dict[str, Any]) -> None:
    used = result.get("usage") or {}
    row = [
        str(used.get("prompt_tokens", 0)),
        str(used.get("image_tokens", 0)),
        str(used.get("completion_tokens", 0)),
        "1" if result.get("cache_hit") else "0",
    ]
    usage_book.add_records(sums, [list(row)])


def _line(
    batch_id: str,
    number: int,
    raw: bytes,
    entry: dict[str, Any] | None,
    result: dict[str, Any] | None,
    ended_by: str,
) -> tuple[str, dict[str, Any]]:
    """One input line's line in the output or the error file."""
    line_id = "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:24]
    custom_id = (entry or {}).get("custom_id") or _custom_id(raw)
    base = {"id": line_id, "custom_id": custom_id}
    never_ran = {
        **base,
        "response": None,
        "error": {
            "code": _ENDED.get(ended_by, "batch_cancelled"),
            "message": f"the batch was {ended_by or 'cancelled'} before this request ran",
        },
    }
    if entry is None:
        return "errors", never_ran
    if "invalid" in entry:
        status, error = _refusal(str(entry["invalid"]))
        return "errors", {
            **base,
            "response": {"status_code": status, "request_id": None, "body": {"error": error}},
            "error": None,
        }
    code = ((result or {}).get("error") or {}).get("code")
    if result is None or code == "cancelled":
        return "errors", never_ran if ended_by or code == "cancelled" else {
            **base,
            "response": None,
            "error": {"code": "result_missing", "message": "the job has no result"},
        }
    status, body = completion(result)
    response = {"status_code": status, "request_id": entry["job_id"], "body": body}
    return ("output" if status == 200 else "errors"), {**base, "response": response, "error": None}


def _refusal(reason: str) -> tuple[int, dict[str, Any]]:
    """A refused line's answer: the translation's own ({status, error}), or a backlog reason as 400."""
    try:
        data = json.loads(reason)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return int(data.get("status", 400)), dict(data["error"])
    return 400, {"message": reason, "type": "invalid_request_error", "param": None, "code": "invalid_request"}


def _custom_id(raw: bytes) -> str | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    value = data.get("custom_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
