"""Which row holds which slot of the cache, and how many positions it holds there. Pure Python: the
tensors themselves live in workers/engine/kv.py.

The cache is allocated once, as `slots` slots of `positions` positions each (every layer's keys and
values). A row takes the lowest free slot when it joins, so the rows in use stay packed at the low end
of the table (the decode step of fixed shapes runs over a prefix of the slots, workers/engine/runner.py)
and a row that leaves frees its slot without moving anything.

A row that leaves may instead leave its slot to the prefix cache (`retain`): its leading positions
stay, for a later row with the same prefix to copy or take over (workers/engine/prefix_index.py), until
a row needs the slot: then the least recently used retained slot is freed. Retained slots are no row's:
they count in neither `used` nor `held`, and a fixed-shape step never covers one for its own sake.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from workers.engine.prefix_index import PrefixIndex


class NoFreeSlot(RuntimeError):
    """Every slot is taken: admission let in more rows than the cache holds (a bug in the engine)."""


@dataclass
class SlotTable:
    slots: int
    positions: int  # the most a row may hold in its slot
    _free: list[int] = field(default_factory=list)
    _slot: dict[str, int] = field(default_factory=dict)  # row id -> its slot
    _length: dict[str, int] = field(default_factory=dict)  # row id -> positions it holds
    index: PrefixIndex = field(default_factory=PrefixIndex)  # the prefixes the slots hold
    _retained: set[str] = field(default_factory=set)  # slots left to the prefix cache, by entry id
    _entries: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._free = list(range(self.slots))
        heapq.heapify(self._free)

    def assign(self, row_id: str, length: int) -> int:
        """The lowest free slot (the least recently used retained one freed when none is), now holding
        `length` positions of this row."""
        if row_id in self._slot:
            raise ValueError(f"row {row_id} already holds slot {self._slot[row_id]}")
        if length > self.positions:
            raise ValueError(f"row {row_id} needs {length} positions; a slot holds {self.positions}")
        if not self._free:
            evicted = self.index.evict()
            if evicted is None:
                raise NoFreeSlot(f"all {self.slots} slots are taken")
            self.release(evicted)
        slot = heapq.heappop(self._free)
        self._slot[row_id], self._length[row_id] = slot, length
        return slot

    def take_over(self, row_id: str, holder: str, length: int) -> int:
        """A retained slot becomes this row's, its first `length` positions kept (a prefix hit that
        copies nothing)."""
        if holder not in self._retained:
            raise ValueError(f"{holder} is not a retained slot")
        if row_id in self._slot:
            raise ValueError(f"row {row_id} already holds slot {self._slot[row_id]}")
        self.index.remove(holder)
        self._retained.discard(holder)
        slot = self._slot.pop(holder)
        del self._length[holder]
        self._slot[row_id], self._length[row_id] = slot, min(length, self.positions)
        return slot

    def release(self, row_id: str) -> None:
        """The row's slot is free (and its prefix forgotten)."""
        self.index.remove(row_id)
        self._retained.discard(row_id)
        slot = self._slot.pop(row_id)
        del self._length[row_id]
        heapq.heappush(self._free, slot)

    def retain(self, row_id: str) -> str | None:
        """A row that leaves: its slot stays with the prefix cache when the index knows its prefix,
        else it is freed. The slot passes to an entry of its own (its id returned): the row may come
        back (a paused row, admitted again) and take a slot under its own id."""
        if row_id not in self.index:
            self.release(row_id)
            return None
        entry = f"retained:{next(self._entries)}"
        self._slot[entry], self._length[entry] = self._slot.pop(row_id), self._length.pop(row_id)
        self.index.rename(row_id, entry)
        self._retained.add(entry)
        self.index.retain(entry)
        return entry

    def retained(self, row_id: str) -> bool:
        return row_id in self._retained

    def set_length(self, row_id: str, length: int) -> None:
        """Positions the row holds now (a prefill chunk wrote up to there)."""
        if length > self.positions:
            raise ValueError(f"row {row_id} needs {length} positions; a slot holds {self.positions}")
        self._length[row_id] = length

    def compact(self) -> list[tuple[int, int, int]]:
        """Move the rows in the highest slots down into the lowest free ones until the rows in use are
        a prefix of the table: (from slot, to slot, positions held) per move, for the cache to copy.
        A fixed-shape step covers the table up to its highest row: one long row left in a high slot
        would make every step cover (and read the padding of) every slot below it."""
        moves = []
        while self._free and self._free[0] < self.top:
            row_id = max(self._live(), key=self._slot.__getitem__)
            old, new = self._slot[row_id], heapq.heappop(self._free)
            self._slot[row_id] = new
            heapq.heappush(self._free, old)
            moves.append((old, new, self._length[row_id]))
        return moves

    def slot(self, row_id: str) -> int:
        return self._slot[row_id]

    def length(self, row_id: str) -> int:
        return self._length[row_id]

    def grow(self, row_ids: list[str]) -> None:
        """One more position for each of these rows (a decode step wrote it)."""
        for row_id in row_ids:
            if self._length[row_id] >= self.positions:
                raise ValueError(f"row {row_id} is at its slot's {self.positions} positions")
            self._length[row_id] += 1

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._slot

    def _live(self) -> list[str]:
        return [row_id for row_id in self._slot if row_id not in self._retained]

    @property
    def used(self) -> int:
        """Slots rows hold (retained ones are not a row's)."""
        return len(self._slot) - len(self._retained)

    @property
    def free(self) -> int:
        """Slots a row may take: free ones and retained ones (evicted on demand)."""
        return len(self._free) + len(self._retained)

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
        """One past the highest slot a row holds: the prefix of the table a fixed-shape step must cover."""
        return max((self._slot[row_id] for row_id in self._live()), default=-1) + 1
