"""A suspect's lone run has the worker to itself (workers/solo_gate.py): a worker death during it is its
own, never another delivery's killer's. Counts and orders of events, never times.

Before: a worker ran several deliveries at once, and a lone run was counted while the worker also
decoded other deliveries' photos and ran their rows. An innocent job whose lone run (or its photo's
decode) overlapped a killer in another delivery was charged the killer's crash and, alone again next
time, abandoned (CI red twice, MRC_MAX_ATTEMPTS=2)."""

from __future__ import annotations

import threading
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


def test_an_ordinary_error_leaves_the_gate_whole_and_an_engine_fault_closes_it() -> None:
    fault: list[BaseException] = []
    gate = SoloGate(lambda: fault[0] if fault else None)
    with pytest.raises(ValueError, match="bug"), gate.shared():
        raise ValueError("one delivery's bug: the worker goes on")
    with gate.alone() as waited:
        assert waited >= 0.0
    fault.append(RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(WorkerUnusable, match="illegal memory access"), gate.alone():
        pass
    with pytest.raises(WorkerUnusable), gate.shared():
        pass


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


def _pipeline(store: MemoryStore, records: MemoryJobRecords, backend: EchoBackend) -> Pipeline:
    settings = Settings(max_attempts=2, engine_reserved_rows=2, model_batch_max_jobs=16)
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
    records = MemoryJobRecords()
    records.begin("innocent")
    records.suspect_group(["innocent"], 2)  # in a group of two when its last worker died: alone now
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
    asked, ended = threading.Event(), {}
    _watch(pipeline.gate, "alone", asked)
    try:
        killing = threading.Thread(target=lambda: ended.update(k=_run_or_death(pipeline, killer_delivery)))
        killing.start()
        assert steps.running.wait(30), "the killer never ran"
        fetched.clear()
        innocent = _deliver(pipeline, _message("innocent", "b"), ended)
        assert asked.wait(30), "the innocent job never asked for the worker"
        steps.release.set()
        for thread in (killing, innocent):
            thread.join(30)
    finally:
        steps.release.set()
        pipeline.close()
    assert isinstance(ended["k"], WorkerUnusable), ended
    assert isinstance(ended["innocent"], WorkerUnusable), ended
    assert "inputs/b.jpg" not in fetched  # its photo was never fetched, let alone decoded
    assert int(records.get("innocent").get("solo_runs", "0")) == 0, "charged for another job's crash"
    assert records.get("killer").get("solo_runs", "0") == ("1" if killer_was == "alone" else "0")
    pipeline = _pipeline(store, records, EchoBackend())
    try:
        assert pipeline.run([_message("innocent", "b")]) == ["succeeded"]
    finally:
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
    records = MemoryJobRecords()
    records.begin("lone")
    records.suspect_group(["lone"], 2)
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
    assert records.get("lone")["solo_runs"] == "1"  # counted once, never paused and counted again
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
