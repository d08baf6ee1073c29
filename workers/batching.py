"""Pure functions that decide how jobs are grouped into model batches."""

from __future__ import annotations

from collections.abc import Sequence


def form_batches(costs: Sequence[int], max_jobs: int, token_budget: int) -> list[list[int]]:
    """Group job indices into batches of at most `max_jobs` whose padded cost stays within `token_budget`.

    Jobs are sorted by cost first, so neighbours in a batch have similar sequence lengths and little
    padding. The padded cost of a batch is its size times its longest member. A job costlier than the
    budget alone still gets a batch of its own (it must run somewhere).
    """
    if max_jobs < 1:
        raise ValueError("max_jobs must be >= 1")
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = max([costs[i] for i in current] + [costs[index]])
        if current and (len(current) >= max_jobs or longest * (len(current) + 1) > token_budget):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def form_batches_by_lane(
    costs: Sequence[int], lanes: Sequence[int], max_jobs: int, token_budget: int
) -> list[list[int]]:
    """form_batches within each lane, lanes in ascending order: an interactive ticket that shares a
    delivery with backlog jobs runs in the first model batch, and its result is written first."""
    groups: list[list[int]] = []
    for lane in sorted(set(lanes)):
        members = [i for i, value in enumerate(lanes) if value == lane]
        for group in form_batches([costs[i] for i in members], max_jobs, token_budget):
            groups.append([members[j] for j in group])
    return groups


def halves(items: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split a batch in two for a retry after an out-of-memory fault."""
    mid = len(items) // 2
    return list(items[:mid]), list(items[mid:])


def padding_waste(costs: Sequence[int]) -> float:
    """Fraction of a batch's padded positions that are padding."""
    if not costs:
        return 0.0
    padded = max(costs) * len(costs)
    return 1.0 - sum(costs) / padded
