"""Batch invariance of the pool step (workers/engine/pool_step.py): one row's attention as the step
computes it, at any slot start and beside any rows (the kernel's property the step rests on), and one
row decoded alone or beside neighbours that put its slot elsewhere (what a job sees). The CPU's
tests/unit/test_pool_step.py and the GPU's tests/gpu/test_engine_cuda.py both run them."""

from __future__ import annotations

import torch

from tests.support.engine_runs import photo
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import pool_step


def slot_attention(
    keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, where: tuple[int, int, int, int],
    noise: torch.Generator,
) -> torch.Tensor:  # fmt: skip
    """One row's attention over `keys` (its slot's) as the pool step computes it: at slot start
    `offset` of an `extent` read by `rows` query rows, the row `index` of them, every other position and
    row filled with other rows' (random) keys, values and masks."""
    offset, extent, rows, index = where
    heads, length, dim = keys.shape
    pool_keys = torch.randn(1, heads, extent, dim, generator=noise).to(keys)
    pool_values = torch.randn(1, heads, extent, dim, generator=noise).to(keys)
    pool_keys[0, :, offset : offset + length], pool_values[0, :, offset : offset + length] = keys, values
    queries = torch.randn(1, heads, rows, dim, generator=noise).to(keys)
    queries[0, :, index] = query
    lowest = torch.finfo(keys.dtype).min
    mask = torch.full((1, 1, rows, extent), lowest, dtype=keys.dtype, device=keys.device)
    for other in range(rows):
        start = int(torch.randint(0, extent, (1,), generator=noise))
        mask[0, 0, other, start : start + int(torch.randint(1, 900, (1,), generator=noise))] = 0
    mask[0, 0, index] = lowest
    mask[0, 0, index, offset : offset + length] = 0
    out = torch.nn.functional.scaled_dot_product_attention(queries, pool_keys, pool_values, attn_mask=mask)
    return out[0, :, index]


def layouts_that_differ(device: str, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """The (length, slot start, extent, rows) layouts in which one row's attention differs, by a bit,
    from the same row's at the pool's start: slots and extents in whole grains of the device (its
    kernel's block), rows at least its least, rows of 1 to 3,366 positions, extents up to 1,000 past
    the row. Eight heads of 64 (Fuyu-8B's head size): a review found a row's last block summed
    otherwise when the extent was not whole blocks in ~6 % of such layouts, none with four heads."""
    grain, least = pool_step.grain(device), pool_step.least_rows(device)
    noise = torch.Generator().manual_seed(3)
    differ = []
    for length in (1, grain, grain + 1, 3_366, *range(100, 3_300, 97)):
        keys = (3 * torch.randn(8, length, 64, generator=noise)).to(device, dtype)
        values = torch.randn(8, length, 64, generator=noise).to(device, dtype)
        query = torch.randn(8, 64, generator=noise).to(device, dtype)
        alone = slot_attention(keys, values, query, (0, _grains(length, grain), least, 0), noise)
        for slot, more, rows in ((1, 0, 8), (3, 700, 64), (5, 1_000, least)):
            where = (slot * grain, _grains(slot * grain + length + more, grain), rows, rows - 1)
            if not torch.equal(slot_attention(keys, values, query, where, noise), alone):
                differ.append((length, *where[:3]))
    return differ


def _grains(positions: int, grain: int) -> int:
    return -(-positions // grain) * grain


def decoded_beside(
    backend: FuyuBackend, job: GenerationInput, before: tuple[int, ...]
) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The job's tokens, its slot's keys and values per layer after them, and its slot's start when it
    joined: run by a pool runner after neighbours of the oracle's sizes `before` (the first leaving
    after its first step: a hole, which a compaction may close), all decoding together."""
    runner = backend.step_model(8, 1024, pool=6144, decode="pool")
    batch = runner.new_batch()
    last: dict[str, int] = {}
    for index, size in enumerate((*before, None)):
        row = "job" if size is None else f"n{index}"
        item = job if size is None else photo(size, index, index % 3, 1)
        inputs, length = backend.row_inputs(item)
        runner.begin(row, inputs, length, need=length + job.max_new_tokens + 2)
        last[row] = runner.extend([(row, length)])[0] or 0
        batch.join(row)
    joined = runner.table.start("job")
    tokens = [last["job"]]
    for step in range(job.max_new_tokens - 1):
        picked = runner.decode(batch, [last[row] for row in batch.row_ids])
        last = dict(zip(batch.row_ids, picked, strict=True))
        tokens.append(last["job"])
        if step == 0 and before:
            batch.drop({"n0"})
    start, length = runner.table.start("job"), runner.table.length("job")
    cache = [
        (keys[:, start : start + length].clone(), values[:, start : start + length].clone())
        for keys, values in zip(runner.cache.keys, runner.cache.values, strict=True)
    ]  # fmt: skip
    return tokens, cache, joined


# The oracle's photo sizes placed before the row (tests/support/engine_runs.py's SIZES), in order.
NEIGHBOURS = [(1,), (0, 2), (2, 1, 0), (0, 1, 2, 3)]
# ~500 positions on the tiny Fuyu: they cross the CPU kernel's first block of keys (512).
JOB = GenerationInput(torch.full((3, 600, 700), 70, dtype=torch.uint8), "Is the parcel damaged?", 10)


def unlike_alone(backend: FuyuBackend, before: tuple[int, ...]) -> list[str]:
    """What differs between JOB decoded alone and beside neighbours of sizes `before`, which put its
    slot elsewhere: its slot not moved, its tokens, any layer's keys or values by a bit. [] when none."""
    alone_tokens, alone_cache, alone_start = decoded_beside(backend, JOB, ())
    tokens, cache, start = decoded_beside(backend, JOB, before)
    differ = ["its slot did not move"] if start == alone_start else []
    differ += [f"tokens {tokens} against {alone_tokens}"] if tokens != alone_tokens else []
    for layer, (keys, values) in enumerate(cache):
        differ += [f"layer {layer}'s keys"] if not torch.equal(keys, alone_cache[layer][0]) else []
        differ += [f"layer {layer}'s values"] if not torch.equal(values, alone_cache[layer][1]) else []
    return differ
