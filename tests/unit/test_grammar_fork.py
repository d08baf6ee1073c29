"""Grammar compiles in a forked child stopped at their limit (workers/grammar_fork.py): a costly format
is stopped there, leaves no process behind and is refused at once for a while after; the grammar that
comes back from a child is the one compiled in the parent. Asserts outcomes, never durations."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared import response_format as rf
from shared.errors import CompileInterrupted, InvalidJob
from shared.settings import Settings
from workers import grammar_fork
from workers.backends.fuyu import FuyuBackend
from workers.grammar import CompileTimedOut, Grammars
from workers.grammar_compiles import Compiles
from workers.metrics import Metrics
from workers.row_grammars import RowGrammars

# Tens of seconds to compile on a 448-token vocabulary (review, helper-84), on any machine far past
# the limits below.
COSTLY = {"type": "json_schema", "schema": {"type": "string", "pattern": "^[a-z]{1,16000}$"}}


def _children() -> set[str]:
    """This process's children (every thread's), from /proc: in a whole run the session's services
    and workers are among them, so a test compares with what there was before it."""
    tasks = Path("/proc/self/task").iterdir()
    return {pid for task in tasks for pid in (task / "children").read_text().split()}


def _fmt(value: dict[str, Any]) -> rf.JsonSchemaFormat | rf.ChoiceFormat:
    parsed = rf.parse(value)
    assert parsed is not None
    return parsed


def test_what_the_child_returns_comes_back_whole_however_large() -> None:
    big = "x" * (5 << 20)  # past any pipe's buffer: read while it is written
    assert grammar_fork.run(lambda: big, 30.0) == big


def test_an_error_in_the_child_comes_back_as_its_reason() -> None:
    def fails() -> str:
        raise ValueError("no such rule")

    with pytest.raises(grammar_fork.ChildFailed, match="ValueError: no such rule"):
        grammar_fork.run(fails, 30.0)


def test_a_child_past_its_limit_is_stopped_and_reaped() -> None:
    def forever() -> str:
        while True:
            time.sleep(1)

    before = _children()
    with pytest.raises(grammar_fork.TimedOut):
        grammar_fork.run(forever, 0.2)
    assert _children() <= before


def test_a_ctrl_c_to_the_process_group_is_not_the_compiles_error(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the group: a compiling child that took it for its own error
    failed its job `invalid_job` as a format that does not compile. The child ignores it."""
    started = tmp_path / "started"
    before = _children()

    def slow() -> str:
        started.write_text("1")
        time.sleep(1.0)
        return "compiled"

    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(grammar_fork.run(slow, 60.0)))
    runner.start()
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in _children() - before:
        os.kill(int(pid), signal.SIGINT)
    runner.join(60)
    assert result == ["compiled"]


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    from tests.conftest import MODEL_HOME

    loaded = FuyuBackend(Settings(model="tiny", device="cpu", home=str(MODEL_HOME), quantization="fp32"))
    loaded.load()
    return loaded


def _grammars(backend: FuyuBackend, limit_s: float | None) -> Grammars:
    tokenizer = backend.processor.tokenizer
    return Grammars(tokenizer, backend.grammars.vocab_size, backend.eos_id, keep=4, limit_s=limit_s)


def test_a_costly_format_is_stopped_at_its_limit_then_refused_at_once(
    backend: FuyuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammars = _grammars(backend, 0.3)
    costly = _fmt(COSTLY)
    forks: list[float] = []
    real_run = grammar_fork.run

    def counted(work: Callable[[], str], limit_s: float) -> str:
        forks.append(limit_s)
        return real_run(work, limit_s)

    monkeypatch.setattr(grammar_fork, "run", counted)
    before = _children()
    with pytest.raises(CompileTimedOut):
        grammars.compile(costly)
    assert _children() <= before  # stopped, not left running beside the worker
    with pytest.raises(CompileTimedOut, match="less than 300 s ago"):
        grammars.compile(costly)  # no second compile for the same end
    assert forks == [0.3]
    boolean = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    grammars.compile(_fmt({"type": "json_schema", "schema": boolean}))
    assert forks == [0.3]  # milliseconds to compile: in the caller's thread, no fork
    # Patterns spelled out past 2,048 characters go to a child; what comes back is the grammar itself.
    longer = _fmt({"type": "json_schema", "schema": {"type": "string", "pattern": "^[a-z]{1,2100}$"}})
    from_child = _grammars(backend, 60.0).compile(longer)
    assert forks == [0.3, 60.0]
    here = _grammars(backend, None).compile(longer)
    assert from_child.serialize_json() == here.serialize_json()
    lookbehind = {"type": "string", "pattern": "(?<=a)b" + "c{3000}"}  # past 2,048: compiled in a child
    refused = rf.JsonSchemaFormat.model_construct(type="json_schema", schema_=lookbehind)
    with pytest.raises(InvalidJob, match="does not compile"):  # the library's reason, from the child
        grammars.compile(refused)
    assert len(forks) == 3


def test_another_keys_schema_compiles_while_one_key_sends_costly_ones(backend: FuyuBackend) -> None:
    """Review, helper-84: eight costly formats from one key held every compile place for 30-40 s; the
    other key's small schemas were told the compiler was busy until their attempts ran out. Each
    costly compile is stopped at its limit now, and the other key's goes next."""

    class Holder:
        model_id = "tiny"
        grammars = _grammars(backend, 0.3)  # each compile stopped at 0.3 s

    before = _children()
    # A generous wait for a place (5 s): what is asserted is the order, not a duration.
    rows = RowGrammars(Holder(), 5.0, Metrics(), Compiles(5.0, threads=1, overdue=0))
    costly = [
        rows.ask(
            rf.parse({**COSTLY, "schema": {"type": "string", "pattern": f"^[a-z]{{1,{16000 - i}}}$"}}),
            "key-a",
        )
        for i in range(3)
    ]
    small = rows.ask(_fmt({"type": "choice", "choices": ["yes", "no"]}), "key-b")
    settled = _settle(rows, small)
    assert not isinstance(settled, Exception), settled
    for ask in costly:
        error = _settle(rows, ask)
        assert isinstance(error, InvalidJob), error
        assert "did not compile within" in error.message
    assert _children() <= before


def test_a_format_refused_for_a_compile_stopped_lately_says_so_not_that_it_compiled(
    backend: FuyuBackend,
) -> None:
    """Review, helper-86: a job of a format stopped minutes before failed in 0.3 s saying its grammar
    "did not compile within 10 s", though nothing compiled for it. And per key (review, helper-87: the
    refusal told another key that someone had sent that exact schema): another key's job of the same
    format compiles it again."""

    class Holder:
        model_id = "tiny"
        grammars = _grammars(backend, 0.3)

    rows = RowGrammars(Holder(), 5.0, Metrics(), Compiles(5.0, threads=1, overdue=0))
    first = _settle(rows, rows.ask(rf.parse(COSTLY), "key-a"))
    assert isinstance(first, InvalidJob), first
    assert "did not compile within" in first.message
    again = _settle(rows, rows.ask(rf.parse(COSTLY), "key-a"))
    assert isinstance(again, InvalidJob), again
    assert "did not compile within" not in again.message
    assert "stopped at the 5 s limit" in again.message
    assert "less than 300 s ago" in again.message
    other = _settle(rows, rows.ask(rf.parse(COSTLY), "key-c"))  # compiled (and stopped) for key-c too
    assert isinstance(other, InvalidJob), other
    assert "did not compile within" in other.message
    assert "ago" not in other.message


def _settle(rows: RowGrammars, ask: object) -> object:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        value = rows.settle(ask)  # type: ignore[arg-type]
        if not isinstance(value, float):
            return value
        time.sleep(min(value, 0.05))
    raise AssertionError("the ask never settled")


def test_the_child_holds_none_of_the_workers_descriptors() -> None:
    """A child forked while another compile's pipe was open held its write end, and that compile saw
    no end of its pipe until the other child ended, then timed out (review, helper-85: 8 of 14 cheap
    formats beside a costly one); a child that outlived its worker kept its listening socket."""
    with open(__file__, "rb") as held_open:
        listed = grammar_fork.run(lambda: " ".join(sorted(os.listdir("/proc/self/fd"), key=int)), 30.0)
        assert str(held_open.fileno()) not in listed.split()
    open_fds = [int(fd) for fd in listed.split()]
    assert len([fd for fd in open_fds if fd > 2]) <= 2  # the pipe's write end, and the listing's own


def test_a_child_killed_by_a_signal_is_not_the_formats_fault(
    backend: FuyuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review, helper-85: an OOM kill of the compile's process failed its job `invalid_job`, for good,
    as a format that does not compile. It is a retryable fault of the worker's."""

    def killed() -> str:
        os.kill(os.getpid(), signal.SIGKILL)
        return "never"

    with pytest.raises(grammar_fork.ChildDied, match="signal 9"):
        grammar_fork.run(killed, 30.0)

    def died(_work: Callable[[], str], _limit_s: float) -> str:
        raise grammar_fork.ChildDied("signal 9")

    monkeypatch.setattr(grammar_fork, "run", died)
    with pytest.raises(CompileInterrupted) as interrupted:
        _grammars(backend, 5.0).compile(_fmt(COSTLY))
    assert interrupted.value.retryable


def test_the_child_runs_none_of_the_workers_signal_handlers(tmp_path: Path) -> None:
    """Review, helper-85: a SIGTERM to the process group ran Celery's handler in the compiling child
    too (a second "warm shutdown" line, logged from a fork of a threaded process)."""
    ran = tmp_path / "handler-ran"
    previous = signal.signal(signal.SIGUSR1, lambda *_: ran.write_text("in " + str(os.getpid())))
    try:

        def signalled() -> str:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
            return "compiled"

        assert grammar_fork.run(signalled, 30.0) == "compiled"
        assert not ran.exists()
    finally:
        signal.signal(signal.SIGUSR1, previous)
