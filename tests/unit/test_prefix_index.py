"""The prefix index and the slot table's retained slots (workers/engine/prefix_index.py,
workers/engine/slot_table.py): hash chains, longest matches, least-recently-used eviction. Pure
Python, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.prefix_index import BLOCK, PrefixIndex, chain
from workers.engine.slot_table import NoFreeSlot, SlotTable

IMAGE = list(range(100, 100 + 3 * BLOCK))  # three blocks of "image" positions


def test_a_chain_is_per_whole_block_and_covers_everything_before() -> None:
    ids = [*IMAGE, 1, 2, 3]
    hashes = chain("photo", ids)
    assert len(hashes) == 3  # the partial block after the image has none
    assert chain("photo", ids) == hashes
    assert chain("other photo", ids)[0] != hashes[0], "the identity is not in block 0"
    changed = [*IMAGE[:-1], 7, 1, 2, 3]
    assert chain("photo", changed)[:2] == hashes[:2]
    assert chain("photo", changed)[2] != hashes[2]
    earlier = [5, *IMAGE[1:], 1, 2, 3]
    assert all(a != b for a, b in zip(chain("photo", earlier), hashes, strict=True)), "a block forgot"


def test_the_longest_match_wins_and_a_miss_is_none() -> None:
    index = PrefixIndex()
    index.add("short", chain("p", IMAGE[: 2 * BLOCK]))
    index.add("long", chain("p", IMAGE))
    hit = index.match(chain("p", [*IMAGE, 9] * 2))
    assert hit is not None
    assert (hit.holder, hit.positions) == ("long", 3 * BLOCK)
    assert index.match(chain("q", IMAGE)) is None
    index.remove("long")
    hit = index.match(chain("p", IMAGE))
    assert hit is not None
    assert (hit.holder, hit.positions) == ("short", 2 * BLOCK)


def test_retained_holders_are_evicted_least_recently_used_first_and_a_hit_refreshes() -> None:
    index = PrefixIndex()
    for name in ("a", "b", "c"):
        index.add(name, chain(name, IMAGE))
        index.retain(name)
    index.add("running", chain("r", IMAGE))  # not retained: never evicted
    assert index.match(chain("a", IMAGE)) is not None  # a is now the most recently used
    assert [index.evict(), index.evict(), index.evict(), index.evict()] == ["b", "c", "a", None]
    assert index.match(chain("b", IMAGE)) is None
    assert index.match(chain("r", IMAGE)) is not None


def test_a_full_table_frees_the_least_recently_used_retained_slot_and_never_a_rows() -> None:
    table = SlotTable(2, positions=100)
    table.assign("a", 0)
    table.index.add("a", chain("a", IMAGE))
    table.set_length("a", 3 * BLOCK)
    assert table.retain("a") is not None
    assert (table.used, table.spare, table.held, table.cached) == (0, table.pool, 0, 3 * BLOCK)
    table.assign("b", 5)
    table.assign("c", 5)  # the retained slot is freed for it
    assert "a" not in table
    assert table.index.match(chain("a", IMAGE)) is None
    with pytest.raises(NoFreeSlot):
        table.assign("d", 5)


def test_taking_over_a_retained_slot_keeps_its_positions_and_frees_nothing() -> None:
    table = SlotTable(2, positions=100)
    slot = table.assign("a", 0)
    table.index.add("a", chain("a", IMAGE))
    table.set_length("a", 60)
    entry = table.retain("a")
    assert entry is not None
    assert table.take_over("b", entry, 3 * BLOCK) == slot
    assert (table.length("b"), table.used, table.cached) == (3 * BLOCK, 1, 0)
    with pytest.raises(ValueError, match="not a retained slot"):
        table.take_over("c", "b", 1)


def test_a_paused_row_comes_back_under_its_own_id_beside_its_retained_slot() -> None:
    """A paused row's slot passed to the cache under the row's own id, so the row, admitted again,
    collided with it: a ValueError that ended the engine, or a slot taken over twice and lost."""
    table = SlotTable(3, positions=100)
    table.assign("b", 0)
    table.index.add("b", chain("p", IMAGE))
    table.set_length("b", 3 * BLOCK)
    entry = table.retain("b")  # paused: its prompt's blocks kept
    assert entry is not None
    assert entry != "b"
    assert "b" not in table
    table.assign("b", 0)  # admitted again: a slot of its own, the cached one still there
    hit = table.index.match(chain("p", IMAGE))
    assert hit is not None
    assert hit.holder == entry
    with pytest.raises(ValueError, match="already holds"):
        table.take_over("b", entry, 3 * BLOCK)
    table.release("b")
    assert table.take_over("b", entry, 3 * BLOCK) is not None
    assert (table.used, table.spare, table.cached) == (1, table.pool - table.size("b"), 0)


def test_a_row_with_no_prefix_known_leaves_its_slot_free() -> None:
    table = SlotTable(1, positions=10)
    table.assign("a", 4)
    assert table.retain("a") is None  # nothing of it in the index: nothing to keep
    assert (table.spare, table.cached, "a" in table) == (table.pool, 0, False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "leave", "keep"]), st.integers(0, 5)), max_size=60))
def test_any_sequence_keeps_slots_rows_and_retained_apart(operations: list[tuple[str, int]]) -> None:
    table = SlotTable(3, positions=100)
    rows: set[str] = set()
    made = 0
    for kind, value in operations:
        if kind == "join" and table.used < 3:
            name = f"r{made}"
            made += 1
            hit = table.index.match(chain(value, IMAGE))
            if hit is not None and table.retained(hit.holder):
                table.take_over(name, hit.holder, hit.positions)
            else:
                table.assign(name, 0)
            table.index.add(name, chain(value, IMAGE))
            table.set_length(name, 3 * BLOCK)
            rows.add(name)
        elif kind in ("leave", "keep") and rows:
            name = sorted(rows)[value % len(rows)]
            rows.discard(name)
            if kind == "keep":
                table.retain(name)
            else:
                table.release(name)
        slots = [table.slot(r) for r in rows]
        assert len(set(slots)) == len(slots)
        assert table.used == len(rows)
        assert table.spare == table.pool - table.unit * len(rows)
        assert table.held == 3 * BLOCK * len(rows)
        retained = table.index.retained()
        assert not set(retained) & rows
        assert table.cached == 3 * BLOCK * len(retained)
