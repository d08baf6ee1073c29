"""Grammar compiles off the delivery's path with a time limit (issue 36, item 9): the policy with a
clock the test moves and stand-in compiles the test holds and releases (no timing in any assertion),
and the row grammars' answers: the job's error names the schema's place."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared import response_format as rf
from shared.errors import CompilerBusy, InvalidJob
from workers.grammar_compiles import Compiles, Wait
from workers.metrics import Metrics
from workers.row_grammars import RowGrammars

GUARD_S = 10.0  # a stand-in compile never waits longer, should a test fail before releasing it


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Held:
    """Stand-in compiles: each key's compile runs until the test releases it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.running: dict[str, threading.Event] = {}
        self.open = threading.Event()  # release() with no key: every compile, started or not
        self._lock = threading.Lock()  # compile threads add gates while the test releases them

    def ran(self, key: str) -> threading.Event:
        """Set once `key`'s compile has started (it may not have been asked for yet)."""
        with self._lock:
            return self.running.setdefault(key, threading.Event())

    def work(self, key: str) -> Callable[[], str]:
        with self._lock:
            self.gates.setdefault(key, threading.Event())

        def compile_it() -> str:
            self.started.append(key)
            self.ran(key).set()
            if not self.open.is_set():
                self.gates[key].wait(GUARD_S)
            return f"grammar:{key}"

        return compile_it

    def release(self, *keys: str) -> None:
        if not keys:
            self.open.set()
        with self._lock:
            for key in keys or tuple(self.gates):
                self.gates[key].set()


@pytest.fixture
def held() -> Iterator[Held]:
    stand_in = Held()
    yield stand_in
    stand_in.release()  # never leave a compile thread waiting after the test


def _done(wait: Wait) -> Any:
    return wait.compile.future.result(GUARD_S)


def test_one_compile_per_format_however_many_jobs_wait_for_it(held: Held) -> None:
    clock = Clock()
    compiles = Compiles(limit_s=5.0, clock=clock)
    first, second = (compiles.request("a", held.work("a")) for _ in range(2))
    assert held.ran("a").wait(GUARD_S)
    assert compiles.poll(first).state == "waiting"
    held.release("a")
    assert _done(first) == _done(second) == "grammar:a"
    assert (compiles.poll(first).state, compiles.poll(second).state) == ("done", "done")
    assert held.started == ["a"]


def test_a_compile_past_its_limit_fails_its_jobs_and_later_ones_at_once_without_a_second(held: Held) -> None:
    clock = Clock()
    compiles = Compiles(limit_s=5.0, clock=clock)
    first = compiles.request("slow", held.work("slow"))
    assert held.ran("slow").wait(GUARD_S)
    clock.now += 4.0
    assert compiles.poll(first).state == "waiting"
    clock.now += 1.0
    assert compiles.poll(first).state == "overdue"
    later = compiles.request("slow", held.work("slow"))  # the compile still runs: no second one
    assert compiles.poll(later).state == "overdue"
    assert held.started == ["slow"]
    assert compiles.counts() == {"queued": 0, "running": 0, "overdue": 1}
    held.release("slow")
    assert _done(later) == "grammar:slow"  # it finishes in the background (the caller keeps it)


def test_overdue_compiles_give_their_place_but_never_pile_up(held: Held) -> None:
    """One compile within its limit and one past it at most: a third costly format waits, and its job
    is told the compiler is busy (retried), not that its format failed."""
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, overdue=1, clock=clock)
    a = compiles.request("a", held.work("a"))
    b = compiles.request("b", held.work("b"))
    assert held.ran("a").wait(GUARD_S)
    assert compiles.counts() == {"queued": 1, "running": 1, "overdue": 0}
    clock.now += 5.0  # a passes its limit: b takes its place
    assert compiles.poll(a).state == "overdue"
    assert held.ran("b").wait(GUARD_S)
    c = compiles.request("c", held.work("c"))
    clock.now += 5.0  # b passes its limit too, but the overdue place is a's: c cannot start
    assert compiles.poll(b).state == "overdue"
    assert compiles.poll(c).state == "busy"
    assert held.started == ["a", "b"]
    assert compiles.counts() == {"queued": 0, "running": 1, "overdue": 1}
    held.release("a", "b")
    assert (_done(a), _done(b)) == ("grammar:a", "grammar:b")
    assert held.started == ["a", "b"]  # c's only job gave up: its compile was dropped, never run


def test_a_queued_compile_starts_when_a_running_one_passes_its_limit(held: Held) -> None:
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, overdue=1, clock=clock)
    compiles.request("a", held.work("a"))
    b = compiles.request("b", held.work("b"))
    assert held.ran("a").wait(GUARD_S)
    verdict = compiles.poll(b)
    assert (verdict.state, verdict.wait_s) == ("waiting", 5.0)  # when a passes its limit
    clock.now += 5.0
    assert compiles.poll(b).state == "waiting"  # b started in a's place: its own limit counts now
    assert held.ran("b").wait(GUARD_S)
    held.release("b")
    assert _done(b) == "grammar:b"


# ------------------------------------------------------------------ the row grammars
class Grammars:
    """The backend's grammars as RowGrammars uses them, compiles held by the test."""

    def __init__(self, held: Held) -> None:
        self.held, self.kept, self.compiled = held, {}, []

    def cached(self, fmt: Any, owner: str = "") -> Any:
        return self.kept.get((owner, rf.digest(fmt)))

    def compile_and_keep(self, fmt: Any, owner: str = "") -> tuple[Any, float]:
        key = rf.digest(fmt)
        self.compiled.append(key)
        grammar = self.held.work(key)()
        if "broken" in rf.canonical(fmt):
            raise InvalidJob("response_format does not compile to a grammar: stand-in")
        self.kept[(owner, key)] = grammar
        return grammar, 0.0

    def matcher(self, compiled: Any) -> Any:
        return ("row state", compiled)


class Backend:
    model_id = "stand-in"

    def __init__(self, grammars: Grammars | None) -> None:
        self.grammars = grammars


NOTE = {"type": "object", "properties": {"note": {"type": "string", "pattern": "^([a-z]{1,40}x){1,50}$"}}}


def _row_grammars(held: Held, clock: Clock) -> tuple[RowGrammars, Grammars]:
    grammars = Grammars(held)
    return RowGrammars(Backend(grammars), 5.0, Metrics(), Compiles(5.0, clock=clock)), grammars


def test_a_job_whose_grammar_overruns_fails_naming_the_schemas_costliest_place(held: Held) -> None:
    clock = Clock()
    rows, grammars = _row_grammars(held, clock)
    fmt = rf.parse({"type": "json_schema", "schema": NOTE})
    ask = rows.ask(fmt)
    assert isinstance(rows.settle(ask), float)  # compiling: look again later
    assert held.ran(rf.digest(fmt)).wait(GUARD_S)
    clock.now += 5.0
    error = rows.settle(ask)
    assert isinstance(error, InvalidJob)
    assert error.message.startswith("response_format.schema.properties.note.pattern (2050 spelled out):")
    assert "MRC_GRAMMAR_COMPILE_TIMEOUT_S" in error.message
    held.release()
    assert ask.wait is not None
    _done(ask.wait)
    again = rows.ask(fmt)  # the compile ended in the background and was kept: no second compile
    assert rows.settle(again) == ("row state", f"grammar:{rf.digest(fmt)}")
    assert len(grammars.compiled) == 1


def test_each_key_compiles_a_format_of_its_own_and_joins_only_its_own_compile(held: Held) -> None:
    """Shared, a key's first job of a format found another key's grammar, or joined its compile, and
    ran seconds sooner: how long it took told it that another key had sent that schema."""
    rows, grammars = _row_grammars(held, Clock())
    fmt = rf.parse({"type": "json_schema", "schema": NOTE})
    first, again, other = rows.ask(fmt, "key-a"), rows.ask(fmt, "key-a"), rows.ask(fmt, "key-b")
    assert first.wait is not None
    assert again.wait is not None
    assert other.wait is not None
    assert first.wait.compile is again.wait.compile  # the same key's jobs share one compile
    assert other.wait.compile is not first.wait.compile
    held.release()
    assert _done(first.wait) == _done(other.wait) == f"grammar:{rf.digest(fmt)}"
    assert len(grammars.compiled) == 2
    assert rows.ask(fmt, "key-a").wait is None  # kept for each key: no third compile
    assert rows.ask(fmt, "key-b").wait is None
    assert rows.ask(fmt, "key-c").wait is not None


def test_the_row_grammars_settle_to_a_state_an_error_or_none(held: Held) -> None:
    clock = Clock()
    rows, _grammars = _row_grammars(held, clock)
    assert rows.settle(rows.ask(None)) is None
    choice = rf.parse({"type": "choice", "choices": ["refund", "replace"]})
    ask = rows.ask(choice)
    held.release()
    assert ask.wait is not None
    _done(ask.wait)
    assert rows.settle(ask) == ("row state", f"grammar:{rf.digest(choice)}")
    broken = rf.parse({"type": "choice", "choices": ["broken"]})
    ask = rows.ask(broken)  # released already: it runs through, and fails
    assert ask.wait is not None
    with pytest.raises(InvalidJob):
        _done(ask.wait)
    error = rows.settle(ask)
    assert isinstance(error, InvalidJob)
    assert "stand-in" in error.message
    no_grammar = RowGrammars(Backend(None), 5.0, Metrics())
    assert isinstance(no_grammar.settle(no_grammar.ask(choice)), InvalidJob)


def test_a_job_the_compiler_cannot_start_for_is_retried_not_refused(held: Held) -> None:
    clock = Clock()
    grammars = Grammars(held)
    compiles = Compiles(5.0, threads=1, overdue=0, clock=clock)
    rows = RowGrammars(Backend(grammars), 5.0, Metrics(), compiles)
    choice_a = rf.parse({"type": "choice", "choices": ["a"]})
    first = rows.ask(choice_a)
    second = rows.ask(rf.parse({"type": "choice", "choices": ["b"]}))
    assert first.wait is not None
    assert held.ran(rf.digest(choice_a)).wait(GUARD_S)
    clock.now += 5.0
    busy = rows.settle(second)
    assert isinstance(busy, CompilerBusy)
    assert busy.retryable
    assert isinstance(rows.settle(first), InvalidJob)


def test_a_queued_compile_whose_only_job_failed_first_is_never_run(held: Held) -> None:
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, clock=clock)
    a = compiles.request("a", held.work("a"))
    b = compiles.request("b", held.work("b"))
    compiles.give_up(b)  # its job's image did not decode, say
    assert compiles.counts()["queued"] == 0
    held.release("a")
    assert _done(a) == "grammar:a"
    assert held.started == ["a"]


def test_a_queued_job_never_spins_while_the_compile_ahead_of_it_cannot_give_its_place(held: Held) -> None:
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, overdue=0, clock=clock)
    a = compiles.request("a", held.work("a"))
    assert held.ran("a").wait(GUARD_S)
    clock.now += 1.0
    b = compiles.request("b", held.work("b"))
    clock.now += 4.0  # a is past its limit but has no overdue place to go to
    assert compiles.poll(a).state == "overdue"
    verdict = compiles.poll(b)
    assert (verdict.state, verdict.wait_s) == ("waiting", 1.0)  # its own limit, not 0 again and again
    clock.now += 1.0
    assert compiles.poll(b).state == "busy"


def test_the_next_compile_is_the_one_of_the_key_with_fewest_under_way(held: Held) -> None:
    """One key's many formats queue behind each other, never in front of another key's (review,
    helper-84: eight costly formats from one key held every place and another key's small schema
    was retried until it failed)."""
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, overdue=1, clock=clock)
    a1, a2, a3 = (compiles.request(k, held.work(k), owner="key-a") for k in ("a1", "a2", "a3"))
    assert held.ran("a1").wait(GUARD_S)
    b1 = compiles.request("b1", held.work("b1"), owner="key-b")
    clock.now += 5.0  # a1 passes its limit and gives its place: key-b's compile goes before a2
    assert compiles.poll(a1).state == "overdue"
    assert held.ran("b1").wait(GUARD_S)
    assert held.started == ["a1", "b1"]
    held.release("b1")
    assert _done(b1) == "grammar:b1"
    assert held.ran("a2").wait(GUARD_S)  # then key-a's next, in its order
    held.release()
    assert (_done(a2), _done(a3)) == ("grammar:a2", "grammar:a3")
    assert held.started == ["a1", "b1", "a2", "a3"]


def test_a_light_compile_starts_at_once_beside_costly_ones_holding_every_place(held: Held) -> None:
    """Review, helper-86: another key's small schemas waited up to 10 s for one of the two places that
    costly compiles held. A format that compiles in milliseconds takes no place."""
    clock = Clock()
    compiles = Compiles(limit_s=5.0, threads=1, overdue=0, clock=clock)
    costly = compiles.request("costly", held.work("costly"), owner="key-c")
    queued = compiles.request("costly-2", held.work("costly-2"), owner="key-c")
    assert held.ran("costly").wait(GUARD_S)
    light = compiles.request("small", held.work("small"), owner="key-a", light=True)
    assert held.ran("small").wait(GUARD_S)  # started though the only place is taken
    held.release("small")
    assert _done(light) == "grammar:small"
    assert compiles.counts() == {"queued": 1, "running": 1, "overdue": 0}  # the places as they were
    held.release()
    assert (_done(costly), _done(queued)) == ("grammar:costly", "grammar:costly-2")
    assert compiles.counts() == {"queued": 0, "running": 0, "overdue": 0}


def test_a_compile_that_raises_past_exception_still_gives_its_place_back(held: Held) -> None:
    """Review, helper-87: work raising a BaseException (SystemExit) kept its place for good and its
    future never ended, so every later costly compile stayed queued."""
    compiles = Compiles(limit_s=5.0, threads=1, overdue=0, clock=Clock())

    def leaves() -> str:
        raise SystemExit("boom")

    gone = compiles.request("gone", leaves, owner="key-a")
    with pytest.raises(SystemExit):
        _done(gone)
    after = compiles.request("after", held.work("after"), owner="key-b")
    held.release()
    assert _done(after) == "grammar:after"
    assert compiles.counts() == {"queued": 0, "running": 0, "overdue": 0}
