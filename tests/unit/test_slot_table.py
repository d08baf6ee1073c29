"""The slot table (workers/engine/slot_table.py): which row holds which slot, and how much of it. Pure
Python, no torch: any sequence of joins, steps and leaves keeps the rows packed at the low end, never
gives one slot to two rows, and counts what the rows really hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.engine.slot_table import NoFreeSlot, SlotTable

# An operation: ("join", length) | ("step", 0) | ("leave", which of the rows in place).
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(1, 20)),
        st.tuples(st.just("step"), st.just(0)),
        st.tuples(st.just("leave"), st.integers(0, 100)),
    ),
    max_size=60,
)


@given(slots=st.integers(1, 8), operations=OPERATIONS)
def test_any_sequence_keeps_the_table_consistent(slots: int, operations: list[tuple[str, int]]) -> None:
    table = SlotTable(slots, positions=24)
    lengths: dict[str, int] = {}  # the model of it: row -> positions held
    made = 0
    for kind, value in operations:
        if kind == "join" and table.free:
            free_before = sorted(set(range(slots)) - {table.slot(r) for r in lengths})
            row = f"r{made}"
            made += 1
            assert table.assign(row, value) == free_before[0]  # the lowest free slot
            lengths[row] = value
        elif kind == "join":
            with pytest.raises(NoFreeSlot):
                table.assign("extra", value)
        elif kind == "step":
            growing = [r for r, n in lengths.items() if n < table.positions]
            table.grow(growing)
            for row in growing:
                lengths[row] += 1
        elif lengths:
            row = sorted(lengths)[value % len(lengths)]
            table.release(row)
            del lengths[row]
        held = {r: table.slot(r) for r in lengths}
        assert len(set(held.values())) == len(held)  # no slot holds two rows
        assert table.used == len(lengths)
        assert table.used + table.free == slots
        assert table.held == sum(lengths.values())
        assert table.top == max(held.values(), default=-1) + 1
        assert all(table.length(r) == n for r, n in lengths.items())


def test_a_freed_slot_is_the_next_one_taken_and_nothing_else_moves() -> None:
    table = SlotTable(4, positions=10)
    for row in "abc":
        table.assign(row, 3)
    table.release("b")
    assert (table.slot("a"), table.slot("c"), table.top) == (0, 2, 3)
    assert table.assign("d", 5) == 1
    assert table.held == 3 + 3 + 5


def test_a_row_never_grows_past_its_slot_and_never_joins_twice() -> None:
    table = SlotTable(2, positions=4)
    with pytest.raises(ValueError, match="needs 5 positions"):
        table.assign("long", 5)
    table.assign("a", 4)
    with pytest.raises(ValueError, match="already holds"):
        table.assign("a", 1)
    with pytest.raises(ValueError, match="at its slot's 4 positions"):
        table.grow(["a"])
    assert table.length("a") == 4
    assert "a" in table
    assert "b" not in table


@given(slots=st.integers(1, 8), operations=OPERATIONS)
def test_compaction_leaves_the_rows_a_prefix_of_the_table_and_moves_each_row_whole(
    slots: int, operations: list[tuple[str, int]]
) -> None:
    table = SlotTable(slots, positions=24)
    rows = 0
    for kind, value in operations:
        if kind == "join" and table.free:
            table.assign(f"r{rows}", value)
            rows += 1
        elif kind == "leave" and table.used:
            table.release(sorted(table._slot)[value % table.used])
    before = {row: (table.slot(row), table.length(row)) for row in table._slot}
    moves = table.compact()
    assert table.top == table.used  # no hole below any row
    after = {row: (table.slot(row), table.length(row)) for row in table._slot}
    assert {row: length for row, (_, length) in after.items()} == {r: n for r, (_, n) in before.items()}
    moved = {(before[r][0], after[r][0], after[r][1]) for r in after if before[r][0] != after[r][0]}
    assert set(moves) == moved  # what the cache must copy: every move, and only those
    assert all(new < old for old, new, _ in moves)
