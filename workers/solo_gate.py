"""The worker to itself for a suspect's lone run; every other job's work beside each other's.

A lone run (workers/admission.py: a suspect in a group of one) is counted against its job: a worker
that dies during it is taken to have been killed by it, and a job that every lone run of it lost is
abandoned. That holds only if nothing else the worker does can kill it meanwhile. A worker runs
several deliveries at once (MRC_WORKER_DELIVERIES): another delivery's killer, dying in its photo's
decode or in its engine rows while an innocent job ran alone, was charged to the innocent one (CI red
twice, with MRC_MAX_ATTEMPTS=2: abandoned after one such coincidence).

So every delivery's jobs hold the gate shared from their claim to their results (the claim marks
them `running`: one waiting outside is no suspect of a death it never saw), and a lone run holds it
alone, from the count of its run to its result. A lone run that waits keeps new work out, so that a
busy worker is ever quiet for it; it starts once the work in hand has ended, and what runs outside
any holder has ended too (`busy`: rows a failed delivery left in the engine, a grammar compile past
its limit). Nothing here knows about jobs: the pipeline decides what holds what.

The gate breaks when a holder leaves by any exception: the worker ends on it (workers/tasks.py exits
on whatever leaves a delivery), and whoever waits leaves with WorkerUnusable rather than start work
on a worker that is going (and count a lone run that the exit would charge).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shared.errors import WorkerUnusable

# A waiter looks again this often for a fault it was not woken for (the engine's death wakes no one).
_LOOK_S = 0.5


class SoloGate:
    def __init__(
        self,
        fatal: Callable[[], BaseException | None] = lambda: None,
        busy: Callable[[float], bool] = lambda waited_s: False,
    ) -> None:
        self._fatal = fatal  # the engine's fatal error, once it has died
        self._busy = busy  # work outside any holder still running, after waiting so long for it
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting_alone = 0
        self._broken: BaseException | None = None

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Beside any other shared holder; never beside a lone run, nor ahead of one that waits."""
        with self._cond:
            while self._alone or self._waiting_alone:
                self._raise_if_dying()
                self._cond.wait(_LOOK_S)
            self._raise_if_dying()
            self._shared += 1
        try:
            yield
        except BaseException as exc:  # the worker ends: nothing may start on it now
            self._note_death(exc)
            raise
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[float]:
        """With nothing else held; yields the seconds it waited for the work in hand to end."""
        began = time.monotonic()
        with self._cond:
            self._waiting_alone += 1
            try:
                while self._alone or self._shared or self._busy(time.monotonic() - began):
                    self._raise_if_dying()
                    self._cond.wait(_LOOK_S)
                self._raise_if_dying()
            finally:
                self._waiting_alone -= 1
                self._cond.notify_all()  # shared waiters look again (none may be left waiting alone)
            self._alone = True
        try:
            yield time.monotonic() - began
        except BaseException as exc:  # the worker ends: nothing may start on it now
            self._note_death(exc)
            raise
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()

    def _raise_if_dying(self) -> None:
        fault = self._broken or self._fatal()
        if isinstance(fault, WorkerUnusable):
            raise fault
        if fault is not None:
            raise WorkerUnusable(f"the worker is dying: {fault!r}"[:500])

    def _note_death(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = self._broken or exc
            self._cond.notify_all()
