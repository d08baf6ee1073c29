"""Waiting out an outage during a backlog run (producer/backlog/outages.py): a step is tried again
through Redis or S3 being away, until a deadline; other faults are raised at once."""

from __future__ import annotations

import time

import pytest
import redis

from producer.backlog import outages
from shared.errors import StoreUnavailable, UsageError


def test_a_step_is_tried_again_through_an_outage_with_growing_pauses() -> None:
    faults: list[Exception] = [redis.ConnectionError("refused"), StoreUnavailable("S3 away")]
    faults.append(redis.BusyLoadingError("loading"))
    pauses: list[float] = []

    def step() -> str:
        if faults:
            raise faults.pop(0)
        return "done"

    assert outages.outlast(step, time.monotonic() + 60, "testing", sleep=pauses.append) == "done"
    assert pauses == [1.0, 2.0, 4.0]


def test_past_the_deadline_the_outage_is_named_and_other_faults_pass_at_once() -> None:
    def away() -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with pytest.raises(outages.Outage, match="Connection refused"):
        outages.outlast(away, time.monotonic() + 0.05, "testing", sleep=time.sleep)
    calls: list[int] = []

    def refused() -> None:
        calls.append(1)
        raise UsageError("run r was cancelled; start a new run id")

    with pytest.raises(UsageError):
        outages.outlast(refused, time.monotonic() + 60, "testing", sleep=lambda _s: None)
    assert calls == [1]
