"""Finding the job that breaks the model or kills the worker by splitting its group in halves, not by
running every suspect alone (issue 36, item 11). Counts of steps, runs and crashes, never times.

Before: every job whose record still said `running` after an unclean kill ran with nothing beside it,
and a decode step that failed set every running row alone: 48 suspects took 1,872 decode steps
(48 x 39) where together they take 156."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.errors import ModelError, ServiceUnreachable, WorkerUnusable
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from tests.support.step_proxy import StepProxy
from workers.admission import suspect_groups
from workers.backends.base import GenerationInput
from workers.backends.echo import EchoBackend
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence
from workers.pipeline import Pipeline, assemble
from workers.slots import Message, Slot

WORDS = " ".join(f"w{i}" for i in range(37))  # an echo answer of 39 tokens with the image size


def _store() -> MemoryStore:
    store = MemoryStore("mrc")
    store.put_bytes("inputs/good.jpg", imagegen.photo(64, 48), "image/jpeg")
    return store


def _message(job_id: str, prompt: str = WORDS) -> Message:
    body = {"job_id": job_id, "image_uri": "s3://mrc/inputs/good.jpg", "prompt": prompt, "max_new_tokens": 64}
    return Message(job_id, body)


def _pipeline(
    store: MemoryStore, backend: EchoBackend, records: MemoryJobRecords, max_attempts: int = 3
) -> Pipeline:
    settings = Settings(max_attempts=max_attempts, engine_reserved_rows=2, model_batch_max_jobs=16)
    return assemble(backend, store, store, records, settings, sleep=lambda _s: None, requeue=lambda *_a: None)


def test_48_suspects_of_an_unclean_kill_run_in_halves_of_their_deliveries_not_one_by_one() -> None:
    store, records, backend = _store(), MemoryJobRecords(), EchoBackend()
    deliveries = [[_message(f"d{d}-{i}") for i in range(16)] for d in range(3)]
    for message in (m for delivery in deliveries for m in delivery):
        records.begin(message.request_id)  # in hand when the worker was killed: still `running`
    pipeline = _pipeline(store, backend, records)
    try:
        for delivery in deliveries:
            assert pipeline.run(delivery) == ["succeeded"] * 16
    finally:
        pipeline.close()
    steps = len(backend.calls)
    # Each delivery's 16 in two groups of 8, each group its 38 decode steps: 6 x 38 = 228, against
    # 48 x 38 = 1,824 one by one (and 4 x 38 = 152 with no suspicion at all).
    assert steps <= 6 * 38, f"{steps} decode steps"
    assert max(backend.calls) == 8
    assert {records.get(m.request_id).get("suspect_group") for d in deliveries for m in d} == {"8"}


def test_a_suspect_group_is_halved_at_each_crash_and_only_the_killer_is_abandoned() -> None:
    """The killer ends its worker whenever it runs (SystemExit in the model stands for a segfault: the
    engine dies, every delivery thread takes the exit path, the records of the jobs in hand still say
    `running`). Each crash halves the group its jobs run in; the killer alone dies twice (MRC_MAX_ATTEMPTS
    3) and is abandoned; every other job succeeds, once."""
    store, records = _store(), MemoryJobRecords()
    delivery = [_message(f"j{i}", "ok") for i in range(16)]
    delivery[11] = _message("killer", "KILL")
    for message in delivery:
        records.begin(message.request_id)  # the first crash: the delivery was in hand
    crashes, sizes = 0, []
    while store.get_result("killer") is None:
        assert crashes < 10, "the killer was never abandoned"
        backend = EchoBackend(fail_on="KILL", error=SystemExit("segfault"))
        pipeline = _pipeline(store, backend, records)
        try:
            pipeline.run(delivery)
        except WorkerUnusable:
            crashes += 1
            sizes.append(int(records.get("killer")["suspect_group"]))
        finally:
            pipeline.close()
    assert crashes == 5, sizes  # in groups of 8, 4, 2, then alone twice (solo runs 1 and 2)
    assert sizes == [8, 4, 2, 1, 1]
    abandoned = store.get_result("killer")
    assert abandoned["error"]["code"] == "internal_error"
    # Its count of deliveries is the result's (a review saw them one apart): the delivery in hand at the
    # first crash, the 5 that crashed here, then this one.
    assert abandoned["attempts"] == 7
    assert "delivered 7 times" in abandoned["error"]["message"]
    assert [e["job_id"] for e in records.dlq] == ["killer"]
    for message in delivery:
        if message.request_id != "killer":
            assert store.get_result(message.request_id)["status"] == "succeeded", message.request_id


class _KillsBeforeTheEngine(EchoBackend):
    """The killer ends its worker before the engine admits it: while its photo is decoded (a
    segfaulting decoder: SystemExit on the decode thread), or while its inputs are built."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def fit_image(self, image: Any) -> Any:
        if self.where == "decode" and tuple(image.shape[-2:]) == (49, 65):
            raise SystemExit("segfault decoding the image")
        return super().fit_image(image)

    def row_inputs(self, item: GenerationInput) -> tuple[Any, int]:
        if self.where == "inputs" and "KILL" in item.prompt:
            raise SystemExit("segfault building inputs")
        return super().row_inputs(item)


@pytest.mark.parametrize("where", ["decode", "inputs"])
def test_a_job_that_kills_before_the_engine_admits_it_is_still_halved_and_abandoned(where: str) -> None:
    """A review of the first fix found this: with the run counted only at admission, a killer that
    dies while its photo is decoded or its inputs are built was never counted, and crashed its worker
    (and its group's innocent jobs) forever. The group is recorded as it starts, the lone run too."""
    store, records = _store(), MemoryJobRecords()
    store.put_bytes("inputs/bomb.jpg", imagegen.photo(65, 49), "image/jpeg")
    delivery = [_message(f"j{i}", "ok") for i in range(16)]
    body = {"job_id": "killer", "image_uri": "s3://mrc/inputs/bomb.jpg", "prompt": "KILL"}
    delivery[11] = Message("killer", {**body, "max_new_tokens": 64})
    for message in delivery:
        records.begin(message.request_id)
    crashes, sizes = 0, []
    while store.get_result("killer") is None:
        assert crashes < 10, f"the killer was never abandoned: groups {sizes}"
        pipeline = _pipeline(store, _KillsBeforeTheEngine(where), records)
        try:
            pipeline.run(delivery)
        except (WorkerUnusable, SystemExit):
            crashes += 1
            sizes.append(int(records.get("killer")["suspect_group"]))
        finally:
            pipeline.close()
    assert sizes == [8, 4, 2, 1, 1], sizes
    assert "abandoned" in store.get_result("killer")["error"]["message"]
    assert all(
        store.get_result(m.request_id)["status"] == "succeeded" for m in delivery if m.request_id != "killer"
    )


def _slot(job_id: str, last_group: int = 0) -> Slot:
    slot = Slot(job_id, {}, 0.0)
    slot.suspect, slot.suspect_group = True, last_group
    return slot


def test_suspects_are_split_by_the_group_they_last_ran_in() -> None:
    fresh = [_slot(f"f{i}") for i in range(5)]
    assert [len(g) for g in suspect_groups(fresh)] == [3, 2]  # halves of the delivery's suspects
    halved = [_slot(f"h{i}", 8) for i in range(8)] + [_slot("x", 2), _slot("y", 3)]
    assert [[s.request_id for s in g] for g in suspect_groups(halved)] == [
        ["h0", "h1", "h2", "h3"],
        ["h4", "h5", "h6", "h7"],
        ["y"],
        ["x"],
    ]  # fmt: skip  the least suspected first: likely innocent, they finish before a crash
    assert [len(g) for g in suspect_groups([_slot("only")])] == [1]


# ------------------------------------------------------------------ a failed decode step, in process
class _Poisoned(StepProxy):
    """The echo step model; a decode step with the poison row in it fails, alone too."""

    def __init__(self) -> None:
        self.inner, self.decodes = EchoBackend().step_model(), []

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        self.decodes.append(list(batch.row_ids))
        if "poison" in batch.row_ids:
            raise ValueError("index out of range in self")
        return self.inner.decode(batch, last, masks)


def _row(row_id: str) -> Sequence:
    item = GenerationInput(torch.zeros((3, 8, 8), dtype=torch.uint8), f"{row_id} {WORDS}", 64)
    return Sequence(row_id, item, 10, 64, 0, "backlog")


def test_a_step_that_fails_is_split_in_halves_and_only_the_poison_row_fails() -> None:
    runner = _Poisoned()
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(16, 0), lambda row: done.__setitem__(row.row_id, row))
    ids = [f"r{i}" for i in range(15)] + ["poison"]
    for row_id in ids:
        engine.submit(_row(row_id))
    while not engine.idle and engine.steps < 2000:
        engine.step()
    assert isinstance(done["poison"].error, ModelError)
    assert all(done[row_id].error is None for row_id in ids if row_id != "poison")
    failed = [step for step in runner.decodes if "poison" in step]
    assert [len(step) for step in failed] == [16, 8, 4, 2, 1], "not halved at each failure"
    # 8 + 4 + 2 + 1 innocent rows finish in four groups: four answers' worth of steps, not fifteen.
    assert engine.steps <= 5 * 40, engine.steps


# ------------------------------------------------------ a lone run that never reached the engine
class _NoWithdrawal(MemoryJobRecords):
    def withdraw_solo_run(self, job_id: str) -> None:
        raise ConnectionError("Redis refused the withdrawal")


def test_a_lone_run_that_never_reached_the_engine_is_withdrawn() -> None:
    """A review's finding: a lone suspect whose photo fetch failed retryably went back to the queue
    with its lone run counted, though no model ran and no worker died: one death fewer to abandon it."""
    store, records = _store(), MemoryJobRecords()
    records.begin("lone")
    records.suspect_group(["lone"], 2)  # alone now
    real = store.get_bytes

    def blip(bucket: str, key: str, max_bytes: int) -> bytes:
        if key.startswith("inputs/"):
            raise ServiceUnreachable("the object store", "blip")
        return real(bucket, key, max_bytes)

    store.get_bytes = blip  # type: ignore[method-assign]  # an S3 blip for the photo, nothing else
    refusing = _NoWithdrawal()  # Redis refuses the withdrawal: the run stays counted (logged), once
    refusing.begin("lone")
    refusing.suspect_group(["lone"], 2)
    for kept, left in ((records, "0"), (refusing, "1")):
        pipeline = _pipeline(store, EchoBackend(), kept, max_attempts=4)
        try:
            assert pipeline.run([_message("lone", "ok")]) == ["retry"]
        finally:
            pipeline.close()
        assert kept.get("lone")["solo_runs"] == left
    store.get_bytes = real  # type: ignore[method-assign]
    records.begin("lone")  # delivered again after a worker died with it in hand: alone, and it runs
    records.suspect_group(["lone"], 2)
    pipeline = _pipeline(store, EchoBackend(), records, max_attempts=2)
    try:
        assert pipeline.run([_message("lone", "ok")]) == ["succeeded"]
    finally:
        pipeline.close()


def test_a_spent_suspect_whose_answer_was_written_settles_its_record_and_is_never_abandoned() -> None:
    """A service-level review's finding: Redis went away as a lone run's succeeded result was written
    (S3 had it, the record still said `running` with the lone run counted) and the worker ended. Next
    delivery: spent, it was abandoned; the succeeded result was kept, but the record said `running`
    for good. The failure never replaces the answer, and the record is settled from it."""
    store, records = _store(), MemoryJobRecords()
    pipeline = _pipeline(store, EchoBackend(), records, max_attempts=2)
    try:
        assert pipeline.run([_message("lone", "ok")]) == ["succeeded"]
        answer = store.get_result("lone")
        records.set_state("lone", "running", checked="1")  # the write Redis lost
        records.suspect_group(["lone"], 1)
        records.solo_run("lone")  # its withdrawal was refused (MRC_SUSPECT_RUN_KEPT)
        assert pipeline.run([_message("lone", "ok")]) == ["skipped"]
    finally:
        pipeline.close()
    assert store.get_result("lone") == answer
    assert records.get("lone")["state"] == "succeeded"
    assert records.dlq == []
