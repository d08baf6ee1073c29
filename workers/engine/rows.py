"""The engine's rows as others see them: the scheduler's candidates, a step's grammar masks, a batch
emptied, a group split in halves. Plain Python."""

from __future__ import annotations

from collections.abc import Iterable

from workers.engine import masks, scheduler
from workers.engine.sequence import Sequence
from workers.engine.step import RowBatch, StepModel


def emptied(batch: RowBatch, runner: StepModel, keep: bool = False) -> RowBatch:
    """The batch with every row dropped (their slots free); a fresh one if dropping fails (a batch
    whose bookkeeping itself ran out of memory: the slot cache's never does, it is plain Python)."""
    try:
        batch.drop(set(batch.row_ids), keep)
    except Exception:
        return runner.new_batch()
    return batch


def masks_of(rows: list[Sequence]) -> masks.MaskFn | None:
    """The rows' grammar mask, built when the model call asks for it; None: every row is free."""
    constraints = [row.constraint for row in rows]
    if all(c is None for c in constraints):
        return None
    return lambda: masks.for_rows(constraints)


def candidates(rows: Iterable[Sequence]) -> list[scheduler.Candidate]:
    """The rows as the pure policy sees them."""
    return [_candidate(r) for r in rows]


def _candidate(row: Sequence) -> scheduler.Candidate:
    """A step asks for every waiting row's candidate several times, and a deep backlog waits: made
    once per change of what it shows (5.4 ms of host time a step with 1,000 rows waiting, remade)."""
    shows = (row.lane, row.group, row.pauses, row.turn)
    if row.seen is None or row.seen[0] != shows:
        made = scheduler.Candidate(
            row.row_id, row.lane, row.group, row.prompt_tokens, row.pauses, row.turn, row.need
        )
        row.seen = (shows, made)
    candidate: scheduler.Candidate = row.seen[1]
    return candidate


def has_backlog(rows: Iterable[scheduler.Candidate]) -> bool:
    return any(c.lane != scheduler.INTERACTIVE for c in rows)


def halves(rows: list[Sequence]) -> list[list[Sequence]]:
    """Two groups of (nearly) equal size, tickets first (so the tickets' half runs first); one row
    stays one."""
    ordered = sorted(rows, key=lambda r: r.lane != scheduler.INTERACTIVE)
    middle = (len(ordered) + 1) // 2
    return [part for part in (ordered[:middle], ordered[middle:]) if part]
