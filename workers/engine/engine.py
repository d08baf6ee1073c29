"""The loop: admit waiting jobs (prefill alone, merge into the batch) -> one decode step for every
running row -> retire rows that finished, handing each back at once."""

from __future__ import annotations

from collections.abc import Callable

from workers.engine import scheduler
from workers.engine.kv import Batch
from workers.engine.runner import Runner
from workers.engine.sequence import Sequence

Finished = Callable[[Sequence], None]


class Engine:
    def __init__(self, runner: Runner, limits: scheduler.Limits, on_finished: Finished) -> None:
        self.runner, self.limits, self.on_finished = runner, limits, on_finished
        self.waiting: list[Sequence] = []
        self.running: dict[str, Sequence] = {}
        self.batch = Batch()
        self.steps = 0

    def submit(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> None:
        self._admit()
        if self.running:
            rows = [self.running[row_id] for row_id in self.batch.row_ids]
            nexts = self.runner.decode(self.batch, [row.tokens[-1] for row in rows])
            self._retire({row.row_id for row, token in zip(rows, nexts, strict=True) if row.accept(token)})
        self.steps += 1

    def _admit(self) -> None:
        def candidate(row: Sequence) -> scheduler.Candidate:
            return scheduler.Candidate(row.row_id, row.lane, row.reserved_tokens)

        chosen = scheduler.admit(
            [candidate(r) for r in self.waiting], [candidate(r) for r in self.running.values()], self.limits
        )
        by_id = {row.row_id: row for row in self.waiting}
        for row_id in chosen:
            row = by_id[row_id]
            self.waiting.remove(row)
            token, cache, length = self.runner.prefill(row.inputs)
            if row.accept(token):  # ended at its first token: it never joins the batch
                self.on_finished(row)
                continue
            self.running[row_id] = row
            self.batch.add(row_id, cache, length)

    def _retire(self, done: set[str]) -> None:
        self.batch.drop(done)
        for row_id in done:
            self.on_finished(self.running.pop(row_id))
