"""The slot table (workers/engine/slot_table.py): where each row's slot lies in the cache's pool, and
how much of it the row holds. Pure Python, no torch: any sequence of joins, steps and leaves never
gives one position to two slots, keeps each slot within its size, counts what the rows really hold,
and places any row whose need fits in what the rows leave free (compacting, or freeing retained
slots, as needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.prefix_index import Hit, chain
from workers.engine.slot_table import UNIT, NoFreeSlot, SlotTable, rounded

# An operation: ("join", need) | ("step", 0) | ("leave", which row) | ("keep", which row).
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(1, 120)),
        st.tuples(st.just("step"), st.just(0)),
        st.tuples(st.just("leave"), st.integers(0, 100)),
        st.tuples(st.just("keep"), st.integers(0, 100)),
    ),
    max_size=80,
)


def _check_disjoint(table: SlotTable) -> None:
    runs = sorted((table.start(h), table.size(h)) for h in table._start)
    assert all(start % table.grain == 0 for start, _ in runs), runs  # the pool step's kernel block
    runs += table._free
    runs.sort()
    cursor = 0
    for start, size in runs:
        assert start == cursor, runs  # slots and free runs tile the pool exactly, no overlap
        cursor = start + size
    assert cursor == table.pool


@settings(max_examples=300, deadline=None)
@given(pool=st.integers(128, 600), operations=OPERATIONS, grain=st.sampled_from([UNIT, 32, 64, 512]))
def test_by_need_any_sequence_keeps_the_pool_consistent(
    pool: int, operations: list[tuple[str, int]], grain: int
) -> None:
    """Also with slots on a grain larger than the index's block (the pool step's kernel block):
    every slot starts on it, through first fit, compaction and retained slots' shrinking."""
    pool *= max(1, grain // 64)  # the CPU pool step's 512: room for 2-9 slots, as the others
    moved: list[tuple[int, int, int]] = []
    table = SlotTable(8, positions=120, capacity=pool, mover=lambda *m: moved.append(m), grain=grain)
    lengths: dict[str, int] = {}
    made = 0
    for kind, value in operations:
        live = sorted(lengths)
        if kind == "join":
            row = f"r{made}"
            made += 1
            if rounded(value, grain) <= table.spare:  # admission's rule: what the rows leave free
                start = table.assign(row, 0, value)
                assert table.size(row) == rounded(value, grain)
                assert start % grain == 0
                lengths[row] = 0
            else:
                with pytest.raises(NoFreeSlot):
                    table.assign(row, 0, value)
        elif kind == "step":
            growing = [r for r in live if lengths[r] < table.size(r)]
            table.grow(growing)
            for row in growing:
                lengths[row] += 1
        elif live:
            row = live[value % len(live)]
            if kind == "keep":
                table.index.add(row, chain(row, list(range(lengths[row]))))
                table.retain(row)
            else:
                table.release(row)
            del lengths[row]
        _check_disjoint(table)
        assert table.used == len(lengths)
        assert table.held == sum(lengths.values())
        assert all(table.length(r) == n for r, n in lengths.items())
        assert table.reserved == sum(table.size(r) for r in lengths)
    assert all(new < old for old, new, _ in moved)  # compaction only slides down


def test_a_row_by_need_holds_its_need_not_the_longest_jobs() -> None:
    table = SlotTable(64, positions=3366, capacity=8 * 3376)
    for index in range(60):  # a 640x480 photo and 64 new tokens: ~442 positions
        table.assign(f"r{index}", 378, 442)
    assert table.used == 60  # where uniform slots of the longest job hold 8
    assert table.size("r0") == 448
    with pytest.raises(NoFreeSlot):
        table.assign("one-too-many", 378, 442)


def test_holes_are_compacted_for_a_row_that_fits_in_none_of_them() -> None:
    moves: list[tuple[int, int, int]] = []
    table = SlotTable(8, positions=64, capacity=128, mover=lambda *m: moves.append(m))
    for row in "abcd":
        table.assign(row, 5, 32)
    table.release("a")
    table.release("c")  # two holes of 32: no run of 64
    assert table.assign("e", 0, 64) == 64
    assert moves == [(32, 0, 5), (96, 32, 5)]  # b and d slid down, positions held each
    assert (table.start("b"), table.start("d")) == (0, 32)


def test_a_retained_prefix_keeps_its_blocks_only_and_is_freed_least_recently_used() -> None:
    table = SlotTable(4, positions=100, capacity=224)
    table.assign("a", 0, 100)
    table.index.add("a", chain("a", list(range(40))))  # two whole blocks known
    table.set_length("a", 40)
    entry = table.retain("a")
    assert entry is not None
    assert (table.size(entry), table.length(entry), table.cached, table.used) == (32, 32, 32, 0)
    table.assign("b", 0, 100)
    table.assign("c", 0, 90)  # 112 + 96 + 32 retained = 240 > 224: the retained slot goes
    assert entry not in table
    assert table.index.match(chain("a", list(range(40)))) is None


@pytest.mark.parametrize("capacity", [None, 1024], ids=["uniform", "by-need"])
def test_rows_that_asked_about_one_photo_at_once_leave_one_copy_of_its_prefix(capacity: int | None) -> None:
    """Review finding: four questions about one photo, run together, each left its own copy of the
    photo's blocks; 16 copies of 4 photos filled the cache and pushed out the prefixes of the photos
    asked about next. One copy stays, the longest; the gauge counts whole blocks in either layout."""
    table = SlotTable(8, positions=100, capacity=capacity)
    photo = list(range(48))  # three whole blocks, then the questions (a partial block: no hash)
    for row in "abcd":
        table.assign(row, 0, 60)
        table.index.add(row, chain("photo", photo))
        table.set_length(row, 55)
    kept = table.retain("a")
    assert kept is not None
    assert [table.retain(row) for row in "bcd"] == [None, None, None]  # freed: `kept` holds it all
    assert (table.cached, table.length(kept)) == (48, 48)
    assert table.spare == table.pool
    longer = list(range(64))  # the same start and one block more: it covers `kept`, which goes
    table.assign("e", 0, 80)
    table.index.add("e", chain("photo", longer))
    table.set_length("e", 70)
    entry = table.retain("e")
    assert entry is not None
    assert kept not in table
    assert (table.cached, table.index.match(chain("photo", photo)).holder) == (64, entry)  # type: ignore[union-attr]
    other = list(range(100, 132))  # another photo: kept beside it
    table.assign("f", 0, 40)
    table.index.add("f", chain("other", other))
    table.set_length("f", 32)
    assert table.retain("f") is not None
    assert table.cached == 96


@pytest.mark.parametrize("capacity", [None, 2048], ids=["uniform", "by-need"])
def test_questions_that_diverge_after_one_photo_leave_one_copy_of_it(capacity: int | None) -> None:
    """Left open by the eleventh session: questions about one photo whose own tokens fill whole blocks
    (a long question, a schema's instructions) diverge after the photo, and each left a slot holding
    the photo's positions again. The first one stays; the others, mostly the same photo, go (the
    kept one serves their photo). A row that shares less than half of its blocks stays beside it."""
    table = SlotTable(8, positions=200, capacity=capacity)
    photo = list(range(96))  # six blocks of photo
    for row, question in zip("abcd", (1000, 2000, 3000, 4000), strict=True):
        table.assign(row, 0, 140)
        table.index.add(row, chain("photo", photo + list(range(question, question + 32))))
        table.set_length(row, 130)
    kept = table.retain("a")
    assert kept is not None
    assert [table.retain(row) for row in "bcd"] == [None, None, None]
    assert table.cached == 128  # one copy: the photo and the first question's two blocks
    assert table.spare == table.pool
    hit = table.index.match(chain("photo", photo + list(range(5000, 5032))))
    assert hit == Hit(kept, 96)  # a fifth question finds the photo in it
    # A shared start of less than half (a common instruction before different photos) is kept twice.
    table.assign("e", 0, 140)
    table.index.add("e", chain("photo", photo[:32] + list(range(7000, 7096))))
    table.set_length("e", 128)
    assert table.retain("e") is not None
    assert table.cached == 256


def test_a_compaction_whose_copy_fails_leaves_a_table_that_tiles_the_pool() -> None:
    """Review finding: compaction moved the slots' starts as it went and set the free runs only at the
    end, so a copy that failed half way left a slot overlapping a free run (the next row was placed
    inside a live slot) and the old run in neither list. Now the free runs are the gaps between the
    slots as they stand; a retained slot whose copy failed is forgotten, a row's stays where it was."""
    table = SlotTable(8, positions=100, capacity=600)
    for row in "abcde":
        table.assign(row, 20, 96)
        table.index.add(row, chain(row, list(range(16))))
    table.release("a")
    table.retain("c")  # a retained slot, between rows
    retained = next(h for h in table._start if table.retained(h))
    failures = iter([False, True])  # b moves; the retained slot's copy fails

    def mover(old: int, new: int, length: int) -> None:
        if next(failures, False):
            raise MemoryError("out of memory")

    table.mover = mover
    with pytest.raises(MemoryError):
        table.compact()
    _check_disjoint(table)
    assert table.start("b") == 0
    assert retained not in table
    assert table.index.match(chain("c", list(range(16)))) is None
    assert table.start("d") == 288  # not moved: rows keep their slot
    assert table.assign("f", 0, 96) == 96  # placed in a gap, inside no slot
    _check_disjoint(table)


def test_a_retained_slot_is_taken_over_where_it_lies_when_it_can_grow_there() -> None:
    table = SlotTable(4, positions=100, capacity=256)
    table.assign("a", 0, 100)
    table.index.add("a", chain("a", list(range(40))))
    table.set_length("a", 40)
    entry = table.retain("a")
    assert entry is not None
    assert table.take_over("b", entry, 32, 100) == 0  # the free run after it is enough
    assert (table.size("b"), table.length("b"), table.cached) == (112, 32, 0)
    table.assign("c", 0, 100)
    table.index.add("c", chain("c", list(range(40))))
    table.set_length("c", 40)
    kept = table.retain("c")
    assert kept is not None
    table.assign("d", 0, 96)  # right after c's kept blocks: c's slot cannot grow there
    assert table.take_over("e", kept, 32, 100) is None
    assert kept in table  # nothing changed: the runner copies instead


def test_the_uniform_grid_keeps_slots_of_the_longest_job_and_a_scratch_column() -> None:
    table = SlotTable(4, positions=10)
    assert (table.pool, table.unit) == (44, 11)
    for row in "abc":
        table.assign(row, 3, 2)
    assert [table.slot(r) for r in "abc"] == [0, 1, 2]
    table.release("b")
    assert table.top == 3
    table.compact()
    assert ([table.slot(r) for r in "ac"], table.top) == ([0, 1], 2)
    table.set_length("a", 10)
    with pytest.raises(ValueError, match="at its slot's 11 positions"):
        table.grow(["a"])  # the last column is the scratch


def test_a_row_never_grows_past_its_slot_and_never_joins_twice() -> None:
    table = SlotTable(2, positions=40, capacity=96)
    with pytest.raises(ValueError, match="needs 41 positions"):
        table.assign("long", 0, 41)
    table.assign("a", 30, 32)
    with pytest.raises(ValueError, match="already holds"):
        table.assign("a", 1)
    table.set_length("a", 32)
    with pytest.raises(ValueError, match="at its slot's 32 positions"):
        table.grow(["a"])
    assert "a" in table
    assert "b" not in table


def _retained(table: SlotTable, row: str, known: int) -> str:
    """A row of need 100 that held `known` positions, left to the prefix cache: the entry's id."""
    table.assign(row, 0, 100)
    table.index.add(row, chain(row, list(range(known))))
    table.set_length(row, known)
    entry = table.retain(row)
    assert entry is not None
    return entry


def test_a_pool_smaller_than_the_longest_rows_slot_is_refused() -> None:
    """A pool that cannot hold the longest row's slot would place such a row in a slot smaller than
    its need (the extent was capped at the pool), and it ran out of room mid-answer."""
    with pytest.raises(ValueError, match="holds no row of 120"):
        SlotTable(2, positions=120, capacity=120)  # its slot is 128
    assert SlotTable(2, positions=120, capacity=128).extent(120) == 128


def test_a_retained_slot_larger_than_the_rows_need_is_cut_to_it_when_taken_over() -> None:
    """A long question's retained prefix, taken over by a row that needs less: the row's slot is its
    own need, the rest is free again (admission counts needs; it held the whole slot, and a ticket
    admitted for the room found none, step after step)."""
    table = SlotTable(4, positions=100, capacity=256)
    entry = _retained(table, "a", 96)  # six whole blocks known
    assert table.size(entry) == 96
    assert table.take_over("b", entry, 32, 40) == 0
    assert (table.size("b"), table.length("b"), table.reserved, table.spare) == (48, 32, 48, 208)
    table.assign("t", 0, 100)  # a ticket that fits in what admission counted free
    table.assign("u", 0, 90)
    assert table.spare == 256 - 48 - 112 - 96


def test_the_grid_is_compacted_only_when_that_closes_a_hole() -> None:
    """A retained slot under a row is no hole: compaction would move nothing, every step."""
    table = SlotTable(4, positions=10)
    table.assign("a", 3, 8)
    table.index.add("a", chain("a", list(range(16))))
    table.assign("b", 3, 8)
    assert table.retain("a") is not None
    assert (table.top, table.packed_top) == (2, 2)
    table.assign("c", 3, 8)
    table.release("b")
    assert (table.top, table.packed_top) == (3, 2)
    table.compact()
    assert (table.slot("c"), table.top, table.packed_top) == (1, 2, 2)
