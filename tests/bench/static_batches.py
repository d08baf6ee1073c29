"""Static batching, as the worker did it before the iteration-level engine: pure functions that group
jobs into model batches run through `generate()` to their longest row. Kept for the benchmarks'
"bare static loop" baseline (tests/bench/bench_throughput.py), which the engine is measured against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The most jobs a batch may hold: one number, or one per group, from its input lengths (long inputs
# may be capped lower than short ones).
MaxJobs = int | Callable[[Sequence[int]], int]


@dataclass(frozen=True)
class Cost:
    """What one job costs a model batch: its input positions (image + prompt) and its decode steps."""

    input_tokens: int
    new_tokens: int


def waste(values: Sequence[int]) -> float:
    """Fraction of a batch's padded positions that are padding, when every row is padded to the
    longest: prefill padding for input lengths, idle decode steps for new-token counts."""
    if not values:
        return 0.0
    return 1.0 - sum(values) / (max(values) * len(values))


def fits(group: Sequence[Cost], max_jobs: MaxJobs, token_budget: int, max_waste: float) -> bool:
    """Whether these jobs may share one model batch: few enough (for their input lengths), within the
    token budget (rows x the longest input plus the most new tokens), and padded by at most
    `max_waste` of their prefill positions and of their decode steps (a 512-token job never makes its
    neighbours decode 512 steps)."""
    inputs = [c.input_tokens for c in group]
    if len(group) > (max_jobs(inputs) if callable(max_jobs) else max_jobs):
        return False
    news = [c.new_tokens for c in group]
    if len(group) > 1 and (max(inputs) + max(news)) * len(group) > token_budget:
        return False
    return waste(inputs) <= max_waste and waste(news) <= max_waste


def form_batches(
    costs: Sequence[Cost], max_jobs: MaxJobs, token_budget: int, max_waste: float = 1.0
) -> list[list[int]]:
    """Group job indices into model batches that `fits` allows.

    Jobs are sorted by new tokens, then input length, so equal jobs sit together and most batches
    need no padding at all. A job that fits no batch (costlier than the budget) runs alone: it must
    run somewhere.
    """
    if isinstance(max_jobs, int) and max_jobs < 1:
        raise ValueError("max_jobs must be >= 1")
    order = sorted(range(len(costs)), key=lambda i: (costs[i].new_tokens, costs[i].input_tokens, i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if current and not fits([costs[i] for i in [*current, index]], max_jobs, token_budget, max_waste):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def form_batches_by_lane(
    costs: Sequence[Cost], lanes: Sequence[int], max_jobs: MaxJobs, token_budget: int, max_waste: float = 1.0
) -> list[list[int]]:
    """form_batches within each lane, lanes in ascending order: an interactive ticket that shares a
    delivery with backlog jobs runs in the first model batch, and its result is written first."""
    groups: list[list[int]] = []
    for lane in sorted(set(lanes)):
        members = [i for i, value in enumerate(lanes) if value == lane]
        for group in form_batches([costs[i] for i in members], max_jobs, token_budget, max_waste):
            groups.append([members[j] for j in group])
    return groups


def halves(items: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split a batch in two for a retry after an out-of-memory fault."""
    mid = len(items) // 2
    return list(items[:mid]), list(items[mid:])
