"""The iteration-level engine (workers/engine/): its oracle and its scheduling policy.

The oracle: every row's tokens equal the same job through `generate()` alone (greedy, fp32, CPU),
whatever the arrival schedule, the image sizes, the prompt lengths and the `max_new_tokens` of the
rows it shares steps with: rows join the running batch mid-flight and leave at their own length.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.settings import Settings
from tests.support.engine_runs import PROMPTS, SIZES, drive
from tests.support.engine_runs import alone as _alone
from tests.support.engine_runs import photo as _photo
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import capacity, scheduler, slot_table
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")
DECODES = ["rows", "fixed", "pool"]


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    loaded = FuyuBackend(Settings(model="tiny", home=HOME, quantization="fp32", device="cpu"))
    loaded.load()
    return loaded


def _item(size: int, prompt: int, new: int) -> GenerationInput:
    height, width = SIZES[size]
    fill = 40 + 50 * size + 7 * prompt  # a different picture per size and prompt
    image = torch.full((3, height, width), fill, dtype=torch.uint8)
    image[:, : height // 2] = 255 - fill
    return GenerationInput(image, PROMPTS[prompt], new)


def _sequence(backend: FuyuBackend, row_id: str, item: GenerationInput, lane: str) -> Sequence:
    inputs = backend.prepare([item]).inputs
    return Sequence(
        row_id, inputs, int(inputs["input_ids"].shape[1]), item.max_new_tokens, backend.eos_id, lane
    )


def _run(
    backend: FuyuBackend,
    jobs: list[tuple[GenerationInput, int, str]],
    limits: scheduler.Limits,
    decode: str = "rows",
) -> tuple[dict[str, Sequence], Engine]:
    """Submit each job at its arrival step; run until every row has finished."""
    done: dict[str, Sequence] = {}
    runner = backend.step_model(limits.max_rows, decode=decode)
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i][1])
    while pending or not engine.idle:
        while pending and jobs[pending[0]][1] <= engine.steps:
            index = pending.pop(0)
            item, _arrival, lane = jobs[index]
            engine.submit(_sequence(backend, str(index), item, lane))
        engine.step()
        assert engine.steps < 500, "the engine does not finish"
    return done, engine


job = st.tuples(
    st.integers(0, len(SIZES) - 1), st.integers(0, len(PROMPTS) - 1), st.integers(1, 10),
    st.integers(0, 6), st.sampled_from(["interactive", "backlog"]),
)  # fmt: skip


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    st.lists(job, min_size=1, max_size=4), st.integers(1, 4), st.booleans(), st.sampled_from(DECODES),
    st.sampled_from([0.0, 0.25, 1.0]),
)  # fmt: skip
def test_every_row_equals_the_same_job_alone(
    backend: FuyuBackend, spec: list[Any], rows: int, hold: bool, decode: str, share: float
) -> None:
    """Both ways a decode step runs: rows as they are (the CPU's), one fixed-shape call (CUDA's); with
    and without the backlog's share (held rows stepping beside tickets, backlog rows joining them)."""
    reference = cache(lambda size, prompt, new: tuple(_alone(backend, _item(size, prompt, new))))
    jobs = [(_item(size, prompt, new), arrival, lane) for size, prompt, new, arrival, lane in spec]
    limits = scheduler.Limits(max_rows=rows, reserved_interactive=0, hold_backlog=hold, backlog_share=share)
    done, _engine = _run(backend, jobs, limits, decode)
    assert sorted(done) == [str(i) for i in range(len(jobs))]
    for index, (size, prompt, new, _arrival, _lane) in enumerate(spec):
        row = done[str(index)]
        assert row.tokens == list(reference(size, prompt, new)), f"row {index} of {spec}"
        assert row.finish_reason == ("length" if len(row.tokens) == new else "stop")


photo_job = st.tuples(
    st.integers(0, len(SIZES) - 1), st.integers(0, 2), st.integers(0, len(PROMPTS) - 1), st.integers(1, 8),
    st.integers(0, 8), st.sampled_from(["interactive", "backlog"]),
)  # fmt: skip


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    st.lists(photo_job, min_size=1, max_size=6), st.integers(1, 4), st.sampled_from([1 << 30, 16, 23, 100]),
    st.booleans(), st.sampled_from(DECODES),
)  # fmt: skip
def test_with_prefix_hits_chunks_and_evictions_every_row_equals_the_same_job_alone(
    backend: FuyuBackend, spec: list[Any], rows: int, chunk: int, hold: bool, decode: str
) -> None:
    """Questions about the same photos in any order: a row whose photo (and prompt start) is in a slot
    reuses those positions (from a running row, or a finished row's slot until a row needs it), the
    rest is prefilled in chunks of any size between decode steps; the tokens never change."""
    reference = cache(lambda *key: tuple(_alone(backend, _photo(*key))))
    done: dict[str, Sequence] = {}
    runner = backend.step_model(rows, decode=decode)
    limits = scheduler.Limits(rows, 0, hold_backlog=hold, prefill_tokens=chunk, backlog_share=0.25)
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
    arrivals = sorted(range(len(spec)), key=lambda i: spec[i][4])
    while arrivals or not engine.idle:
        while arrivals and spec[arrivals[0]][4] <= engine.steps:
            index = arrivals.pop(0)
            size, photo, prompt, new, _arrival, lane = spec[index]
            row = _sequence(backend, str(index), _photo(size, photo, prompt, new), lane)
            row.identity = ("key", size, photo)
            engine.submit(row)
        engine.step()
        assert engine.steps < 2000, "the engine does not finish"
        for row in {**engine.running, **engine.held, **engine.prefilling}.values():
            # the slot is the row's need, as admission counted it: a larger one (a retained slot taken
            # over whole) is room admission does not know of, and a ticket it let in finds none
            assert runner.table.size(row.row_id) == runner.table.extent(row.need), row.row_id
    for index, (size, photo, prompt, new, _arrival, _lane) in enumerate(spec):
        row = done[str(index)]
        assert row.tokens == list(reference(size, photo, prompt, new)), f"row {index} of {spec}"
        assert row.cached_tokens < row.prompt_tokens
    assert runner.table.used == 0


def test_a_photos_second_question_reuses_its_prefix_and_another_keys_does_not(backend: FuyuBackend) -> None:
    """The same photo asked twice, one after the other: the second reuses the image's positions from
    the first's retained slot (whole blocks, all but the question); from another key, nothing."""
    runner = backend.step_model(2)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(2, 0), lambda row: done.__setitem__(row.row_id, row))
    asks = [("a", "alice", 0), ("b", "alice", 1), ("c", "bob", 2)]
    for row_id, key, prompt in asks:
        row = _sequence(backend, row_id, _photo(3, 0, prompt, 3), "interactive")
        row.identity = (key, "photo")
        engine.submit(row)
        while not engine.idle:
            engine.step()
    image = backend.image_tokens(*SIZES[3])  # the prompts differ from their first token on
    assert done["a"].cached_tokens == 0
    assert done["b"].cached_tokens >= image - 15, (done["b"].cached_tokens, image)
    assert done["b"].cached_tokens % 16 == 0
    assert done["c"].cached_tokens == 0, "another key's photo reused"
    for row_id, _key, prompt in asks:
        assert done[row_id].tokens == _alone(backend, _photo(3, 0, prompt, 3))


def test_a_paused_row_admitted_again_finds_its_own_prefix_and_keeps_the_table_whole(
    backend: FuyuBackend,
) -> None:
    """A row paused mid-prefill leaves its slot to the cache; admitted again under the same row id it
    collided with that slot (ValueError, the engine's end) or took a slot over twice (one lost). Now
    the slot passes to a cache entry of its own, which the row takes over when it comes back."""
    runner = backend.step_model(3)
    item = _photo(3, 0, 1, 3)
    inputs = backend.prepare([item]).inputs
    length = int(inputs["input_ids"].shape[1])
    assert runner.begin("a", inputs, length, ("key", "photo")) == 0
    assert runner.extend([("a", length)]) != [None]  # a runs: its prefix is in slot 0
    assert runner.begin("b", inputs, length, ("key", "photo")) >= length - 16  # copied from a
    runner.abandon("b", keep=True)  # paused
    assert runner.begin("b", inputs, length, ("key", "photo")) >= length - 16  # back, no collision
    [token] = runner.extend([("b", length)])
    assert token == _alone(backend, item)[0]
    assert runner.table.used == 2
    assert runner.table.reserved == runner.table.size("a") + runner.table.size("b")
    assert runner.table.spare == runner.table.pool - runner.table.reserved  # nothing lost


def test_a_row_joins_mid_flight_and_leaves_at_its_own_length(backend: FuyuBackend) -> None:
    """A long row runs; a short one joins at step 3 and leaves before it; a third joins after."""
    long, short, late = _item(3, 1, 12), _item(0, 0, 3), _item(1, 2, 5)
    jobs = [(long, 0, "backlog"), (short, 3, "interactive"), (late, 5, "interactive")]
    done, engine = _run(backend, jobs, scheduler.Limits(max_rows=4))
    for index, (item, _arrival, _lane) in enumerate(jobs):
        assert done[str(index)].tokens == _alone(backend, item)
    assert engine.steps < 12 + 2, "the rows did not share steps"


# ------------------------------------------------------------------ the policy (no model)
def _c(row_id: str, lane: str = "interactive") -> scheduler.Candidate:
    return scheduler.Candidate(row_id, lane)


def test_interactive_rows_are_admitted_before_backlog_rows_whatever_came_first() -> None:
    waiting = [_c("b1", "backlog"), _c("i1"), _c("b2", "backlog"), _c("i2"), _c("i3")]
    limits = scheduler.Limits(max_rows=3, reserved_interactive=0)
    assert scheduler.admit(waiting, [], limits) == ["i1", "i2", "i3"]
    assert scheduler.admit(waiting[:3], [], limits) == ["i1"]  # no backlog beside a ticket (below)
    assert scheduler.admit([_c("b1", "backlog"), _c("b2", "backlog")], [], limits) == ["b1", "b2"]


def test_slots_kept_for_tickets_are_never_taken_by_backlog_rows() -> None:
    limits = scheduler.Limits(max_rows=4, reserved_interactive=1)
    running = [_c(f"b{i}", "backlog") for i in range(3)]
    assert scheduler.admit([_c("b9", "backlog")], running, limits) == []
    assert scheduler.admit([_c("b9", "backlog"), _c("t1")], running, limits) == ["t1"]


def test_a_row_is_admitted_while_a_slot_is_free_whatever_its_length() -> None:
    """Every slot holds any job to its longest: admission counts slots, not rows x the longest."""
    limits = scheduler.Limits(max_rows=3, reserved_interactive=0)
    running = [_c("r1"), _c("r2")]
    assert scheduler.admit([_c("a"), _c("b")], running, limits) == ["a"]
    assert scheduler.admit([_c("a")], [*running, _c("r3")], limits) == []


# ------------------------------------------------------------------ pauses and failures (the model)
class _Faulty:
    """The real runner, with faults injected by a rule over each call."""

    def __init__(self, backend: FuyuBackend, prefill_fault: Any = None, decode_fault: Any = None) -> None:
        self.inner = backend.step_model(8)
        self.prefill_fault, self.decode_fault = prefill_fault, decode_fault
        self.decodes: list[list[str]] = []
        self.inputs: dict[str, Any] = {}

    def new_batch(self) -> Any:
        return self.inner.new_batch()

    def begin(self, row_id: str, inputs: Any, length: int, identity: Any = None, need: Any = None) -> int:
        self.inputs[row_id] = inputs
        return self.inner.begin(row_id, inputs, length, identity, need)

    def extend(self, chunks: list[tuple[str, int]], masks: Any = None) -> list[int | None]:
        for row_id, _stop in chunks:
            error = self.prefill_fault(self.inputs[row_id]) if self.prefill_fault is not None else None
            if error is not None:
                raise error
        return self.inner.extend(chunks, masks)

    def sharing(self, row_id: str, writers: list[tuple[str, int]]) -> bool:
        return bool(self.inner.sharing(row_id, writers))

    def abandon(self, row_id: str, keep: bool = False) -> None:
        self.inner.abandon(row_id, keep)

    def catch_up(self, row_id: str) -> int:
        return int(self.inner.catch_up(row_id))

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        self.decodes.append(list(batch.row_ids))
        if self.decode_fault is not None and (error := self.decode_fault(batch.row_ids)) is not None:
            raise error
        return self.inner.decode(batch, last, masks)


_drive = drive


def test_a_ticket_pauses_a_backlog_row_which_resumes_with_the_same_tokens(backend: FuyuBackend) -> None:
    """Rows full of backlog, no slot kept: the ticket is admitted at the very next step, the youngest
    backlog row goes back to waiting and, recomputed later, still equals its run alone."""
    items = [_item(1, 0, 10), _item(2, 1, 10), _item(0, 2, 4)]
    done: dict[str, Sequence] = {}
    runner = _Faulty(backend)
    limits = scheduler.Limits(max_rows=2, reserved_interactive=0)
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
    rows = [_sequence(backend, "b1", items[0], "backlog"), _sequence(backend, "b2", items[1], "backlog")]
    ticket = _sequence(backend, "t", items[2], "interactive")
    _drive(engine, [(rows[0], 0), (rows[1], 0), (ticket, 3)])
    assert done["b2"].restarts == 1
    assert done["b1"].restarts == 0
    assert set(runner.decodes[3]) == {"b1", "t"}, "the ticket did not take b2's slot at once"
    for row_id, item in zip(["b1", "b2", "t"], items, strict=True):
        assert done[row_id].tokens == _alone(backend, item)


def test_a_paused_job_counts_once_in_the_hit_ratio(backend: FuyuBackend) -> None:
    """Review finding: lookups and hits were counted per admission, so a paused row admitted again
    counted twice, and mostly as a hit on its own kept prefix. Jobs of one photo: one lookup each,
    hits at most the lookups, whatever the pauses."""
    items = [_item(1, 0, 10), _item(1, 1, 10), _item(1, 2, 4)]  # one photo, three questions
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows=2, reserved_interactive=0)
    engine = Engine(backend.step_model(2), limits, lambda row: done.__setitem__(row.row_id, row))
    rows = [_sequence(backend, "b1", items[0], "backlog"), _sequence(backend, "b2", items[1], "backlog")]
    ticket = _sequence(backend, "t", items[2], "interactive")
    for row in (*rows, ticket):
        row.identity = ("key", "photo-1")
    lookups = hits = 0
    arrivals = [(rows[0], 0), (rows[1], 0), (ticket, 3)]
    while arrivals or not engine.idle:
        while arrivals and arrivals[0][1] <= engine.steps:
            engine.submit(arrivals.pop(0)[0])
        report = engine.step()
        lookups, hits = lookups + report.lookups, hits + report.hits
        assert engine.steps < 500
    assert done["b2"].restarts == 1  # paused for the ticket, admitted again
    assert lookups == 3
    assert 1 <= hits <= 2  # the first question of the photo computes it


def test_held_backlog_rows_sit_out_a_tickets_steps_and_resume_with_the_same_tokens(
    backend: FuyuBackend,
) -> None:
    """With hold on (the CPU's default), a ticket's decode steps run without the backlog rows, whose
    cache is kept; they resume where they were once it is done, each still equal to its run alone."""
    items = [_item(1, 0, 12), _item(2, 1, 12), _item(0, 2, 4)]
    done: dict[str, Sequence] = {}
    runner = _Faulty(backend)
    limits = scheduler.Limits(max_rows=4, reserved_interactive=1, hold_backlog=True)
    engine = Engine(runner, limits, lambda row: done.__setitem__(row.row_id, row))
    rows = [_sequence(backend, "b1", items[0], "backlog"), _sequence(backend, "b2", items[1], "backlog")]
    ticket = _sequence(backend, "t", items[2], "interactive")
    _drive(engine, [(rows[0], 0), (rows[1], 0), (ticket, 3)])
    with_ticket = [ids for ids in runner.decodes if "t" in ids]
    assert with_ticket, "the ticket never decoded"
    assert all(ids == ["t"] for ids in with_ticket), f"backlog rows stepped beside the ticket: {with_ticket}"
    assert done["b1"].restarts == done["b2"].restarts == 0  # held, not recomputed
    for row_id, item in zip(["b1", "b2", "t"], items, strict=True):
        assert done[row_id].tokens == _alone(backend, item)


def test_out_of_memory_at_admission_waits_then_runs_alone(backend: FuyuBackend) -> None:
    """A prefill that runs out of memory beside other rows waits (nothing more is admitted) and runs
    once they have left; the same with nothing beside it fails that row alone."""
    big, small = _item(3, 1, 3), _item(0, 0, 6)
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    tried: list[bool] = []

    def fault(inputs: Any) -> Exception | None:
        tried.append(bool(engine.running))
        return oom if inputs["input_ids"].shape[1] > 50 and engine.running else None

    done: dict[str, Sequence] = {}
    engine = Engine(
        _Faulty(backend, prefill_fault=fault), scheduler.Limits(4, 0),
        lambda row: done.__setitem__(row.row_id, row),
    )  # fmt: skip
    _drive(
        engine,
        [(_sequence(backend, "small", small, "backlog"), 0), (_sequence(backend, "big", big, "backlog"), 1)],
    )
    assert done["big"].error is None
    assert done["big"].tokens == _alone(backend, big)
    assert done["small"].tokens == _alone(backend, small)
    assert True in tried, "big was never tried beside small"
    assert tried[-1] is False, "big never waited for the batch to empty"

    failed: dict[str, Sequence] = {}
    lonely = Engine(
        _Faulty(backend, prefill_fault=lambda _inputs: oom), scheduler.Limits(4, 0),
        lambda row: failed.__setitem__(row.row_id, row),
    )  # fmt: skip
    _drive(lonely, [(_sequence(backend, "big", big, "backlog"), 0)])
    assert type(failed["big"].error).__name__ == "OutOfMemory"


class _BeginFailsOnce:
    """The real runner; taking a slot for `victim` runs out of memory once (a prefix copy on a GPU)."""

    def __init__(self, inner: Any, victim: str) -> None:
        self.inner, self.table, self.victim, self.failed = inner, inner.table, victim, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, row_id: str, *args: Any, **kwargs: Any) -> int:
        if row_id == self.victim and not self.failed:
            self.failed = True
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return int(self.inner.begin(row_id, *args, **kwargs))


def test_a_row_whose_admission_failed_waits_in_its_place_and_can_still_be_cancelled(
    backend: FuyuBackend,
) -> None:
    """Review, helper-64: a row whose slot could not be taken beside others was stamped admitted, so a
    cancel of its run no longer reached it (it ran to its end) and its queue time ended there; the
    rows the same plan admitted after it were put back before it."""
    done: dict[str, Sequence] = {}
    engine = Engine(
        _BeginFailsOnce(backend.step_model(4), "b2"), scheduler.Limits(3, 0),
        lambda row: done.__setitem__(row.row_id, row),
    )  # fmt: skip
    rows = {name: _sequence(backend, name, _item(0, 0, 3), "backlog") for name in ("b1", "b2", "b3", "b4")}
    for row in rows.values():
        engine.submit(row)
    engine.step()  # the plan admits b1, b2, b3; b2's slot fails beside b1
    assert [row.row_id for row in engine.waiting] == ["b2", "b3", "b4"]
    assert rows["b2"].first_admitted_at is None
    rows["b2"].cancelled = True  # its run is cancelled while it waits (workers/cancel_watch.py)
    while not engine.idle:
        engine.step()
    assert type(done["b2"].error).__name__ == "Cancelled"
    for name in ("b1", "b3", "b4"):
        assert done[name].error is None
        assert done[name].tokens == _alone(backend, _item(0, 0, 3))


def test_a_step_that_fails_only_in_company_is_split_until_each_row_runs_alone(backend: FuyuBackend) -> None:
    """A decode error that no single row explains: the rows are recomputed in halves, each half apart,
    a half that fails again is halved again, and each row succeeds with its own tokens (the one that
    breaks the model would fail by itself)."""
    items = [_item(0, 0, 6), _item(1, 1, 6), _item(2, 2, 6)]

    def fault(row_ids: list[str]) -> Exception | None:
        return ValueError("shapes do not match") if len(row_ids) > 1 else None

    runner = _Faulty(backend, decode_fault=fault)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(4, 0), lambda row: done.__setitem__(row.row_id, row))
    _drive(engine, [(_sequence(backend, str(i), item, "backlog"), 0) for i, item in enumerate(items)])
    for index, item in enumerate(items):
        assert done[str(index)].error is None
        assert done[str(index)].tokens == _alone(backend, item)
    assert runner.decodes[0] == ["0", "1", "2"]
    assert runner.decodes[1] == ["0", "1"], "the first half did not run apart"  # fails again: halved
    assert all(len(ids) == 1 for ids in runner.decodes[2:]), "rows shared a step after two failures"


def test_a_device_fault_mid_step_fails_every_row_with_the_worker(backend: FuyuBackend) -> None:
    from concurrent.futures import wait

    from shared.errors import WorkerUnusable
    from workers.engine.service import EngineService
    from workers.metrics import Metrics

    def fault(row_ids: list[str]) -> Exception | None:
        return (
            RuntimeError("CUDA error: an illegal memory access was encountered") if len(row_ids) > 1 else None
        )

    service = EngineService(_Faulty(backend, decode_fault=fault), scheduler.Limits(4, 0), Metrics())
    service.start()
    # One call: three rows submitted one by one could let the first finish alone before the others
    # joined (a fast thread, a busy machine), and a lone row's step never meets the fault.
    futures = service.submit_many([_sequence(backend, str(i), _item(i, 0, 8), "backlog") for i in range(3)])
    wait(futures, timeout=60)
    assert all(isinstance(f.exception(), WorkerUnusable) for f in futures)
    late = service.submit(_sequence(backend, "late", _item(0, 0, 2), "interactive"))
    assert isinstance(late.exception(timeout=5), WorkerUnusable), "the dead engine took new work"
    service.stop()


def test_a_row_past_its_deadline_expires_at_admission(backend: FuyuBackend) -> None:
    done: dict[str, Sequence] = {}
    engine = Engine(backend.step_model(4), scheduler.Limits(4, 0), lambda r: done.__setitem__(r.row_id, r))
    row = _sequence(backend, "late", _item(0, 0, 4), "backlog")
    row.deadline = 1.0  # 1970
    _drive(engine, [(row, 0)])
    assert type(done["late"].error).__name__ == "Expired"
    assert done["late"].admitted_at is None


# ------------------------------------------------------------------ pauses and the alone rule (no model)
def _a(row_id: str, lane: str = "interactive", alone: bool = False) -> scheduler.Candidate:
    return scheduler.Candidate(row_id, lane, row_id if alone else None)  # alone: a group of one


def test_a_ticket_pauses_the_youngest_backlog_rows_only_as_many_as_it_needs() -> None:
    limits = scheduler.Limits(max_rows=3, reserved_interactive=0)
    running = [_a("b1", "backlog"), _a("t0"), _a("b2", "backlog")]
    plan = scheduler.plan([_a("t1")], running, limits)
    assert (plan.admit, plan.pause) == (["t1"], ["b2"])
    crowded = scheduler.plan([_a("t1")], [_a("t0"), _a("t2"), _a("t3")], limits)
    assert (crowded.admit, crowded.pause) == ([], []), "a ticket paused another ticket"
    two = scheduler.Limits(max_rows=2, reserved_interactive=0)
    big = scheduler.plan([_a("t1"), _a("t2")], [_a("b1", "backlog"), _a("b2", "backlog")], two)
    assert (big.admit, big.pause) == (["t1", "t2"], ["b2", "b1"])  # the youngest first
    assert scheduler.plan([_a("b3", "backlog")], [_a("b1", "backlog")] * 3, limits).pause == []


def test_no_backlog_row_is_admitted_while_a_ticket_decodes() -> None:
    """A backlog prefill would stall the ticket's every step: its slot is refilled once the ticket is done."""
    limits = scheduler.Limits(max_rows=8, reserved_interactive=0)
    assert scheduler.admit([_a("b2", "backlog")], [_a("b1", "backlog"), _a("t1")], limits) == []
    assert scheduler.admit([_a("b2", "backlog"), _a("t2")], [_a("b1", "backlog")], limits) == ["t2"]
    assert scheduler.admit([_a("b2", "backlog")], [_a("b1", "backlog")], limits) == ["b2"]


def test_backlog_prefill_per_step_is_bounded_so_a_ticket_waits_for_little() -> None:
    limits = scheduler.Limits(max_rows=8, reserved_interactive=0, backlog_prefill_tokens=3000)
    waiting = [scheduler.Candidate(f"b{i}", "backlog", prompt_tokens=1300) for i in range(5)]
    assert scheduler.admit(waiting, [], limits) == ["b0", "b1"]  # 2 x 1300 <= 3000 < 3 x 1300
    huge = [scheduler.Candidate("h", "backlog", prompt_tokens=8000)]
    assert scheduler.admit(huge, [], limits) == ["h"]  # one row always may


def test_a_suspect_runs_with_nothing_beside_it_and_nothing_is_admitted_past_it() -> None:
    limits = scheduler.Limits(max_rows=8, reserved_interactive=0)
    assert scheduler.plan([_a("s", alone=True), _a("t")], [], limits).admit == ["s"]
    # It waits for the ticket running; nothing later is admitted past it, so it is never starved.
    assert scheduler.plan([_a("s", alone=True), _a("t")], [_a("r")], limits).admit == []
    assert scheduler.plan([_a("t")], [_a("s", alone=True)], limits).admit == []
    backlog = [_a("b1", "backlog"), _a("b2", "backlog")]
    assert scheduler.plan([_a("b9", "backlog", alone=True), _a("b3", "backlog")], backlog, limits).admit == []


def test_a_ticket_suspect_pauses_backlog_rows_and_a_backlog_suspect_gives_way_to_tickets() -> None:
    limits = scheduler.Limits(max_rows=8, reserved_interactive=0)
    held = [_a("b1", "backlog"), _a("b2", "backlog")]  # running or held: both are in memory
    plan = scheduler.plan([_a("s", alone=True)], held, limits)
    assert (plan.admit, sorted(plan.pause)) == (["s"], ["b1", "b2"])
    plan = scheduler.plan([_a("t")], [_a("b", "backlog", alone=True)], limits)
    assert (plan.admit, plan.pause) == (["t"], ["b"])
    plan = scheduler.plan([_a("b2", "backlog")], [_a("b", "backlog", alone=True)], limits)
    assert (plan.admit, plan.pause) == ([], [])


def test_one_backlog_row_runs_into_an_empty_cache_even_when_the_reserve_takes_every_slot() -> None:
    # A memory ceiling lowered to the reserve (2 of 2) must not leave the backlog idle with the cache
    # empty for the ceiling's whole life; a ticket that comes pauses the row.
    limits = scheduler.Limits(max_rows=2, reserved_interactive=2)
    assert scheduler.admit([_a("b1", "backlog"), _a("b2", "backlog")], [], limits) == ["b1"]
    assert scheduler.admit([_a("b2", "backlog")], [_a("b1", "backlog")], limits) == []
    plan = scheduler.plan(
        [_a("t1")], [_a("b1", "backlog")], scheduler.Limits(max_rows=1, reserved_interactive=1)
    )
    assert (plan.admit, plan.pause) == (["t1"], ["b1"])


def test_a_lowered_memory_ceiling_keeps_every_other_limit() -> None:
    from workers.backends.echo import EchoBackend

    limits = scheduler.Limits(8, 2, hold_backlog=True, backlog_prefill_tokens=2048)
    engine = Engine(EchoBackend().step_model(), limits, lambda _row: None)
    engine.row_ceiling = 3  # as after an out-of-memory step
    assert engine._limits() == scheduler.Limits(3, 2, hold_backlog=True, backlog_prefill_tokens=2048)


def test_streaming_rows_publish_their_answers_once_each_through_a_pause(backend: FuyuBackend) -> None:
    """The engine's thread offers each streaming row's tokens after every step; the publisher writes
    text a row's answer begins with, once, even when a ticket pauses the row and it starts again."""
    import threading
    import time
    from concurrent.futures import wait

    from workers.engine.service import EngineService
    from workers.metrics import Metrics
    from workers.streaming import MemorySink, TextStreams

    sink = MemorySink()
    streams = TextStreams(sink, backend.detokenize, 0.001, backend.cleans_spaces, backend.settled).start()
    limits = scheduler.Limits(max_rows=2, reserved_interactive=0)
    ticket_in = threading.Event()

    def gate(row_ids: list[str]) -> None:
        # The rows' sixth step waits for the ticket: they are mid-answer when it comes, on any machine
        # (a fast one could finish ten tokens before the test's thread looked).
        if len(runner.decodes) >= 6 and "t" not in row_ids:
            ticket_in.wait(60)

    runner = _Faulty(backend, decode_fault=gate)
    service = EngineService(runner, limits, Metrics(), streams=streams).start()
    rows = [_sequence(backend, f"b{i}", _item(i + 1, i, 10), "backlog") for i in range(2)]
    for row in rows:
        row.stream_to = f"job-{row.row_id}"
    futures = service.submit_many(rows)
    deadline = time.monotonic() + 60
    while not any(e.job_id == "job-b1" for e in sink.entries) and time.monotonic() < deadline:
        time.sleep(0.005)
    ticket = service.submit(_sequence(backend, "t", _item(0, 2, 4), "interactive"))
    ticket_in.set()
    wait([*futures, ticket], timeout=120)
    assert any(f.result().restarts for f in futures), "the ticket paused no row: nothing was tested"
    service.stop()
    streams.stop()
    for future, item in zip(futures, [_item(1, 0, 10), _item(2, 1, 10)], strict=True):
        row = future.result()
        assert row.tokens == _alone(backend, item)
        entries = [e for e in sink.entries if e.job_id == row.stream_to]
        at = 0
        for entry in entries:
            assert entry.at == at
            at += len(entry.text)
        assert "".join(e.text for e in entries) == backend.detokenize(row.tokens)
        assert entries[-1].end
    assert not any(e.job_id.startswith("job-t") for e in sink.entries)  # it asked for no stream


def test_a_pool_of_two_longest_slots_holds_a_dozen_small_rows_at_once(backend: FuyuBackend) -> None:
    """Memory held by need: each row's slot is its prompt and its own new tokens, so the pool that
    uniform slots would give two rows holds all twelve small ones at once, and every row still equals
    the same job alone."""
    positions = backend.slot_positions()
    pool = 2 * -(-positions // 16) * 16
    runner = backend.step_model(16, positions, pool, decode="rows")
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(16, 0), lambda row: done.__setitem__(row.row_id, row))
    items = {f"r{i}": _item(i % 3, i % 3, 4 + i % 5) for i in range(12)}
    for row_id, item in items.items():
        engine.submit(_sequence(backend, row_id, item, "backlog"))
    engine.step()
    assert engine.in_memory == 12
    assert runner.table.reserved == sum(runner.table.size(r) for r in items) <= pool
    while not engine.idle:
        engine.step()
    for row_id, item in items.items():
        assert done[row_id].tokens == _alone(backend, item)


@pytest.mark.parametrize("decode", DECODES)
def test_a_job_that_needs_exactly_a_slots_positions_runs(backend: FuyuBackend, decode: str) -> None:
    """The engine refuses a job by its prompt and new tokens less the last (never fed); the slot table
    sized the same job with that last token and refused it mid-admission, a model error."""
    item = _item(1, 1, 5)
    row = _sequence(backend, "exact", item, "interactive")
    positions = row.prompt_tokens + item.max_new_tokens - 1
    pool = slot_table.pool_for(2, positions, capacity.slot_grain(decode, "cpu"))
    runner = backend.step_model(2, positions, pool, decode=decode)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(2, 0), lambda r: done.__setitem__(r.row_id, r))
    engine.submit(row)
    too_long = _sequence(backend, "long", _item(1, 1, 6), "interactive")
    engine.submit(too_long)
    while not engine.idle:
        engine.step()
    assert done["exact"].error is None, done["exact"].error
    assert done["exact"].tokens == _alone(backend, item)
    assert done["long"].error is not None
    assert "cache positions" in str(done["long"].error)


def test_a_rows_candidate_is_made_once_and_follows_what_changes_in_it() -> None:
    from workers.engine import rows as rows_of

    row = Sequence("r", None, 10, 5, 0, "backlog")
    first = rows_of.candidates([row])[0]
    assert rows_of.candidates([row])[0] is first
    assert (first.prompt_tokens, first.need, first.pauses) == (10, 14, 0)
    row.pauses, row.turn, row.group = 1, True, "split-1"
    again = rows_of.candidates([row])[0]
    assert (again.pauses, again.turn, again.group, again.lane) == (1, True, "split-1", "backlog")
