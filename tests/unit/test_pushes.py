"""shared/pushes.py: which records, with which push marker, mean a job's message is nowhere."""

from __future__ import annotations

import pytest

from shared import names, pushes

QUEUED = {"state": "queued", "published": "1", "checked": "1", "fingerprint": "f"}


@pytest.mark.parametrize(
    ("record", "marker", "missing"),
    [
        (QUEUED, "", True),  # the failover's lost push: published, queued, never begun, no marker
        (QUEUED, pushes.HELD, False),  # in a lane or held unacked by a worker
        (QUEUED, pushes.ACKED, False),  # a worker took it and acked it
        ({**QUEUED, "attempts": "1", "retry_reason": "store_unavailable"}, "", False),  # began: the worker's
        ({**QUEUED, "state": "running"}, "", False),
        ({**QUEUED, "state": "succeeded"}, "", False),
        ({**QUEUED, "published": "0"}, "", False),  # a claim not yet published: its producer's to push
        ({**QUEUED, "run_id": "r1", "checked": "0"}, "", False),  # backlog: recorded with its message
        ({**QUEUED, "run_id": "r1", "push": "job:j:requeue:1", "attempts": "0"}, "", True),  # requeued
        ({}, "", False),  # no record: the resubmission claims the id itself
    ],
)
def test_a_message_is_missing_only_when_nothing_says_it_exists(
    record: dict[str, str], marker: str, missing: bool
) -> None:
    assert pushes.message_missing(record, marker) is missing


def test_a_record_names_the_push_its_message_has() -> None:
    assert pushes.record_push_id("j", QUEUED) == names.job_push_id("j")
    assert pushes.record_push_id("j", {**QUEUED, "push": "job:j:requeue:1"}) == "job:j:requeue:1"
