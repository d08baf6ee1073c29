"""`mrc backlog --rate N`: at most N lines a second over any stretch of time, and at most a second's worth
at once (from the run's first line on: a whole part of 500 went at once before), on a clock of the
test's own."""

from __future__ import annotations

import pytest

from producer.backlog import run as backlog_run


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _sent(monkeypatch: pytest.MonkeyPatch, rate: float | None, lines: int) -> list[tuple[float, int]]:
    """(when, how many) for each part of a run of `lines` lines, as `_queue` takes them."""
    clock = _Clock()
    monkeypatch.setattr(backlog_run.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(backlog_run.time, "sleep", clock.sleep)
    throttle = backlog_run._Throttle(rate)
    sent, at = [], 0
    while at < lines:
        count = throttle.part(min(backlog_run._PART, lines - at))
        throttle.take(count)
        sent.append((clock.now - 100.0, count))
        at += count
    return sent


@pytest.mark.parametrize(("rate", "lines"), [(5, 40), (0.5, 3), (100, 1200), (3000, 20_000), (7.5, 100)])
def test_no_second_holds_more_than_the_rate(monkeypatch: pytest.MonkeyPatch, rate: float, lines: int) -> None:
    sent = _sent(monkeypatch, rate, lines)
    assert sum(count for _, count in sent) == lines
    burst = max(1, int(rate))  # a part: at most a second's worth
    for start, _ in sent:  # windows from each part's start: the rate over them, and one part more
        for span in (1.0, 3.0, 10.0):
            assert sum(count for when, count in sent if start <= when < start + span) <= rate * span + burst
    assert sent[-1][0] >= (lines - max(1, int(rate))) / rate - 1e-9  # the run took as long as the rate says


def test_without_a_rate_parts_are_whole_and_nothing_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _sent(monkeypatch, None, 1200) == [(0.0, 500), (0.0, 500), (0.0, 200)]
