"""Waiting out Redis or S3 being away while a backlog run is under way (a restart, a failover, a
network blip): the step is tried again, with growing pauses, until it works or a deadline passes.

Only for steps that may run again: a run's enqueue resumes where it was (a job id with a record is
never queued twice, a chunk with an index is not read again), and status and report only read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from kombu.exceptions import OperationalError

from shared.errors import StoreUnavailable

T = TypeVar("T")

# What an outage looks like from here: the connection, not a command Redis refused (a ResponseError is
# a fault an operator must see, raised as it is, unless Redis's own words say it is away: is_outage).
OUTAGES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    OperationalError,
    StoreUnavailable,
    ConnectionError,
    TimeoutError,
)


class Heard:
    """When an enqueue last did something new (queued a job, or looked at a full lane): it works then.
    Not every progress report: a try re-reads the indexes of the chunks already done, which works
    while writes fail (review: a write-only fault looped with a fresh budget each time)."""

    def __init__(self) -> None:
        self.at = 0.0
        self._progress, self._enqueued = 0, 0

    def saw(self, progress: Any) -> None:
        before = self._enqueued if id(progress) == self._progress else 0  # each try has its own Progress
        if progress.waiting_for_room or progress.enqueued > before:
            self.at = time.monotonic()
        self._progress, self._enqueued = id(progress), progress.enqueued

    def last(self) -> float:
        return self.at


class Outage(Exception):
    """Redis or S3 stayed away past the deadline."""


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` is Redis or S3 being away (a restart, a failover, replicas gone) rather than a
    fault an operator must see at once. redis-py wraps a pipeline's error in text ("Command # 1 (...)
    of pipeline caused error: NOREPLICAS ..."), so a refusal is read by its words."""
    if isinstance(exc, OUTAGES):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    said = str(exc).rsplit("caused error: ", 1)[-1]  # Redis's own words, not the command it quotes
    return said.startswith(_AWAY_WORDS)


# Refusals that end when Redis is whole again. Not READONLY: without Sentinel the connection stays on
# the replica (a retry cannot succeed: review), and through Sentinel redis-py reconnects by itself.
_AWAY_WORDS = ("NOREPLICAS", "MASTERDOWN", "LOADING", "TRYAGAIN")


def outlast(
    step: Callable[[], T],
    budget_s: float,
    what: str,
    *,
    heard: Callable[[], float] = lambda: 0.0,
    until: float = float("inf"),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`step()`, tried again through each outage for up to `budget_s` from the outage's start (a step
    that ran for hours and then met a restart gets its whole budget: review), never past `until`
    (on `clock`). `heard()`: when the step last showed it was working (its progress callback);
    a failure after that begins a new outage. Outage when one lasts past its budget."""
    pause, told, began = 1.0, False, None
    while True:
        try:
            return step()
        except Exception as exc:
            if not is_outage(exc):
                raise
            now = clock()
            if began is None or heard() > began:  # a new outage: the step worked since the last one
                began, pause, told = now, 1.0, False
            left = min(until, began + budget_s) - now
            fault = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if left <= 0:
                raise Outage(f"Redis or S3 still away ({fault})") from exc
            if not told:  # once an outage: the progress display goes on after it
                print(f"mrc: {what}: Redis or S3 away ({fault}); trying again", file=sys.stderr)
                told = True
            sleep(min(pause, left))
            pause = min(pause * 2, 10.0)
