"""The loop: admit waiting jobs (a slot each, and what the cache holds of their prefix) -> prefill
chunks within the step's budget of positions (rows whose prompt is whole join the batch) -> one decode
step for every running row -> retire rows that finished, handing each back at once and leaving their
slot to the prefix cache.

Failures are settled per row, so one job never fails for its neighbours (workers/engine/settling.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from shared.errors import Cancelled, Expired, InvalidJob, OutOfMemory
from workers import inference
from workers.engine import rows as rows_of
from workers.engine import scheduler
from workers.engine.sequence import Sequence
from workers.engine.settling import CEILING_STEPS, Finished, Settling, StepReport
from workers.engine.slot_table import NoFreeSlot
from workers.engine.step import StepModel

__all__ = ["CEILING_STEPS", "Engine", "Finished", "StepReport"]


class Engine(Settling):
    def __init__(
        self,
        runner: StepModel,
        limits: scheduler.Limits,
        on_finished: Finished,
        clock: Callable[[], float] = time.time,
    ) -> None:
        table = getattr(runner, "table", None)
        if table is not None:  # admission counts the positions the runner's pool really has
            limits = dataclasses.replace(limits, positions=min(limits.positions, table.pool), unit=table.unit)
        self.runner, self.limits, self.on_finished, self.clock = runner, limits, on_finished, clock
        self.waiting = []
        self.running = {}
        self.batch = runner.new_batch()
        self.held = {}
        self.held_batch = runner.new_batch()
        self.prefilling = {}
        self.steps = 0
        self.row_ceiling = None
        self._ceiling_at = 0
        self._report = StepReport()
        self.share = scheduler.Share(limits.backlog_share)  # the backlog's claim on steps beside tickets
        # Steps in a row at which the backlog had work and none of its rows moved (the heartbeat and
        # /healthz show it: a starved backlog is otherwise invisible while other rows step).
        self.backlog_stalled = 0
        self._groups = itertools.count()

    def submit(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.held and not self.prefilling

    @property
    def positions_held(self) -> int:
        """Cache positions the rows in memory really hold."""
        return self.batch.held + self.held_batch.held + sum(r.computed for r in self.prefilling.values())

    def step(self) -> StepReport:
        report = self._report = StepReport()
        self._expire()
        self._refuse_oversized()
        if self.row_ceiling is not None and self.steps - self._ceiling_at >= CEILING_STEPS:
            self.row_ceiling = None
        due = self.share.due
        admitted, drain = self._admit(due)
        admitted = list({id(r): r for r in [*admitted, *self._chunks(due)]}.values())
        rows: list[Sequence] = []
        if self._safely(lambda: self._hold_or_release(due)) and self.running:
            rows = [self.running[row_id] for row_id in self.batch.row_ids]
            report.held = len(self.held)
            try:
                last = [row.tokens[-1] for row in rows]
                nexts = self.runner.decode(self.batch, last, rows_of.masks_of(rows))
            except Exception as exc:
                self._decode_failed(exc)
            else:
                report.decoded_rows = len(rows)
                now, masked = self.clock(), self.batch.padding > 0
                done = set()
                for row, token in zip(rows, nexts, strict=True):
                    row.masked_steps += masked
                    if row.accept(token) or self._past_deadline(row, now):
                        row.finished_at = now
                        done.add(row.row_id)
                self._retire(done)
        self._settle_share(admitted, rows if report.decoded_rows else [], drain)
        self.steps += 1
        return report

    def _settle_share(self, admitted: list[Sequence], decoded: list[Sequence], drain: bool) -> None:
        """Count the step towards the backlog's share, and how long the backlog has not moved."""
        step = scheduler.Step(
            rows_of.candidates(admitted), rows_of.candidates(decoded), rows_of.candidates(self.waiting),
            rows_of.candidates(self._memory_rows()), drain,
        )  # fmt: skip
        self.share.settle(step, self.limits)
        moved = rows_of.has_backlog([*step.admitted, *step.decoded])
        work = moved or rows_of.has_backlog([*step.waiting, *step.in_memory])
        self.backlog_stalled = self.backlog_stalled + 1 if work and not moved else 0

    # ---------------------------------------------------------------- admission
    def _limits(self) -> scheduler.Limits:
        if self.row_ceiling is None:
            return self.limits
        return dataclasses.replace(self.limits, max_rows=min(self.limits.max_rows, self.row_ceiling))

    def _expire(self) -> None:
        now = self.clock()
        for row in [r for r in self.waiting if r.deadline is not None and r.deadline < now]:
            self.waiting.remove(row)
            self._fail(row, Expired("the job's deadline passed while it waited for the model"))
        for row in [r for r in self.waiting if r.cancelled and r.first_admitted_at is None]:
            self.waiting.remove(row)
            self._fail(row, Cancelled("its backlog run was cancelled before the job ran"))

    @staticmethod
    def _past_deadline(row: Sequence, now: float) -> bool:
        """A row answering past its deadline ends `expired` there (review: it ran to its end, the
        answer a second late for a caller that had given up, its steps taken from the rest)."""
        if row.deadline is None or row.deadline >= now:
            return False
        row.error = Expired("the job's deadline passed while it was being answered")
        return True

    def _refuse_oversized(self) -> None:
        """A row that could outgrow its slot fails alone, before it takes one. The worker sizes slots
        to the largest job it accepts (workers/backends/fuyu.py, slot_positions), so this is a guard:
        without it the slot table's refusal would reach the engine thread and end every row in hand."""
        table = getattr(self.runner, "table", None)
        if table is None:
            return
        for row in [r for r in self.waiting if r.need > table.positions]:
            self.waiting.remove(row)
            self._fail(row, InvalidJob(
                f"the job needs {row.need} cache positions ({row.prompt_tokens} of image and prompt, "
                f"{row.max_new_tokens} new tokens); a slot of this worker holds {table.positions}"
            ))  # fmt: skip

    def _admit(self, due: bool) -> tuple[list[Sequence], bool]:
        """Admit what the policy says; the rows admitted (prefilled or not) and whether it waits for a
        group's drain."""
        in_memory = {**self.running, **self.held, **self.prefilling}
        plan = scheduler.plan(
            rows_of.candidates(self.waiting), rows_of.candidates(in_memory.values()), self._limits(), due=due
        )
        if plan.pause:
            if not self._back_to_waiting([in_memory[row_id] for row_id in plan.pause]):
                return [], plan.drain
            self._report.paused += len(plan.pause)
        by_id = {row.row_id: row for row in self.waiting}
        admitted = [by_id[row_id] for row_id in plan.admit]
        for row in admitted:
            self.waiting.remove(row)
            row.turn = row.row_id in plan.turn
        for index, row in enumerate(admitted):
            if not self._begin(row):  # the row is first in line again; those admitted after it follow
                self.waiting[1:1] = admitted[index + 1 :]  # it, in their order (review, helper-64)
                break
        return admitted, plan.drain

    def _begin(self, row: Sequence) -> bool:
        """The row takes a slot, and what the cache holds of its prefix; its prefill follows in chunks.
        False when admission must stop for this step (the row is back in waiting)."""
        now = self.clock()
        try:
            reused = self.runner.begin(row.row_id, row.inputs, row.prompt_tokens, row.identity, row.need)
        except NoFreeSlot:  # the pool has not the room admission counted on: it waits, as for memory
            self.runner.abandon(row.row_id)
            self._requeue([row], restart=False)
            return False
        except Exception as exc:  # its slot and the prefix it copies (memory): its own failure
            error = inference.classify(exc)  # raises WorkerUnusable: nothing here can run any more
            self.runner.abandon(row.row_id)
            if isinstance(error, OutOfMemory) and self.in_memory:
                self._requeue([row], restart=False)  # it may fit alone, or once a neighbour has left
                self._lower_ceiling(self.in_memory)
                return False
            self._fail(row, error)
            return True
        # Admitted once it holds a slot: a row sent back to waiting above is still cancellable and
        # its queue time runs on (review, helper-64: stamped before, it ran on after a cancel).
        row.admitted_at = now
        row.first_admitted_at = row.first_admitted_at or now
        row.computed = row.cached_tokens = reused
        self.prefilling[row.row_id] = row
        report = self._report
        if not row.looked_up:  # a job once: a paused row admitted again mostly finds its own prefix
            row.looked_up = True
            report.lookups += row.identity is not None
            report.hits += reused > 0
        report.reused += reused
        return True

    def _chunks(self, due: bool) -> list[Sequence]:
        """Prefill chunks within the step's budget of positions (scheduler.chunks: tickets first), every
        row's in one call; a row whose prompt is whole joins the decode steps with its first token. A
        row whose next prefix block a chunk of the call writes (the same photo) waits for a second call
        and copies it instead (catch_up), and so do the rows after it: none takes its place in line
        (tickets first) or its share of the budget. The rows that moved."""
        order = scheduler.chunk_order(rows_of.candidates(self.prefilling.values()), self._holding(due))
        left = max(1, self.limits.prefill_tokens)  # the first row always moves
        moved: list[Sequence] = []
        while order and left > 0:
            call: list[tuple[Sequence, int]] = []
            later: list[str] = []
            for index, row_id in enumerate(order):
                row = self.prefilling.get(row_id)
                if row is None:  # sent back meanwhile (a retirement ran out of memory)
                    return moved
                if left <= 0:
                    break
                self._caught_up(row)
                if call and self.runner.sharing(row_id, [(r.row_id, stop) for r, stop in call]):
                    later = order[index:]
                    break
                stop = min(row.prompt_tokens, row.computed + left)
                left -= stop - row.computed
                call.append((row, stop))
            if not self._run_chunks(call, moved):
                break
            order = later
        return moved

    def _run_chunks(self, call: list[tuple[Sequence, int]], moved: list[Sequence]) -> bool:
        """One call of chunks. A call of several that fails runs each chunk alone, so a failure is its
        row's alone (a chunk is one row's). False when this step's chunks stop (out of memory)."""
        finishing = [row for row, stop in call if stop == row.prompt_tokens]
        self._report.calls += 1
        try:
            tokens = self.runner.extend([(r.row_id, stop) for r, stop in call], rows_of.masks_of(finishing))
        except Exception as exc:
            if len(call) > 1:
                inference.classify(exc)  # raises WorkerUnusable: nothing here can run any more
                for chunk in call:  # stops where one alone sent the rows back (a retirement's memory)
                    if chunk[0].row_id not in self.prefilling or not self._run_chunks([chunk], moved):
                        return False
                return True
            return self._chunk_failed(call[0][0], exc)
        for (row, stop), token in zip(call, tokens, strict=True):
            if row.row_id not in self.prefilling:  # sent back meanwhile (a retirement ran out of memory)
                return False
            self._report.computed += stop - row.computed
            row.computed = stop
            moved.append(row)
            if token is not None and not self._joined(row, token):
                return False  # out of memory joining it: every row in memory went back to waiting
        return True

    def _caught_up(self, row: Sequence) -> None:
        """What other rows wrote of its prefix since it began: copied, not computed."""
        gained = self.runner.catch_up(row.row_id)
        if gained:
            self._report.hits += row.cached_tokens == 0 and row.restarts == 0  # a job once, as in _begin
            self._report.reused += gained
            row.computed += gained
            row.cached_tokens += gained

    def _joined(self, row: Sequence, token: int) -> bool:
        """A row whose prefill is whole: into the decode steps, its first token taken. False when the
        join ran out of memory (settled like a failed step: every row in memory back to waiting)."""
        if not self._safely(lambda: self.batch.join(row.row_id)):
            return False
        del self.prefilling[row.row_id]
        self._report.prefilled += 1
        row.first_token_at = self.clock()
        self.running[row.row_id] = row
        if row.accept(token):  # ended at its first token: it leaves before any decode step
            row.finished_at = row.first_token_at
            self._retire({row.row_id})
        return True

    def _hold_or_release(self, due: bool) -> None:
        """Backlog rows out of the decode step while tickets decode (scheduler.hold), back after and
        at the backlog's due steps. After admission: only the tickets that will decode count."""
        if self._holding(due):
            backlog = {row_id for row_id, row in self.running.items() if row.lane != scheduler.INTERACTIVE}
            if backlog:
                self.held_batch.absorb(self.batch.take(backlog))
                self.held.update({row_id: self.running.pop(row_id) for row_id in backlog})
        elif self.held:
            self.batch.absorb(self.held_batch)
            self.running.update(self.held)
            self.held.clear()
            self.held_batch = self.runner.new_batch()

    def _holding(self, due: bool) -> bool:
        running, waiting = rows_of.candidates(self.running.values()), rows_of.candidates(self.waiting)
        return scheduler.hold(running, waiting, self.limits, due)

    def _retire(self, done: set[str]) -> None:
        if not done:
            return
        finished = [self.running.pop(row_id) for row_id in done]
        for row in finished:  # their answers are whole: handed back whatever the batch does next
            self._report.finished += 1
            self.on_finished(row)
        if not self._safely(lambda: self.batch.drop(done, keep=True)):
            return
        if not self.in_memory:
            self.row_ceiling = None  # an empty cache: try the full capacity again
