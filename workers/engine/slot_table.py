"""Which row holds which slot of the cache, and how many positions it holds there. Pure Python: the
tensors themselves live in workers/engine/kv.py.

The cache is allocated once, as `slots` slots of `positions` positions each (every layer's keys and
values). A row takes the lowest free slot when it joins, so the rows in use stay packed at the low end
of the table (the decode step of fixed shapes runs over a prefix of the slots, workers/engine/runner.py)
and a row that leaves frees its slot without moving anything.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


class NoFreeSlot(RuntimeError):
    """Every slot is taken: admission let in more rows than the cache holds (a bug in the engine)."""


@dataclass
class SlotTable:
    slots: int
    positions: int  # the most a row may hold in its slot
    _free: list[int] = field(default_factory=list)
    _slot: dict[str, int] = field(default_factory=dict)  # row id -> its slot
    _length: dict[str, int] = field(default_factory=dict)  # row id -> positions it holds

    def __post_init__(self) -> None:
        self._free = list(range(self.slots))
        heapq.heapify(self._free)

    def assign(self, row_id: str, length: int) -> int:
        """The lowest free slot, now holding `length` positions of this row."""
        if row_id in self._slot:
            raise ValueError(f"row {row_id} already holds slot {self._slot[row_id]}")
        if length > self.positions:
            raise ValueError(f"row {row_id} needs {length} positions; a slot holds {self.positions}")
        if not self._free:
            raise NoFreeSlot(f"all {self.slots} slots are taken")
        slot = heapq.heappop(self._free)
        self._slot[row_id], self._length[row_id] = slot, length
        return slot

    def release(self, row_id: str) -> None:
        slot = self._slot.pop(row_id)
        del self._length[row_id]
        heapq.heappush(self._free, slot)

    def compact(self) -> list[tuple[int, int, int]]:
        """Move the rows in the highest slots down into the lowest free ones until the rows in use are
        a prefix of the table: (from slot, to slot, positions held) per move, for the cache to copy.
        A fixed-shape step covers the table up to its highest row: one long row left in a high slot
        would make every step cover (and read the padding of) every slot below it."""
        moves = []
        while self._free and self._free[0] < self.top:
            row_id = max(self._slot, key=self._slot.__getitem__)
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

    @property
    def used(self) -> int:
        return len(self._slot)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        """Positions the rows hold in all (what memory really holds of them)."""
        return sum(self._length.values())

    @property
    def top(self) -> int:
        """One past the highest slot in use: the prefix of the table a fixed-shape step must cover."""
        return max(self._slot.values(), default=-1) + 1
