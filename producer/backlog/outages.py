"""Waiting out Redis or S3 being away while a backlog run is under way (a restart, a failover, a
network blip): the step is tried again, with growing pauses, until it works or a deadline passes.

Only for steps that may run again: a run's enqueue resumes where it was (a job id with a record is
never queued twice, a chunk with an index is not read again), and status and report only read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from kombu.exceptions import OperationalError

from shared.errors import StoreUnavailable

T = TypeVar("T")

# What an outage looks like from here: the connection, not a command Redis refused (a ResponseError
# other than a read-only replica's is a fault an operator must see, raised as it is).
OUTAGES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.ReadOnlyError,
    OperationalError,
    StoreUnavailable,
    ConnectionError,
    TimeoutError,
)


class Outage(Exception):
    """Redis or S3 stayed away past the deadline."""


def outlast(
    step: Callable[[], T],
    deadline: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`step()`, tried again through outages until `deadline` (time.monotonic()); Outage past it."""
    pause, told = 1.0, False
    while True:
        try:
            return step()
        except OUTAGES as exc:
            fault = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise Outage(f"Redis or S3 still away ({fault})") from exc
            if not told:  # once an outage: the progress display goes on after it
                print(f"mrc: {what}: Redis or S3 away ({fault}); trying again", file=sys.stderr)
                told = True
            sleep(min(pause, left))
            pause = min(pause * 2, 10.0)
