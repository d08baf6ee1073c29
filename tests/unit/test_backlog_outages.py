"""Waiting out an outage during a backlog run (producer/backlog/outages.py): a step is tried again
through Redis or S3 being away, for a budget counted from each outage's start; other faults are
raised at once."""

from __future__ import annotations

import time

import pytest
import redis

from producer.backlog import outages
from shared.errors import StoreUnavailable, UsageError


def test_a_step_is_tried_again_through_an_outage_with_growing_pauses() -> None:
    faults: list[Exception] = [redis.ConnectionError("refused"), StoreUnavailable("S3 away")]
    faults.append(redis.ResponseError("Command # 1 (EVALSHA x) of pipeline caused error: NOREPLICAS"))
    pauses: list[float] = []

    def step() -> str:
        if faults:
            raise faults.pop(0)
        return "done"

    assert outages.outlast(step, 60, "testing", sleep=pauses.append) == "done"
    assert pauses == [1.0, 2.0, 4.0]


def test_past_its_budget_an_outage_is_named_and_other_faults_pass_at_once() -> None:
    def away() -> None:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with pytest.raises(outages.Outage, match="Connection refused"):
        outages.outlast(away, 0.05, "testing", sleep=time.sleep)
    calls: list[int] = []

    def refused() -> None:
        calls.append(1)
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(redis.ResponseError):
        outages.outlast(refused, 60, "testing", sleep=lambda _s: None)
    for words in (  # Redis's own words decide, not the command a pipeline's error quotes (review)
        "Command # 1 (EVALSHA x 1 mrc:run:LOADING-dock) of pipeline caused error: OOM command not allowed",
        "READONLY You can't write against a read only replica.",  # retrying cannot help without Sentinel
    ):
        assert not outages.is_outage(redis.ResponseError(words))
    assert outages.is_outage(redis.ResponseError("MASTERDOWN Link with MASTER is down"))
    with pytest.raises(UsageError):
        outages.outlast(lambda: (_ for _ in ()).throw(UsageError("cancelled")), 60, "testing")
    assert calls == [1]


@pytest.mark.parametrize("worked", [True, False])
def test_each_outage_gets_the_whole_budget_once_the_step_has_worked_again(worked: bool) -> None:
    """Review (helper-50): the budget ran from the enqueue's start, so a run enqueueing for longer
    than MRC_BACKLOG_OUTAGE_S gave up at its first blip. A step that reported progress after an
    outage began starts a new one at its next failure; without progress it is one outage."""
    clock = {"now": 0.0, "heard": -1.0}
    outcomes = ["away"] * 3 + ["worked"] + ["away"] * 2 + ["done"]

    def step() -> str:
        outcome = outcomes.pop(0)
        if outcome == "worked":  # progress reported, then the connection dropped again
            if worked:
                clock["heard"] = clock["now"]
            outcome = "away"
        if outcome == "away":
            raise redis.ConnectionError("refused")
        return outcome

    def sleep(_seconds: float) -> None:
        clock["now"] += 10.0  # each pause, ten seconds of the clock

    def run() -> str:
        return outages.outlast(
            step, 45.0, "testing", heard=lambda: clock["heard"], sleep=sleep, clock=lambda: clock["now"]
        )

    if worked:
        assert run() == "done"
    else:
        with pytest.raises(outages.Outage):  # 50 s of one outage: past its 45 s
            run()


def test_only_new_work_says_the_enqueue_works_not_reports_of_chunks_already_done() -> None:
    """Review (helper-51): every try re-read the indexes of the chunks already done and reported them,
    which works while writes fail; each report began a new outage with a fresh budget, and a
    write-only fault looped for good. Only a job queued, or a look at a full lane, counts."""
    from producer.backlog.run import Progress

    heard = outages.Heard()
    first = Progress("r")
    first.enqueued = 5000
    heard.saw(first)
    assert heard.last() > 0
    since = heard.last()
    again = Progress("r")  # the next try: chunk 1 done (already), chunk 2's writes fail
    again.already = 5000
    heard.saw(again)
    heard.saw(again)
    assert heard.last() == since
    again.enqueued = 1  # it queued something new: it works
    heard.saw(again)
    assert heard.last() > since
    full = Progress("r")
    full.waiting_for_room = True
    since = heard.last()
    heard.saw(full)
    assert heard.last() >= since
