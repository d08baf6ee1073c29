"""Whether the worker's consumer is alive or stuck: what `/healthz` answers.

Alive is making progress: the consumer polls Redis every fraction of a second while idle (the
transport calls `polled`), and every delivery in hand moves from stage to stage, or, while it waits
on the engine, the engine steps (the pipeline's `progress_at`: the least recent of them). Stuck is
no progress for `MRC_STUCK_AFTER_S` while there is work: a batch in hand (then the consumer's polls,
which go on beside it, do not count), or jobs waiting on the worker's lanes. An idle worker with
nothing to do is not stuck however long it waits; a worker that cannot tell whether work waits
(Redis away) is not called stuck either, since restarting it would not bring Redis back.

Before the consumer starts (the model loading, for minutes) and in a worker that stays alive but not
ready on purpose (it refuses readiness and never consumes), there is no consumer to be stuck: alive.
Readiness (/readyz) is what says such a worker takes no work; restarting it would change nothing.

An engine step counts as progress for every delivery waiting on the engine, whichever rows moved, so
the details also show the engine's rows (`engine_rows_held`: backlog rows sitting out steps while
tickets decode; `engine_backlog_stalled_steps`: steps in a row the backlog had work and none of its
rows moved): a starving backlog is visible there, though it is no reason to restart the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Progress = Callable[[], tuple[float, float | None]]  # (last progress, batch in hand since | None)
# How long /healthz waits for its look at the lanes: within a kubelet probe's default second. A look
# that takes longer (Redis hung) goes on beside the answer, which cannot tell, and so is "alive"
# (review, helper-74: each answer took the Redis client's 10 s, and every worker would be restarted).
ANSWER_WITHIN_S = 0.5


class Liveness:
    def __init__(
        self,
        stuck_after_s: float,
        waiting: Callable[[], bool | None],
        progress: Progress | None = None,
        clock: Callable[[], float] = time.monotonic,
        consuming: bool = True,
    ) -> None:
        self.stuck_after_s = stuck_after_s
        self._consuming = consuming
        self._waiting = waiting  # jobs waiting on the lanes: True, False, or None when unknown
        self._progress = progress or (lambda: (0.0, None))
        self._engine: Callable[[], dict[str, Any]] = dict  # the engine's rows now (/healthz details)
        self._clock = clock
        self._last_poll = clock()
        self._lock = threading.Lock()
        self._waiting_cache: tuple[float, bool | None] = (-1e18, None)
        self._looks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrc-liveness")
        self._look: Future[bool | None] | None = None  # the look at the lanes under way

    def watch(self, progress: Progress, engine: Callable[[], dict[str, Any]] | None = None) -> None:
        """Follow this pipeline's progress (known once it is built, after the HTTP server started), and
        show its engine's rows."""
        self._progress = progress
        if engine is not None:
            self._engine = engine

    def polled(self) -> None:
        self._last_poll = self._clock()

    def consuming(self) -> None:
        """The consumer has started: from now on it must make progress while there is work."""
        self._last_poll = self._clock()
        self._consuming = True

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(alive, details) for /healthz."""
        if not self._consuming:
            return True, {"status": "alive", "consuming": False}
        now = self._clock()
        progress_at, batch_since = self._progress()
        # With a delivery in hand only its progress counts: the consumer keeps polling beside it.
        last = progress_at if batch_since is not None else max(self._last_poll, progress_at)
        silent = now - last
        details: dict[str, Any] = {
            "silent_s": round(silent, 1), "stuck_after_s": self.stuck_after_s, **self._engine(),
        }  # fmt: skip
        if batch_since is not None:
            details["batch_for_s"] = round(now - batch_since, 1)
        if silent <= self.stuck_after_s:
            return True, {"status": "alive", **details}
        if batch_since is not None:
            return False, {"status": "stuck", "reason": "a batch in hand made no progress", **details}
        waiting = self._waiting_now(now)
        if waiting:
            return False, {"status": "stuck", "reason": "jobs wait and the consumer does not poll", **details}
        return True, {"status": "alive", "idle": True, "work_waiting": waiting, **details}

    def _waiting_now(self, now: float) -> bool | None:
        with self._lock:
            at, value = self._waiting_cache
            if now - at < 2.0:
                return value
            if self._look is None:  # one look at a time, however many probes come meanwhile
                self._look = self._looks.submit(self._read_waiting)
            look = self._look
        try:
            value = look.result(timeout=ANSWER_WITHIN_S)
        except TimeoutError:  # Redis slow or hung: cannot tell now, so not stuck
            return None
        with self._lock:
            if self._look is look:
                self._look = None
            self._waiting_cache = (now, value)
        return value

    def _read_waiting(self) -> bool | None:
        try:
            return self._waiting()
        except Exception:  # Redis away: cannot tell, so not stuck
            return None
