"""The engine under its failure rules, on the echo model's step model (no weights: each answer is a
known script of tokens): suspects that must run alone without starving or blocking tickets, out of
memory in the batch's bookkeeping, an out-of-memory ceiling that is not forever, progress that means a
row moved, and the timings and token counts of rows that were paused or recomputed."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import pytest
import torch

from shared.errors import AnswerIncomplete, ModelError
from tests.support.engine_runs import drive
from tests.support.step_proxy import StepProxy
from workers.backends.base import GenerationInput
from workers.backends.echo import EchoBackend, EchoRows
from workers.engine import engine as engine_module
from workers.engine import scheduler
from workers.engine.engine import Engine
from workers.engine.sequence import Sequence
from workers.engine.service import EngineService
from workers.metrics import Metrics

OOM = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
ECHO = EchoBackend()  # one vocabulary (the echo model numbers words as it meets them) for every run


def _row(
    row_id: str, lane: str = "backlog", new: int = 12, alone: bool = False, prompt: str = ""
) -> Sequence:
    words = " ".join(f"w{i}" for i in range(new))  # the echo answer: the image size, then these words
    item = GenerationInput(torch.zeros((3, 8, 8), dtype=torch.uint8), prompt or f"{row_id} {words}", new)
    return Sequence(row_id, item, 10, new, 0, lane, group=row_id if alone else None)  # a group of one


def _engine(limits: scheduler.Limits, steps: Any = None) -> tuple[Engine, dict[str, Sequence]]:
    done: dict[str, Sequence] = {}
    engine = Engine(steps or ECHO.step_model(), limits, lambda r: done.__setitem__(r.row_id, r))
    return engine, done


def _drive(engine: Engine, arrivals: list[tuple[Sequence, int]]) -> None:
    drive(engine, arrivals, limit=400)


def test_a_ticket_suspect_beside_held_backlog_rows_runs_and_they_resume() -> None:
    """Held rows counted as kept and were released only once no ticket waited: the suspect waited for
    them, they for it, and the engine spun, reporting progress at every step."""
    limits = scheduler.Limits(max_rows=4, reserved_interactive=1, hold_backlog=True)
    engine, done = _engine(limits)
    _drive(engine, [(_row("b1", new=30), 0), (_row("b2", new=30), 0), (_row("s", "interactive", 5, True), 3)])
    assert sorted(done) == ["b1", "b2", "s"]
    assert all(row.error is None for row in done.values())
    assert done["s"].finished_at is not None


def test_a_suspect_is_not_starved_by_the_rows_that_arrive_after_it() -> None:
    limits = scheduler.Limits(max_rows=4, reserved_interactive=0)
    engine, done = _engine(limits)
    stream = [(_row(f"b{i}", new=6), i) for i in range(120)]  # a new backlog row at every step
    _drive(engine, [*stream, (_row("s", new=4, alone=True), 1)])
    finished_order = list(done)
    assert finished_order.index("s") < finished_order.index("b60"), "later rows kept overtaking it"


def test_a_ticket_does_not_wait_for_a_backlog_suspects_whole_answer() -> None:
    limits = scheduler.Limits(max_rows=4, reserved_interactive=0)
    engine, done = _engine(limits)
    _drive(engine, [(_row("s", new=60, alone=True), 0), (_row("t", "interactive", 3), 5)])
    assert done["s"].restarts == 1  # paused for the ticket, then recomputed
    assert list(done) == ["t", "s"]
    assert done["s"].tokens == _alone_tokens(_row("s", new=60, alone=True))


def _alone_tokens(row: Sequence) -> list[int]:
    engine, done = _engine(scheduler.Limits(max_rows=1, reserved_interactive=0))
    _drive(engine, [(row, 0)])
    return done[row.row_id].tokens


class _FlakyBatch(EchoRows):
    """The echo batch, running out of memory on the join or drop numbered `fail_at`."""

    calls = 0
    fail_at: ClassVar[set[int]] = set()

    def _maybe(self) -> None:
        _FlakyBatch.calls += 1
        if _FlakyBatch.calls in _FlakyBatch.fail_at:
            raise OOM

    def join(self, row_id: str) -> None:
        self._maybe()
        super().join(row_id)

    def drop(self, row_ids: set[str], keep: bool = False) -> None:
        self._maybe()
        super().drop(row_ids, keep)


@pytest.mark.parametrize("fail_at", [{2}, {3}, {4, 5}, {6}])
def test_out_of_memory_in_the_batchs_bookkeeping_is_settled_like_a_failed_step(fail_at: set[int]) -> None:
    """A join held 3x the merged cache and a drop 3.1x: out of memory there reached the engine thread
    and every job in hand came back a suspect. Now every row is recomputed and succeeds."""
    steps = ECHO.step_model()
    steps.new_batch = lambda: _FlakyBatch(steps._prefilled)  # type: ignore[method-assign]
    _FlakyBatch.calls, _FlakyBatch.fail_at = 0, fail_at
    engine, done = _engine(scheduler.Limits(max_rows=4, reserved_interactive=0), steps)
    rows = [(_row(f"r{i}", new=4 + 3 * i), i) for i in range(4)]
    _drive(engine, rows)
    for row, _arrival in rows:
        assert done[row.row_id].error is None
        assert done[row.row_id].tokens == _alone_tokens(_row(row.row_id, new=row.max_new_tokens))


class _OomOnce(StepProxy):
    """The echo step model, out of memory once, on the first decode step of three rows or more."""

    def __init__(self) -> None:
        self.inner, self.failed = ECHO.step_model(), False

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        if len(batch) >= 3 and not self.failed:
            self.failed = True
            raise OOM
        return self.inner.decode(batch, last, masks)


def test_a_transient_out_of_memory_ceiling_is_lifted_under_steady_load() -> None:
    """It lasted until running and held rows were both empty: never, under steady load."""
    limits = scheduler.Limits(max_rows=4, reserved_interactive=0)
    engine, done = _engine(limits, _OomOnce())
    long = (_row("long", new=engine_module.CEILING_STEPS + 200), 0)  # runs throughout: it never empties
    stream = [
        long,
        *((_row(f"b{i}", new=8), 1 + i // 2) for i in range(2 * (engine_module.CEILING_STEPS + 40))),
    ]
    seen: list[tuple[int | None, int]] = []  # (the ceiling, rows running) after each step
    pending = sorted(stream, key=lambda pair: pair[1])
    while pending:
        while pending and pending[0][1] <= engine.steps:
            engine.submit(pending.pop(0)[0])
        engine.step()
        seen.append((engine.row_ceiling, len(engine.running)))
    lowered = next((i for i, (c, _n) in enumerate(seen) if c is not None), None)
    assert lowered is not None, "the injected out-of-memory step never happened"
    lifted = next(i for i in range(lowered, len(seen)) if seen[i][0] is None)
    assert lifted <= lowered + engine_module.CEILING_STEPS + 1
    assert seen[lifted][1] > 0, "lifted only because the engine emptied"
    assert all(row.error is None for row in done.values())


class _OomBesidePrefill(StepProxy):
    """The echo step model, out of memory once, on a decode step of one row while another row is part
    way through its chunked prefill."""

    def __init__(self) -> None:
        self.inner, self.failed, self.engine = ECHO.step_model(), False, None

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        if not self.failed and len(batch) == 1 and self.engine is not None and self.engine.prefilling:
            self.failed = True
            raise OOM
        return self.inner.decode(batch, last, masks)


def test_out_of_memory_in_one_rows_decode_beside_a_prefilling_row_fails_no_job() -> None:
    """Review, helper-91: the lone running row failed out_of_memory although another row's prefill held
    memory beside it, where a chunk or an admission that ran out sends its row back to waiting. A job
    that fits alone is never failed for memory: it waits for the prefill to finish, then runs."""
    steps = _OomBesidePrefill()
    engine, done = _engine(scheduler.Limits(max_rows=2, reserved_interactive=0, prefill_tokens=3), steps)
    steps.engine = engine
    rows = [(_row("a", new=12), 0), (_row("b", new=6), 3)]
    _drive(engine, rows)
    assert steps.failed, "the injected out-of-memory step never happened"
    for row, _arrival in rows:
        assert done[row.row_id].error is None
        assert done[row.row_id].tokens == _alone_tokens(_row(row.row_id, new=row.max_new_tokens))


def test_a_ceiling_lowered_to_the_reserve_never_leaves_the_backlog_idle_with_the_cache_empty() -> None:
    """3 backlog rows, 2 of 4 slots reserved for tickets, one out-of-memory step of 2 rows: the
    ceiling it set (at most the reserve) left no backlog slot, and the rows waited CEILING_STEPS
    steps with nothing in memory."""

    class OomAtTwo(_OomOnce):
        def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
            if len(batch) >= 2 and not self.failed:
                self.failed = True
                raise OOM
            return self.inner.decode(batch, last, masks)

    runner = OomAtTwo()
    engine, done = _engine(scheduler.Limits(max_rows=4, reserved_interactive=2), runner)
    for index in range(3):
        engine.submit(_row(f"b{index}", new=20))
    idle = 0
    while not engine.idle and engine.steps < 2000:
        engine.step()
        idle += bool(engine.waiting and not engine.running and not engine.held)
    assert runner.failed, "the injected out-of-memory step never happened"
    assert idle <= 3, f"{idle} steps with backlog rows waiting and nothing in memory"
    assert sorted(done) == ["b0", "b1", "b2"]
    assert all(row.error is None for row in done.values())


def test_timings_and_counts_belong_to_the_run_that_made_the_answer() -> None:
    """A paused row: first_token and inference came from the discarded run, shared_steps kept
    counting, and its thrown-away tokens (and every end-of-text) counted as generated."""
    metrics = Metrics()
    limits = scheduler.Limits(max_rows=2, reserved_interactive=0)
    paced = EchoBackend(token_s=0.002)
    service = EngineService(paced.step_model(), limits, metrics).start()
    try:
        # 400 tokens at 2 ms: the ticket comes while both still run (>= 0.8 s left), on a busy machine too
        b1, b2 = _row("b1", new=400), _row("b2", new=400)
        futures = [service.submit(b1), service.submit(b2)]
        while not b2.tokens or len(b2.tokens) < 5:
            time.sleep(0.005)
        ticket = service.submit(_row("t", "interactive", 3))
        rows = [f.result(timeout=60) for f in [*futures, ticket]]
    finally:
        service.stop()
    paused = next(row for row in rows if row.restarts)
    assert paused.first_admitted_at is not None
    assert paused.admitted_at is not None
    assert paused.first_admitted_at < paused.admitted_at  # its queue wait ended at the first run
    assert paused.first_token_at is not None
    assert paused.first_token_at >= paused.admitted_at
    generated = metrics.registry.get_sample_value("mrc_engine_generated_tokens_total")
    discarded = metrics.registry.get_sample_value("mrc_engine_discarded_tokens_total")
    assert generated == sum(len(row.tokens) for row in rows)  # answers only: no end-of-text, no reruns
    assert discarded is not None
    assert discarded >= 5


def test_a_row_whose_deadline_passes_while_it_is_answered_ends_expired_and_its_neighbour_goes_on() -> None:
    """Review: a deadline was read at admission only; a row past it ran to its end (its answer a second
    late for a caller that had given up, its steps taken from the others)."""
    now = [1000.0]
    done: dict[str, Sequence] = {}
    limits = scheduler.Limits(max_rows=2, reserved_interactive=0)
    engine = Engine(ECHO.step_model(), limits, lambda r: done.__setitem__(r.row_id, r), clock=lambda: now[0])
    late, other = _row("late", new=40), _row("other", new=12)
    late.deadline = 1005.0
    engine.submit(late)
    engine.submit(other)
    while not engine.idle and engine.steps < 200:
        engine.step()
        now[0] += 1.0
    assert type(done["late"].error).__name__ == "Expired"
    assert 0 < len(done["late"].tokens) < 40
    assert (done["other"].error, len(done["other"].tokens)) == (None, 12)


def test_an_incomplete_structured_answer_counts_its_tokens_as_generated() -> None:
    """Review: its tokens went to the discarded counter, though they are its answer, handed out and
    billed; a failed row's tokens are discarded."""
    metrics = Metrics()
    service = EngineService(ECHO.step_model(), scheduler.Limits(max_rows=2, reserved_interactive=0), metrics)
    incomplete, failed = _row("a"), _row("b")
    incomplete.tokens, incomplete.error = [5, 6, 7], AnswerIncomplete("max_new_tokens reached")
    failed.tokens, failed.error = [5, 6], ModelError("the model failed on this row")
    service._finished(incomplete)
    service._finished(failed)
    assert metrics.registry.get_sample_value("mrc_engine_generated_tokens_total") == 3
    assert metrics.registry.get_sample_value("mrc_engine_discarded_tokens_total") == 2


def test_a_row_that_ends_before_it_is_admitted_counts_its_whole_wait_for_admission() -> None:
    """Review, helper-117: a row past its deadline or cancelled while it waited was never counted in
    mrc_engine_admission_wait_seconds, so an overloaded worker's worst waits were out of the alert's
    sight (MrcInteractiveWaitInWorkersTooLong)."""
    metrics, now = Metrics(), [1000.0]
    service = EngineService(
        ECHO.step_model(), scheduler.Limits(max_rows=2, reserved_interactive=0), metrics, clock=lambda: now[0]
    )
    waited, ran = _row("waited", "interactive"), _row("ran", "interactive")
    waited.submitted_at = ran.submitted_at = 1000.0
    ran.first_admitted_at = 1002.0
    now[0] = 1045.0  # `waited` ends (its deadline passed) never admitted, 45 s after it was handed over
    service._finished(waited)
    service._finished(ran)
    count = metrics.registry.get_sample_value(
        "mrc_engine_admission_wait_seconds_count", {"lane": "interactive"}
    )
    over_30 = count - metrics.registry.get_sample_value(
        "mrc_engine_admission_wait_seconds_bucket", {"lane": "interactive", "le": "30.0"}
    )
    assert (count, over_30) == (2, 1)


def test_progress_means_a_row_moved_and_a_stalled_engine_does_not_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row the policy admits nowhere cannot move: /healthz must not hear of progress, and the loop
    must wait instead of stepping at full speed. (The policy itself no longer has such a state: the
    last one, a backlog row with every slot reserved, now runs into an empty cache.)"""
    monkeypatch.setattr(scheduler, "plan", lambda *args, **kwargs: scheduler.Plan())
    limits = scheduler.Limits(max_rows=1, reserved_interactive=0)
    progress: list[float] = []
    service = EngineService(ECHO.step_model(), limits, Metrics(), progress.append).start()
    try:
        service.submit(_row("b"))
        stop = threading.Event()
        stop.wait(0.5)
        steps = service.engine.steps
    finally:
        service.stop()
    assert progress == []
    assert steps <= 0.5 / 0.05 + 2  # bounded by the loop's wait, on any machine


@pytest.mark.parametrize("decode", ["rows", "fixed", "pool"])
def test_the_padding_metric_counts_what_a_step_read_and_is_never_negative(decode: str) -> None:
    """It went negative: a row's length counted the token not yet fed to the cache. Rows attending to
    their own lengths read no padding; a fixed-shape step reads some, never all (the pool step: the
    extent's positions no running row holds)."""
    from pathlib import Path

    from shared.settings import Settings
    from workers.backends.fuyu import FuyuBackend
    from workers.engine.service import padding

    backend = FuyuBackend(
        Settings(model="tiny", home=str(Path(__file__).resolve().parents[2] / ".cache" / "mrc"),
                 quantization="fp32", device="cpu")
    )  # fmt: skip
    backend.load()
    runner = backend.step_model(4, decode=decode)
    engine, _done = _engine(scheduler.Limits(max_rows=4, reserved_interactive=0), runner)
    for index, (height, width) in enumerate([(48, 64), (90, 120), (200, 150)]):
        item = GenerationInput(torch.full((3, height, width), 40 * index, dtype=torch.uint8), "Refund?", 6)
        inputs, positions = backend.row_inputs(item)
        engine.submit(Sequence(str(index), inputs, positions, 6, backend.eos_id))
    ratios = []
    while not engine.idle:
        if engine.step().decoded_rows:
            ratios.append(padding(engine))
    assert ratios
    assert all(0.0 <= ratio < 1.0 for ratio in ratios), ratios
    assert (max(ratios) > 0) == (decode != "rows")  # rows of three lengths, one fixed shape


def test_a_row_that_could_outgrow_its_slot_fails_alone_and_its_neighbours_run() -> None:
    """The slot table refused it inside the step: the error reached the engine thread and ended every
    row in hand (and the next worker's, with the same job)."""
    from pathlib import Path

    from shared.settings import Settings
    from workers.backends.fuyu import FuyuBackend

    backend = FuyuBackend(
        Settings(model="tiny", home=str(Path(__file__).resolve().parents[2] / ".cache" / "mrc"),
                 quantization="fp32", device="cpu")
    )  # fmt: skip
    backend.load()
    runner = backend.step_model(2, positions=64)
    done: dict[str, Sequence] = {}
    engine = Engine(runner, scheduler.Limits(2, 0), lambda r: done.__setitem__(r.row_id, r))
    for row_id, new in (("fits", 4), ("too-long", 60)):
        image = torch.full((3, 30, 30), 90, dtype=torch.uint8)
        inputs, positions = backend.row_inputs(GenerationInput(image, "Refund?", new))
        assert positions + 4 - 1 <= 64 < positions + 60 - 1
        engine.submit(Sequence(row_id, inputs, positions, new, backend.eos_id, "backlog"))
    while not engine.idle:
        engine.step()
    assert done["fits"].error is None
    assert len(done["fits"].tokens) >= 1
    error = done["too-long"].error
    assert error is not None
    assert error.code == "invalid_job"
    assert "a slot of this worker holds 64" in error.message
    assert runner.table.used == 0


class _BeginFails(StepProxy):
    """The echo step model whose `begin` (a row's embeddings: the image through the model) fails."""

    def __init__(self, error: BaseException, when: Any) -> None:
        super().__init__(ECHO.step_model())
        self.error, self.when = error, when

    def begin(self, row_id: str, inputs: Any, length: int, identity: Any = None, need: Any = None) -> int:
        if self.when(row_id):
            raise self.error
        return super().begin(row_id, inputs, length, identity, need)


@pytest.mark.parametrize("error", [OOM, ValueError("shapes do not match")], ids=["oom", "model"])
def test_a_row_whose_admission_fails_alone_fails_by_itself_and_the_engine_goes_on(error: Exception) -> None:
    """Taking a slot runs the model (the image's patches): out of memory with nothing beside it put
    the row back for ever (the worker never idle), and any other error ended the engine with every
    row in hand. Now it is that row's failure alone, as a prefill's is."""
    steps = _BeginFails(error, lambda row_id: row_id == "bad")
    engine, done = _engine(scheduler.Limits(max_rows=2, reserved_interactive=0), steps)
    _drive(engine, [(_row("bad", new=4), 0), (_row("good", new=4), 0)])
    assert type(done["bad"].error).__name__ == ("OutOfMemory" if error is OOM else "ModelError")
    assert done["good"].error is None
    assert engine.idle
