"""Batch sizes chosen from measured cost: cap each input-length bucket where per-job cost stops falling."""

from __future__ import annotations

import pytest

from workers import batch_sizes
from workers.batch_sizes import BatchSizes, calibrate, choose_cap


def test_cap_is_where_per_job_cost_stops_falling() -> None:
    assert choose_cap({1: 1.0, 2: 0.6, 4: 0.4, 8: 0.39}, upper=8) == 4  # 8 is within 5 % of 4
    assert choose_cap({1: 1.0, 2: 1.0, 4: 1.02}, upper=8) == 1  # compute-bound: batching buys nothing
    assert choose_cap({1: 1.0, 2: 1.3, 4: 1.6}, upper=8) == 1  # padding or cache pressure: it loses
    assert choose_cap({1: 1.0, 2: 0.5, 4: 0.25}, upper=16) == 16  # still falling at the largest tried
    assert choose_cap({}, upper=8) == 8


def test_sizes_double_up_to_the_bound_within_the_token_budget() -> None:
    assert batch_sizes.sizes_to_try(8, 100, 10_000, 16) == [1, 2, 4, 8]
    assert batch_sizes.sizes_to_try(6, 100, 10_000, 16) == [1, 2, 4, 6]
    assert batch_sizes.sizes_to_try(8, 2000, 5_000, 16) == [1, 2]  # 4 x 2016 is over the budget
    assert batch_sizes.sizes_to_try(1, 100, 10, 16) == [1]  # one job always runs


class _FakeModel:
    """Seconds per batch: prefill proportional to rows x positions, decode nearly free per extra row
    (a GPU), or everything proportional to rows (two CPU cores)."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.now = 0.0
        self.calls: list[tuple[tuple[int, int], int]] = []

    def clock(self) -> float:
        return self.now

    def run(self, probe: tuple[int, int], size: int, steps: int) -> None:
        self.calls.append((probe, size))
        positions = probe[0] * probe[1] / 900
        if self.gpu:
            self.now += 0.01 * steps + 1e-6 * positions * size
        else:
            self.now += size * (1e-4 * positions + 0.01 * steps)


def test_calibration_on_a_gpu_like_model_batches_every_bucket() -> None:
    model = _FakeModel(gpu=True)
    sizes = calibrate(model.run, upper=32, token_budget=1_000_000, clock=model.clock)
    assert sizes.calibrated
    assert [b.cap for b in sizes.buckets] == [32, 32, 32]


def test_calibration_on_a_cpu_like_model_runs_long_inputs_alone() -> None:
    model = _FakeModel(gpu=False)
    sizes = calibrate(model.run, upper=8, token_budget=1_000_000, clock=model.clock)
    assert [b.cap for b in sizes.buckets] == [1, 1, 1]
    long_input = sizes.buckets[-1].positions
    assert sizes.cap(long_input) == 1
    assert sizes.summary().endswith(":1")


def test_calibration_stops_timing_sizes_that_only_get_slower() -> None:
    model = _FakeModel(gpu=False)
    model_run = model.run

    def slower(probe: tuple[int, int], size: int, steps: int) -> None:
        model_run(probe, size * size, steps)  # per-job cost grows with the size

    calibrate(slower, upper=64, token_budget=10**9, clock=model.clock)
    largest = max(size for _, size in model.calls)
    assert largest <= 4, "kept timing ever larger batches that could only lose"


def test_a_group_takes_its_longest_inputs_bucket() -> None:
    sizes = BatchSizes.fixed(8)
    small, medium, large = sizes.buckets
    small.cap, medium.cap, large.cap = 8, 4, 1
    assert sizes.cap(small.positions) == 8
    assert sizes.cap(small.limit + 1) == 4
    assert sizes.cap(large.positions * 3) == 1  # longer than any probe: the last bucket
    caps = batch_sizes.caps_for(sizes)
    assert caps([small.positions, large.positions]) == 1


def test_bucket_limits_follow_the_image_side_cap() -> None:
    full = BatchSizes.fixed(8)
    capped = BatchSizes.fixed(8, max_side=480)
    assert capped.buckets[-1].positions < full.buckets[-1].positions


@pytest.mark.parametrize("jobs", [1, 4])
def test_live_batches_keep_a_running_per_job_cost(jobs: int) -> None:
    sizes = BatchSizes.fixed(8)
    tokens = sizes.buckets[0].positions
    sizes.observe(tokens, jobs, 0.4)
    sizes.observe(tokens, jobs, 0.8)
    row = sizes.table()[0]
    expected = (0.4 + 0.2 * (0.8 - 0.4)) / jobs * 1000
    assert row["live_ms_per_job"][str(jobs)] == pytest.approx(expected, abs=0.01)
    assert row["cap"] == 8
    assert sizes.table()[-1]["max_input_tokens"] is None
