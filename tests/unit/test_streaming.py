"""workers/streaming.py: what a streaming row publishes is always a prefix of its answer, never twice,
in one write per flush for every row, and whatever happens to the sink, the row is untouched."""

from __future__ import annotations

import pytest

from workers.streaming import Entry, MemorySink, TextStreams, stable_text


def utf8(tokens: list[int]) -> str:
    """A byte-level 'tokenizer': each token one byte, decoded as a real one does (U+FFFD until whole)."""
    return bytes(tokens).decode("utf-8", "replace")


def test_stable_text_holds_back_a_partial_character_and_with_space_cleanup_the_last_word() -> None:
    assert stable_text("caf\ufffd", cleans_spaces=False) == "caf"
    assert stable_text("a box ,", cleans_spaces=False) == "a box ,"
    assert stable_text("a box ,", cleans_spaces=True) == "a box"
    assert stable_text("refund", cleans_spaces=True) == "refund"


class FlakySink(MemorySink):
    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail, self.writes = fail, 0

    def write(self, entries: list[Entry], fresh: set[str]) -> None:
        self.writes += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("Redis went away")
        super().write(entries, fresh)


def test_every_character_is_published_once_in_order_through_restarts_and_sink_failures() -> None:
    answer = "Refund: oui, très abîmé ✓".encode()
    sink = FlakySink(fail=2)
    streams = TextStreams(sink, utf8, interval_s=1.0)
    offered = list(answer)
    for n in (1, 5, 9):  # the sink fails the first two flushes: offered again, nothing lost
        streams.offer("job-1", offered[:n])
        streams.flush()
    assert sink.writes == 3
    assert sink.text("job-1") == answer[:9].decode()  # what the third offer held, in one entry
    assert len(sink.entries) == 1
    streams.offer("job-1", offered[:2])  # paused and recomputed: the same tokens again, shorter first
    streams.flush()
    for n in range(10, len(offered) + 1):  # one byte at a time: partial characters held back
        streams.offer("job-1", offered[:n])
        streams.flush()
        assert "\ufffd" not in sink.text("job-1")
        assert answer.decode().startswith(sink.text("job-1"))
    streams.offer("job-1", offered, ended=True)
    streams.flush()
    entries = [e for e in sink.entries if e.job_id == "job-1"]
    at = 0
    for entry in entries:  # contiguous: each entry starts where the last one ended
        assert entry.at == at
        at += len(entry.text)
    assert "".join(e.text for e in entries) == answer.decode()
    assert [e.end for e in entries].count(True) == 1
    assert entries[-1].end


def test_one_write_per_flush_for_every_row_and_nothing_for_rows_without_news() -> None:
    sink = FlakySink(fail=0)
    streams = TextStreams(sink, utf8, interval_s=1.0)
    for job in ("a", "b", "c"):
        streams.offer(job, list(b"yes"))
    streams.flush()
    assert sink.writes == 1
    assert {e.job_id for e in sink.entries} == {"a", "b", "c"}
    streams.offer("a", list(b"yes"))  # no new text
    streams.flush()
    assert sink.writes == 1


@pytest.mark.parametrize("interval", [0.005, 0.05])
def test_the_publisher_thread_flushes_what_is_offered_and_everything_at_stop(interval: float) -> None:
    sink = MemorySink()
    streams = TextStreams(sink, utf8, interval_s=interval).start()
    words = list(b"the box is crushed")
    for n in range(1, len(words) + 1):
        streams.offer("j", words[:n])
    streams.offer("j", words, ended=True)
    streams.stop()
    assert sink.text("j") == "the box is crushed"
    assert sink.entries[-1].end
