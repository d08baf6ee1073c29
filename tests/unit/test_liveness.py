"""The liveness rule behind /healthz, on a fake clock."""

from __future__ import annotations

import threading
import time

from workers.liveness import ANSWER_WITHIN_S, Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _liveness(waiting: object = False) -> tuple[Liveness, Clock, dict[str, object]]:
    clock = Clock()
    state: dict[str, object] = {"progress": clock.now, "batch": None}

    def ask() -> bool | None:
        if isinstance(waiting, Exception):
            raise waiting
        return waiting  # type: ignore[return-value]

    live = Liveness(10, ask, lambda: (state["progress"], state["batch"]), clock=clock)  # type: ignore[arg-type, return-value]
    return live, clock, state


def test_idle_with_nothing_to_do_is_alive_however_long() -> None:
    live, clock, _ = _liveness(waiting=False)
    clock.now += 3600
    alive, details = live.report()
    assert alive
    assert details["idle"] is True


def test_no_poll_while_jobs_wait_is_stuck() -> None:
    live, clock, _ = _liveness(waiting=True)
    clock.now += 5
    assert live.report()[0]
    clock.now += 6
    alive, details = live.report()
    assert not alive
    assert "does not poll" in str(details["reason"])
    live.polled()
    assert live.report()[0]


def test_a_batch_without_progress_is_stuck_even_with_an_empty_queue() -> None:
    live, clock, state = _liveness(waiting=False)
    state["batch"] = clock.now
    clock.now += 11
    alive, details = live.report()
    assert not alive
    assert details["batch_for_s"] == 11.0
    state["progress"] = clock.now  # a model batch ended
    assert live.report()[0]


def test_redis_away_is_not_called_stuck() -> None:
    live, clock, _ = _liveness(waiting=ConnectionError("refused"))
    clock.now += 60
    alive, details = live.report()
    assert alive
    assert details["work_waiting"] is None


def test_a_look_at_the_lanes_that_hangs_never_holds_the_answer() -> None:
    """Review, helper-74: with Redis hung, each /healthz waited for the Redis client's 10 s (past a
    kubelet probe's default second: every worker would be restarted). The answer comes within
    ANSWER_WITHIN_S, alive (it cannot tell), and the one look goes on beside it; once it ends (jobs
    do wait, and the consumer still does not poll) the worker is stuck."""
    release = threading.Event()
    looks: list[float] = []

    def ask() -> bool:
        looks.append(time.monotonic())
        release.wait(10)
        return True

    clock = Clock()
    live = Liveness(10, ask, lambda: (1000.0, None), clock=clock)
    clock.now += 11
    for _ in range(3):
        began = time.monotonic()
        alive, details = live.report()
        assert alive
        assert details["work_waiting"] is None
        assert time.monotonic() - began < ANSWER_WITHIN_S + 1.0
    assert len(looks) == 1, "a look per probe: a hung Redis would pile them up"
    release.set()
    alive, details = live.report()
    assert not alive, details


def test_before_the_consumer_starts_or_when_it_never_will_the_worker_is_alive() -> None:
    """Loading the model for minutes, or alive but not ready on purpose, with jobs waiting: alive (a
    restart would change nothing); once consuming, the same silence is stuck."""
    clock = Clock()
    live = Liveness(10, lambda: True, clock=clock, consuming=False)
    clock.now += 3600
    alive, details = live.report()
    assert (alive, details["consuming"]) == (True, False)
    live.consuming()
    clock.now += 11
    assert live.report()[0] is False


def test_the_engines_held_rows_and_a_stalled_backlog_are_shown_while_other_rows_make_progress() -> None:
    """An engine step is progress for every delivery waiting on the engine, whichever rows moved: a
    starving backlog looked alive and nothing said so. It is shown, and is no reason to restart."""
    live, clock, state = _liveness(waiting=True)
    live.watch(
        lambda: (state["progress"], state["batch"]),  # type: ignore[arg-type, return-value]
        lambda: {"engine_rows_held": 14, "engine_backlog_stalled_steps": 2900},
    )
    state["batch"] = clock.now
    alive, details = live.report()
    assert alive
    assert (details["engine_rows_held"], details["engine_backlog_stalled_steps"]) == (14, 2900)


def test_the_pipeline_reports_its_engines_held_rows_and_backlog_stall() -> None:
    from shared.memory_records import MemoryJobRecords
    from shared.settings import Settings
    from shared.stores.memory import MemoryStore
    from workers.backends.echo import EchoBackend
    from workers.pipeline import assemble

    store = MemoryStore("mrc")
    pipeline = assemble(EchoBackend(), store, store, MemoryJobRecords(), Settings(), sleep=lambda _s: None)
    try:
        live = pipeline.live()
        assert (live["engine_rows_held"], live["engine_backlog_stalled_steps"]) == (0, 0)
        assert pipeline.describe()["engine_backlog_share"] == Settings().engine_backlog_share
    finally:
        pipeline.close()
