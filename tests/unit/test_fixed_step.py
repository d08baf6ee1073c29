"""The decode step of fixed shapes (workers/engine/fixed_step.py), on the CPU: it compiles as one graph
(`torch.compile(fullgraph=True)`: a graph break raises), so the same step can be captured on CUDA; the
compiled step gives the eager step's logits; slots no row runs in write only the scratch column; and
the buckets cover every shape a step may take.

The compile here uses the `aot_eager` backend: whether the step is one graph is decided by the tracing
(dynamo), whatever the backend; inductor's code generation takes ~40 s on this machine and is timed by
tests/bench/bench_step_cost.py instead (eager vs compiled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.engine_runs import three_rows_one_gone, tiny_backend
from workers.engine.fixed_step import WIDTHS, buckets, rows_bucket, width_bucket

HOME = str(Path(__file__).resolve().parents[2] / ".cache" / "mrc")


@pytest.fixture(scope="module")
def running() -> tuple[Any, list[int], list[int], list[int]]:
    """A runner of 4 slots with two rows in slots 0 and 2 (slot 1 a hole left by a row that left)."""
    backend = tiny_backend(HOME)
    runner = backend.step_model(4, 512, decode="fixed")
    batch, tokens = three_rows_one_gone(backend, runner)
    slots = [runner.table.slot(r) for r in batch.row_ids]
    lengths = [runner.table.length(r) for r in batch.row_ids]
    assert slots == [0, 2]
    return runner, slots, lengths, tokens


@torch.inference_mode()
def test_the_step_compiles_as_one_graph_and_gives_the_eager_logits(running: Any) -> None:
    runner, slots, lengths, tokens = running
    step = runner.step(4, 128)
    step.fill(slots, lengths, tokens)
    eager = step.forward().clone()
    torch._dynamo.reset()
    compiled = torch.compile(step.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    assert torch.allclose(compiled(), eager, atol=1e-5)
    # The rows' own step through their own lengths (the CPU's path) picks the same tokens.
    starts = [slot * runner.cache.stride for slot in slots]
    assert eager[slots].argmax(-1).tolist() == _rows_step(runner, starts, lengths, tokens)


@torch.inference_mode()
def test_a_slot_no_row_runs_in_writes_only_the_scratch_column(running: Any) -> None:
    runner, slots, lengths, tokens = running
    keys = runner.cache.grid(runner.cache.keys[0], 4, runner.cache.stride)  # [slots, heads, width, dim]
    hole_before = keys[1, :, : runner.cache.scratch].clone()
    spare_before = keys[3].clone()
    step = runner.step(4, 128)
    step.fill(slots, lengths, tokens)
    logits = step.forward()
    assert torch.isfinite(logits).all()  # a hole attends to one position: no NaN in its row
    assert torch.equal(keys[1, :, : runner.cache.scratch], hole_before)
    assert torch.equal(keys[3, :, : runner.cache.scratch], spare_before[:, : runner.cache.scratch])
    for slot, length in zip(slots, lengths, strict=True):  # each running row wrote its own position
        assert keys[slot, :, length].abs().sum() > 0


def _rows_step(runner: Any, starts: list[int], lengths: list[int], tokens: list[int]) -> list[int]:
    batch = runner.new_batch()
    batch.row_ids = [r for r in ("r0", "r2")]
    logits = runner._decode_rows(batch, starts, lengths, tokens)
    return [int(t) for t in logits.argmax(-1).tolist()]


@pytest.mark.parametrize(("slots", "positions"), [(1, 100), (5, 1000), (32, 2400), (48, 9000)])
def test_the_buckets_cover_every_shape_a_step_may_take(slots: int, positions: int) -> None:
    shapes = set(buckets(slots, positions))
    for top in range(1, slots + 1):
        rows = rows_bucket(top, slots)
        assert top <= rows <= slots
        assert rows == slots or rows & (rows - 1) == 0  # a power of two, or every slot
        for width in sorted({1, positions // 3, positions, *[w for w in WIDTHS if w <= positions]}):
            bucket = width_bucket(width, positions)
            assert width <= bucket <= positions
            assert (rows, bucket) in shapes
    assert len(shapes) <= (slots.bit_length() + 1) * (len(WIDTHS) + 1)  # a handful to capture
