"""Where each row's positions live in the cache's pool, and how many it holds. Pure Python: the tensors
themselves live in workers/engine/kv.py.

The cache is one pool of positions per layer, allocated once. A row holds one contiguous run of it,
its *slot* (`start`, `size`), so attention reads a row as a plain view and a decode step writes one
position per row in place. A slot is sized when the row joins, one of two ways:

- **by need** (`capacity` given; the CPU's rows decode): the row's prompt plus its own
  `max_new_tokens` (less the last token, never fed), rounded up to UNIT positions (the pool step's
  table: to its attention kernel's block, `grain`, so slots start at multiples of it). A 640x480
  photo with 64 new tokens holds ~450 positions, not the longest job's ~3,400: the same memory holds
  several times the rows.
- **uniform** (no `capacity`; the fixed-shape step's layout): every slot is `positions + 1` (the
  longest job, and a scratch column a fixed-shape step writes to for slots no row runs in), at a
  multiple of that, so the pool is a `[slots, positions + 1]` grid a fixed-shape step reads as a
  view.

A row takes the lowest run that fits (first fit). When none does, retained slots are freed (the
least recently used that opens a run that fits, else the least recently used); with none left and
enough positions free, the slots above the first hole slide down (`compact`, each move handed to
`mover` for the cache to copy). A slot never grows past its size, so a row admitted never runs out of
room mid-answer.

A row that leaves may leave its slot to the prefix cache (`retain`): its leading positions stay (by
need, only the whole blocks the index knows: the rest is freed at once), for a later row with the
same prefix to take over or copy (workers/engine/prefix_index.py). One copy of a prefix is kept: a
row whose blocks a retained slot holds already leaves nothing, and a retained slot whose blocks are
all the start of the leaving row's is freed. Retained slots are no row's: they count in neither
`used` nor `held`, and are freed when a row needs the room.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.prefix_index import PrefixIndex

UNIT = 16  # positions a slot held by need is rounded up to (the prefix index's block)

# (from start, to start, positions): the cache copies a slot's first positions to a new place.
Mover = Callable[[int, int, int], None]


def rounded(need: int, grain: int = UNIT) -> int:
    """A need rounded up to whole grains (UNITs unless said)."""
    return max(grain, -(-need // grain) * grain)


def pool_for(rows: int, positions: int, grain: int = UNIT) -> int:
    """The pool that holds `rows` rows of the longest job by need (the same memory as that many
    uniform slots, give or take a grain)."""
    return rows * rounded(positions, grain)


class NoFreeSlot(RuntimeError):
    """No run of the pool holds the row even with every retained slot freed and the rest compacted:
    admission let in more than the cache holds (the engine sends the row back to waiting)."""


@dataclass
class SlotTable:
    slots: int  # uniform: the slots of the grid; by need: rows at most (informational)
    positions: int  # the most a row may hold
    capacity: int | None = None  # positions in the pool: slots by need; None: uniform slots
    mover: Mover | None = None  # copies a slot's positions when compaction moves it
    # By need: what slots' sizes, and so their starts, are whole multiples of. The pool step's attention
    # kernel sums a row's keys in blocks counted from the pool's first position: slots at multiples of
    # its block put a row's keys in the same blocks wherever it lies (workers/engine/pool_step.py).
    grain: int = UNIT
    index: PrefixIndex = field(default_factory=PrefixIndex)  # the prefixes the slots hold
    _start: dict[str, int] = field(default_factory=dict)  # holder -> first position of its slot
    _size: dict[str, int] = field(default_factory=dict)  # holder -> positions its slot spans
    _length: dict[str, int] = field(default_factory=dict)  # holder -> positions it holds
    _free: list[tuple[int, int]] = field(default_factory=list)  # (start, size) runs, sorted
    _retained: set[str] = field(default_factory=set)  # slots left to the prefix cache, by entry id
    _entries: itertools.count[int] = field(default_factory=itertools.count)
    moved: int = 0  # positions compaction copied (the metrics report it)

    def __post_init__(self) -> None:
        self.uniform = self.capacity is None
        if self.capacity is None:
            self.capacity = self.slots * (self.positions + 1)
        self.pool = self.capacity
        if self.grain % UNIT:
            raise ValueError(f"a grain of {self.grain} positions is no multiple of the index's {UNIT}")
        if self.pool < self.extent(self.positions):  # the longest row must fit, or it never runs
            raise ValueError(f"a pool of {self.pool} positions holds no row of {self.positions}")
        self._free = [(0, self.pool)]

    # ---------------------------------------------------------------- sizes
    @property
    def unit(self) -> int:
        """What a slot's positions are rounded up to (the scheduler counts the same)."""
        return self.positions + 1 if self.uniform else self.grain

    def extent(self, need: int) -> int:
        """The positions a slot for a row that may hold `need` spans."""
        if self.uniform:
            return self.positions + 1
        return rounded(need, self.grain)

    # ---------------------------------------------------------------- rows in and out
    def assign(self, row_id: str, length: int, need: int | None = None, keep: str | None = None) -> int:
        """A slot for this row, holding `length` positions now and room for `need` (the longest job
        when not said); its first position. Retained slots are freed for it (never `keep`), and the
        others compacted, when no run is free."""
        if row_id in self._start:
            raise ValueError(f"row {row_id} already holds a slot at {self._start[row_id]}")
        need = self.positions if need is None else need
        if max(length, need) > self.positions:
            raise ValueError(
                f"row {row_id} needs {max(length, need)} positions; a slot holds {self.positions}"
            )
        size = self.extent(need)
        start = self._place(size, keep)
        self._start[row_id], self._size[row_id], self._length[row_id] = start, size, length
        return start

    def _place(self, size: int, keep: str | None) -> int:
        """First fit; else free a retained slot (the least recently used whose room, with the free runs
        beside it, fits; else the least recently used) and try again; with none left to free, compact.
        Freeing a cached prefix costs nothing now, a compaction copies every slot it moves: a backlog
        of photos asked once filled the pool with prefixes no row wanted, and compacting them around
        cost it 11 % of its throughput."""
        while True:
            start = self._first_fit(size)
            if start is not None:
                return start
            retained = [h for h in self.index.retained() if h != keep]
            if retained:
                self.release(next((h for h in retained if self._opens(h, size)), retained[0]))
                continue
            if sum(run for _, run in self._free) < size:
                raise NoFreeSlot(f"no {size} positions free in a pool of {self.pool}")
            self.compact()

    def _opens(self, holder: str, size: int) -> bool:
        """Whether freeing the holder's slot leaves a run of `size` (with the free runs beside it)."""
        start, run = self._start[holder], self._size[holder]
        end = start + run
        for free_start, free_run in self._free:
            if free_start + free_run == start or free_start == end:
                run += free_run
        return run >= size

    def _first_fit(self, size: int) -> int | None:
        for index, (start, run) in enumerate(self._free):
            if run >= size:
                if run == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, run - size)
                return start
        return None

    def grow_in_place(self, holder: str, need: int) -> bool:
        """Whether the holder's slot could be widened to room for `need` from the free run just past
        it (then it is)."""
        size = self.extent(need)
        start, have = self._start[holder], self._size[holder]
        if size <= have:
            return True
        end = start + have
        index = bisect.bisect_left(self._free, (end, 0))
        if index == len(self._free) or self._free[index][0] != end or self._free[index][1] < size - have:
            return False
        run = self._free[index][1]
        if run == size - have:
            del self._free[index]
        else:
            self._free[index] = (end + size - have, run - (size - have))
        self._size[holder] = size
        return True

    def take_over(self, row_id: str, holder: str, length: int, need: int | None = None) -> int | None:
        """A retained slot becomes this row's, its first `length` positions kept (a prefix hit that
        copies nothing), when it can hold the row's need where it lies; else None (nothing changed)."""
        if holder not in self._retained:
            raise ValueError(f"{holder} is not a retained slot")
        if row_id in self._start:
            raise ValueError(f"row {row_id} already holds a slot at {self._start[row_id]}")
        need = self.positions if need is None else need
        if not self.grow_in_place(holder, need):
            return None
        self._shrink(holder, self.extent(max(need, length)))
        self.index.remove(holder)
        self._retained.discard(holder)
        self._length.pop(holder)
        self._start[row_id], self._size[row_id] = self._start.pop(holder), self._size.pop(holder)
        self._length[row_id] = min(length, self._size[row_id])
        return self._start[row_id]

    def release(self, row_id: str) -> None:
        """The row's slot is free (and its prefix forgotten)."""
        self.index.remove(row_id)
        self._retained.discard(row_id)
        start, size = self._start.pop(row_id), self._size.pop(row_id)
        del self._length[row_id]
        self._give_back(start, size)

    def _give_back(self, start: int, size: int) -> None:
        """A run back to the free list, merged with its neighbours."""
        index = bisect.bisect_left(self._free, (start, 0))
        if index < len(self._free) and self._free[index][0] == start + size:
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == start:
            start, size = self._free[index - 1][0], self._free[index - 1][1] + size
            self._free.pop(index - 1)
            index -= 1
        self._free.insert(index, (start, size))

    def retain(self, row_id: str) -> str | None:
        """A row that leaves: its slot stays with the prefix cache when the index knows its prefix,
        else it is freed. By need, only the blocks the index knows stay; the rest is freed now. The
        slot passes to an entry of its own (its id returned): the row may come back (a paused row,
        admitted again) and take a slot under its own id."""
        if row_id not in self.index:
            self.release(row_id)
            return None
        copy = next((h for h in self.index.covering(row_id) if h in self._retained), None)
        if copy is None:
            copy = self._diverging_copy(row_id)
        if copy is not None:  # one copy of a prefix is enough: rows asking about one photo at once
            self.index.retain(copy)  # (it would have served this row's prefix: used now)
            self.release(row_id)  # left N copies, and pushed other photos' prefixes out
            return None
        entry = f"retained:{next(self._entries)}"
        for table in (self._start, self._size, self._length):
            table[entry] = table.pop(row_id)
        self.index.rename(row_id, entry)
        for shorter in [h for h in self.index.covered(entry) if h in self._retained]:
            self.release(shorter)  # all its blocks are the start of this one's
        self._retained.add(entry)
        self.index.retain(entry)
        kept = min(self._length[entry], self.index.known(entry))
        self._shrink(entry, self.extent(kept))  # by need: the rest is free now (uniform: the slot stays)
        self._length[entry] = kept  # what a later row can reuse (the cached-positions gauge)
        return entry

    def _diverging_copy(self, row_id: str) -> str | None:
        """A retained slot that holds at least half of this row's known blocks, from the start, and then
        goes on differently (another question about the same photo): keeping this row's slot too would
        keep the photo's positions twice for a few blocks of question of its own. Contiguous slots
        cannot share the photo's blocks between two questions (pages could), so the row's slot goes
        and the one already cached serves the photo; a later row asking this row's very question
        computes its few question positions again."""
        shared = self.index.sharing(row_id)
        if shared is None:
            return None
        other, blocks = shared
        if blocks >= self.index.blocks(other):
            return None  # all of the other's blocks start this row's: the other goes (covered)
        return other if 2 * blocks >= self.index.blocks(row_id) else None

    def _shrink(self, holder: str, size: int) -> None:
        """By need, the holder's slot spans `size` positions at most: the tail goes back to the free
        runs (a slot larger than its row's need is memory admission does not count, so a ticket the
        scheduler let in would find no room)."""
        if self.uniform or size >= self._size[holder]:
            return
        self._give_back(self._start[holder] + size, self._size[holder] - size)
        self._size[holder] = size

    def retained(self, row_id: str) -> bool:
        return row_id in self._retained

    def set_length(self, row_id: str, length: int) -> None:
        """Positions the row holds now (a prefill chunk wrote up to there)."""
        if length > self._size[row_id] - self.uniform:
            raise ValueError(f"row {row_id} needs {length} positions; its slot holds {self._size[row_id]}")
        self._length[row_id] = length

    def grow(self, row_ids: list[str]) -> None:
        """One more position for each of these rows (a decode step wrote it)."""
        for row_id in row_ids:
            if self._length[row_id] >= self._size[row_id] - self.uniform:
                raise ValueError(f"row {row_id} is at its slot's {self._size[row_id]} positions")
            self._length[row_id] += 1

    def compact(self) -> list[tuple[int, int, int]]:
        """Slide every slot above the first free run down to close the holes: (from, to, positions
        held) per move, each handed to `mover` in order (each one's target is free by then). The
        fixed-shape step covers the grid up to its highest row, and a row by need finds one run where
        there were several holes."""
        moves = []
        cursor = 0
        try:
            for holder in sorted(self._start, key=self._start.__getitem__):
                start = self._start[holder]
                if start != cursor:
                    self._move(holder, cursor)
                    moves.append((start, cursor, self._length[holder]))
                    self.moved += self._length[holder]
                    start = cursor
                cursor = start + self._size[holder]
        finally:  # a move that failed leaves the slots where they are now: the free runs between them
            self._free = self._gaps()
        return moves

    def _move(self, holder: str, to: int) -> None:
        """One slot moved, in the cache and then in the table. A retained slot whose copy failed is
        forgotten (its positions may be half moved); a row's stays where it was."""
        try:
            if self.mover is not None:
                self.mover(self._start[holder], to, self._length[holder])
        except BaseException:
            if holder in self._retained:
                self.index.remove(holder)
                self._retained.discard(holder)
                for table in (self._start, self._size, self._length):
                    del table[holder]
            raise
        self._start[holder] = to

    def _gaps(self) -> list[tuple[int, int]]:
        """The free runs: what no slot spans, in order."""
        gaps, cursor = [], 0
        for start, size in sorted((self._start[h], self._size[h]) for h in self._start):
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + size
        return gaps + ([(cursor, self.pool - cursor)] if cursor < self.pool else [])

    # ---------------------------------------------------------------- reading it
    def start(self, row_id: str) -> int:
        """The first position of the row's slot in the pool."""
        return self._start[row_id]

    def slot(self, row_id: str) -> int:
        """Uniform: the row's slot in the grid."""
        return self._start[row_id] // (self.positions + 1)

    def length(self, row_id: str) -> int:
        return self._length[row_id]

    def size(self, row_id: str) -> int:
        return self._size[row_id]

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._start

    def _live(self) -> list[str]:
        return [row_id for row_id in self._start if row_id not in self._retained]

    @property
    def used(self) -> int:
        """Rows holding a slot (retained ones are not a row's)."""
        return len(self._start) - len(self._retained)

    @property
    def spare(self) -> int:
        """Positions a row may take: free ones and retained ones (freed on demand)."""
        return self.pool - sum(self._size[row_id] for row_id in self._live())

    @property
    def reserved(self) -> int:
        """Positions the rows' slots span (what admission counts)."""
        return self.pool - self.spare

    @property
    def held(self) -> int:
        """Positions the rows hold in all (what memory really holds of them)."""
        return sum(self._length[row_id] for row_id in self._live())

    @property
    def cached(self) -> int:
        """Positions the retained slots hold for the prefix cache."""
        return sum(self._length[row_id] for row_id in self._retained)

    @property
    def top(self) -> int:
        """Uniform: one past the highest slot a row holds (the prefix of the grid a fixed-shape step
        covers)."""
        return max((self.slot(row_id) for row_id in self._live()), default=-1) + 1

    @property
    def packed_top(self) -> int:
        """Uniform: what `top` would be after `compact` (the slots held below it, retained ones too:
        compaction keeps them, so a retained slot under a row is no hole to close)."""
        top = self.top
        return sum(1 for holder in self._start if self.slot(holder) < top)

    @property
    def reach(self) -> int:
        """By need: one past the highest position a row's next decode step writes (the prefix of the
        pool a pool step reads); 0 with no row."""
        return max((self._start[r] + self._length[r] + 1 for r in self._live()), default=0)

    @property
    def packed_reach(self) -> int:
        """By need: what `reach` would be after `compact` (every slot below the highest row's, retained
        ones too, slides down to close the holes)."""
        live = self._live()
        if not live:
            return 0
        highest = max(live, key=self._start.__getitem__)
        below = sum(self._size[h] for h in self._start if self._start[h] < self._start[highest])
        return below + self._length[highest] + 1
