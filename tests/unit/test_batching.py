from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers import batching


def test_similar_costs_are_grouped_and_caps_hold() -> None:
    costs = [100, 2000, 110, 2100, 105, 1900]
    groups = batching.form_batches(costs, max_jobs=3, token_budget=10_000)
    assert [sorted(g) for g in groups] == [[0, 2, 4], [1, 3, 5]]


def test_budget_splits_batches_and_a_lone_giant_still_runs() -> None:
    groups = batching.form_batches([600, 600, 600, 5000], max_jobs=8, token_budget=1500)
    assert groups == [[0, 1], [2], [3]]


@given(st.lists(st.integers(1, 3000), max_size=40), st.integers(1, 16), st.integers(1, 40_000))
def test_every_job_lands_in_exactly_one_batch(costs: list[int], max_jobs: int, budget: int) -> None:
    groups = batching.form_batches(costs, max_jobs, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    for group in groups:
        assert 1 <= len(group) <= max_jobs
        assert len(group) == 1 or max(costs[i] for i in group) * len(group) <= budget


def test_padding_waste() -> None:
    assert batching.padding_waste([10, 10]) == 0.0
    assert batching.padding_waste([5, 10]) == 0.25
    assert batching.padding_waste([]) == 0.0


def test_interactive_jobs_get_the_first_model_batches() -> None:
    costs = [100, 900, 100, 100, 900, 100]
    lanes = [1, 0, 1, 1, 0, 1]  # 0 = interactive, 1 = backlog
    groups = batching.form_batches_by_lane(costs, lanes, max_jobs=8, token_budget=100_000)
    assert groups == [[1, 4], [0, 2, 3, 5]]


@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 1)), max_size=40), st.integers(1, 16))
def test_by_lane_keeps_every_job_once_and_lanes_in_order(jobs: list[tuple[int, int]], max_jobs: int) -> None:
    costs, lanes = [c for c, _ in jobs], [lane for _, lane in jobs]
    groups = batching.form_batches_by_lane(costs, lanes, max_jobs, 20_000)
    assert sorted(i for g in groups for i in g) == list(range(len(jobs)))
    order = [lanes[g[0]] for g in groups]
    assert order == sorted(order)
    assert all(len({lanes[i] for i in g}) == 1 for g in groups)
