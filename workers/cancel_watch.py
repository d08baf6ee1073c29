"""Cancels that come while a job waits in the engine: `mrc backlog cancel` (and an OpenAI batch's)
ends every job of the run that has not started, and a worker claims many more backlog jobs than it
runs at once (deliveries of up to MRC_MODEL_BATCH_MAX_JOBS each). Admission reads the cancel mark once,
at the claim; a delivery's backlog rows the engine has not admitted yet are read again once a second
(one round trip for them all) and a cancelled one is marked for the engine to drop, as it drops a row
past its deadline (review: a cancel answered 0 and eight claimed jobs that had not started ran).
A row the engine admitted is left to finish: its work is under way."""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.records import JobRecords
from workers.admission import is_cancelled
from workers.engine.sequence import Sequence

EVERY_S = 1.0


class CancelWatch:
    def __init__(
        self, records: JobRecords, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.records, self.every_s, self.clock = records, every_s, clock
        self._rows: dict[str, Sequence] = {}
        self._next = clock() + every_s

    def track(self, job_id: str, row: Sequence) -> None:
        self._rows[job_id] = row

    def wait_s(self) -> float | None:
        """How long until the next look (None: nothing to watch)."""
        return None if not self._rows else max(0.0, self._next - self.clock())

    def poll(self) -> None:
        """Look, when a look is due: rows admitted or ended meanwhile are no longer watched."""
        if not self._rows or self.clock() < self._next:
            return
        self._next = self.clock() + self.every_s
        self._rows = {
            job_id: row
            for job_id, row in self._rows.items()
            if row.first_admitted_at is None and row.error is None and row.finish_reason is None
        }
        if not self._rows:
            return
        try:
            records = self.records.get_many(list(self._rows))
        except Exception:  # Redis away: the next look; admission has read the mark once already
            return
        for row, record in zip(self._rows.values(), records, strict=True):
            if is_cancelled(record):
                row.cancelled = True
