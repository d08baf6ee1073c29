"""A step's prefill chunks in one model call (workers/engine/runner.py `extend`, row_attention.per_chunk):
the rows' positions laid end to end, each attending to its own slot. The oracle holds (every row's tokens
equal its job alone, greedy, fp32, CPU), questions about one photo still compute its prefix once, and a
call that fails is settled row by row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.settings import Settings
from tests.support.engine_runs import SIZES, drive
from tests.support.engine_runs import alone as _alone
from tests.support.engine_runs import photo as _photo
from tests.support.step_proxy import StepProxy
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import scheduler
from workers.engine.embeddings import PROJECTED_AT_LEAST, embed
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    loaded = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cpu"))
    loaded.load()
    return loaded


def _row(backend: FuyuBackend, row_id: str, item: GenerationInput, identity: Any = None) -> Sequence:
    inputs = backend.prepare([item]).inputs
    length = int(inputs["input_ids"].shape[1])
    return Sequence(row_id, inputs, length, item.max_new_tokens, backend.eos_id, identity=identity)


class _Counting(StepProxy):
    """The real runner; each prefill call's rows and positions recorded, a fault injected by a rule."""

    def __init__(self, inner: Any, fault: Any = None) -> None:
        super().__init__(inner)
        self.calls: list[list[tuple[str, int]]] = []  # (row, positions computed) per call
        self.fault = fault

    def extend(self, chunks: list[tuple[str, int]], masks: Any = None) -> list[int | None]:
        table = self.inner.table
        self.calls.append([(row_id, stop - table.length(row_id)) for row_id, stop in chunks])
        if self.fault is not None and (error := self.fault([row_id for row_id, _ in chunks])) is not None:
            raise error
        return super().extend(chunks, masks)


@pytest.mark.parametrize("decode", ["rows", "fixed", "pool"])
def test_a_steps_chunks_of_several_rows_run_in_one_call_and_equal_each_job_alone(
    backend: FuyuBackend, decode: str
) -> None:
    """Four photos admitted together, their prompts within the step's budget: one prefill call computes
    all their positions; a budget that cuts them still makes one call a step."""
    items = [_photo(size, size, size % 3, 5) for size in range(4)]
    for budget in (1 << 30, 150):
        runner = _Counting(backend.step_model(4, decode=decode))
        done: dict[str, Sequence] = {}
        limits = scheduler.Limits(4, 0, prefill_tokens=budget)
        engine = Engine(runner, limits, lambda row, done=done: done.__setitem__(row.row_id, row))
        rows = [_row(backend, str(i), item) for i, item in enumerate(items)]
        drive(engine, [(row, 0) for row in rows])
        for index, item in enumerate(items):
            assert done[str(index)].tokens == _alone(backend, item), (budget, index)
        if budget > 1000:
            assert len(runner.calls) == 1, runner.calls
            assert sorted(n for _, n in runner.calls[0]) == sorted(row.prompt_tokens for row in rows)
        else:
            assert all(sum(n for _, n in call) <= budget for call in runner.calls), runner.calls
            assert max(len(call) for call in runner.calls) > 1, "no call ever held two rows' chunks"
            assert sum(n for call in runner.calls for _, n in call) == sum(r.prompt_tokens for r in rows)


class _RetiringOutOfMemory(StepProxy):
    """The real runner; the first retirement (a finished row's slot left to the prefix cache) runs out
    of memory, once."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.armed = True

    def new_batch(self) -> Any:
        batch = self.inner.new_batch()
        drop = batch.drop

        def failing_drop(row_ids: set[str], keep: bool = False) -> None:
            if keep and self.armed:
                self.armed = False
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            drop(row_ids, keep)

        batch.drop = failing_drop
        return batch


def test_questions_about_one_photo_admitted_together_compute_its_prefix_once(backend: FuyuBackend) -> None:
    """Three questions about one photo and one about another, all in one step: the photo's prefix is
    computed by its first question's chunk; the second waits for a second call and copies it, and the
    rows after it wait with it (none takes its place in line)."""
    items = [_photo(3, 0, 0, 4), _photo(3, 0, 1, 4), _photo(2, 1, 2, 4), _photo(3, 0, 2, 4)]
    identities = [("key", 0), ("key", 0), ("key", 1), ("key", 0)]
    runner = _Counting(backend.step_model(4))
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    rows = [_row(backend, str(i), item, identities[i]) for i, item in enumerate(items)]
    for row in rows:
        engine.submit(row)
    reports = []
    while not engine.idle:
        reports.append(engine.step())
    assert [[row_id for row_id, _ in call] for call in runner.calls] == [["0"], ["1", "2", "3"]]
    assert [report.calls for report in reports[:2]] == [2, 0]  # what mrc_engine_prefill_calls_total counts
    image = backend.image_tokens(*SIZES[3])
    for index, item in enumerate(items):
        assert done[str(index)].tokens == _alone(backend, item), index
    assert done["0"].cached_tokens == done["2"].cached_tokens == 0
    assert done["1"].cached_tokens >= image - 15
    assert done["3"].cached_tokens >= image - 15
    computed = sum(n for call in runner.calls for _, n in call)
    assert computed == sum(row.prompt_tokens - done[row.row_id].cached_tokens for row in rows)


def test_questions_about_one_photo_admitted_together_project_its_patches_once(backend: FuyuBackend) -> None:
    """The rows that copy their photo's prefix from a question admitted with them (no hit yet at their
    admission) project only the patches past what they copied, as a row with a hit does: a row's
    embeddings are made as its first chunk runs, not as it is admitted."""
    items = [_photo(3, 0, 0, 2), _photo(3, 0, 1, 2), _photo(2, 1, 2, 2), _photo(3, 0, 2, 2)]
    identities = [("key", 0), ("key", 0), ("key", 1), ("key", 0)]
    runner = backend.step_model(4)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    rows = [_row(backend, str(i), item, identities[i]) for i, item in enumerate(items)]
    vision = backend.model.model.vision_embed_tokens
    projected: list[int] = []
    hook = vision.register_forward_hook(lambda _m, args, _out: projected.append(int(args[0].shape[-2])))
    try:
        for row in rows:
            engine.submit(row)
        while not engine.idle:
            engine.step()
    finally:
        hook.remove()
    image_id = backend.model.config.image_token_id
    patches = [int((row.inputs["input_ids"][0] == image_id).sum()) for row in rows]
    copied = [
        int((row.inputs["input_ids"][0][: done[row.row_id].cached_tokens] == image_id).sum()) for row in rows
    ]
    assert min(copied[1], copied[3]) > PROJECTED_AT_LEAST  # they did copy their photo's prefix
    assert projected == [  # in the order the calls made them: row 0, then rows 1, 2 and 3 in one call
        max(min(PROJECTED_AT_LEAST, n), n - before) for n, before in zip(patches, copied, strict=True)
    ]
    for index, item in enumerate(items):
        assert done[str(index)].tokens == _alone(backend, item), index


def test_a_failed_call_of_several_rows_fails_only_the_row_that_fails_alone(backend: FuyuBackend) -> None:
    """A call fails whenever row "bad" is in it: each row of the call runs alone, "bad" fails by itself
    and its neighbours' tokens equal their jobs alone."""
    items = [_photo(size, size, size % 3, 4) for size in range(3)]

    def fault(row_ids: list[str]) -> Exception | None:
        return ValueError("a row that breaks the model") if "bad" in row_ids else None

    runner = _Counting(backend.step_model(4), fault)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    ids = ["0", "bad", "2"]
    drive(engine, [(_row(backend, row_id, item), 0) for row_id, item in zip(ids, items, strict=True)])
    assert [[row_id for row_id, _ in call] for call in runner.calls] == [ids, ["0"], ["bad"], ["2"]]
    assert done["bad"].error is not None
    assert done["bad"].error.code == "model_error"
    for row_id, item in zip(ids, items, strict=True):
        if row_id != "bad":
            assert done[row_id].error is None
            assert done[row_id].tokens == _alone(backend, item), row_id


def test_a_call_whose_token_pick_fails_leaves_its_rows_as_they_were(backend: FuyuBackend) -> None:
    """Review finding: the call recorded every row's new length before picking the first tokens, so a
    pick that failed (out of memory in lm_head, the grammar's fill) left the rows' chunks run alone
    refused ("a chunk s..s") and every row of the call failed. Now nothing is recorded before the pick."""
    items = [_photo(size, size, size % 3, 4) for size in range(3)]
    inner = backend.step_model(4)
    head = inner.model.lm_head
    armed = [True]

    def fault(row_ids: list[str]) -> Exception | None:
        if len(row_ids) > 1 and armed[0]:  # the forward runs; the pick's lm_head fails, once
            armed[0] = False

            def failing(_hidden: Any) -> Any:
                del head.forward
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

            head.forward = failing
        return None

    runner = _Counting(inner, fault)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    drive(engine, [(_row(backend, str(i), item), 0) for i, item in enumerate(items)])
    assert [len(call) for call in runner.calls] == [3, 1, 1, 1]
    for index, item in enumerate(items):
        assert done[str(index)].error is None, done[str(index)].error
        assert done[str(index)].tokens == _alone(backend, item)
    assert inner.table.used == 0


def test_a_retirement_out_of_memory_during_a_calls_joins_sends_the_rest_back(backend: FuyuBackend) -> None:
    """Review finding: a row ending at its first token retires as the call's rows join; its retirement
    running out of memory sends every row in memory back to waiting, and the call's next row then
    joined from a prefilling list it was no longer in (KeyError: the engine's end). Now the joins stop
    there, and every row still finishes with its own tokens."""
    items = [_photo(0, 0, 0, 1), _photo(1, 1, 1, 4), _photo(2, 2, 2, 4)]

    for decode in ("rows", "fixed", "pool"):
        runner = _RetiringOutOfMemory(backend.step_model(4, decode=decode))
        done: dict[str, Sequence] = {}
        engine = Engine(
            runner, scheduler.Limits(4, 0), lambda row, done=done: done.__setitem__(row.row_id, row)
        )
        drive(engine, [(_row(backend, str(i), item), 0) for i, item in enumerate(items)])
        assert not runner.armed, "the retirement never ran out of memory"
        for index, item in enumerate(items):
            assert done[str(index)].error is None, (decode, index)
            assert done[str(index)].tokens == _alone(backend, item), (decode, index)


def test_a_failed_call_run_row_by_row_stops_where_a_retirement_sent_the_rows_back(
    backend: FuyuBackend,
) -> None:
    """Review finding: a call of three rows fails for its second row's image (its patches made as its
    first chunk runs), and the rows run alone; the first ends at its first token and its retirement
    runs out of memory, sending every row in memory back to waiting. The second then ran from a
    prefilling list it was no longer in (KeyError: the engine's end, every job in hand failed). Now
    the rows alone stop there; the bad row fails by itself and the others finish with their tokens."""
    items = {"a": _photo(0, 0, 0, 1), "bad": _photo(2, 2, 2, 4), "c": _photo(1, 1, 1, 3)}

    rows = []
    for row_id, item in items.items():
        row = _row(backend, row_id, item)
        if row_id == "bad":
            row.inputs = {**row.inputs, "pixel_values": row.inputs["pixel_values"][:-1]}
        rows.append(row)
    runner = _RetiringOutOfMemory(backend.step_model(4))
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    drive(engine, [(row, 0) for row in rows])
    assert not runner.armed, "the retirement never ran out of memory"
    assert done["bad"].error is not None
    assert done["bad"].error.code == "model_error"
    for row_id in ("a", "c"):
        assert done[row_id].error is None, row_id
        assert done[row_id].tokens == _alone(backend, items[row_id]), row_id
    assert (list(runner.inner._pending), runner.inner.table.used) == ([], 0)


@pytest.mark.parametrize("budget", [130, 200, 250])
def test_a_ticket_waiting_for_its_photos_prefix_keeps_its_place_ahead_of_the_backlog(
    backend: FuyuBackend, budget: int
) -> None:
    """Review finding: a ticket deferred to the step's second call (its photo's prefix being written by
    the first) gave its share of the budget to the backlog row after it, which took it in the first
    call: the ticket's first token came a step later than before packing (and at 250 positions, after
    the backlog row's). The rows after a deferred row now wait with it."""
    big = GenerationInput(torch.full((3, 480, 640), 77, dtype=torch.uint8), "Refund?", 6)
    jobs = [
        ("X", big, 0, "backlog", ("key", "big")),
        ("T1", _photo(3, 0, 0, 6), 1, "interactive", ("key", 0)),
        ("T2", _photo(3, 0, 1, 6), 1, "interactive", ("key", 0)),
    ]
    done: dict[str, Sequence] = {}
    steps = [0]
    engine = Engine(
        backend.step_model(4), scheduler.Limits(4, 0, prefill_tokens=budget),
        lambda row: done.__setitem__(row.row_id, row), clock=lambda: float(steps[0]),
    )  # fmt: skip
    rows = []
    for row_id, item, arrival, lane, identity in jobs:
        row = _row(backend, row_id, item, identity)
        row.lane = lane
        rows.append((row, arrival))
    pending = sorted(rows, key=lambda pair: pair[1])
    while pending or not engine.idle:
        while pending and pending[0][1] <= engine.steps:
            engine.submit(pending.pop(0)[0])
        engine.step()
        steps[0] = engine.steps  # the clock reads the step a row's first token came at
    assert done["T1"].first_token_at == done["T2"].first_token_at == 1.0  # the step they came at
    assert done["T2"].cached_tokens > 0
    assert done["X"].first_token_at is not None
    assert done["X"].first_token_at > 1.0
    for row_id, item, *_ in jobs:
        assert done[row_id].tokens == _alone(backend, item), row_id


def test_a_calls_cpu_threads_follow_what_its_rows_compute_in_all(backend: FuyuBackend) -> None:
    """Review finding: threads sized by the rows' whole prompts put a question's few positions after
    its photo's prefix hit on every core (small calls on every core are the slowest case beside busy
    processes, workers/cpu_threads.py). Sized by each row's prefill less what it reused: a chunk of a
    long prompt still counts the whole prefill."""
    sized: list[int] = []
    runner = backend.step_model(2)
    runner.threads = lambda positions, _kind: sized.append(positions)
    first = backend.prepare([_photo(3, 0, 0, 2)]).inputs
    length = int(first["input_ids"].shape[1])
    assert runner.begin("a", first, length, ("key", 0)) == 0
    runner.extend([("a", 100)])
    runner.extend([("a", length)])
    assert sized == [length, length], "a chunk of a prompt not counted as its whole prefill"
    runner.table.retain("a")
    second = backend.prepare([_photo(3, 0, 1, 2)]).inputs
    other = int(second["input_ids"].shape[1])
    reused = runner.begin("b", second, other, ("key", 0))
    assert reused > 0
    runner.extend([("b", other)])
    assert sized[-1] == other - reused


def test_a_prefix_hit_projects_only_the_patches_past_it(backend: FuyuBackend) -> None:
    """A photo's question after a hit projects the image patches it still computes (64 at least), not
    all, and the positions it computes get the embeddings a row without a hit gets."""
    noise = torch.Generator().manual_seed(7)
    image = torch.randint(0, 256, (3, 700, 600), dtype=torch.uint8, generator=noise)
    inputs = backend.prepare([GenerationInput(image, "Is the parcel damaged?", 4)]).inputs
    vision = backend.model.model.vision_embed_tokens
    projected: list[int] = []
    hook = vision.register_forward_hook(lambda _m, args, _out: projected.append(int(args[0].shape[-2])))
    try:
        whole = embed(backend.model, inputs)
        patches = projected.pop()
        ids = inputs["input_ids"][0]
        image_end = int((ids == backend.model.config.image_token_id).nonzero().max()) + 1
        for reused in (1, 16, 300, image_end - 40, image_end - 1, image_end, int(ids.shape[0]) - 1):
            part = embed(backend.model, inputs, reused)
            assert torch.allclose(part[:, reused:], whole[:, reused:], rtol=0, atol=1e-5), reused
            before = int((ids[:reused] == backend.model.config.image_token_id).sum())
            assert projected.pop() == max(min(PROJECTED_AT_LEAST, patches), patches - before), reused
    finally:
        hook.remove()
