"""The pool step (workers/engine/pool_step.py), on the CPU: fixed shapes over slots held by need. It
compiles as one graph (`torch.compile(fullgraph=True)`: a graph break raises), so the same step can
be captured on CUDA; its logits are the rows step's (each row over its own view) wherever the slots
lie; rows of the bucket that no job fills write only the scratch position past the pool, and no row
writes anywhere but its own next position; the buckets cover every shape a step may take.

The compile uses the `aot_eager` backend, as tests/unit/test_fixed_step.py says why."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine_runs import alone, three_rows_one_gone, tiny_backend
from tests.support.invariance import NEIGHBOURS, layouts_that_differ, unlike_alone
from workers.backends.base import GenerationInput
from workers.backends.fuyu import FuyuBackend
from workers.engine import pool_step

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module")
def backend() -> FuyuBackend:
    return tiny_backend(HOME)


@pytest.fixture(scope="module")
def running(backend: FuyuBackend) -> tuple[Any, Any, list[int], list[int], list[int]]:
    return _two_rows_and_a_hole(backend)


def _two_rows_and_a_hole(backend: FuyuBackend) -> tuple[Any, Any, list[int], list[int], list[int]]:
    """A pool runner with two rows by need, a hole between them (a row that left), and the rows
    listed in the batch high slot first (the step's order is the batch's, not the pool's)."""
    runner = backend.step_model(4, 512, pool=2048, decode="pool")
    batch, tokens = three_rows_one_gone(backend, runner)
    batch.row_ids.reverse()
    tokens.reverse()
    starts = [runner.table.start(r) for r in batch.row_ids]
    lengths = [runner.table.length(r) for r in batch.row_ids]
    assert starts[0] > starts[1] + lengths[1] + runner.table.size("r0") - runner.table.length("r0") - 1
    return runner, batch, starts, lengths, tokens


@torch.inference_mode()
def test_the_step_compiles_as_one_graph_and_gives_the_rows_steps_tokens(running: Any) -> None:
    runner, batch, starts, lengths, tokens = running
    reach = max(s + n + 1 for s, n in zip(starts, lengths, strict=True))
    extent = pool_step.extent_bucket(reach, 2048, runner.table.grain)
    step = runner.step(4, extent)
    step.fill(starts, lengths, tokens)
    eager = step.forward().clone()
    torch._dynamo.reset()
    compiled = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    assert torch.allclose(compiled(), eager, atol=1e-5)
    rows = runner._decode_rows(batch, starts, lengths, tokens)
    assert torch.allclose(eager[:2], rows, atol=1e-4)
    assert eager[:2].argmax(-1).tolist() == rows.argmax(-1).tolist()


@torch.inference_mode()
def test_rows_write_only_their_own_next_position_and_padding_only_the_scratch(running: Any) -> None:
    runner, _batch, starts, lengths, tokens = running
    keys = runner.cache.keys[0]
    scratch = runner.cache.scratch
    assert scratch == runner.table.pool == keys.shape[1] - 1
    keys[:, scratch] = 0  # so that the padding rows' write shows
    before = keys.clone()
    step = runner.step(4, 2048)
    step.fill(starts, lengths, tokens)
    logits = step.forward()
    assert torch.isfinite(logits).all()  # a padding row attends to one position: no NaN in its row
    written = {start + length for start, length in zip(starts, lengths, strict=True)} | {scratch}
    changed = {int(p) for p in (keys != before).any(dim=2).any(dim=0).nonzero().flatten()}
    assert changed == written


@torch.inference_mode()
def test_a_decode_compacts_when_that_shrinks_the_extent_and_the_tokens_stay(backend: FuyuBackend) -> None:
    runner, batch, starts, lengths, tokens = _two_rows_and_a_hole(backend)
    expected = runner._decode_rows(batch, starts, lengths, tokens).argmax(-1).tolist()
    table = runner.table
    assert pool_step.extent_bucket(table.reach, table.pool, table.grain) > pool_step.extent_bucket(
        table.packed_reach, table.pool, table.grain
    )
    assert runner.decode(batch, tokens) == expected
    assert table.moved > 0
    assert table.start(batch.row_ids[0]) < starts[0]
    assert batch.read == pool_step.extent_bucket(table.packed_reach, table.pool, table.grain)
    assert 0 < batch.padding < batch.read


@pytest.mark.parametrize(("old", "new"), [(40, 10), (10, 40), (100, 95), (95, 100)])
def test_an_overlapping_move_through_the_staging_buffer_equals_a_copy(old: int, new: int) -> None:
    """Compaction slides a slot down by less than its length: the move goes through a buffer allocated
    at start, a piece at a time (no allocation that could run out of memory half way)."""
    from workers.engine.kv import SlotCache

    staged = SlotCache(2, 256, 2, 4, torch.float32, "cpu", staging=7)
    cloned = SlotCache(2, 256, 2, 4, torch.float32, "cpu")
    for a, b in zip((*staged.keys, *staged.values), (*cloned.keys, *cloned.values), strict=True):
        a.copy_(torch.randn_like(a))
        b.copy_(a)
    staged.move(old, new, 60, start=3)
    cloned.move(old, new, 60, start=3)
    for a, b in zip((*staged.keys, *staged.values), (*cloned.keys, *cloned.values), strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_a_row_whose_keys_are_not_finite_changes_no_other_rows_tokens(backend: FuyuBackend) -> None:
    """Review finding: every row of a pool step reads the whole extent, other rows' positions hidden by
    an additive mask, which hides no NaN (NaN + min is NaN, 0 x NaN too): one row whose activations
    overflowed (bf16, NF4 on a GPU) made every row's tokens 0. Its keys and values are written finite."""
    picked = {}
    for decode in ("rows", "pool"):
        runner = backend.step_model(4, 512, pool=2048, decode=decode)
        batch, tokens = three_rows_one_gone(backend, runner)
        poisoned = runner.cache.keys[0].new_full((), float("nan"))
        starts = {r: runner.table.start(r) for r in batch.row_ids}
        inputs = backend.prepare(
            [GenerationInput(torch.full((3, 30, 30), 90, dtype=torch.uint8), "?", 4)]
        ).inputs
        runner.begin("bad", inputs, int(inputs["input_ids"].shape[1]))
        runner._pending["bad"].embeddings = runner.embedded("bad") * poisoned  # its activations overflowed
        tokens.append(runner.extend([("bad", int(inputs["input_ids"].shape[1]))])[0])
        batch.join("bad")
        assert {r: runner.table.start(r) for r in starts} == starts
        picked[decode] = [runner.decode(batch, tokens) for _ in range(3)]
    assert [step[:2] for step in picked["pool"]] == [step[:2] for step in picked["rows"]]


@pytest.mark.parametrize("decode", ["rows", "fixed", "pool"])
@torch.inference_mode()
def test_a_row_placed_where_a_non_finite_row_was_gets_its_own_tokens(
    backend: FuyuBackend, decode: str
) -> None:
    """Second review: the fixed step (CUDA's default) reads its slot's grid past the row's length
    under the same additive mask, where the slot's previous row left its keys: one that overflowed
    left NaN, and a shorter row placed there later picked token 0 from its second token on."""
    big = GenerationInput(
        torch.full((3, 240, 320), 90, dtype=torch.uint8), "What is written on the label?", 4
    )
    small = GenerationInput(torch.full((3, 48, 64), 150, dtype=torch.uint8), "Refund?", 6)
    runner = backend.step_model(2, 256, decode=decode)
    batch = runner.new_batch()
    inputs, length = backend.row_inputs(big)
    runner.begin("bad", inputs, length)
    embeddings = runner.embedded("bad")
    runner._pending["bad"].embeddings = embeddings * embeddings.new_full((), float("nan"))
    batch.join("bad")
    runner.decode(batch, [runner.extend([("bad", length)])[0] or 0])
    where = runner.table.start("bad")
    batch.drop({"bad"})
    inputs, length = backend.row_inputs(small)
    runner.begin("good", inputs, length)
    assert runner.table.start("good") == where
    tokens = [runner.extend([("good", length)])[0] or 0]
    batch.join("good")
    for _ in range(small.max_new_tokens - 1):
        tokens += runner.decode(batch, tokens[-1:])
    expected = alone(backend, small)
    assert tokens[: len(expected)] == expected


@pytest.fixture(scope="module", params=["bf16", "nf4"])
def half(request: pytest.FixtureRequest) -> FuyuBackend:
    return tiny_backend(HOME, quantization=request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_kernel_sums_a_row_alike_wherever_its_slot_starts_on_the_grain(dtype: Any) -> None:
    """What the pool step's batch invariance rests on, checked on this torch (a kernel that changed its
    blocks fails here first): one row's attention, bit for bit, at any slot start that is a multiple of
    the CPU's grain, beside any rows' masks, over any extent, with at least the least rows."""
    assert layouts_that_differ("cpu", dtype) == []


@pytest.mark.parametrize("before", NEIGHBOURS)
@torch.inference_mode()
def test_in_half_precision_a_row_is_the_same_wherever_its_neighbours_put_it(
    half: FuyuBackend, before: tuple[int, ...]
) -> None:
    """Outside review, thirteenth session: in bf16 and nf4 a job's tokens through the pool step
    depended on the jobs beside it (2-3 of 12 differed from alone). A row decoded beside neighbours of
    other sizes, which put its slot elsewhere (one of them leaving, a hole), writes the keys and values
    it writes alone, every layer, bit for bit, and picks the same tokens."""
    assert unlike_alone(half, before) == []


def test_the_slot_table_knows_how_far_a_step_reads_and_how_far_after_compaction() -> None:
    from workers.engine.slot_table import SlotTable

    table = SlotTable(4, 200, capacity=1000)
    table.assign("a", 10, 40)
    table.assign("b", 20, 100)
    table.assign("c", 5, 30)
    assert table.reach == table.start("c") + 5 + 1 == 48 + 112 + 6
    table.release("a")
    table.release("b")
    assert table.packed_reach == 6  # c slides to the pool's start
    table.compact()
    assert table.reach == 6
    assert table.start("c") == 0
    table.release("c")
    assert table.reach == table.packed_reach == 0


@pytest.mark.parametrize(
    ("rows", "grains", "device"),
    [(1, 1, "cuda"), (5, 8, "cuda"), (16, 512, "cuda"), (48, 70, "cuda"), (3, 3, "cpu"), (16, 128, "cpu")],
)
def test_the_buckets_cover_every_shape_a_step_may_take(rows: int, grains: int, device: str) -> None:
    """Every extent is whole kernel blocks (the device's grain): the kernel's last block of keys is
    then as long for a row beside others as alone."""
    grain = pool_step.grain(device)
    pool = grains * grain
    shapes = set(pool_step.buckets(rows, pool, device))
    extents = pool_step.extent_buckets(pool, grain)
    assert extents == sorted(set(extents))
    assert extents[-1] == pool
    assert all(extent % grain == 0 for extent in extents)
    for low, high in itertools.pairwise(extents):
        assert high <= max(low * 1.5, low + grain)  # padding bounded by the ratio
    for count in range(1, rows + 1):
        for reach in sorted({1, pool // 3, pool - 1, pool, *[e for e in extents if e <= pool]}):
            extent = pool_step.extent_bucket(reach, pool, grain)
            assert reach <= extent <= pool
            covered = next(r for r, _ in sorted(shapes) if r >= count)
            assert covered >= pool_step.least_rows(device)
            assert (covered, extent) in shapes
    assert len(shapes) <= (rows.bit_length() + 1) * 2 * pool.bit_length()  # a handful to capture
