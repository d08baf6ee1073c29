"""The decode step of fixed shapes over slots held by need (`MRC_ENGINE_DECODE=pool`): capturable, as
the `fixed` step is, without the worst-case slots the `fixed` step's grid needs.

The running rows are one sequence of the step's `rows` positions (batch 1), each with its own
position id, each writing its new key and value at its own place in the pool. Attention is one call
over the pool's first `extent` positions, under a float mask that shows each row its own slot's
positions and the one it writes: no gather, no copy, and the shape does not depend on where the slots
lie. Shapes come from a few buckets — rows rounded up to a power of two, the extent up to one of
`extent_buckets` (each about 1.41x the one before) — so a handful of steps serve every batch, and each
can be compiled (`torch.compile(fullgraph=True)`: tests/unit/test_pool_step.py) or captured once as a
CUDA graph and replayed. Rows of the bucket that no row fills attend to one position and write to the
cache's scratch position, past the pool.

What it costs: the keys and values of the extent are read once for all rows (one matrix product; a
decode step is bound by that read on a GPU), but scores are computed for every row against every
position of the extent, `rows` times the useful ones. Fine where reading memory bounds the step (a
GPU at these batch sizes); on the CPU, where a step's cost follows the arithmetic, the `rows` step
(each row over its own view) stays the default.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.fixed_step import StaticStep, rows_bucket
from workers.engine.kv import SlotCache

SMALLEST = 128  # the least extent a step reads
GRAIN = 128  # extents are whole multiples of this

# Batch invariance in half precision. A row's attention is one masked call over the extent, and the
# kernel sums keys in blocks counted from the extent's first position, rescaling between blocks: a
# row whose slot starts elsewhere in a block has its keys summed in other groups, rounded otherwise,
# and in bf16 or nf4 its answer came to depend on where its neighbours put it (2-3 of 12 jobs differed
# from alone, first at token 15-47). Slots start at multiples of the kernel's block (the table's grain)
# and every other row's keys add exact zeros, so a row's sums are the same wherever it lies. Extents
# are whole blocks too: the kernel's last block is what is left of the extent, and a row whose last
# keys fell in a 256-key tail alone and in a full block beside others was summed otherwise (rarely:
# found by a second review, on a Fuyu of Fuyu-8B's head size). The CPU's flash kernel sums keys in
# blocks of 512 (its kv split) and takes another path under 4 query rows, so a step there runs at
# least 4 rows (tests/unit/test_pool_step.py checks both on this torch, at bf16 and fp16). CUDA's
# memory-efficient kernel reads keys 64 or 128 at a time over all of them in one block of threads:
# 128 (tests/gpu/test_engine_cuda.py checks a row beside others and alone there).
KERNEL_BLOCK = {"cpu": 512, "cuda": 128}
LEAST_ROWS = {"cpu": 4, "cuda": 1}


def _kind(device: Any) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def grain(device: Any) -> int:
    """What the pool step's slots start at multiples of, on this device: its attention kernel's block."""
    return KERNEL_BLOCK[_kind(device)]


def least_rows(device: Any) -> int:
    """The fewest query rows a pool step computes on this device (padding rows beyond the running)."""
    return LEAST_ROWS[_kind(device)]


def step_rows(count: int, slots: int, device: Any) -> int:
    """Rows a step of `count` running rows computes: a power of two, at least the kernel's least."""
    return max(rows_bucket(count, slots), least_rows(device))


def extent_buckets(pool: int, grain: int = GRAIN) -> list[int]:
    """The extents a step may read: from SMALLEST, each about 1.41x the one before, in whole grains
    (the kernel's block: every block of keys the kernel reads is whole, so a row's last block is as
    long beside any rows as alone), and the whole pool (a multiple of the grain) last."""
    if pool % grain:
        raise ValueError(f"a pool of {pool} positions is no multiple of its grain of {grain}")
    buckets: list[int] = []
    size = float(max(SMALLEST, grain))
    while size < pool:
        bucket = -(-int(size) // grain) * grain
        if not buckets or bucket > buckets[-1]:
            buckets.append(bucket)
        size *= 2**0.5
    return [b for b in buckets if b < pool] + [pool]


def extent_bucket(extent: int, pool: int, grain: int = GRAIN) -> int:
    """Positions a step reads: the highest running row's end, rounded up to a bucket."""
    return next(b for b in extent_buckets(pool, grain) if b >= min(extent, pool))


def buckets(rows: int, pool: int, device: Any = "cuda") -> list[tuple[int, int]]:
    """Every (rows, extent) shape a step may take: what capture at warm-up covers."""
    counts = sorted({step_rows(2**k, rows, device) for k in range(rows.bit_length() + 1)})
    return [(r, e) for r in counts for e in extent_buckets(pool, grain(device))]


class PoolStep(StaticStep):
    """One decode step of `rows` rows over the pool's first `extent` positions: static inputs, an eager
    or captured forward pass."""

    def __init__(self, model: Any, cache: SlotCache, rows: int, extent: int) -> None:
        self.model, self.cache, self.rows, self.extent = model, cache, rows, extent
        self.language = model.model.language_model
        device, dtype = cache.keys[0].device, cache.keys[0].dtype
        self.ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.write = torch.full((rows,), cache.scratch, dtype=torch.long, device=device)
        self.lowest = torch.finfo(dtype).min
        self.mask = torch.full((1, 1, rows, extent), self.lowest, dtype=dtype, device=device)
        self._columns = torch.arange(extent, device=device)

    def fill(self, starts: list[int], lengths: list[int], tokens: list[int]) -> None:
        """The step's inputs, in the batch's order: each row's last token, its position = its length,
        written at its slot's start + its length, and its mask showing its slot up to that position."""
        device, count = self.ids.device, len(starts)
        start = torch.tensor(starts, device=device)
        end = start + torch.tensor(lengths, device=device)  # the position the row writes now
        self.ids.zero_()
        self.positions.zero_()
        self.write.fill_(self.cache.scratch)
        self.ids[0, :count] = torch.tensor(tokens, device=device)
        self.positions[0, :count] = end - start
        self.write[:count] = end
        columns = self._columns.unsqueeze(0)
        visible = (columns >= start.unsqueeze(1)) & (columns <= end.unsqueeze(1))
        self.mask[0, 0, :count] = torch.where(visible, 0.0, self.lowest).to(self.mask.dtype)
        self.mask[0, 0, count:] = self.lowest
        self.mask[0, 0, count:, 0] = 0  # a row no job fills attends to one position: no NaN in its row

    def last_hidden(self) -> torch.Tensor:
        """[rows, hidden], in the batch's order."""
        cache = self.cache
        cache.rows, cache.write, cache.view, cache.extent = None, self.write, None, self.extent
        hidden: torch.Tensor = self._hidden(self.language, self.ids, self.mask, self.positions, cache)
        return hidden[0]
