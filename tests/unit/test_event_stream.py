"""The in-process records' completion events behave as the Redis stream does for the waits that wake
on them (producer/queue/sender.py `Queue.wait`): ids that only grow, past the cap too, and a read that
blocks until a newer event comes."""

from __future__ import annotations

import threading

from shared.memory_records import MemoryJobRecords


def test_ids_keep_growing_once_the_stream_is_capped_and_a_read_after_the_tail_sees_what_comes() -> None:
    records = MemoryJobRecords()
    for n in range(5):
        records.add_event({"job_id": f"old-{n}"}, keep=3)
    tail = records.events_tail()
    assert tail == "5-0"
    assert [e["job_id"] for e in records.events_after("0-0")] == ["old-2", "old-3", "old-4"]
    assert records.add_event({"job_id": "mine"}, keep=3) == "6-0"
    assert records.events_tail() == "6-0"
    assert [(e["id"], e["job_id"]) for e in records.events_after(tail)] == [("6-0", "mine")]


def test_a_blocking_read_wakes_as_an_event_comes_past_the_cap() -> None:
    records = MemoryJobRecords()
    for n in range(3):
        records.add_event({"job_id": f"old-{n}"}, keep=3)
    tail = records.events_tail()
    adding = threading.Timer(0.2, lambda: records.add_event({"job_id": "mine"}, keep=3))
    adding.start()
    try:
        found = records.events_after(tail, block_s=30)  # before: the cap kept the count, nothing woke it
    finally:
        adding.join()
    assert [e["job_id"] for e in found] == ["mine"]
