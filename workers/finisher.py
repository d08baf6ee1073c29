"""How a job leaves the worker: its result stored, its record updated, its log line written; or, for a
retryable fault, back to its lane with backoff; or, out of attempts, into the dead-letter list."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from shared import encoding, ops_counts
from shared.errors import Abandoned, InternalError, StoreUnavailable
from shared.jobs import ErrorInfo, JobResult, now_rfc3339, parse_rfc3339
from shared.records import ANSWER_MAX_BYTES, JobRecords
from shared.settings import Settings
from shared.stores import ResultStore
from workers import outcomes
from workers.backends.base import ModelBackend
from workers.cache import ResultCache, prompt_label
from workers.metrics import Metrics
from workers.slots import Slot

Requeue = Callable[[str, object, float], None]  # (request id, job message, delay in seconds)
_WRITE_BACKOFF_S = (0.2, 0.5, 1.0, 2.0)


class Finisher:
    def __init__(
        self,
        backend: ModelBackend,
        results: ResultStore,
        records: JobRecords,
        settings: Settings,
        metrics: Metrics,
        log: Any,
        requeue: Requeue | None = None,
        sleep: Callable[[float], None] = time.sleep,
        cache: ResultCache | None = None,
    ) -> None:
        self.cache = cache
        self.backend = backend
        self.results = results
        self.records = records
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.requeue: Requeue = _no_requeue if requeue is None else requeue
        self.sleep = sleep

    def finish(self, slot: Slot) -> None:
        """Result to S3, then the record, then the log line: in that order, so a record never claims
        a result that is not stored. A retryable fault goes back to the queue until its attempts run out,
        then fails and lands in the dead-letter list."""
        error, last = slot.error, slot.attempts >= self.settings.max_attempts
        if isinstance(error, StoreUnavailable) and self._wait_out(slot, error.message):
            return
        if slot.job is not None and error is not None and error.retryable and not last:
            self._retry(slot, error.code, error.message)
            return
        result = outcomes.build_result(slot, self.backend)
        existing = self._kept(slot) if result.status == "failed" else None
        if existing is not None:
            slot.outcome = "skipped"
            self.log.warning("MRC_SKIPPED", job_id=slot.job_id, reason="result_exists",
                             code=result.error.code if result.error else "")  # fmt: skip
            if slot.job is not None and existing.get("job_fingerprint") in (None, slot.job.fingerprint()):
                # Its record lagged its result (Redis lost the write as the worker ended): settled now,
                # usage and event too, or it says `running` for good and a backlog run never ends.
                self.settle_stored(existing, slot.job.api_key)
            return
        stored = result.to_json_dict()
        if not self._put(slot.job_id, stored):
            unstored = "the result could not be stored"
            if self._wait_out(slot, unstored):
                return
            if slot.job is not None and not last:
                self._retry(slot, "internal_error", unstored)
            else:
                slot.outcome = "unwritten"
                self.records.set_state(
                    slot.job_id, "failed", dead_letter="1", error_code="internal_error",
                    error_message=unstored,
                )  # fmt: skip
                self._unwritten(slot, result, unstored)
                self._dead_letter(slot, "internal_error", unstored)
            return
        slot.outcome = result.status
        # The code in the record too: `mrc backlog status` counts failures by code without S3 reads.
        self.records.set_state(
            slot.job_id,
            result.status,
            answer=_answer(stored),
            **({"error_code": result.error.code} if result.error else {}),
        )
        self._count_usage(slot, result)
        outcomes.report(slot, result, self.metrics, self.log)
        if result.status == "succeeded" and not slot.cache_hit:
            self._remember(slot)
        if error is not None and (error.retryable or isinstance(error, Abandoned)):
            self._dead_letter(slot, error.code, error.message)
        # Last: the event wakes the waits for the job (producer/http/completions.py, Client.wait), and
        # what they may look at next (its log line, metrics, cached answer, dead letter) is written.
        # Its message is acked with its delivery's end, after it.
        self._announce(result)

    def settle_stored(self, stored: dict[str, Any], api_key: str | None) -> None:
        """A succeeded result a worker stored and died before following up (its record still says
        `running`): the record settled, its usage counted (once per job: shared/usage.py) and its
        completion event written, as its own end would have (review: the skip left all three out).
        The record first, and a failure to write it raised (the delivery is then given back, not acked:
        a swallowed one left the record `running` for good, review); usage and event best effort."""
        self.records.set_state(str(stored["job_id"]), "succeeded")
        try:
            result = JobResult.model_validate(stored)
        except Exception as exc:  # a result of an older schema: settled, nothing more to tell from it
            self.log.warning("MRC_SETTLE_FAILED", job_id=str(stored.get("job_id")), error=repr(exc)[:200])
            return
        try:
            self.records.count_usage(
                result.job_id,
                api_key,
                result.usage.model_dump(),
                result.cache_hit,
                ops_counts.Finished(result.lane, result.status, "", _latency_s(result)),
            )
        except Exception as exc:
            self.log.warning("MRC_USAGE_COUNT_FAILED", job_id=result.job_id, error=repr(exc)[:200])
        self._announce(result)

    def _kept(self, slot: Slot) -> dict[str, Any] | None:
        """The stored result a failed outcome must not replace: a succeeded one, or any one for a
        message that is not a valid job (its id may be a real job's). None: write."""
        try:
            existing = self.results.get_result(slot.job_id)
        except StoreUnavailable:
            return None  # writing will meet the same outage, and retry
        if existing is None or (slot.job is not None and existing.get("status") != "succeeded"):
            return None
        return existing

    def _remember(self, slot: Slot) -> None:
        """Only succeeded answers are cached; a cache that is down costs GPU time, never a job."""
        if self.cache is None or slot.cache_key is None or slot.job is None or slot.text is None:
            return
        value = {
            "text": slot.text,
            "output_tokens": slot.output_tokens,
            "finish_reason": slot.finish_reason,
            "prompt_tokens": slot.prompt_positions,  # a hit reports the usage of the answer it reuses
            "label": prompt_label(slot.job.prompt),
        }
        try:
            self.cache.put(slot.cache_key, value, self.settings.cache_ttl_s)
        except Exception as exc:
            self.log.warning("MRC_CACHE_WRITE_FAILED", job_id=slot.job_id, error=repr(exc)[:300])

    def _count_usage(self, slot: Slot, result: JobResult) -> None:
        """The answer's tokens to its key's totals, once per job (shared/usage.py). Best effort, as
        the event: the result (which carries its usage) is the truth."""
        try:
            self.records.count_usage(
                result.job_id,
                slot.job.api_key if slot.job else None,
                result.usage.model_dump(),
                result.cache_hit,
                ops_counts.Finished(
                    result.lane, result.status, result.error.code if result.error else "", _latency_s(result)
                ),
            )
        except Exception as exc:
            self.log.warning("MRC_USAGE_COUNT_FAILED", job_id=result.job_id, error=repr(exc)[:200])

    def _announce(self, result: JobResult) -> None:
        """A completion event for upstream systems that follow the stream instead of polling each job.
        Best effort: the result object is the truth, and a lost event is found by `mrc status`."""
        event = {
            "job_id": result.job_id,
            "status": result.status,
            "result_uri": self.results.result_uri(result.job_id),
            "ticket_id": result.ticket_id or "",
            "lane": result.lane,
            "code": result.error.code if result.error else "",
            "finished_at": result.finished_at,
        }
        try:
            self.records.add_event(event, self.settings.events_max)
        except Exception as exc:  # Redis hiccup after the result is stored: the job is done regardless
            self.log.warning("MRC_EVENT_FAILED", job_id=result.job_id, error=repr(exc)[:200])

    def _wait_out(self, slot: Slot, message: str) -> bool:
        """A job that met S3 away retried without counting the attempt, while its faults are younger
        than MRC_STORE_OUTAGE_S (shared/store_faults.py). False past that: counted as any fault."""
        self.metrics.store_faults.inc()  # the outage's signal, counted or not
        if slot.job is None:
            return False
        retries = self.records.store_fault(slot.job_id, self.settings.store_outage_s)
        if retries < 0:
            return False
        self._retry(slot, "internal_error", message, retries, counted=False)
        return True

    def _retry(self, slot: Slot, code: str, message: str, nth: int = 0, counted: bool = True) -> None:
        """Back to its lane after a delay doubling with the attempts (or with `nth`, the retries an
        S3 outage did not count)."""
        tries = min(nth or slot.attempts, 32)  # an outage's retries are unbounded: 2**1024 overflowed
        base = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (tries - 1))
        delay = round(base * random.uniform(0.5, 1.5), 3)  # jitter: retries of one outage spread out
        self.records.set_state(slot.job_id, "queued", retry_reason=code)
        self.requeue(slot.request_id, slot.body, delay)
        slot.outcome = "retry"
        self.metrics.retries.labels(code=code).inc()
        self.log.warning("MRC_RETRY", job_id=slot.job_id, code=code, message=message[:300],
                         attempts=slot.attempts, delay=delay, counted=counted)  # fmt: skip

    def _unwritten(self, slot: Slot, result: JobResult, message: str) -> None:
        """A job failed for good with no result stored: its MRC_ERROR line and metrics as a failed
        job's (review, helper-93: only MRC_DEAD_LETTER said so, and no job count had it)."""
        error = InternalError(message)
        failed = result.model_copy(update={"status": "failed", "error": ErrorInfo.from_error(error)})
        outcomes.report(slot, failed, self.metrics, self.log)

    def _dead_letter(self, slot: Slot, code: str, message: str) -> None:
        entry = {"job_id": slot.job_id, "code": code, "message": message[:500], "attempts": slot.attempts,
                 "at": now_rfc3339(), "job": slot.body}  # fmt: skip
        self.records.dead_letter(entry)
        self.metrics.dead_letters.inc()
        self.log.error("MRC_DEAD_LETTER", job_id=slot.job_id, code=code, attempts=slot.attempts)

    def _put(self, job_id: str, result: dict[str, Any]) -> bool:
        for delay in (*_WRITE_BACKOFF_S, None):
            try:
                self.results.put_result(job_id, result)
                return True
            except StoreUnavailable as exc:
                self.log.warning("MRC_STORE_RETRY", job_id=job_id, error=exc.message[:300])
                if delay is None:
                    return False
                self.sleep(delay)
        return False


def _latency_s(result: JobResult) -> float | None:
    """Submission to result, for the ops page's latency buckets (None when a time is unreadable)."""
    try:
        return (parse_rfc3339(result.finished_at) - parse_rfc3339(result.submitted_at)).total_seconds()
    except (TypeError, ValueError):
        return None


def _no_requeue(request_id: str, body: object, delay: float) -> None:
    raise InternalError(f"no requeue configured; cannot retry {request_id}")


def _answer(stored: dict[str, Any]) -> str | None:
    """A ticket's result as S3 stores it, kept beside its record for the waits on it (shared/records.py
    ANSWER_TTL_S); None for the backlog's, which no one waits on, and for one too large to keep."""
    if stored.get("lane") != "interactive":
        return None
    body = encoding.to_bytes(stored, separators=(",", ":"))  # the bytes S3 stores, and their size
    return body.decode("utf-8") if len(body) <= ANSWER_MAX_BYTES else None
