"""What a backlog run says once it is queued, read from its index (`runs/<run_id>/index/`, in
manifest order) and its jobs' records and results, without holding the run in memory: `status`
(counts, rate, usage), `report` (results.jsonl and errors.jsonl, streamed), `cancel`."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from producer.backlog import chunk_index, manifest
from producer.queue.sender import Queue
from shared import encoding, names
from shared import usage as usage_book
from shared.errors import BucketMissing, StoreUnavailable, UsageError
from shared.jobs import now_rfc3339, parse_rfc3339
from shared.records import RECORD_TTL_S, TERMINAL
from shared.runs import RUN_TTL_S, RunRecords
from shared.settings import Settings
from shared.stores import RunFiles

_READ_THREADS = 16


_CANCELLED_AT = "cancelled_at"


class RunReader:
    """The reading half of a backlog run (producer/backlog/run.py `Backlog` is the writing half)."""

    queue: Queue
    runs: RunRecords
    files: RunFiles
    settings: Settings

    def entries(self, run_id: str) -> Iterator[dict[str, Any]]:
        """The run's index in manifest order: {"line", "custom_id", "job_id"} or {"line", "invalid"}."""
        for key in chunk_index.readable(self.files.list_keys(self._key(run_id, "index/"))):
            yield from chunk_index.entries_of(self.files.get_text(key) or "")

    def status(self, run_id: str) -> dict[str, Any]:
        run = self._run(run_id, indexed=True)
        states: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        recent = invalid = cancelling = 0  # cancelling: of the queued, apart from the states' sum
        last_end = 0.0  # when the run's last job ended
        since = time.time() - 60
        usage = usage_book.empty_sums()
        seen: set[str] = set()  # a line repeated is one job: counted, and its tokens summed, once
        unrecorded: list[str] = []
        for batch in manifest.batched(self.entries(run_id), 1000):
            invalid += sum(1 for e in batch if "invalid" in e)
            ids = [e["job_id"] for e in batch if "job_id" in e and e["job_id"] not in seen]
            ids = list(dict.fromkeys(ids))
            seen.update(ids)
            usage_book.add_records(usage, self.runs.usage(ids))
            for job_id, (state, code, updated, marked) in zip(ids, self.runs.states(ids), strict=True):
                states[state or "unknown"] += 1
                if state is None:
                    unrecorded.append(job_id)
                if marked and state == "queued":  # a cancelled run's: ends `cancelled` once a worker looks
                    cancelling += 1
                if state == "failed":
                    codes[code or "unknown"] += 1
                ended = parse_rfc3339(updated).timestamp() if state in TERMINAL and updated else 0.0
                recent += ended >= since
                last_end = max(last_end, ended)
        jobs = sum(states.values())
        left = states["queued"] + states["running"]
        # Over the last minute, or over the run's own time while it is younger (review: a run seconds
        # old read a sixtieth of its rate per second of age, its ETA that many times too long).
        created = run.get("created_at") or self._started(run_id)
        age = time.time() - parse_rfc3339(created).timestamp() if created else 60.0
        rate = recent / min(60.0, max(1.0, age))
        over = run.get("state") == "enqueued"  # every line queued (a pass cut short leaves some unqueued)
        if not left and over and last_end and created:
            # Over: its own rate, from its start to its last end (the last minute's fell with every
            # second after it ended; review, helper-110).
            span = last_end - parse_rfc3339(created).timestamp()
            rate = (states["succeeded"] + states["failed"]) / max(span, 0.001)
        # Jobs without a record are done only once records have expired (7 days): a younger run's
        # were lost with Redis's data, and running it again queues them (review, helper-63: "done"),
        # unless their result is stored (review, helper-78: counted lost, and a --wait ran a pass).
        lost = self._without_result(unrecorded) if age < RECORD_TTL_S else 0
        settled = not lost
        if "created_at" not in run:  # gone (or made anew by a worker's count, or by a cancel)
            state = "cancelled" if run.get("state") == "cancelled" else self._gone(run_id)
        elif not left and settled and run.get("state") == "enqueued":  # no jobs: every line invalid
            state = "done"
        else:
            state = run.get("state", "expired")
        return {
            "run_id": run_id,
            "state": state,
            "created_at": created,
            "lines": int(run.get("lines", 0)),
            "jobs": jobs,
            "queued": states["queued"],
            "cancelling": cancelling,  # of `queued`: marked cancelled, never run (review)
            "running": states["running"],
            "succeeded": states["succeeded"],
            "failed": states["failed"],
            "failed_by_code": dict(codes),
            "unknown": states["unknown"],  # records expired (after 7 days): the results say
            # of those, in a run younger than its jobs' records and without a result: lost with Redis's
            # data (a pass of the run queues them again)
            "lost": lost,
            "invalid_lines": invalid,
            "rate_per_s": round(rate, 2),
            # none while lines wait unqueued and no pass queues them (its --timeout, a full lane's --no-block)
            "eta_s": round(left / rate, 1) if rate > 0 and (left or over) else None,
            "usage": usage,  # the finished jobs' tokens (their results' `usage`, summed)
        }

    def cancel(self, run_id: str) -> int | None:
        """Stop a run: jobs not started yet end failed with `cancelled`; returns how many of those were
        in the run's index (an enqueue still going marks its last, unindexed part itself: `status`
        counts every one as `cancelling` until a worker ends it). None, and nothing marked, for a run
        that is done: there is nothing to stop, and a cancel mark would refuse for good the run again
        that makes it whole after Redis lost its data (review, helper-92), or one that failed (a batch
        whose input went: helper-102, a cancel turned it `cancelled` where the batch said `failed`)."""
        self._run(run_id)
        try:
            if self.status(run_id)["state"] in ("done", "failed"):
                return None
        except StoreUnavailable:  # S3 away: the run is stopped all the same (review, helper-94: an
            pass  # OpenAI batch's cancel then marked nothing, and its jobs all ran)
        # An enqueue in progress stops at its next job (the enqueue step reads this state), marks what it
        # queued of its chunk, and workers fail any job of a cancelled run that is still unmarked.
        self.runs.update(run_id, state="cancelled")
        cancelled = 0
        # The index read before the mark is written: a bucket gone with the index is said (exit 5), not
        # made again by the mark and read as a run of nothing, "cancelled 0" (review, helper-82). The
        # state above has stopped the run's jobs either way.
        for batch in manifest.batched(self.entries(run_id), 1000):
            cancelled += self.runs.cancel_many([e["job_id"] for e in batch if "job_id" in e])
        # Kept beside the index too: a pass after Redis lost the record finds it (review, helper-78: a
        # --wait's pass queued a cancelled run's 100 jobs again).
        self.files.put_text(self._key(run_id, _CANCELLED_AT), now_rfc3339())
        self.runs.count(run_id, cancelled=cancelled)
        return cancelled

    def report(self, run_id: str) -> dict[str, Any]:
        """Write results.jsonl (one line per valid manifest line, in order) and errors.jsonl (invalid
        lines and failed jobs), streaming; returns their URIs and the counts."""
        run = self._run(run_id, indexed=True)
        counts: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        last_finish: list[str] = []
        with tempfile.SpooledTemporaryFile(8 << 20, mode="w+", encoding="utf-8") as errors:

            def rows() -> Iterator[str]:
                with ThreadPoolExecutor(_READ_THREADS) as pool:
                    for batch in manifest.batched(self.entries(run_id), 1000):
                        results = pool.map(self._result_of, batch)
                        for entry, result in zip(batch, results, strict=True):
                            if "invalid" in entry:
                                counts["invalid"] += 1
                                errors.write(encoding.to_text(entry) + "\n")
                                continue
                            row = _result_row(entry, result, self.queue.results.result_uri(entry["job_id"]))
                            counts[row["status"]] += 1
                            if row["status"] == "failed":
                                codes[(row["error"] or {}).get("code", "unknown")] += 1
                                errors.write(encoding.to_text({"line": entry["line"], **row}) + "\n")
                            if result and result.get("finished_at"):
                                last_finish[:] = [max([result["finished_at"], *last_finish])]
                            yield encoding.to_text(row) + "\n"

            results_uri = self.files.write_lines(self._key(run_id, "results.jsonl"), rows())
            errors.seek(0)
            errors_uri = self.files.write_lines(self._key(run_id, "errors.jsonl"), errors)
        wall = None
        if last_finish and run.get("created_at"):
            wall = (parse_rfc3339(last_finish[0]) - parse_rfc3339(run["created_at"])).total_seconds()
        done = counts["succeeded"] + counts["failed"]
        state = run["state"] if "created_at" in run and "state" in run else self._gone(run_id)
        if state == "enqueued" and not counts["pending"]:
            state = "done"  # as `status` says it (review, helper-79: a --wait's last line said "enqueued")
        return {
            "run_id": run_id,
            "state": state,
            "results": results_uri,
            "errors": errors_uri,
            "counts": dict(counts),
            "failed_by_code": dict(codes),
            "wall_s": round(wall, 1) if wall is not None else None,
            "images_per_s": round(done / wall, 2) if wall else None,
        }

    def _without_result(self, job_ids: list[str]) -> int:
        """How many of `job_ids` have no result stored; one found is remembered (a --wait asks again)."""
        found: set[str] = self.__dict__.setdefault("_with_result", set())
        look = [job_id for job_id in job_ids if job_id not in found]
        with ThreadPoolExecutor(_READ_THREADS) as pool:
            stored = list(pool.map(self.queue.results.has_result, look))
        found.update(job_id for job_id, has in zip(look, stored, strict=True) if has)
        return sum(1 for job_id in job_ids if job_id not in found)

    def cancel_marked(self, run_id: str) -> bool:
        """Whether the run was cancelled, as kept beside its index (whatever Redis still holds)."""
        return self.files.get_text(self._key(run_id, _CANCELLED_AT)) is not None

    def _gone(self, run_id: str) -> str:
        """The state of a run without its record: `cancelled` if it was, `lost` with Redis's data
        within its 30 days, else `expired` (review, helper-76: "expired" for a run a minute old)."""
        if self.cancel_marked(run_id):
            return "cancelled"
        began = self._started(run_id)
        return "lost" if began and time.time() - parse_rfc3339(began).timestamp() < RUN_TTL_S else "expired"

    def _started(self, run_id: str) -> str | None:
        """When the run began, from the mark its first pass left beside its index; None if none."""
        mark = (self.files.get_text(self._key(run_id, "started_at")) or "").strip()
        try:
            parse_rfc3339(mark)
        except ValueError:
            return None
        return mark

    def _result_of(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        return None if "job_id" not in entry else self.queue.settled_result(entry["job_id"])

    def _run(self, run_id: str, indexed: bool = False) -> dict[str, str]:
        """The run's record; `indexed`: {} for a run whose record expired (30 days) and whose index is
        still in S3, which is all `status` and `report` need (review, helper-74: "no backlog run")."""
        run = self.runs.get(run_id)
        if run:
            return run
        try:
            indexed_at_all = next(iter(self.files.list_keys(self._key(run_id, "index/"))), None) is not None
        except BucketMissing:  # no record and no bucket: no run (a recorded run's index gone is said)
            indexed_at_all = False
        if not indexed_at_all:
            raise UsageError(f"no backlog run {run_id[:70]!r} (no record, and no index in S3)")
        if not indexed and self._gone(run_id) != "lost":  # cancel: its jobs' records (7 days) went
            raise UsageError(  # before the run's (review, helper-75); a lost record's may be queued still
                f"run {run_id[:70]!r} has expired (its record and its jobs' are gone): nothing to cancel"
            )
        return {}

    def _key(self, run_id: str, name: str) -> str:
        return names.run_key(self.settings.s3_prefix, run_id, name)

    def _index_key(self, run_id: str, chunk: int) -> str:
        return chunk_index.key_of(self._key(run_id, "index/"), chunk)


def _result_row(entry: dict[str, Any], result: dict[str, Any] | None, uri: str) -> dict[str, Any]:
    base = {"custom_id": entry["custom_id"], "job_id": entry["job_id"]}
    if result is None:
        return {**base, "status": "pending", "text": None, "error": None, "result_uri": None, "output": None}
    return {
        **base,
        "status": result["status"],
        "text": result.get("text"),
        "error": result.get("error"),
        "result_uri": uri,
        "output": result.get("output"),  # structured answers: the parsed JSON, or the choice
    }
