"""The rows in memory and how a failure settles them.

Failures are settled here, per row, so one job never fails for its neighbours:
- a prefill chunk that fails is that job's alone (a chunk is one row's): its error, except out of
  memory while other rows are in memory, which sends it back to waiting and admits nothing more until
  a row leaves;
- a decode step that fails may have written part of the step into the cache, so every running row
  goes back to waiting and is recomputed from its prompt (greedy: on the CPU in fp32 the same tokens
  again; on a GPU a batch of another shape may round differently). Out of memory also lowers the
  admission ceiling below what ran, for CEILING_STEPS steps; any other error splits the rows into two
  groups (scheduler: a group runs beside nothing else), and a group that fails again is split again,
  so the one row that breaks the model fails by itself in about log2(rows) failed steps and the
  others succeed, most of them still in company;
- out of memory in the batch's own bookkeeping (a join, a drop, a hold) is settled like a failed
  step: the rows in memory go back to waiting, the ceiling is lowered; no job fails for it;
- a device fault (WorkerUnusable) leaves the engine: nothing on this process can run any more.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import MrcError, OutOfMemory
from workers import inference
from workers.engine import rows as rows_of
from workers.engine.sequence import Sequence
from workers.engine.step import RowBatch, StepModel

Finished = Callable[[Sequence], None]
# Decode steps a lowered admission ceiling lasts before full capacity is tried again: an out-of-memory
# step may be transient (fragmentation, a neighbour process), and rows never all leave under load.
CEILING_STEPS = 256


@dataclass
class StepReport:
    prefilled: int = 0  # rows whose prefill became whole (they joined the decode steps)
    computed: int = 0  # prefill positions computed (chunks)
    calls: int = 0  # prefill model calls that computed them (a step's chunks go in one, or a few)
    lookups: int = 0  # jobs admitted (first time) that could reuse a cached prefix
    hits: int = 0  # of those, rows that did
    reused: int = 0  # positions they reused, not computed
    decoded_rows: int = 0
    finished: int = 0  # rows handed back (succeeded, failed, expired)
    paused: int = 0  # rows paused for a ticket
    held: int = 0  # backlog rows that sat out the decode step (hold) while tickets decoded
    restarted: int = 0  # rows sent back because their step (or the batch's bookkeeping) failed
    discarded: int = 0  # generated tokens thrown away with the rows paused or restarted

    @property
    def moved(self) -> bool:
        """Whether a row got anywhere: what liveness counts as progress."""
        return bool(self.prefilled or self.computed or self.decoded_rows or self.finished)


class Settling:
    """The engine's rows (waiting, prefilling, running, held) and the rules that settle a failure
    among them; workers/engine/engine.py is the loop that moves them."""

    runner: StepModel
    on_finished: Finished
    clock: Callable[[], float]
    waiting: list[Sequence]
    running: dict[str, Sequence]  # in admission order
    batch: RowBatch
    held: dict[str, Sequence]  # backlog rows sitting out decode steps while tickets run, cache kept
    held_batch: RowBatch
    prefilling: dict[str, Sequence]  # rows with a slot whose prefill is under way, in admission order
    steps: int
    row_ceiling: int | None  # rows in memory, lowered by out-of-memory for CEILING_STEPS
    _ceiling_at: int
    _report: StepReport
    _groups: itertools.count[int]

    @property
    def in_memory(self) -> int:
        """Rows holding a slot: running, held and prefilling."""
        return len(self.running) + len(self.held) + len(self.prefilling)

    def _memory_rows(self) -> list[Sequence]:
        return [*self.running.values(), *self.held.values(), *self.prefilling.values()]

    def _fail(self, row: Sequence, error: MrcError) -> None:
        row.error, row.finished_at = error, self.clock()
        self._report.finished += 1
        self.on_finished(row)

    def _requeue(self, rows: list[Sequence], restart: bool = True) -> None:
        """Rows first in line again; `restart`: they had run, and are recomputed from their prompt."""
        for row in rows:
            if restart:
                self._report.discarded += len(row.tokens)
                row.restart()
        self.waiting[:0] = rows

    def _lower_ceiling(self, rows: int) -> None:
        self.row_ceiling, self._ceiling_at = max(1, rows), self.steps

    def _drop_all(self, keep: bool = False) -> None:
        """Every running row out of the batch, its slot free or left to the prefix cache (`keep`)."""
        self.running.clear()
        self.batch = rows_of.emptied(self.batch, self.runner, keep)

    def _safely(self, bookkeeping: Callable[[], object]) -> bool:
        """Run a change to the batches (a join, a drop, a hold or release); out of memory there is
        settled like a failed step (every row in memory back to waiting, the ceiling lowered), never
        a job's error and never the engine's end. False when that happened."""
        try:
            bookkeeping()
        except Exception as exc:
            if not isinstance(inference.classify(exc), OutOfMemory):
                raise  # a fault in the engine itself: the service ends it (WorkerUnusable)
            self._memory_failed()
            return False
        return True

    def _memory_failed(self) -> None:
        rows = self._memory_rows()
        if rows:
            self._lower_ceiling(len(rows) - 1)  # the youngest's share freed
        for row_id in self.prefilling:
            self.runner.abandon(row_id)
        self.running.clear()
        self.held.clear()
        self.prefilling.clear()
        self._drop_all()
        self.held_batch = rows_of.emptied(self.held_batch, self.runner)
        self._requeue(rows)
        self._report.restarted += len(rows)

    def _decode_failed(self, exc: Exception) -> None:
        error = inference.classify(exc)  # raises WorkerUnusable for a device fault
        rows = list(self.running.values())
        # One row alone fails with its error; out of memory beside held or prefilling rows is theirs
        # too (their slots hold memory), so the row waits for them, as a failed chunk's does.
        if len(rows) == 1 and not (isinstance(error, OutOfMemory) and self.in_memory > 1):
            self._drop_all()
            self._fail(rows[0], error)
            return
        self._report.restarted += len(rows)
        if isinstance(error, OutOfMemory):
            self._lower_ceiling(self.in_memory - 1)  # the youngest's share freed
        else:  # halves that run apart: the one that fails again is split again, down to one row
            for half in rows_of.halves(rows):
                group = f"split-{next(self._groups)}"
                for row in half:
                    row.group = group
        self._drop_all()
        self._requeue(rows)

    def _chunk_failed(self, row: Sequence, exc: Exception) -> bool:
        """A chunk that failed is its row's alone (a chunk is one row's): its error, except out of
        memory while other rows are in memory, which sends it back to waiting and stops this step's
        chunks (False). Its slot is freed: what the chunk wrote is not known to be sound."""
        error = inference.classify(exc)  # raises WorkerUnusable: nothing here can run any more
        del self.prefilling[row.row_id]
        self.runner.abandon(row.row_id)
        if isinstance(error, OutOfMemory) and self.in_memory:
            self._requeue([row])  # it may fit alone, or once a neighbour has left
            self._lower_ceiling(self.in_memory)
            return False
        self._fail(row, error)
        return True

    def _back_to_waiting(self, rows: list[Sequence]) -> bool:
        """Paused rows, first in line again (recomputed from their prompt). False when dropping them
        ran out of memory (then every row in memory went back instead)."""
        ids = {row.row_id for row in rows}

        def drop() -> None:  # their prompts' positions stay with the prefix cache: a pause loses less
            if ids >= set(self.running):
                self._drop_all(keep=True)
            else:
                self.batch.drop(ids & set(self.running), keep=True)
            self.held_batch.drop(ids & set(self.held), keep=True)
            for row_id in ids & set(self.prefilling):
                self.runner.abandon(row_id, keep=True)

        if not self._safely(drop):
            return False
        for row in rows:
            self.running.pop(row.row_id, None)
            self.held.pop(row.row_id, None)
            self.prefilling.pop(row.row_id, None)
            row.pauses += 1
        self._requeue(rows)
        return True
