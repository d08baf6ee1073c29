"""Drive the engine over real model inputs for oracle tests: each job submitted at its arrival step."""

from __future__ import annotations

from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence


def engine_tokens(
    backend: FuyuBackend, items: list[GenerationInput], arrivals: list[int], max_rows: int = 8
) -> list[list[int]]:
    """Each job's generated tokens, the jobs joining the running batch at their arrival steps."""
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows, 0)
    engine = Engine(backend.step_model(max_rows), limits, lambda row: done.__setitem__(row.row_id, row))
    pending = sorted(range(len(items)), key=lambda i: arrivals[i])
    while pending or not engine.idle:
        while pending and arrivals[pending[0]] <= engine.steps:
            index = pending.pop(0)
            inputs, positions = backend.row_inputs(items[index])
            engine.submit(
                Sequence(str(index), inputs, positions, items[index].max_new_tokens, backend.eos_id)
            )
        engine.step()
    return [done[str(i)].tokens for i in range(len(items))]


def drive(engine: Engine, arrivals: list[tuple[Sequence, int]], limit: int = 500) -> None:
    """Submit each row at its arrival step; step until every row has finished (at most `limit` steps)."""
    pending = sorted(arrivals, key=lambda pair: pair[1])
    while pending or not engine.idle:
        while pending and pending[0][1] <= engine.steps:
            engine.submit(pending.pop(0)[0])
        engine.step()
        assert engine.steps < limit, (
            f"no end after {limit} steps: waiting {[r.row_id for r in engine.waiting]}"
        )
