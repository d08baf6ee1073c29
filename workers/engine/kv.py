"""The KV cache as one pool of positions allocated once, and the running batch as rows in it.

Per layer, keys and values are one tensor each, `[heads, pool, head_dim]`, allocated at start
(workers/engine/capacity.py sizes it). Each row holds one contiguous run of the pool, its slot
(workers/engine/slot_table.py says where, plain Python), so attention reads a row as a view
`[:, start:start + length]`. A row prefills in place in its slot; every decode step writes one position
per row in place, at that row's own position; a row that leaves frees its slot and nothing moves (a
compaction, rare, copies the slots above a hole down).

In the uniform layout (the fixed-shape step's) every slot is `positions + 1` long and the pool is a
grid `[slots, positions + 1]`: `grid()` reads a prefix of it as `[slots, heads, width, head_dim]`
without a copy, and a slot no running row holds writes to its own last column (scratch).

`SlotCache` is what transformers' model calls `cache`: its `update()` writes the step's new keys and
values where the runner's write plan says (`rows`, `write`) and returns what attention reads: the whole
pool (attention per row, over views of each row's own run), the grid's prefix (one call of fixed
shape), or the pool's prefix (the pool step: one call of fixed shape over slots by need, each row
masked to its own). No step allocates or copies the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.slot_table import SlotTable


class SlotCache:
    """transformers' Cache protocol, as far as the engine's model calls use it."""

    is_compileable = False  # transformers' own compile switches stay off: the runner compiles/captures

    def __init__(
        self,
        layers: int,
        pool: int,
        heads: int,
        head_dim: int,
        dtype: Any,
        device: Any,
        stride: int = 1,
        scratch: bool = False,
        staging: int = 0,
        finite: bool = False,
    ) -> None:
        shape = (heads, pool + scratch, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        # Where a move whose runs overlap (compaction sliding a slot down by less than its length)
        # goes through, in pieces: allocated here, so a compaction never runs out of memory half way
        # (a slot half moved is a row whose positions are wrong). 0: a clone per move instead.
        self.staging = (
            torch.zeros((heads, staging, head_dim), dtype=dtype, device=device) if staging else None
        )
        # The fixed-shape steps read positions no row of theirs holds under an additive mask, which hides
        # no NaN or infinity (NaN + min is NaN, 0 x NaN too): the pool step every row's extent (one row
        # whose activations overflowed made every row's attention NaN), the fixed step a slot's grid
        # past its row's length (what its previous row left). With them, keys and values are written
        # finite.
        self.finite = finite
        # Uniform layout: a slot's length (positions + 1); its last column is the scratch a fixed-shape
        # step writes to for a slot no running row holds. By need with `scratch`: one position past
        # the pool, where the pool step's padding rows write (workers/engine/pool_step.py).
        self.stride = stride
        self.scratch = pool if scratch else stride - 1
        # The write plan of the next call (set by the runner): where each batch row writes, as a position
        # in the pool (`rows` None), or as its slot in the grid (`rows`) and a position in the slot
        # (`write`); the grid's prefix attention reads (slots, width), or None for the whole pool.
        self.rows: torch.Tensor | None = None
        self.write: torch.Tensor | None = None
        self.view: tuple[int, int] | None = None
        # The pool step's instead: its rows are one sequence ([1, heads, rows, head_dim]), each writing at
        # its `write` position; attention reads the pool's first `extent` positions, under a mask.
        self.extent: int | None = None
        # A prefill call's chunks instead (set by the runner): where in the pool each of the call's
        # positions is written (a slice: one row's chunk; an index: several rows' end to end).
        self.chunk: slice | torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """What the cache allocated: the pool (and its scratch position), and the staging buffer."""
        tensors = (*self.keys, *self.values, *([self.staging] if self.staging is not None else []))
        return sum(t.numel() * t.element_size() for t in tensors)

    def grid(self, tensor: torch.Tensor, slots: int, width: int) -> torch.Tensor:
        """The uniform layout's first `slots` slots, `width` positions each: [slots, heads, width, dim]."""
        heads, pool, dim = tensor.shape
        grid = tensor.view(heads, pool // self.stride, self.stride, dim).permute(1, 0, 2, 3)
        return grid[:slots, :, :width]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> Any:
        """Write one position per batch row ([rows, heads, 1, head_dim]) in place, or the positions of a
        call's chunks ([1, heads, n, head_dim]); return what attention reads."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.finite:
            key_states, value_states = _finite(key_states), _finite(value_states)
        if self.chunk is not None:  # attention reads each chunk's slot (row_attention.per_chunk)
            keys[:, self.chunk] = key_states[0]
            values[:, self.chunk] = value_states[0]
            return keys, values
        assert self.write is not None
        if self.extent is not None:
            keys[:, self.write] = key_states[0]
            values[:, self.write] = value_states[0]
            return keys[None, :, : self.extent], values[None, :, : self.extent]
        where = self.write if self.rows is None else self.rows * self.stride + self.write
        keys[:, where] = key_states[:, :, -1].transpose(0, 1)
        values[:, where] = value_states[:, :, -1].transpose(0, 1)
        if self.view is None:
            return keys, values
        slots, width = self.view
        return self.grid(keys, slots, width), self.grid(values, slots, width)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the runner (position_ids), never from the cache

    def put(self, start: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A joining row's prefill cache ([heads, length, head_dim] per layer) into its slot: its one copy."""
        for index, (new_keys, new_values) in enumerate(layers):
            length = new_keys.shape[1]
            if self.finite:
                new_keys, new_values = _finite(new_keys), _finite(new_values)
            self.keys[index][:, start : start + length].copy_(new_keys)
            self.values[index][:, start : start + length].copy_(new_values)

    def move(self, old: int, new: int, length: int, start: int = 0) -> None:
        """A slot's positions start..length to another slot (compaction: workers/engine/slot_table.py;
        a prefix hit on another row: workers/engine/prefix_index.py). Runs may overlap (compaction
        slides a slot down by less than its length): then through a copy."""
        overlap = abs(new - old) < length - start
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                if not overlap:
                    tensor[:, new + start : new + length].copy_(tensor[:, old + start : old + length])
                elif self.staging is None:
                    tensor[:, new + start : new + length].copy_(tensor[:, old + start : old + length].clone())
                else:
                    self._staged(tensor, old, new, start, length)

    def _staged(self, tensor: torch.Tensor, old: int, new: int, start: int, length: int) -> None:
        """An overlapping move through the staging buffer, a piece at a time: low pieces first when
        moving down (each piece's target was read already), high pieces first when moving up."""
        assert self.staging is not None
        piece = self.staging.shape[1]
        offsets = list(range(start, length, piece))
        for offset in offsets if new < old else reversed(offsets):
            size = min(piece, length - offset)
            self.staging[:, :size].copy_(tensor[:, old + offset : old + offset + size])
            tensor[:, new + offset : new + offset + size].copy_(self.staging[:, :size])

    def read(self, start: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of a slot's first positions (a retained prefix carried past its own slot's release)."""
        return [
            (keys[:, start : start + length].clone(), values[:, start : start + length].clone())
            for keys, values in zip(self.keys, self.values, strict=True)
        ]


def _finite(states: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(states, nan=0.0, posinf=0.0, neginf=0.0)


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
                start = self.table.assign(row_id, length)
                assigned.append(row_id)
                layers = [(layer.keys[index], layer.values[index]) for layer in cache.layers]
                self.cache.put(start, layers)
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
