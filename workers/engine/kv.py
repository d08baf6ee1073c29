"""The KV cache as slots allocated once, and the running batch as rows in those slots.

Per layer, keys and values are one tensor each, `[slots, heads, positions + 1, head_dim]`, allocated at
start (workers/engine/capacity.py sizes it). A row that joins copies its prefill's keys and values into
its slot, once; every decode step writes one position per row in place, at that row's own position; a
row that leaves frees its slot and nothing moves. The last column is scratch: a fixed-shape step
(workers/engine/runner.py) covers slots that no running row holds there, and writes their position to
it. Which row holds which slot is workers/engine/slot_table.py's, plain Python.

`SlotCache` is what transformers' model calls `cache`: its `update()` writes the step's new keys and
values where the runner's write plan says (`rows`, `write`) and returns what attention reads: the whole
buffers (attention per row, over views of each row's own length) or a prefix view `[:S, :, :W]` (one
call of fixed shape). No step allocates or copies the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.slot_table import SlotTable


class SlotCache:
    """transformers' Cache protocol, as far as the engine's model calls use it."""

    is_compileable = False  # transformers' own compile switches stay off: the runner compiles/captures

    def __init__(
        self, layers: int, slots: int, heads: int, positions: int, head_dim: int, dtype: Any, device: Any
    ) -> None:
        shape = (slots, heads, positions + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.scratch = positions  # the write position of a slot no running row holds
        # The write plan of the next call (set by the runner): the slot and position of each batch row,
        # and the prefix attention reads (slots, width), or None for the whole buffers.
        self.rows: torch.Tensor | None = None
        self.write: torch.Tensor | None = None
        self.view: tuple[int, int] | None = None
        # A prefill chunk instead (set by the runner): (slot, first position) of one row's positions.
        self.chunk: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> Any:
        """Write one position per batch row ([rows, heads, 1, head_dim]) in place, or a chunk's
        positions of one row ([1, heads, n, head_dim]); return what attention reads."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.chunk is not None:
            slot, start = self.chunk
            stop = start + key_states.shape[2]
            keys[slot, :, start:stop] = key_states[0]
            values[slot, :, start:stop] = value_states[0]
            return keys[slot : slot + 1, :, :stop], values[slot : slot + 1, :, :stop]
        keys[self.rows, :, self.write] = key_states[:, :, -1]
        values[self.rows, :, self.write] = value_states[:, :, -1]
        if self.view is None:
            return keys, values
        slots, width = self.view
        return keys[:slots, :, :width], values[:slots, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the runner (position_ids), never from the cache

    def put(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A joining row's prefill cache ([heads, length, head_dim] per layer) into its slot: its one copy."""
        for index, (new_keys, new_values) in enumerate(layers):
            length = new_keys.shape[1]
            self.keys[index][slot, :, :length].copy_(new_keys)
            self.values[index][slot, :, :length].copy_(new_values)

    def move(self, old: int, new: int, length: int, start: int = 0) -> None:
        """A row's positions start..length from one slot to another (compaction: workers/engine/
        slot_table.py; a prefix hit on another row: workers/engine/prefix_index.py)."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[new, :, start:length].copy_(keys[old, :, start:length])
            values[new, :, start:length].copy_(values[old, :, start:length])


class SlotBatch:
    """Rows of the engine in slots of one cache (the running batch, or the held one: moving rows from one
    to the other moves no tensor). `row_ids` is the batch order of a decode step's inputs and outputs."""

    def __init__(self, table: SlotTable, cache: SlotCache) -> None:
        self.table, self.cache = table, cache
        self.row_ids: list[str] = []
        self.read = 0  # positions the last decode step read for these rows
        self.padding = 0  # of those, positions no row holds (a fixed-shape step's padding)

    def __len__(self) -> int:
        return len(self.row_ids)

    def add(self, row_ids: list[str], cache: Any, length: int) -> None:
        """Rows prefilled together (their cache holds `length` positions each) join: one copy each."""
        assigned: list[str] = []
        try:
            for index, row_id in enumerate(row_ids):
                slot = self.table.assign(row_id, length)
                assigned.append(row_id)
                layers = [(layer.keys[index], layer.values[index]) for layer in cache.layers]
                self.cache.put(slot, layers)
        except BaseException:
            for row_id in assigned:  # all or nothing: the engine sends the rows back to waiting
                self.table.release(row_id)
            raise
        self.row_ids += row_ids

    def drop(self, row_ids: set[str], keep: bool = False) -> None:
        """Rows that left: their slots are free at once, and nothing moves. `keep`: their prompts'
        positions are sound (they finished, or were paused), so their slots go to the prefix cache."""
        for row_id in [r for r in self.row_ids if r in row_ids]:
            if keep:
                self.table.retain(row_id)
            else:
                self.table.release(row_id)
        self.row_ids = [r for r in self.row_ids if r not in row_ids]

    def join(self, row_id: str) -> None:
        """A row whose prefill is whole (in its slot already) joins the decode steps."""
        self.row_ids.append(row_id)

    def take(self, row_ids: set[str]) -> SlotBatch:
        """These rows, slots and all, into a batch of their own (held rows)."""
        taken = SlotBatch(self.table, self.cache)
        taken.row_ids = [r for r in self.row_ids if r in row_ids]
        self.row_ids = [r for r in self.row_ids if r not in row_ids]
        return taken

    def absorb(self, other: SlotBatch) -> None:
        self.row_ids += other.row_ids
        other.row_ids = []

    @property
    def width(self) -> int:
        """The longest row's positions."""
        return max((self.table.length(r) for r in self.row_ids), default=0)

    @property
    def held(self) -> int:
        """Positions the rows really hold."""
        return sum(self.table.length(r) for r in self.row_ids)
