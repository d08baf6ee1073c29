"""Whether, and how, a delivered job runs: the job id's history decides.

- A job id holds one job for life (its fingerprint: image, prompt, max_new_tokens). A different job
  under a used id is refused and never overwrites the first one's result.
- A job that already succeeded is not computed again; the result object is the truth when the Redis
  record is gone (expired), says the job ended or a worker died with it (`running`: it may have
  written the result and not the record), or was not checked against S3 by the producer.
- A job whose previous delivery ended with the job in hand (record still `running`: the worker died)
  is a suspect: it runs after the rest of its delivery, in a group with nothing beside it, the groups
  one after another. Each time its worker dies again its group is halved (`suspect_groups`), so a job
  that kills workers is alone after about log2(n) crashes while its innocent neighbours finish in
  company; it alone is abandoned (and dead-lettered) once it killed every worker that ran it alone.
- A job past its deadline expires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any

from shared.errors import Abandoned, Cancelled, Expired, StoreUnavailable
from shared.jobs import Job, parse_rfc3339
from shared.records import JobRecords
from shared.settings import Settings
from shared.stores import ResultStore
from workers.lane_pools import LanePools
from workers.metrics import Metrics
from workers.slots import Slot

_ENDED_OR_UNKNOWN = (None, "succeeded", "failed")
# A delivery's looks for earlier results asked of S3 at once, at most: one after another, a delivery
# of 16 backlog jobs waited 16 round trips (a real S3's ~20 ms each) before any of its rows could start.
LOOKS_AT_ONCE = 16


def _same_job(job: Job, record: dict[str, str]) -> bool:
    """Whether the record, if any, holds this job (its fingerprint): else the id is another job's."""
    return record.get("fingerprint") in (None, "", job.fingerprint())


def _needs_look(record: dict[str, str]) -> bool:
    """Whether a stored result may exist that the record does not tell of. Not for a job submitted
    through the producer, which found none (or drew its id), and never taken since. A `running` record
    is a worker that died with it, a retry one whose look at S3 failed: its result may be stored, its
    record not (review)."""
    state = record.get("state")
    fresh = state not in _ENDED_OR_UNKNOWN and state != "running" and not record.get("retry_reason")
    return not (fresh and record.get("checked") == "1")


class Admission:
    def __init__(
        self,
        records: JobRecords,
        results: ResultStore,
        settings: Settings,
        metrics: Metrics,
        log: Any,
        worker: str = "",
        settle: Callable[[dict[str, Any], str | None], None] = lambda _result, _key: None,
    ) -> None:
        self.worker = worker  # this worker's name, kept in the records of the jobs it runs
        # What a job's end would have written after its result (record, usage, event), for a result a
        # dead worker stored and never followed up (workers/finisher.py `settle_stored`).
        self.settle = settle
        self.records = records
        self.results = results
        self.settings = settings
        self.metrics = metrics
        self.log = log
        # a pool per lane: a ticket's look never queues behind a backlog delivery's (review, helper-121)
        self._looks = LanePools(LOOKS_AT_ONCE, "-look", decodes=False)

    def close(self) -> None:
        self._looks.shutdown()

    def admit(self, slots: Iterable[Slot]) -> None:
        """Claim each parsed job for this delivery, or settle it (skipped, expired) without running.
        The delivery's records are read in one round trip and its attempts counted in another."""
        now = datetime.now(UTC)
        parsed = [slot for slot in slots if slot.job is not None]
        records = self.records.get_many([slot.job_id for slot in parsed])
        seen: set[str] = set()
        running: list[Slot] = []
        # `mrc backlog cancel` marks the run's queued jobs; they end failed (`cancelled`), not run
        cancelled = {s.job_id for s, r in zip(parsed, records, strict=True) if is_cancelled(r)}
        looks = self._look_all(parsed, records)
        for slot, record in zip(parsed, records, strict=True):
            assert slot.job is not None
            if slot.job_id in seen:  # two copies in one delivery (a redelivery met its original)
                self._skip(slot, "duplicate_in_delivery")
                continue
            seen.add(slot.job_id)
            if self._settled(slot, slot.job, record, looks.get(slot.job_id)):
                continue
            slot.suspect = record.get("state") == "running"
            slot.solo_runs = int(record.get("solo_runs", "0"))
            slot.suspect_group = int(record.get("suspect_group", "0"))
            running.append(slot)
        for slot, attempts in zip(
            running, self.records.begin_many([s.job_id for s in running], self.worker), strict=True
        ):
            assert slot.job is not None
            slot.attempts = attempts
            self._judge(slot, slot.job_id in cancelled, now)

    def recheck(self, group: list[Slot]) -> None:
        """After a wait for the worker to itself (a lone run waits for the deliveries in hand): a job
        cancelled or past its deadline meanwhile is not run."""
        now = datetime.now(UTC)
        for slot, record in zip(group, self.records.get_many([s.job_id for s in group]), strict=True):
            self._judge(slot, is_cancelled(record), now)

    def _judge(self, slot: Slot, cancelled: bool, now: datetime) -> None:
        assert slot.job is not None
        deadline = self._deadline(slot.job)
        if slot.error is None and cancelled:
            slot.error = Cancelled("its backlog run was cancelled before the job ran")
        elif slot.error is None and deadline is not None and deadline < now:
            slot.error = Expired(f"deadline {deadline.isoformat()} passed before the job ran")

    def start_group(self, group: list[Slot]) -> None:
        """Before suspects run together: record the group's size (its jobs run in halves of it if their
        worker dies again) and count a lone run, the worker its own from here to its result
        (workers/solo_gate.py), so a death from its photo's fetch on is its own. A job abandoned
        (`abandon_spent`) is neither."""
        if len(group) == 1 and (self.abandon_spent(group[0]) or not group[0].live):
            return  # abandoned, or cancelled or expired while it waited: runs nothing
        for slot in group:
            slot.group_size = len(group)
        if len(group) == 1:
            self.records.solo_run(group[0].job_id)
            group[0].lone_counted = True
        self.records.suspect_group([slot.job_id for slot in group], len(group))

    def abandon_spent(self, slot: Slot) -> bool:
        """A job to run alone that every lone run so far lost (MRC_MAX_ATTEMPTS - 1 of them) is
        abandoned instead: True, its error set (it needs the worker to itself no more)."""
        if slot.error is None and slot.solo_runs >= max(1, self.settings.max_attempts - 1):
            slot.error = Abandoned(
                f"abandoned: {slot.solo_runs} workers that ran this job alone died before it finished "
                f"(delivered {slot.attempts} times, this one included: the result's attempts); "
                "requeue it with `mrc dlq requeue` once fixed"
            )
        return isinstance(slot.error, Abandoned)

    def group_ended(self, group: list[Slot]) -> None:
        """The group's run ended with the worker alive (its results written, or a fault not the job's
        ending the worker): a lone run counted as it began is withdrawn. `solo_runs` counts the lone
        runs the worker died in; one that ended, or never reached the model (a failed fetch, a cached
        answer), or came back for a retry, must not count against the job's next suspicion."""
        for slot in group:
            if slot.lone_counted:
                slot.lone_counted = False
                try:
                    self.records.withdraw_solo_run(slot.job_id)
                except Exception as exc:
                    self.log.warning("MRC_SUSPECT_RUN_KEPT", job_id=slot.job_id, error=repr(exc)[:200])

    def _look_all(
        self, slots: list[Slot], records: list[dict[str, str]]
    ) -> dict[str, Future[dict[str, Any] | None]]:
        """The earlier results the delivery's jobs need looked up, asked of S3 at once (a single one
        is asked where it is judged: no hop to a thread for a ticket)."""
        wanted = {
            slot.job_id: slot
            for slot, record in zip(slots, records, strict=True)
            if slot.job is not None and _same_job(slot.job, record) and _needs_look(record)
        }
        if len(wanted) <= 1:
            return {}
        return {
            job_id: self._looks.submit(slot, self.results.get_result, job_id)
            for job_id, slot in sorted(wanted.items())
        }

    def _settled(
        self, slot: Slot, job: Job, record: dict[str, str], look: Future[dict[str, Any] | None] | None
    ) -> bool:
        if not _same_job(job, record):
            return self._skip(slot, "job_id_reused")
        if not _needs_look(record):
            return False
        state = record.get("state")
        fingerprint = job.fingerprint()
        try:
            existing = look.result() if look is not None else self.results.get_result(slot.job_id)
        except StoreUnavailable as exc:
            # A record says `succeeded` only after its result is stored: done, S3 away or not (review:
            # it was retried, failed over its success at its last attempt, and counted twice once
            # requeued). Otherwise it cannot tell whether it ran: retried, never run blind.
            if state == "succeeded":
                return self._skip(slot, "already_succeeded")
            slot.error = exc  # waited out (workers/finisher.py): S3 away is not the job's fault
            return False
        if existing is None:
            return False
        if existing.get("job_fingerprint") not in (None, fingerprint):
            return self._skip(slot, "job_id_reused")
        if existing.get("status") == "succeeded":
            # Its worker died between the result and the record, or between the record and its count
            # (review, helper-93: `succeeded` uncounted for good, its run "running" on the ops page).
            if state not in _ENDED_OR_UNKNOWN or (state == "succeeded" and not record.get("usage_counted")):
                self.settle(existing, job.api_key)
            return self._skip(slot, "already_succeeded")
        if record.get("state") == "failed":
            # Its failure was written and its delivery died before the ack (a neighbour killed the
            # worker): the outcome stands, written once. A requeued dead letter or a resubmission of
            # the job says `queued` and runs again.
            return self._skip(slot, "already_failed")
        return False  # failed before and sent again: the same job may run again

    def _skip(self, slot: Slot, reason: str) -> bool:
        slot.outcome = "skipped"
        self.metrics.duplicates.inc()
        if reason == "job_id_reused":
            self.log.warning(
                "MRC_SKIPPED", job_id=slot.job_id, reason=reason,
                message="a different job (image, prompt or max_new_tokens) under a used job id; not run",
            )  # fmt: skip
        else:
            self.log.info("MRC_SKIPPED", job_id=slot.job_id, reason=reason)
        return True

    def deadline_s(self, job: Job) -> float | None:
        """The job's deadline as wall-clock seconds, for the engine to check again at admission."""
        deadline = self._deadline(job)
        return None if deadline is None else deadline.timestamp()

    def _deadline(self, job: Job) -> datetime | None:
        """The job's own deadline, else its lane's default (MRC_DEADLINE_<LANE>_S after submission)."""
        if job.deadline:
            return parse_rfc3339(job.deadline)
        seconds = (
            self.settings.deadline_backlog_s
            if job.lane == "backlog"
            else self.settings.deadline_interactive_s
        )
        return parse_rfc3339(job.submitted_at) + timedelta(seconds=seconds) if seconds > 0 else None


def is_cancelled(record: dict[str, str]) -> bool:
    return record.get("cancelled") == "1" or record.get("run_cancelled") == "1"


def suspect_groups(suspects: list[Slot]) -> list[list[Slot]]:
    """A delivery's suspects in the groups they run in, one group after another (bisection): each job
    in a group of at most half the one it last ran in as a suspect (its worker died again with it
    there), or, the first time, of half the delivery's suspects. A group of one is a lone run. The
    least suspected run first (the largest groups): likely innocent, they finish before a crash."""
    first = -(-len(suspects) // 2)  # half, rounded up
    by_limit: dict[int, list[Slot]] = {}
    for slot in suspects:
        limit = -(-slot.suspect_group // 2) if slot.suspect_group else first
        by_limit.setdefault(max(1, limit), []).append(slot)
    groups: list[list[Slot]] = []
    for limit in sorted(by_limit, reverse=True):
        slots = by_limit[limit]
        groups += [slots[i : i + limit] for i in range(0, len(slots), limit)]
    return groups
