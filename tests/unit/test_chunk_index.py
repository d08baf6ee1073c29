"""A chunk's index while it is queued (producer/backlog/chunk_index.py): a partial index every few
seconds and when the lane fills, read in the whole one's place until that is written, never taken by a
resume as the chunk's index, and deleted once the whole one is written; on a clock of the test's own."""

from __future__ import annotations

from producer.backlog import chunk_index
from producer.backlog.chunk_index import ChunkIndex
from shared.stores.memory import MemoryStore

FOLDER = "runs/r/index/"


class _Clock:
    def __init__(self) -> None:
        self.now = 5.0

    def __call__(self) -> float:
        return self.now


def _queued(n: int) -> dict[str, object]:
    return {"line": n, "custom_id": f"c{n}", "job_id": f"r.c{n}"}


def _keys(store: MemoryStore) -> list[str]:
    return list(store.list_keys(FOLDER))


def test_a_growing_chunk_is_indexed_partially_every_few_seconds_and_whole_at_its_end() -> None:
    store, clock = MemoryStore(), _Clock()
    index = ChunkIndex(store, FOLDER, 3, clock=clock)
    index.entries.append(_queued(15001))
    index.grew()
    assert _keys(store) == [], "written at once: a fast chunk would write its index twice"
    clock.now += chunk_index.PARTIAL_EVERY_S
    index.entries.append(_queued(15002))
    index.grew()
    assert _keys(store) == [FOLDER + "00000003.partial.jsonl"]
    assert [e["line"] for e in _read(store)] == [15001, 15002]
    clock.now += chunk_index.PARTIAL_EVERY_S
    index.grew()  # nothing new: nothing written
    index.entries.insert(0, {"line": 15000, "invalid": "not JSON"})
    index.write()
    assert _keys(store) == [FOLDER + "00000003.jsonl"], "the partial index outlived the whole one"
    assert [e["line"] for e in _read(store)] == [15000, 15001, 15002]


def test_a_pass_about_to_wait_for_room_writes_what_it_queued_at_once() -> None:
    store, clock = MemoryStore(), _Clock()
    index = ChunkIndex(store, FOLDER, 0, clock=clock)
    index.grew(waiting=True)
    assert _keys(store) == [], "an empty partial index"
    index.entries.extend(_queued(n) for n in range(1, 51))
    index.grew(waiting=True)
    assert len(_read(store)) == 50


def test_readers_take_the_whole_index_over_a_partial_one_and_a_resume_takes_only_whole_ones() -> None:
    store = MemoryStore()
    store.put_text(FOLDER + "00000000.jsonl", '{"line": 1, "custom_id": "a", "job_id": "r.a"}\n')
    store.put_text(FOLDER + "00000000.partial.jsonl", '{"line": 1, "custom_id": "old", "job_id": "r.old"}\n')
    store.put_text(FOLDER + "00000001.partial.jsonl", '{"line": 5001, "custom_id": "b", "job_id": "r.b"}\n')
    keys = _keys(store)
    assert list(chunk_index.readable(keys)) == [FOLDER + "00000000.jsonl", FOLDER + "00000001.partial.jsonl"]
    assert chunk_index.listed(keys) == ({0}, {0, 1})


def test_a_pass_over_a_chunk_a_killed_pass_left_partial_deletes_that_partial_index() -> None:
    store = MemoryStore()
    store.put_text(FOLDER + "00000002.partial.jsonl", '{"line": 10001, "custom_id": "a", "job_id": "r.a"}\n')
    index = ChunkIndex(store, FOLDER, 2, known=[_queued(10000)], stale_partial=True)
    index.entries.append(_queued(10001))
    assert [e["line"] for e in index.write()] == [10000, 10001]
    assert _keys(store) == [FOLDER + "00000002.jsonl"]


def test_entries_split_at_newlines_only() -> None:
    text = '{"line": 1, "custom_id": "a\u2028b", "job_id": "r.x"}\n\n{"line": 2, "invalid": "no"}\n'
    assert [e["line"] for e in chunk_index.entries_of(text)] == [1, 2]


def _read(store: MemoryStore) -> list[dict[str, object]]:
    key = next(chunk_index.readable(_keys(store)))
    return chunk_index.entries_of(store.get_text(key) or "")
