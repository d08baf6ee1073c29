"""Grammar compiles off the delivery's path, each with a time limit (issue 36, item 9).

The grammar library compiles a format in one native call that cannot be interrupted; a pattern's
`{1,20000}` took 51.6 s on a 448-token vocabulary, in the delivery's own thread, so every job after it
in the delivery waited. Here:

- a compile runs on a thread of its own, started when a job asks for its format, while the delivery
  decodes images and hands its other jobs to the engine;
- one compile per format at a time, keyed by the format's canonical hash: a later job with the same
  format waits for the same compile (and finds the grammar in the backend's cache once it is done);
- a job waits for its compile to *run* at most MRC_GRAMMAR_COMPILE_TIMEOUT_S: past that it fails
  `invalid_job` (the format is too costly), and so does at once every later job of that format while
  the compile still runs. The compile itself finishes in the background, and its grammar is kept;
- at most THREADS compiles run within their limit. A compile past its limit gives its place to the
  next one, as long as fewer than OVERDUE compiles are past theirs: so THREADS + OVERDUE threads at
  most, however many costly formats arrive. A job whose compile could not start within the limit
  (every place taken by costly compiles) is retried later (`CompilerBusy`): its format is not at fault;
- a queued compile that no job waits for any more is dropped, never started;
- the next compile to start is the one whose owner (the API key of the job that asked first) has
  the fewest compiles under way, the oldest among equals: one key's many costly formats queue behind
  each other, never in front of another key's (review, helper-84: eight from one key filled every
  place and another key's small schemas were retried until they failed). The real compiler also
  stops each compile at its limit (workers/grammar_fork.py), so a place comes free within it.

Policy only: no xgrammar here (workers/grammar.py compiles), and a clock the tests can drive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

THREADS = 2  # compiles running within their limit (a normal one takes milliseconds)
OVERDUE = 2  # compiles past their limit still running (uninterruptible), beyond THREADS

State = Literal["done", "waiting", "overdue", "busy"]


@dataclass(eq=False)
class Compile:
    """One format's compile: queued, running, then done (its future holds the grammar or the error)."""

    key: str
    work: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    started_at: float | None = None
    overdue: bool = False  # past its limit and counted against OVERDUE, not THREADS
    waiters: int = 0
    owner: str = ""  # the API key of the job that asked first ("" without keys)
    light: bool = False  # one that compiles in milliseconds: started at once, beside the places


@dataclass(eq=False)
class Wait:
    """One job's wait for a compile."""

    compile: Compile
    since: float
    ended: bool = False


@dataclass(frozen=True)
class Verdict:
    """done: the compile ended (its future holds the grammar, or its error); waiting: look again
    within `wait_s` (or when the future ends); overdue: it has run past the limit; busy: it could not
    start within the limit."""

    state: State
    wait_s: float = 0.0


class Compiles:
    def __init__(
        self,
        limit_s: float,
        threads: int = THREADS,
        overdue: int = OVERDUE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_s, self.threads, self.overdue_cap, self.clock = limit_s, threads, overdue, clock
        self._lock = threading.Lock()
        self._flight: dict[str, Compile] = {}  # queued or running, by key
        self._queue: deque[Compile] = deque()
        self._running = 0  # within their limit
        self._overdue = 0  # past it, still running
        self._owners: dict[str, int] = {}  # compiles under way (running or overdue) per owner

    def request(self, key: str, work: Callable[[], Any], owner: str = "", light: bool = False) -> Wait:
        """Start (or join) the compile of `key`; `work` runs on a compile thread and returns the grammar.
        `owner`: whose turn it is (the asking job's API key). `light`: a format that compiles in
        milliseconds, started at once on a thread of its own, never queued behind costly ones (review,
        helper-86: another key's small schemas waited up to 10 s for one of the two places)."""
        with self._lock:
            compile = self._flight.get(key)
            if compile is None:
                compile = self._flight[key] = Compile(key, work, owner=owner, light=light)
                if light:
                    compile.started_at = self.clock()
                    threading.Thread(
                        target=self._run, args=(compile,), name="mrc-grammar", daemon=True
                    ).start()
                else:
                    self._queue.append(compile)
            compile.waiters += 1
            self._dispatch()
            return Wait(compile, self.clock())

    def poll(self, wait: Wait) -> Verdict:
        """Where this job's wait stands now. An overdue or busy verdict ends the wait (a job gives up
        once: a queued compile nobody waits for is dropped)."""
        with self._lock:
            now = self.clock()
            self._promote(now)
            compile = wait.compile
            if compile.future.done():
                return Verdict("done")
            if compile.started_at is not None:
                deadline = compile.started_at + self.limit_s
                state: State = "overdue"
            else:  # queued: look again when a running compile passes its limit (it may give its place)
                deadline = wait.since + self.limit_s
                state = "busy"
            if now >= deadline:
                self._end(wait)
                return Verdict(state)
            return Verdict("waiting", min([deadline, *self._next_overdue(now)]) - now)

    def give_up(self, wait: Wait) -> None:
        """This job stops waiting (it failed before it needed the grammar)."""
        with self._lock:
            self._end(wait)
            self._dispatch()

    def counts(self) -> dict[str, int]:
        """Compiles queued, running within their limit, and past it (tests; the heartbeat could)."""
        with self._lock:
            return {"queued": len(self._queue), "running": self._running, "overdue": self._overdue}

    # ---------------------------------------------------------------- under the lock
    def _dispatch(self) -> None:
        while self._queue and self._running < self.threads:
            compile = self._next()
            self._queue.remove(compile)
            if compile.waiters == 0:  # every job that asked for it gave up: never started
                self._flight.pop(compile.key, None)
                compile.future.cancel()
                continue
            compile.started_at = self.clock()
            self._running += 1
            self._owners[compile.owner] = self._owners.get(compile.owner, 0) + 1
            threading.Thread(target=self._run, args=(compile,), name="mrc-grammar", daemon=True).start()

    def _next(self) -> Compile:
        """The queued compile whose owner has the fewest under way; the oldest among equals."""
        return min(self._queue, key=lambda c: self._owners.get(c.owner, 0))  # min keeps the first

    def _promote(self, now: float) -> None:
        """Compiles past their limit leave THREADS for OVERDUE, while OVERDUE has room."""
        for compile in self._flight.values():
            if self._overdue >= self.overdue_cap:
                break
            started = compile.started_at
            running = started is not None and not compile.overdue and not compile.light
            running = running and not compile.future.done()
            if running and started is not None and now - started >= self.limit_s:
                compile.overdue = True
                self._running -= 1
                self._overdue += 1
        self._dispatch()

    def _next_overdue(self, now: float) -> list[float]:
        """When running compiles will pass their limit (still ahead: one already past it that could not
        give its place waits for an overdue one to end, which no clock tells)."""
        moments = [
            c.started_at + self.limit_s
            for c in self._flight.values()
            if c.started_at is not None and not c.overdue and not c.light and not c.future.done()
        ]
        return [moment for moment in moments if moment > now]

    def _end(self, wait: Wait) -> None:
        if wait.ended:
            return
        wait.ended = True
        compile = wait.compile
        compile.waiters -= 1
        if compile.waiters == 0 and compile.started_at is None:
            self._queue.remove(compile)
            self._flight.pop(compile.key, None)
            compile.future.cancel()

    # ---------------------------------------------------------------- the compile thread
    def _run(self, compile: Compile) -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, compile.work())
        except BaseException as exc:  # the job's error (e.g. InvalidJob: does not compile), handed to it;
            outcome = (False, exc)  # any other, too: a place kept by a compile that ended blocks the rest
        with self._lock:
            # The place is given back before the future ends, under the same lock: whoever sees the
            # grammar also sees the place free (CI, 2026-12-06: a test read "running 1" after its
            # result, the place still held for a moment). Nothing adds callbacks to these futures, so
            # ending one here runs none of anyone's code under the lock.
            self._release(compile)
            ok, value = outcome
            if ok:
                compile.future.set_result(value)
            else:
                compile.future.set_exception(value)
            self._dispatch()

    def _release(self, compile: Compile) -> None:
        if compile.light:
            pass  # held no place
        elif compile.overdue:
            self._overdue -= 1
        else:
            self._running -= 1
        if not compile.light:
            left = self._owners.get(compile.owner, 1) - 1
            if left:
                self._owners[compile.owner] = left
            else:
                self._owners.pop(compile.owner, None)
        if self._flight.get(compile.key) is compile:
            del self._flight[compile.key]
