"""A suspect's lone run has the worker to itself (workers/solo_gate.py): a worker death during it is its
own, never another delivery's killer's. Counts and orders of events, never times.

Before: a worker ran several deliveries at once, and a lone run was counted while the worker also
decoded other deliveries' photos and ran their rows. An innocent job whose lone run (or its photo's
decode) overlapped a killer in another delivery was charged the killer's crash and, alone again next
time, abandoned (CI red twice, MRC_MAX_ATTEMPTS=2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from shared.errors import WorkerUnusable
from shared.memory_records import MemoryJobRecords
from shared.settings import Settings
from shared.stores.memory import MemoryStore
from tests.support import imagegen
from tests.support.step_proxy import StepProxy
from workers.backends.echo import EchoBackend, EchoSteps
from workers.pipeline import Pipeline, assemble
from workers.slots import Message
from workers.solo_gate import SoloGate


# ------------------------------------------------------------------------------- the gate alone
def _enter(
    hold: Callable[[], AbstractContextManager[Any]], inside: threading.Event, leave: threading.Event
) -> tuple[threading.Thread, list[BaseException | None]]:
    """A thread that takes the hold, says so, and keeps it until `leave`; what it ended with is kept."""
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            with hold():
                inside.set()
                assert leave.wait(30)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ended


def _waits(thread: threading.Thread, inside: threading.Event) -> bool:
    """The thread is still outside after a while (a slow machine can only make this pass more)."""
    return not inside.wait(0.3) and thread.is_alive()


def test_shared_holders_run_together_and_a_lone_run_waits_for_them_and_keeps_new_ones_out() -> None:
    gate = SoloGate()
    a_in, b_in, lone_in, c_in = (threading.Event() for _ in range(4))
    a_out, b_out, lone_out, c_out = (threading.Event() for _ in range(4))
    a, _ = _enter(gate.shared, a_in, a_out)
    b, _ = _enter(gate.shared, b_in, b_out)
    assert a_in.wait(10)
    assert b_in.wait(10)  # beside each other
    lone, lone_ended = _enter(gate.alone, lone_in, lone_out)
    assert _waits(lone, lone_in)  # two holders in hand
    c, c_ended = _enter(gate.shared, c_in, c_out)
    assert _waits(c, c_in)  # a lone run waits: nothing new starts before it
    a_out.set()
    assert _waits(lone, lone_in)  # one holder still in hand
    b_out.set()
    assert lone_in.wait(10)
    assert _waits(c, c_in)  # not beside the lone run
    lone_out.set()
    assert c_in.wait(10)
    c_out.set()
    for thread in (a, b, lone, c):
        thread.join(10)
    assert lone_ended == [None]
    assert c_ended == [None]


def test_a_holder_that_leaves_through_the_workers_death_breaks_the_gate_for_those_waiting() -> None:
    gate = SoloGate()
    held, leave, never = threading.Event(), threading.Event(), threading.Event()
    failing = threading.Event()

    def hold_until_death() -> None:
        with gate.shared():
            held.set()
            assert failing.wait(10)
            raise SystemExit("segfault")  # a segfault's stand-in: no Exception

    def dies() -> None:
        with pytest.raises(SystemExit):
            hold_until_death()

    thread = threading.Thread(target=dies, daemon=True)
    thread.start()
    assert held.wait(10)
    lone, lone_ended = _enter(gate.alone, never, leave)
    later, later_ended = _enter(gate.shared, never, leave)
    failing.set()
    for waiter in (thread, lone, later):
        waiter.join(10)
    assert not never.is_set()  # neither started work on a dying worker
    assert all(isinstance(e[0], WorkerUnusable) for e in (lone_ended, later_ended)), (lone_ended, later_ended)


def test_any_error_leaving_a_holder_closes_the_gate_and_so_does_an_engine_fault() -> None:
    """Whatever leaves a delivery ends the worker (workers/tasks.py): a Redis error in a results stage
    too. A lone run that started in the moment before the exit would be charged with it."""
    fault: list[BaseException] = []
    gate = SoloGate(lambda: fault[0] if fault else None)
    with gate.alone() as waited:
        assert waited >= 0.0
    with pytest.raises(ConnectionError, match="Redis"), gate.shared():
        raise ConnectionError("Redis went away while the results were written")
    with pytest.raises(WorkerUnusable, match="Redis went away"), gate.alone():
        pass
    engine_died = SoloGate(lambda: fault[0] if fault else None)
    fault.append(RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(WorkerUnusable, match="illegal memory access"), engine_died.alone():
        pass
    with pytest.raises(WorkerUnusable), engine_died.shared():
        pass


def test_a_lone_run_waits_for_work_outside_the_holders_for_as_long_as_it_says() -> None:
    """Rows a failed delivery left in the engine, a grammar compile past its limit: `busy` says how
    long they are waited for (the pipeline: rows until they end, compiles up to their limit)."""
    asked: list[float] = []
    busy = threading.Event()
    busy.set()

    def still(waited_s: float) -> bool:
        asked.append(waited_s)
        return busy.is_set()

    gate = SoloGate(busy=still)
    inside, leave = threading.Event(), threading.Event()
    lone, ended = _enter(gate.alone, inside, leave)
    assert _waits(lone, inside)
    busy.clear()
    assert inside.wait(10)  # looked again without being woken
    leave.set()
    lone.join(10)
    assert ended == [None]
    assert asked == sorted(asked)
    assert len(asked) >= 2


# ------------------------------------------------------------------------------- in the pipeline
class _Holding(StepProxy):
    """The echo step model; a decode step with `name`'s row in it waits for `release`, then goes on,
    or ends the worker (SystemExit stands for a segfault, as a paced killer is SIGKILLed)."""

    def __init__(self, inner: Any, name: str, dies: bool) -> None:
        self.inner, self.name, self.dies = inner, name, dies
        self.running, self.release = threading.Event(), threading.Event()

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        if any(row_id.endswith(f":{self.name}") for row_id in batch.row_ids):
            self.running.set()
            assert self.release.wait(30), "never released"
            if self.dies:
                raise SystemExit("segfault")
        return self.inner.decode(batch, last, masks)


class _Backend(EchoBackend):
    def __init__(self, name: str, dies: bool) -> None:
        super().__init__()
        self.steps = _Holding(EchoSteps(self), name, dies)  # its words are this backend's to read

    def step_model(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps


def _store() -> tuple[MemoryStore, list[str]]:
    """A store and the photo keys fetched from it, in order."""
    store, fetched = MemoryStore("mrc"), []
    for name in ("a", "b"):
        store.put_bytes(f"inputs/{name}.jpg", imagegen.photo(64, 48), "image/jpeg")
    real = store.get_bytes

    def watched(bucket: str, key: str, max_bytes: int) -> bytes:
        fetched.append(key)
        return real(bucket, key, max_bytes)

    store.get_bytes = watched  # type: ignore[method-assign]  # watched, not changed
    return store, fetched


def _message(job_id: str, photo: str = "a", lane: str = "interactive") -> Message:
    body = {
        "job_id": job_id,
        "image_uri": f"s3://mrc/inputs/{photo}.jpg",
        "prompt": "ok",
        "max_new_tokens": 64,
    }
    return Message(job_id, {**body, "lane": lane})


def _suspect_alone(job_id: str) -> MemoryJobRecords:
    """Records where the job was in a group of two when its last worker died: it runs alone now."""
    records = MemoryJobRecords()
    records.begin(job_id)
    records.suspect_group([job_id], 2)
    return records


def _pipeline(store: MemoryStore, records: MemoryJobRecords, backend: EchoBackend, **more: Any) -> Pipeline:
    settings = Settings(max_attempts=2, engine_reserved_rows=2, model_batch_max_jobs=16, **more)
    idle = lambda *_a: None  # noqa: E731
    return assemble(backend, store, store, records, settings, sleep=idle, requeue=idle)


def _watch(gate: SoloGate, name: str, called: threading.Event) -> None:
    """Set `called` as a delivery asks the gate for `name` (watched, not changed)."""
    real = getattr(gate, name)

    def asked() -> AbstractContextManager[Any]:
        called.set()
        return real()

    setattr(gate, name, asked)


def _deliver(pipeline: Pipeline, message: Message, ended: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            ended[message.request_id] = pipeline.run([message])
        except BaseException as exc:  # the worker's death, kept for the assertions
            ended[message.request_id] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("killer_was", ["fresh", "in_a_group", "alone"])
def test_a_lone_run_waiting_while_another_deliverys_killer_kills_the_worker_is_not_charged(
    killer_was: str,
) -> None:
    """The CI failure's shape: the killer runs in one delivery (a fresh job, a suspect in a group, or one
    alone) while an innocent suspect's delivery comes to run it alone. The innocent job waits for the
    worker to itself; the worker dies before it has it, and no lone run is counted against it. Next
    worker, it runs alone and succeeds."""
    store, fetched = _store()
    records = _suspect_alone("innocent")
    killer_delivery = [_message("killer")]
    if killer_was != "fresh":
        records.begin("killer")
        records.suspect_group(["killer"], 4 if killer_was == "in_a_group" else 2)
    if killer_was == "in_a_group":
        records.begin("neighbour")
        records.suspect_group(["neighbour"], 4)
        killer_delivery.append(_message("neighbour"))
    backend = _Backend("killer", dies=True)
    steps, pipeline = backend.steps, _pipeline(store, records, backend)
    ended: dict[str, Any] = {}
    _second_while_first_runs(pipeline, steps, killer_delivery, _message("innocent", "b"), ended)
    assert isinstance(ended["first"], WorkerUnusable), ended
    assert isinstance(ended["innocent"], WorkerUnusable), ended
    assert "inputs/b.jpg" not in fetched  # its photo was never fetched, let alone decoded
    assert int(records.get("innocent").get("solo_runs", "0")) == 0, "charged for another job's crash"
    assert records.get("killer").get("solo_runs", "0") == ("1" if killer_was == "alone" else "0")
    pipeline = _pipeline(store, records, EchoBackend())
    try:
        assert pipeline.run([_message("innocent", "b")]) == ["succeeded"]
    finally:
        pipeline.close()


def _second_while_first_runs(
    pipeline: Pipeline, steps: _Holding, first: list[Message], second: Message, ended: dict[str, Any]
) -> None:
    """`first` delivered and held in a decode step; `second` delivered, and once it asks the gate for
    the worker to itself, the step released; both to their ends (a death kept in `ended`)."""
    asked = threading.Event()
    _watch(pipeline.gate, "alone", asked)
    try:
        held = threading.Thread(target=lambda: ended.update(first=_run_or_death(pipeline, first)))
        held.start()
        assert steps.running.wait(30), "the first delivery never ran"
        waiting = _deliver(pipeline, second, ended)
        assert asked.wait(30), "the second never asked for the worker"
        steps.release.set()
        for thread in (held, waiting):
            thread.join(30)
    finally:
        steps.release.set()
        pipeline.close()


def _run_or_death(pipeline: Pipeline, delivery: list[Message]) -> Any:
    try:
        return pipeline.run(delivery)
    except BaseException as exc:
        return exc


def test_a_ticket_coming_during_a_lone_run_waits_for_it_and_neither_pauses_nor_runs_beside_it() -> None:
    """A backlog job's lone run holds the worker: a ticket delivered meanwhile neither fetches its photo
    nor pauses the lone row (a death then would have been charged to the backlog job); it runs next."""
    store, fetched = _store()
    records = _suspect_alone("lone")
    backend = _Backend("lone", dies=False)
    steps, pipeline = backend.steps, _pipeline(store, records, backend)
    asked, ended = threading.Event(), {}
    _watch(pipeline.gate, "shared", asked)
    try:
        lone = _deliver(pipeline, _message("lone", "a", "backlog"), ended)
        assert steps.running.wait(30), "the lone run never ran"
        ticket = _deliver(pipeline, _message("ticket", "b"), ended)
        assert asked.wait(30)
        ticket.join(0.3)  # time it had to start beside the lone run: a slow machine only gives it less
        assert "inputs/b.jpg" not in fetched
        steps.release.set()
        for thread in (lone, ticket):
            thread.join(30)
    finally:
        steps.release.set()
        pipeline.close()
    assert ended == {"lone": ["succeeded"], "ticket": ["succeeded"]}
    assert records.get("lone")["solo_runs"] == "0"  # counted as it began, withdrawn as it ended
    assert store.get_result("lone")["status"] == store.get_result("ticket")["status"] == "succeeded"


def test_a_job_abandoned_instead_of_run_alone_does_not_wait_for_the_worker() -> None:
    """A suspect whose lone runs are spent is abandoned without a run: it needs no quiet worker, and a
    delivery in hand (here, stuck in a decode step) does not hold its failure back."""
    store, _fetched = _store()
    records = MemoryJobRecords()
    records.begin("spent")
    records.suspect_group(["spent"], 1)
    records.solo_run("spent")  # one lone run died already: MRC_MAX_ATTEMPTS=2 allows no second
    backend = _Backend("busy", dies=False)
    steps, pipeline = backend.steps, _pipeline(store, records, backend)
    ended: dict[str, Any] = {}
    try:
        busy = _deliver(pipeline, _message("busy"), ended)
        assert steps.running.wait(30)
        _deliver(pipeline, _message("spent", "b"), ended).join(30)
        assert ended.get("spent") == ["failed"], ended  # while the other delivery still holds the gate
        steps.release.set()
        busy.join(30)
    finally:
        steps.release.set()
        pipeline.close()
    assert "abandoned" in store.get_result("spent")["error"]["message"]
    assert ended["busy"] == ["succeeded"]


# ----------------------------------------------- work that outlives its delivery (a review's findings)
class _HeldCompile:
    """A grammar library whose compile runs until released (a costly schema: native, uninterruptible)."""

    def __init__(self) -> None:
        self.running, self.release = threading.Event(), threading.Event()

    def cached(self, fmt: Any, owner: str = "") -> None:
        return None

    def compile_and_keep(self, fmt: Any, owner: str = "") -> tuple[str, float]:
        self.running.set()
        assert self.release.wait(30), "never released"
        self.running.clear()
        return "grammar", 0.0

    def matcher(self, compiled: Any) -> None:
        return None


def _counting(records: MemoryJobRecords, seen: list[Any], what: Callable[[], Any]) -> None:
    """Note `what` as each lone run is counted (watched, not changed)."""
    real = records.solo_run

    def counted(job_id: str) -> None:
        seen.append(what())
        real(job_id)

    records.solo_run = counted  # type: ignore[method-assign]


def test_a_lone_run_waits_for_a_compile_its_job_no_longer_needs() -> None:
    """A job whose photo failed before it needed its grammar leaves the compile running (it cannot be
    stopped): a lone run is not counted beside it (a compile that ate the memory would be charged to
    it), though it waits no longer than the compile's limit."""
    store, _fetched = _store()
    store.put_bytes("inputs/bad.jpg", imagegen.truncated_jpeg(), "image/jpeg")  # its header reads
    records = _suspect_alone("lone")
    backend, held = _Backend("none", dies=False), _HeldCompile()
    backend.grammars = held  # type: ignore[attr-defined]
    pipeline = _pipeline(store, records, backend, grammar_compile_timeout_s=60.0)
    seen: list[bool] = []
    _counting(records, seen, held.running.is_set)
    asked, ended = threading.Event(), {}
    _watch(pipeline.gate, "alone", asked)
    try:
        choice = {"type": "choice", "choices": ["x", "y"]}
        costly = {**_message("costly", "bad").body, "response_format": choice}
        assert pipeline.run([Message("costly", costly)]) == ["failed"]
        assert held.running.wait(10), "the compile never started"
        lone = _deliver(pipeline, _message("lone", "b"), ended)
        assert asked.wait(30)
        held.release.set()
        lone.join(30)
    finally:
        held.release.set()
        pipeline.close()
    assert ended == {"lone": ["succeeded"]}
    assert seen == [False], "counted while the compile ran"


class _Paced(StepProxy):
    """The echo step model; each decode step with the slow row in it lasts 50 ms (a paced model)."""

    def decode(self, batch: Any, last: list[int], masks: Any = None) -> list[int]:
        if any(row_id.endswith(":slow") for row_id in batch.row_ids):
            time.sleep(0.05)
        return self.inner.decode(batch, last, masks)


def test_a_lone_run_waits_for_rows_a_failed_delivery_left_in_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in a delivery's model stage fails its jobs and the delivery leaves the gate, while its rows
    handed to the engine still run (here the slow row, 64 paced steps): a lone run is counted once
    they have ended."""
    store, _fetched = _store()
    records = _suspect_alone("lone")
    backend = EchoBackend()
    paced = _Paced(EchoSteps(backend))
    monkeypatch.setattr(backend, "step_model", lambda *_a, **_k: paced)
    pipeline = _pipeline(store, records, backend)
    engine = pipeline.model.engine
    seen: list[bool] = []
    _counting(records, seen, lambda: engine.idle)
    real_take = pipeline.model._take_row

    def buggy(slot: Any, row: Any) -> None:
        if slot.job_id == "quick":
            raise RuntimeError("a bug reading one row")
        real_take(slot, row)

    monkeypatch.setattr(pipeline.model, "_take_row", buggy)
    long_prompt = " ".join(f"w{i}" for i in range(70))
    slow = Message("slow", {**_message("slow").body, "prompt": long_prompt})
    try:
        assert pipeline.run([_message("quick", "b"), slow]) == ["failed", "failed"]
        assert not engine.idle  # the slow row decodes on, its delivery gone
        monkeypatch.setattr(pipeline.model, "_take_row", real_take)
        assert pipeline.run([_message("lone", "b")]) == ["succeeded"]
    finally:
        pipeline.close()
    assert seen == [True], "counted beside rows still in the engine"


def test_a_delivery_that_ends_the_worker_for_redis_keeps_a_waiting_lone_run_from_starting() -> None:
    """Whatever leaves a delivery ends the worker (workers/tasks.py), a Redis error writing its results
    too: a lone run waiting then never starts, and is never counted against its innocent job."""
    store, _fetched = _store()
    records = _suspect_alone("lone")
    backend = _Backend("plain", dies=False)
    steps, pipeline = backend.steps, _pipeline(store, records, backend)
    real_set = records.set_state

    def set_state(job_id: str, state: str, **fields: Any) -> None:
        if job_id == "plain":
            raise ConnectionError("Connection reset by peer")
        real_set(job_id, state, **fields)

    records.set_state = set_state  # type: ignore[method-assign]  # Redis goes away for this write
    ended: dict[str, Any] = {}
    _second_while_first_runs(pipeline, steps, [_message("plain")], _message("lone", "b"), ended)
    assert isinstance(ended["first"], ConnectionError), ended
    assert isinstance(ended["lone"], WorkerUnusable), ended
    assert int(records.get("lone").get("solo_runs", "0")) == 0


def test_a_lone_run_the_worker_leaves_for_redis_is_withdrawn_not_charged() -> None:
    """A review's finding: the lone job's own results hit a Redis error; the worker ends for it, not for
    the job, whose lone run is withdrawn (it counts the runs a worker died in)."""
    store, _fetched = _store()
    records = _suspect_alone("lone")
    real_set = records.set_state

    def set_state(job_id: str, state: str, **fields: Any) -> None:
        if state != "running":
            raise ConnectionError("Connection reset by peer")
        real_set(job_id, state, **fields)

    records.set_state = set_state  # type: ignore[method-assign]  # Redis goes away as results are written
    pipeline = _pipeline(store, records, EchoBackend())
    try:
        with pytest.raises(ConnectionError):
            pipeline.run([_message("lone")])
    finally:
        pipeline.close()
    assert records.get("lone")["solo_runs"] == "0"


def test_a_lone_job_cancelled_while_it_waits_for_the_worker_is_not_run() -> None:
    """A review's finding: cancellation was read at the claim only, and a lone run waits after it."""
    store, fetched = _store()
    records = _suspect_alone("lone")
    backend = _Backend("busy", dies=False)
    ended: dict[str, Any] = {}
    steps, pipeline = backend.steps, _pipeline(store, records, backend)
    real_alone = pipeline.gate.alone

    def cancelled_meanwhile() -> AbstractContextManager[float]:
        records.set_state("lone", "running", cancelled="1")  # `mrc backlog cancel` while it waits
        return real_alone()

    pipeline.gate.alone = cancelled_meanwhile  # type: ignore[method-assign]
    _second_while_first_runs(pipeline, steps, [_message("busy")], _message("lone", "b"), ended)
    assert ended == {"first": ["succeeded"], "lone": ["failed"]}
    assert store.get_result("lone")["error"]["code"] == "cancelled"
    assert "inputs/b.jpg" not in fetched
    assert int(records.get("lone").get("solo_runs", "0")) == 0
