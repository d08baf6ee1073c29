"""Out of memory is out of memory whichever allocator ran out: CUDA's (`torch.OutOfMemoryError`), the
CPU's (`DefaultCPUAllocator: can't allocate memory`, a plain RuntimeError), Python's own
(`MemoryError`). Each is retryable for the job, lowers the engine's row ceiling after a failed step
(never marks the rows alone) and never counts towards the worker's model-failure streak."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.errors import ModelError, OutOfMemory, WorkerUnusable
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from tests.support.step_proxy import StepProxy
from workers import inference, stages
from workers.backends.base import GenerationInput
from workers.backends.echo import EchoBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence
from workers.pipeline import assemble
from workers.slots import Message


def _cpu_allocator_failure() -> RuntimeError:
    """The CPU allocator's own failure, raised by torch (not a string made up to look like it)."""
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the CPU allocator gave 4 EiB")


CPU_ALLOC = _cpu_allocator_failure()
MEMORY_ERRORS = [
    CPU_ALLOC,
    RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
        "allocate 17179869184 bytes."
    ),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    MemoryError(),
    RuntimeError("std::bad_alloc"),
]


@pytest.mark.parametrize("error", MEMORY_ERRORS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_every_allocator_failure_is_out_of_memory(error: BaseException) -> None:
    assert inference.out_of_memory(error)
    assert not inference.device_fatal(error)
    assert isinstance(inference.classify(error), OutOfMemory)


def test_an_allocator_failure_raised_from_another_error_is_out_of_memory() -> None:
    outer = ValueError("the model's forward failed")
    outer.__cause__ = CPU_ALLOC  # what `raise ValueError(...) from exc` leaves
    assert isinstance(inference.classify(outer), OutOfMemory)
    unrelated = ValueError("shapes do not match")
    unrelated.__context__ = MemoryError()  # raised while one was handled, not because of it
    assert isinstance(inference.classify(unrelated), ModelError)


def test_other_failures_keep_their_class() -> None:
    assert isinstance(inference.classify(ValueError("shapes do not match")), ModelError)
    with pytest.raises(WorkerUnusable):
        inference.classify(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_stage_that_runs_out_of_memory_is_retryable_not_an_internal_error() -> None:
    def decode() -> None:
        raise CPU_ALLOC

    error, _seconds = stages.timed("image decode", decode)
    assert isinstance(error, OutOfMemory)
    assert error.retryable


class _FailsInCompany(StepProxy):
    """The echo step model whose decode steps of two rows or more fail with `error`."""

    def __init__(self, error: BaseException) -> None:
        self.inner, self.error, self.decodes = EchoBackend().step_model(), error, []

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        self.decodes.append(len(batch))
        if len(batch) >= 2:
            raise self.error
        return self.inner.decode(batch, last, masks)


def _row(row_id: str) -> Sequence:
    item = GenerationInput(torch.zeros((3, 8, 8), dtype=torch.uint8), f"{row_id} a b c d e f", 8)
    return Sequence(row_id, item, 10, 8, 0, "backlog")


def test_a_decode_step_that_runs_out_of_cpu_memory_lowers_the_ceiling_and_isolates_no_row() -> None:
    runner = _FailsInCompany(CPU_ALLOC)
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows=4, reserved_interactive=0)
    engine = Engine(runner, limits, lambda r: done.__setitem__(r.row_id, r))
    for index in range(3):
        engine.submit(_row(f"r{index}"))
    engine.step()  # admit all three, one decode step of three rows: out of memory
    assert engine.row_ceiling == 2, "the ceiling was not lowered"
    assert all(row.group is None for row in engine.waiting), "rows were set apart as if one broke the model"
    while not engine.idle and engine.steps < 200:
        engine.step()
    assert sorted(done) == ["r0", "r1", "r2"]
    assert all(row.error is None for row in done.values())


def test_a_job_out_of_cpu_memory_is_retried_and_the_failure_streak_is_not_counted() -> None:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/good.jpg", imagegen.photo(64, 48), "image/jpeg")
    backend = EchoBackend(fail_on="HUGE", error=CPU_ALLOC)
    retried: list[str] = []
    pipeline = assemble(
        backend, store, store, MemoryJobRecords(), Settings(model_failure_streak=1),
        sleep=lambda _s: None, requeue=lambda request_id, _body, _delay: retried.append(request_id),
    )  # fmt: skip
    body = {"job_id": "huge", "image_uri": "s3://mrc/inputs/good.jpg", "prompt": "HUGE", "max_new_tokens": 8}
    # A streak of one model error would end the worker (WorkerUnusable); out of memory is no model error.
    assert pipeline.run([Message("huge", body)]) == ["retry"]
    assert retried == ["huge"]
    assert store.get_result("huge") is None
    pipeline.close()
